"""A member's side of a round end: post its row, read the decision.

Every worker posts its row at the end of each round (on a job of several
hosts through its host's leader, host_arrivals.py); every worker but the
chief then waits for the round's decision and reads it the job's way
(distributions.py; on a job of several hosts from its host's leader's
file, host_relay.py). One back from a stall so long that the decision
was deleted reads itself as dropped. Membership (membership.py) is the
worker's way in. No TensorFlow here.
"""

from oscars_tf.errors import PeerTimeoutError
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import store_keys
from oscars_tf.protocol.decision import Decision
from oscars_tf.protocol.kv_store import KeyMissing

POLL_S = 0.5  # a member's first wait for the decision (then doubled)
LONG_POLL_S = 4.0  # a member's wait for the decision: at most this per RPC


class Member:
  """One worker's row out and decision in, round after round."""

  def __init__(self, worker, codec):
    """`worker`: the worker's Membership (its store, clock, index, members,
    relay and arrivals); `codec`: its distribution's (distributions.py)."""
    self.worker = worker
    self.codec = codec

  def post(self, round_, row):
    """Arrives at the end of `round_` with `row` (store text)."""
    w = self.worker
    key = store_keys.arrival(round_, w.me)
    if w.arrivals is not None and w.me != 0:  # the chief reads files
      w.arrivals.post(w.store, key, round_, row, w.members)
    else:
      w.store.set(key, row)

  def withdraw(self, round_):
    """Deletes this worker's row of `round_` (if posted): left out of the
    round, no one reads it."""
    self.worker.store.delete(store_keys.arrival(round_, self.worker.me))

  def await_decision(self, round_, timeout, expected_steps=None):
    """The Decision of `round_` (a dropped one if it was deleted while this
    worker waited); PeerTimeoutError if none comes within `timeout` s.
    `expected_steps`: the plan's k_i of `round_` (Membership.exchange)."""
    w = self.worker
    deadline = w.clock.monotonic() + timeout
    text = self._from_host(round_, deadline)
    if text is not None:
      return self._read(round_, text, expected_steps)
    poll = POLL_S  # doubled each time: a long wait costs O(log) RPCs
    while True:
      try:
        text = w.store.get(store_keys.decision(round_),
                           min(poll, w.clock.left(deadline)))
        if w.relay is not None and w.relay.leads(w.members):
          w.relay.write(round_, text)
        return self._read(round_, text, expected_steps)
      except KeyMissing:
        poll = min(2 * poll, LONG_POLL_S)
      # Back from a stall so long that the decision was deleted: dropped.
      if self.latest_round() > round_:
        return Decision(round_, (), (), (w.me,), (None,) * w.n)
      if w.clock.left(deadline) <= 0:
        raise PeerTimeoutError(
            f"worker {w.me}: the chief (worker 0) decided no membership "
            f"for round {round_} within {timeout:.0f} s; it may have died or "
            "stalled. Restart the job from the last checkpoint "
            "(oscars-launch --restarts does this).")

  def latest_round(self):
    """The chief's latest decided round as the store has it now (-1: none
    yet, or the chief is rewriting it)."""
    return _int_or(kv_store.value_now(self.worker.store, store_keys.latest()),
                   -1)

  def _from_host(self, round_, deadline):
    """The round's changes from the host's leader (host_relay.py), or
    None: read the chief's."""
    w = self.worker
    relay = w.relay
    if relay is None:
      return None
    if relay.token is None:  # the first round: the job's incarnation
      try:
        relay.bind(w.store.get(store_keys.job(), w.clock.left(deadline)))
      except KeyMissing:
        return None
    if relay.leads(w.members):
      return None
    return relay.wait(round_, deadline,
                      lambda: self.latest_round() >= round_)

  def _read(self, round_, text, expected_steps):
    """The Decision of `round_` from the text under its key."""
    w = self.worker
    decision = self.codec.read(round_, text, w.members, expected_steps,
                               w.decision_timeout)
    if decision is None:
      raise PeerTimeoutError(
          f"worker {w.me}: the table snapshot of round {round_} is "
          "gone from the store (this worker is too far behind).")
    return decision


def _int_or(text, default):
  try:
    return int(text)
  except (TypeError, ValueError):
    return default
