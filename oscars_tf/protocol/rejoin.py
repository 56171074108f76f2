"""A dropped worker's way back in (membership.py's rejoin path).

A worker left out of its round's decision asks to rejoin (its row under
`j/<me>`) and reads the decisions from the round after the chief's latest
on, until one names it a newcomer. Two skews of the store are handled here
(issue 43, item 11):

* The chief rewrites `latest` as a delete then a set (the coordination
  service refuses to overwrite a key), so a read can find it missing for a
  moment. A dropped worker has seen its round's decision, and the chief
  sets `latest` right after each decision, so a missing `latest` is that
  gap (or a dead chief): the rejoiner waits for it instead of starting from
  its own round, which cost one read per round since, and past
  membership.KEEP_ROUNDS a wait on a deleted key until the timeout.
* A rejoiner held up while the chief went on (let in, then dropped again)
  finds the decision it waits for deleted: `latest` at or past its round
  with the decision missing says so, and it asks again for the round after
  `latest`.

No TensorFlow here.
"""

from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import store_keys
from oscars_tf.protocol import table_deltas
from oscars_tf.protocol.decision import Decision
from oscars_tf.protocol.kv_store import KeyMissing
from oscars_tf.protocol.kv_store import put

POLL_S = 0.5  # a dropped worker checks for the end of training this often


def wait_to_rejoin(store, me, round_, row_text, timeout,
                   read_snapshot=None, asked_to_rejoin=lambda: None,
                   clock=None):
  """The Decision of the round that lets worker `me` back in.

  `me` was dropped at `round_` and asks with `row_text` (its encoded row);
  it gives up (PeerTimeoutError, its request withdrawn) after `timeout`
  seconds, or when training ends (WorkerLostError). `read_snapshot(r,
  deadline)`: the whole decision of round r, or None if it is gone
  ("deltas": the changes say who is new, the snapshot carries the chief's
  plan); None: every decision key holds the whole one ("full"). `clock`:
  whose time the waits are (clock.py; None: the real one)."""
  clock = clock_lib.real_unless(clock)
  deadline = clock.monotonic() + timeout

  def ask():
    put(store, store_keys.rejoin_request(me), row_text)
  latest = _latest(store, deadline, clock)
  ask()
  asked_to_rejoin()
  r = max(round_, latest) + 1
  while True:
    try:
      text = store.get(store_keys.decision(r),
                       min(POLL_S, clock.left(deadline)))
    except KeyMissing:
      if _value_now(store, store_keys.finished()) is not None:
        raise WorkerLostError(
            f"worker {me} was dropped at round {round_} (too late at its "
            "round end) and training ended before it could rejoin; the "
            "chief's model and checkpoint are the job's result.") from None
      latest = _int_or(_value_now(store, store_keys.latest()), -1)
      if latest >= r:  # round r was decided and its decision deleted since
        ask()  # the chief may have read and dropped the request meanwhile
        r = latest + 1
        continue
      if clock.left(deadline) <= 0:
        store.delete(store_keys.rejoin_request(me))  # not asking any more
        raise PeerTimeoutError(
            f"worker {me}: dropped at round {round_}, and not let back in "
            f"within {timeout:.0f} s.") from None
      continue
    if read_snapshot is None:
      decision = Decision.decode(text)
    elif me in table_deltas.Changes(text).newcomers:
      # A newcomer holds no snapshot: it reads the whole one.
      decision = read_snapshot(r, deadline)
      if decision is None:  # too slow even for that: ask again
        ask()
        r += 1
        continue
    else:
      decision = None
    if decision is not None and me in decision.newcomers:
      return decision
    r += 1


def _latest(store, deadline, clock):
  """The chief's latest round; waited for (until `deadline`) if missing:
  the chief is between its delete and set. -1 if it never comes."""
  try:
    return _int_or(store.get(store_keys.latest(), clock.left(deadline)), -1)
  except KeyMissing:
    return -1


def _value_now(store, key):
  try:
    return store.get(key, 0.001)
  except KeyMissing:
    return None


def _int_or(text, default):
  try:
    return int(text)
  except (TypeError, ValueError):
    return default
