"""What the protocol tests share: a worker's table row, a job of
Memberships on one store (and its clock), their hooks, a round of
exchanges in threads."""

import math

from fake_clock import FakeClock
from fake_store import run_threads
from oscars_tf.protocol import membership


def row(worker, round_=0, rate=None, sync_cost=0.1):
  """Worker `worker`'s row as a round book posts it (records.FIELDS: rate,
  round, loss, divergence, learning rate, steps, healthy, exhausted, sync
  cost); its rate 10 + `worker` unless `rate` says."""
  return [10.0 + worker if rate is None else rate, float(round_), 1.0,
          math.nan, 0.1, 8.0, 1.0, 0.0, sync_cost]


def workers(store, n, straggler=0.5, decision=5.0, first_round=None,
            relay_for=None, **kwargs):
  """Workers 0..n-1's Memberships on `store`, on its clock: round 0 waits
  `first_round` (the straggler timeout unless given); `relay_for(i)`:
  worker i's host relay; `kwargs` go to every one."""
  return [membership.Membership(
      store, i, n, straggler, decision,
      first_round_timeout=first_round or straggler, clock=store.clock,
      relay=relay_for(i) if relay_for else None, **kwargs)
          for i in range(n)]


class Hooks:
  """Membership hooks: each calls the function given for it, if any."""

  def __init__(self, asked_to_rejoin=None, dropped=None):
    self._asked = asked_to_rejoin or (lambda: None)
    self._dropped = dropped or (lambda workers: None)

  def asked_to_rejoin(self):
    self._asked()

  def dropped(self, workers_):
    self._dropped(workers_)


def run(fns, clock=None, timeout=20):
  """run_threads, the threads counted by `clock` if it is a FakeClock."""
  return run_threads(fns, timeout,
                     clock if isinstance(clock, FakeClock) else None)


def exchange(ws, round_, row_of=None, **kwargs):
  """Every Membership of `ws` exchanges its row of `round_` (`row_of(j,
  round_)`, else `row`), each in a thread on their clock: (decisions,
  errors)."""
  row_of = row_of or row
  return run([lambda w=w: w.exchange(round_, row_of(w.me, round_), **kwargs)
              for w in ws], ws[0].clock if ws else None)
