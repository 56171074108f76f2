"""How a round's decision reaches the members: whole, or as table changes.

Membership(distribution=...) picks one of two codecs, once, and every
member of a job uses the same one. Both answer one interface:

  publish(decision, expected_steps) -> (text, decision)
      The chief writes the round's decision to the store; it returns the
      text under the decision key (a host's leader passes it on:
      host_relay.py) and the decision as the members will read it.
  read(round_, text, members, expected_steps, timeout) -> Decision | None
      A member reads the decision of `round_` from the text under its key;
      None where the whole decision it needs is gone from the store.
  newcomer_decision(round_, text, me, deadline) -> Decision | None | MISSING
      A rejoiner (rejoin.py): round `round_`'s decision if its text may
      name `me` a newcomer, None where it does not, MISSING where it does
      but the whole decision is gone.
  relays: whether a host relay can pass the text on (host_relay.py).

`Full` ("full"): every member reads the whole decision every round (N²
bytes out of the chief). `Deltas` ("deltas", the default): the chief
writes the table's changes and members apply them to the snapshot they
hold (table_deltas.py: O(N + changes · N) bytes a round); the whole
decision is kept too, for newcomers and members whose snapshot differs.
No TensorFlow here.
"""

import base64

import numpy as np

from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import store_keys
from oscars_tf.protocol import table_deltas
from oscars_tf.protocol.decision import Decision
from oscars_tf.protocol.kv_store import KeyMissing

DISTRIBUTIONS = ("deltas", "full")
KEEP_SNAPSHOTS = 4  # whole snapshots kept ("deltas" distribution)
MISSING = object()  # newcomer_decision: named, the whole decision is gone


def make(distribution, store, num_workers, bytes_per_member=None,
         clock=None):
  """The codec of `distribution` ("deltas" or "full") for one worker."""
  if distribution not in DISTRIBUTIONS:
    raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got "
                     f"{distribution!r}.")
  if distribution == "full":
    return Full(store)
  return Deltas(store, num_workers, bytes_per_member, clock)


class Full:
  """The whole decision under every round's key."""

  name = "full"
  relays = False

  def __init__(self, store):
    self.store = store

  def publish(self, decision, expected_steps=None):
    del expected_steps  # every row travels
    text = decision.encode()
    self.store.set(store_keys.decision(decision.round), text)
    # The chief plans from what the members decode (float32 rows), so
    # that its plan is theirs to the last bit.
    return text, Decision.decode(text)

  def read(self, round_, text, members, expected_steps=None, timeout=None):
    del round_, members, expected_steps, timeout
    return Decision.decode(text)

  def newcomer_decision(self, round_, text, me, deadline):
    del round_, me, deadline
    return Decision.decode(text)


class Deltas:
  """The table's changes under the round's key, the whole decision under
  the snapshot key; one worker's snapshot of the table held between
  rounds (the chief's too: it plans from what the members apply)."""

  name = "deltas"
  relays = True

  def __init__(self, store, num_workers, bytes_per_member=None, clock=None):
    """`bytes_per_member` (the chief's): the most a member reads of a
    round's changes; the rest wait a round or more (delta_budget.py;
    None: nothing waits)."""
    self.store = store
    self.n = num_workers
    self.bytes_per_member = bytes_per_member
    self.clock = clock_lib.real_unless(clock)
    self.snapshot = table_deltas.empty(num_workers)
    self.snapshot_round = -1
    self._pending = table_deltas.pending_changes(num_workers)  # the chief's

  def publish(self, decision, expected_steps=None):
    round_, members = decision.round, decision.members
    snapshot, ops, blocks, cells = table_deltas.chief_changes(
        self.snapshot, decision.row_array[list(members)], members, round_,
        self._pending, len(decision.newcomers) + len(decision.dropped),
        expected_steps, self.bytes_per_member)
    # The whole snapshot, for newcomers and members whose digest differs;
    # the chief's decision is made from it as every member makes theirs.
    self.store.set(store_keys.snapshot(round_), base64.b64encode(
        decision_codec.table_bytes(
            round_, self.n, decision.epoch_done, members,
            decision.newcomers, decision.dropped, snapshot[list(members)],
            decision.chief_plan)).decode("ascii"))
    self.store.delete(store_keys.snapshot(round_ - KEEP_SNAPSHOTS))
    text = table_deltas.encode(
        round_, self.n, decision.epoch_done, decision.newcomers,
        decision.dropped, cells, table_deltas.digest(snapshot), ops, blocks)
    self.store.set(store_keys.decision(round_), text)
    self.snapshot, self.snapshot_round = snapshot, round_
    return text, decision_codec.decision_with_array(
        Decision, round_, members, decision.newcomers, decision.dropped,
        snapshot.astype(np.float64), decision.epoch_done,
        decision.chief_plan)

  def read(self, round_, text, members, expected_steps=None, timeout=0.0):
    """The changes applied to the snapshot of the round before; where
    there is none, or it differs, the whole decision (waited for up to
    `timeout` s; None if it is gone)."""
    changes = table_deltas.Changes(text)
    held = None
    if self.snapshot_round == round_ - 1:
      held = changes.apply(self.snapshot, members, expected_steps)
    if held is None:  # no previous snapshot, or it differs: the whole one
      return self.read_whole(round_, self.clock.monotonic() + timeout)
    snapshot, members = held
    self.snapshot, self.snapshot_round = snapshot, round_
    return decision_codec.decision_with_array(
        Decision, round_, members, changes.newcomers, changes.dropped,
        snapshot.astype(np.float64), changes.epoch_done, None)

  def read_whole(self, round_, deadline):
    """The whole decision of `round_`, held as the snapshot from now on;
    None if it is gone."""
    try:
      text = self.store.get(store_keys.snapshot(round_),
                            max(0.001, self.clock.left(deadline)))
    except KeyMissing:
      return None
    decision = Decision.decode(text)
    self.snapshot = decision.row_array.astype(np.float32)
    self.snapshot_round = round_
    return decision

  def newcomer_decision(self, round_, text, me, deadline):
    # A newcomer holds no snapshot: it reads the whole one (which carries
    # the chief's plan).
    if me not in table_deltas.Changes(text).newcomers:
      return None
    decision = self.read_whole(round_, deadline)
    return MISSING if decision is None else decision
