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

No TensorFlow here: the store is anything with `set`, `get` and `delete`
(runtime/coordination_store.ContextStore is TensorFlow's coordination
service; tests use a dict).
"""

import base64
import math

import numpy as np

from oscars_tf.errors import PeerTimeoutError
from oscars_tf.protocol import arrival_reads
from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import delta_budget
from oscars_tf.protocol import host_arrivals
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import rejoin
from oscars_tf.protocol import store_keys
from oscars_tf.protocol import table_deltas
from oscars_tf.protocol.decision import Decision
from oscars_tf.protocol.kv_store import KeyMissing
from oscars_tf.protocol.kv_store import put as _put

POLL_S = 0.5  # a member's first wait for the decision (then doubled)
LONG_POLL_S = 4.0  # a member's wait for the decision: at most this per RPC
PUBLISH_MARGIN_S = 5.0  # at most: see _publish_margin
KEEP_ROUNDS = 1000  # decisions kept in the store (older ones are deleted)
KEEP_SNAPSHOTS = 4  # whole snapshots kept ("deltas" distribution)
DISTRIBUTIONS = ("deltas", "full")


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
    (N² bytes). All members of a job must use the same one.

    `bytes_per_member` (the chief's, "deltas"): the most a member reads of
    a round's changes; the rest wait a round or more (delta_budget.py;
    None: nothing waits).

    `relay`: a host_relay.HostRelay ("deltas"), through which one member
    per host reads each round's changes from the chief for the host.

    `hooks`: an object with `asked_to_rejoin()` (called once a dropped
    worker's request is in) and `dropped(workers)` (the chief, as it drops
    them): fault-injection tests stop a process there, or wait for it.

    `clock`: whose time the waits are (clock.py; None: the real one)."""
    if distribution not in DISTRIBUTIONS:
      raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got "
                       f"{distribution!r}.")
    self.distribution = distribution
    self.clock = clock_lib.real_unless(clock)
    self.bytes_per_member = bytes_per_member
    self.relay = relay if distribution == "deltas" else None
    # The host's rows gathered by its leader (host_arrivals.py).
    self.arrivals = (host_arrivals.HostArrivals.for_member(
        self.relay, straggler_timeout) if self.relay is not None else None)
    self._snapshot = table_deltas.empty(num_workers)  # "deltas" only
    self._snapshot_round = -1
    self._pending = table_deltas.pending_changes(num_workers)  # the chief's
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
    self._hooks = hooks or _NoHooks()
    self.members = tuple(range(num_workers))
    self.events = []  # (round, "dropped"/"rejoined", worker, seconds)
    self._epoch_done = 0
    self._expected_steps = None  # k_i of the round being exchanged
    if self.relay is not None and me == 0:  # the job's incarnation
      self.relay.bind(host_relay.new_token())
      _put(store, store_keys.job(), self.relay.token)

  # -- every worker --------------------------------------------------------

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
    self._expected_steps = expected_steps
    key = store_keys.arrival(round_, self.me)
    if self.arrivals is not None and self.me != 0:  # the chief reads files
      self.arrivals.post(self.store, key, round_, _dump(row), self.members)
    else:
      self.store.set(key, _dump(row))
    if self.me == 0:
      decision = self._decide(round_, row, epoch_done, chief_plan,
                              expected_s)
    else:
      decision = self._await(round_, self._timeout(round_))
    if self.me not in decision.members:
      self.store.delete(key)  # never read (if posted)
      decision = self._rejoin(round_, [rate_before, *row[1:]])
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

  def _timeout(self, round_):
    return self.first_round_timeout if round_ == 0 else self.decision_timeout

  def _await(self, round_, timeout):
    deadline = self.clock.monotonic() + timeout
    text = self._from_host(round_, deadline)
    if text is not None:
      return self._read_decision(round_, text)
    poll = POLL_S  # doubled each time: a long wait costs O(log) RPCs
    while True:
      try:
        text = self.store.get(store_keys.decision(round_),
                              min(poll, self.clock.left(deadline)))
        if self.relay is not None and self.relay.leads(self.members):
          self.relay.write(round_, text)
        return self._read_decision(round_, text)
      except KeyMissing:
        poll = min(2 * poll, LONG_POLL_S)
      # Back from a stall so long that the decision was deleted: dropped.
      if _int_or(self._try_get(store_keys.latest()), -1) > round_:
        return Decision(round_, (), (), (self.me,), (None,) * self.n)
      if self.clock.left(deadline) <= 0:
        raise PeerTimeoutError(
            f"worker {self.me}: the chief (worker 0) decided no membership "
            f"for round {round_} within {timeout:.0f} s; it may have died or "
            "stalled. Restart the job from the last checkpoint "
            "(oscars-launch --restarts does this).")

  def _from_host(self, round_, deadline):
    """The round's changes from the host's leader (host_relay.py), or
    None: read the chief's."""
    relay = self.relay
    if relay is None:
      return None
    if relay.token is None:  # the first round: the job's incarnation
      try:
        relay.bind(self.store.get(store_keys.job(),
                                  self.clock.left(deadline)))
      except KeyMissing:
        return None
    if relay.leads(self.members):
      return None
    return relay.wait(round_, deadline, lambda: _int_or(
        self._try_get(store_keys.latest()), -1) >= round_)

  def _rejoin(self, round_, row):
    t0 = self.clock.monotonic()
    decision = rejoin.wait_to_rejoin(
        self.store, self.me, round_, _dump(row),
        self.decision_timeout,
        self._read_snapshot if self.distribution == "deltas" else None,
        self._hooks.asked_to_rejoin, self.clock)
    self.events.append((decision.round, "rejoined", self.me,
                        self.clock.monotonic() - t0))
    return decision

  def _read_decision(self, round_, text):
    """The Decision of `round_` from the text under its key."""
    if self.distribution == "full":
      return Decision.decode(text)
    changes = table_deltas.Changes(text)
    held = None
    if self._snapshot_round == round_ - 1:
      held = changes.apply(self._snapshot, self.members,
                           self._expected_steps)
    if held is None:  # no previous snapshot, or it differs: the whole one
      decision = self._read_snapshot(round_, self.clock.monotonic() +
                                     self.decision_timeout)
      if decision is None:
        raise PeerTimeoutError(
            f"worker {self.me}: the table snapshot of round {round_} is "
            "gone from the store (this worker is too far behind).")
      return decision
    snapshot, members = held
    self._snapshot, self._snapshot_round = snapshot, round_
    return decision_codec.decision_with_array(
        Decision, round_, members, changes.newcomers, changes.dropped,
        snapshot.astype(np.float64), changes.epoch_done, None)

  def _read_snapshot(self, round_, deadline):
    """The whole decision of `round_` ("deltas"); None if it is gone."""
    try:
      text = self.store.get(store_keys.snapshot(round_),
                            max(0.001, self.clock.left(deadline)))
    except KeyMissing:
      return None
    decision = Decision.decode(text)
    self._snapshot = decision.row_array.astype(np.float32)
    self._snapshot_round = round_
    return decision

  def _publish(self, decision):
    """The chief writes the round's decision; returns it as the members
    will read it."""
    round_ = decision.round
    if self.distribution == "full":
      text = decision.encode()
      self.store.set(store_keys.decision(round_), text)
      # The chief plans from what the members decode (float32 rows), so
      # that its plan is theirs to the last bit.
      return Decision.decode(text)
    members = decision.members
    snapshot, ops, blocks, cells = table_deltas.chief_changes(
        self._snapshot, decision.row_array[list(members)], members, round_,
        self._pending, len(decision.newcomers) + len(decision.dropped),
        self._expected_steps, self.bytes_per_member)
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
    if self.relay is not None:  # the chief leads its host
      self.relay.write(round_, text)
    self._snapshot, self._snapshot_round = snapshot, round_
    return decision_codec.decision_with_array(
        Decision, round_, members, decision.newcomers, decision.dropped,
        snapshot.astype(np.float64), decision.epoch_done,
        decision.chief_plan)

  def _try_get(self, key):
    try:
      return self.store.get(key, 0.001)
    except KeyMissing:
      return None

  # -- the chief -----------------------------------------------------------

  def _read_arrivals(self, round_, others, rows, deadline):
    """The rows of `others` (members but the chief) into `rows`
    (arrival_reads.py); one not there by `deadline` (or whose process is
    gone) is left out."""
    arrival_reads.read_arrivals(
        self.store, round_, others, self.members, rows, deadline,
        self.is_gone, self.arrivals, self.clock)

  def _decide(self, round_, my_row, epoch_done, chief_plan, expected_s=0.0):
    rows = {0: _dump(my_row)}  # store texts, decoded at once
    t0 = self.clock.monotonic()
    straggler_s = (self.straggler_timeout if round_ else
                   self.first_round_timeout)
    # Invariant: the chief decides within a member's wait for the decision
    # (`_timeout`, from the member's own arrival) less a margin to publish
    # and be read. The members `expected_s` waits for arrive after the
    # chief, so none of them gives up first, however long the chief
    # expected them to take (issue 43: it waited up to decision_timeout +
    # straggler_timeout).
    members_wait = self._timeout(round_)
    deadline = t0 + min(max(0.0, expected_s) + straggler_s,
                        members_wait - _publish_margin(members_wait))
    others = [j for j in self.members if j != 0]
    self._read_arrivals(round_, others, rows, deadline)
    arrived = [0] + [j for j in others if j in rows]
    dropped = [j for j in others if j not in rows]
    if dropped:
      self._hooks.dropped(dropped)
    for j in dropped:
      self.events.append((round_, "dropped", j,
                          self.clock.monotonic() - t0))
    newcomers = []
    was_member = set(self.members)  # a set: `in` a tuple is O(workers)
    outside = [j for j in range(1, self.n) if j not in was_member]
    asked = kv_store.values_unless_gone(  # no waiting: asked already or not
        self.store, [store_keys.rejoin_request(j) for j in outside],
        self.clock.monotonic(), clock=self.clock)
    for j, text in zip(outside, asked):
      if text is not None:
        self.store.delete(store_keys.rejoin_request(j))
        # One that died while it waited is not let in: every member would
        # wait for it in the round's collective until collective_timeout.
        if not self.is_gone(j):
          rows[j] = text
          newcomers.append(j)
    # Every arrival of the round is read (or the chief's own): one call
    # deletes them all (a directory), not one RPC per member.
    self.store.delete(store_keys.arrivals(round_))
    if newcomers and callable(chief_plan):  # made only when needed
      chief_plan = chief_plan()
    members = tuple(sorted(arrived + newcomers))
    table = decision_codec.rows_array(self.n, rows)
    decision = Decision(round_, members, tuple(newcomers), tuple(dropped),
                        decision_codec.RowView(table, members), epoch_done,
                        chief_plan if newcomers else None, row_array=table)
    decision = self._publish(decision)
    _put(self.store, store_keys.latest(), str(round_))
    self.store.delete(store_keys.decision(round_ - KEEP_ROUNDS))
    return decision


def _publish_margin(members_wait):
  """Seconds the chief keeps, of the members' wait, to publish in time."""
  return min(PUBLISH_MARGIN_S, members_wait / 4)


class _NoHooks:
  def asked_to_rejoin(self):
    pass

  def dropped(self, workers):
    pass


def _dump(row):
  return decision_codec.encode_row(row)


def _int_or(text, default):
  try:
    return int(text)
  except (TypeError, ValueError):
    return default
