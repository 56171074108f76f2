"""Who takes part in each round, agreed through a key-value store.

At every round end each worker writes its table row to the store (on a job
of several hosts each host's leader posts the rows of the host it gathered
through files, and the members whose rows it holds post none:
host_arrivals.py; the chief reads the round's keys in directory reads:
arrival_reads.py). The chief waits for the
members' rows, up to `straggler_timeout` seconds after its own arrival; a
member that is not there by then (stopped, cut off, dead) is dropped from
the round, and one whose process is gone (its server refuses
connections) is dropped as soon as the chief sees that. The chief writes
one *decision* per round — the members, the newcomers and every row — and
every member reads it (as the changes to the last round's table,
table_deltas.py; on a job of several hosts through its host's leader,
host_relay.py), so all members plan from the same snapshot and enter the
same collectives, and no collective ever waits for a worker that is not
there.

A dropped worker that comes back (a stall ended) finds itself left out of
the decision of its round. It asks to rejoin and waits for the decision that
names it a newcomer (rejoin.py); in that round it takes its group's model
(weight 0).

The roles live apart: the chief's side in membership_chief.py (collect
rows, decide, write the decision), a member's in membership_member.py
(post its row, read the decision), the two ways a decision travels in
distributions.py ("full", "deltas"), a rejoin in rejoin.py, the store's
keys in store_keys.py. `Membership` is one worker's way into them all.

No TensorFlow here: the store is anything with `set`, `get` and `delete`
(runtime/coordination_store.ContextStore is TensorFlow's coordination
service; tests use a dict).
"""

import math

from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import delta_budget
from oscars_tf.protocol import distributions
from oscars_tf.protocol import host_arrivals
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import membership_chief
from oscars_tf.protocol import membership_member
from oscars_tf.protocol import rejoin
from oscars_tf.protocol import store_keys
from oscars_tf.protocol.decision import Decision  # noqa: F401 (callers')
from oscars_tf.protocol.kv_store import put as _put


class Membership:
  """One worker's side of the round-end exchange (the chief decides)."""

  def __init__(self, store, me, num_workers, straggler_timeout,
               decision_timeout, first_round_timeout=None, is_gone=None,
               distribution="deltas",
               bytes_per_member=delta_budget.BYTES_PER_MEMBER, relay=None,
               hooks=None, clock=None):
    """`is_gone(j)`: whether worker j's process is known to be gone (its
    server refuses connections); such a member is dropped at once instead
    of after the straggler timeout, which is for the live but slow.

    `distribution`: "deltas" (the default), the chief writes the table's
    changes and members apply them to the snapshot they hold
    (table_deltas.py: O(N + changes · N) bytes out of the chief per
    round); "full", every member reads the whole decision every round
    (N² bytes). All members of a job must use the same one
    (distributions.py).

    `bytes_per_member` (the chief's, "deltas"): the most a member reads of
    a round's changes; the rest wait a round or more (delta_budget.py;
    None: nothing waits).

    `relay`: a host_relay.HostRelay ("deltas"), through which one member
    per host reads each round's changes from the chief for the host.

    `hooks`: an object with `asked_to_rejoin()` (called once a dropped
    worker's request is in) and `dropped(workers)` (the chief, as it drops
    them): fault-injection tests stop a process there, or wait for it.

    `clock`: whose time the waits are (clock.py; None: the real one)."""
    self.clock = clock_lib.real_unless(clock)
    self.codec = distributions.make(distribution, store, num_workers,
                                    bytes_per_member, self.clock)
    self.distribution = distribution
    self.bytes_per_member = bytes_per_member
    self.relay = relay if self.codec.relays else None
    # The host's rows gathered by its leader (host_arrivals.py).
    self.arrivals = (host_arrivals.HostArrivals.for_member(
        self.relay, straggler_timeout) if self.relay is not None else None)
    if not straggler_timeout > 0 or not decision_timeout > 0:
      raise ValueError("membership timeouts must be > 0 s.")
    self.store = store
    self.me = me
    self.n = num_workers
    self.straggler_timeout = float(straggler_timeout)
    self.decision_timeout = float(decision_timeout)
    # Round 0 holds tracing and start-up, which take long and unevenly.
    self.first_round_timeout = float(first_round_timeout or decision_timeout)
    self.is_gone = is_gone or (lambda j: False)
    self.hooks = hooks or _NoHooks()
    self.members = tuple(range(num_workers))
    self.events = []  # (round, "dropped"/"rejoined", worker, seconds)
    self.member_side = membership_member.Member(self, self.codec)
    self.chief_side = (membership_chief.Chief(self, self.codec)
                       if me == 0 else None)

  def exchange(self, round_, row, epoch_done=0, chief_plan=None,
               expected_s=0.0, rate_before=math.nan, expected_steps=None):
    """Arrives at the end of `round_` with `row`; returns the Decision.

    On the chief this also decides: `epoch_done` and `chief_plan` (a dict,
    or a function that makes it, called only when someone rejoins) are
    what newcomers adopt to plan like the others; `expected_s` is how
    long the others should still take (a chief that arrives early, its data
    run out, waits that long before the straggler timeout starts). A worker
    dropped from `round_` waits to rejoin and returns the decision of the
    round it rejoins in, whose number is then larger than `round_`; it asks
    with `rate_before` as its rate (measured before the round it was late
    for: a stall is not its speed, and NaN would plan it at the median).
    `expected_steps`: every worker's planned k_i for `round_` (the same
    plan on every member), so that only steps that differ from the plan
    travel ("deltas").
    """
    text = _dump(row)
    self.member_side.post(round_, text)
    if self.chief_side is not None:
      decision = self.chief_side.decide(round_, text, epoch_done, chief_plan,
                                        expected_s, expected_steps)
    else:
      decision = self.member_side.await_decision(
          round_, self.member_wait(round_), expected_steps)
    if self.me not in decision.members:
      self.member_side.withdraw(round_)  # never read (if posted)
      decision = rejoin.as_newcomer(self, round_,
                                    _dump([rate_before, *row[1:]]))
    self.members = decision.members
    return decision

  def finish(self, round_):
    """The chief marks the end of training (dropped workers stop waiting);
    host leaders remove their decision files, and the last of a host's
    members to finish the host's directory."""
    if self.me == 0:
      _put(self.store, store_keys.finished(), str(round_))
    if self.relay is not None and self.relay.leads(self.members):
      self.relay.remove_files(round_)
      if self.arrivals is not None:
        self.arrivals.finish(round_)
    if self.relay is not None:
      self.relay.leave(self.members)

  def say_done(self):
    """A worker other than the chief, at its exit: the chief may go."""
    try:
      _put(self.store, store_keys.done(self.me), "1")
    except Exception:  # pylint: disable=broad-except
      pass  # the chief (and its store) is gone already

  def wait_until_done(self, timeout):
    """The chief, at its exit: it hosts the store, so it waits (at most
    `timeout` s) until every member has said it is done or its process is
    gone; a member still finishing (evaluating, writing its results) would
    otherwise lose the store under its feet."""
    others = [j for j in self.members if j != self.me]
    kv_store.values_unless_gone(
        self.store, [store_keys.done(j) for j in others],
        self.clock.monotonic() + timeout, lambda i: self.is_gone(others[i]),
        self.clock)

  def member_wait(self, round_):
    """Seconds a member waits for the decision of `round_`."""
    return self.first_round_timeout if round_ == 0 else self.decision_timeout


class _NoHooks:
  def asked_to_rejoin(self):
    pass

  def dropped(self, workers):
    pass


def _dump(row):
  return decision_codec.encode_row(row)
