"""Numbers the members agree on between rounds: epoch logs, stop votes.

A collective here would wait for a stalled member up to the collective
timeout, and a member that never comes back would abort every process's
collectives. So these go through the store, decided by the chief the way a
round's membership is (membership.py): each member writes its numbers; the
chief reads the members' numbers for up to `straggler_timeout` after its
own and writes the result — every contribution that came in time — and
every member reads that one result, so all take the same decision (stop or
go on) from the same numbers. A member too late is left out of this result
only; it is late at its next round end too, where the round protocol drops
it, and it rejoins from there.

No TensorFlow here: the store is anything with `set`, `get` and `delete`
(its keys: store_keys.py).
"""

import collections
import json

from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import store_keys
from oscars_tf.protocol.kv_store import KeyMissing

KEEP_RESULTS = 1000  # results kept in the store (a member back from a long
                     # stall reads its own); older ones are deleted


class Agreements:
  """One worker's side of the agreements (the chief decides)."""

  def __init__(self, store, me, straggler_timeout, decision_timeout,
               is_gone=None, clock=None):
    """`is_gone(j)`: worker j's process is known to be gone (not waited
    for; see membership.Membership); `clock`: clock.py's (None: real)."""
    self.store = store
    self.clock = clock_lib.real_unless(clock)
    self.is_gone = is_gone or (lambda j: False)
    self.me = me
    self.straggler_timeout = float(straggler_timeout)
    self.decision_timeout = float(decision_timeout)
    self._last = None  # (round, number of agreements at that round)
    self._exchanges = {}  # name -> number of exchanges of that name so far
    self._published = collections.deque()  # the chief's result keys

  def gather(self, round_, members, numbers):
    """{worker: numbers} of the members whose numbers reached the chief in
    time (always the chief's). Every member calls it at the same point, at
    the same `round_`; the result is the same on all of them."""
    index = self._next_index(round_)
    base = store_keys.agreement(round_, index)
    mine = store_keys.agreement_numbers(round_, index, self.me)
    self.store.set(mine, json.dumps([float(x) for x in numbers]))
    if self.me == 0:
      result = self._decide(round_, index, members, numbers)
    else:
      result = self._await(base, round_)
      if self.me not in result:  # too late: nobody will read it
        self.store.delete(mine)
    return result

  def exchange(self, name, text, workers):
    """{worker: text} for every worker in `workers`: the `text` each wrote
    at this exchange of `name`, or None for one that did not within the
    decision timeout or whose process is gone. Every worker calls it at the
    same point and reads the others' texts itself: no chief decides, as
    every worker must take part (one missing is the caller's error, not a
    member left out). The keys stay: one per worker and exchange."""
    index = self._exchanges[name] = self._exchanges.get(name, -1) + 1
    self.store.set(store_keys.exchange_text(name, index, self.me), text)
    others = [j for j in workers if j != self.me]
    deadline = self.clock.monotonic() + self.decision_timeout
    texts = kv_store.values_unless_gone(
        self.store, [store_keys.exchange_text(name, index, j)
                     for j in others], deadline,
        lambda i: self.is_gone(others[i]), self.clock)
    # The chief hosts the coordination service: it leaves only once every
    # other worker has read, or a worker that stops on what it read (a
    # mismatch) would take the service away from a slower reader, which
    # would then see a lost service instead of the mismatch.
    if self.me == 0:
      kv_store.values_unless_gone(
          self.store, [store_keys.exchange_read(name, index, j)
                       for j in others], deadline,
          lambda i: self.is_gone(others[i]), self.clock)
    else:
      try:
        self.store.set(store_keys.exchange_read(name, index, self.me), "1")
      except WorkerLostError:
        pass  # the mark landed and the chief left before the reply: this
              # worker has every text, so it goes on with them
    return {self.me: text, **dict(zip(others, texts))}

  def _next_index(self, round_):
    index = self._last[1] + 1 if self._last and self._last[0] == round_ else 0
    self._last = (round_, index)
    return index

  def _decide(self, round_, index, members, numbers):
    base = store_keys.agreement(round_, index)
    result = {0: [float(x) for x in numbers]}
    others = [j for j in members if j != 0]
    texts = kv_store.values_unless_gone(
        self.store, [store_keys.agreement_numbers(round_, index, j)
                     for j in others],
        self.clock.monotonic() + self.straggler_timeout,
        lambda i: self.is_gone(others[i]), self.clock)
    for j, text in zip(others, texts):
      if text is not None:  # else late or gone: left out of this result
        result[j] = json.loads(text)
    # Every number read (or late: its member deletes it on finding itself
    # out): one call deletes them all, a directory.
    self.store.delete(base)
    self.store.set(base, json.dumps({str(j): v for j, v in result.items()}))
    self._published.append(base)
    if len(self._published) > KEEP_RESULTS:
      self.store.delete(self._published.popleft())
    return result

  def _await(self, base, round_):
    try:
      text = self.store.get(base, self.decision_timeout)
    except KeyMissing:
      raise PeerTimeoutError(
          f"worker {self.me}: the chief (worker 0) wrote no result for the "
          f"agreement at round {round_} within {self.decision_timeout:.0f} s;"
          " it may have died or stalled. Restart the job from the last "
          "checkpoint (oscars-launch --restarts does this).") from None
    return {int(j): v for j, v in json.loads(text).items()}


def mean(result, count):
  """Element-wise mean of the `count` numbers of each member in `result`."""
  rows = list(result.values())
  return [sum(r[i] for r in rows) / len(rows) for i in range(count)]
