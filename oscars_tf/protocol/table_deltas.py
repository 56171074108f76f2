"""A round's table snapshot as changes to the last one: O(changes) bytes.

Every member plans from the whole table (plans agree without a leader), so
if each of N members reads the whole table from the chief every round, N²
numbers leave the chief per round (64 MB at 1,024 workers). But the table
changes little from round to round once the rates have settled. So the
chief keeps a *snapshot* — the table every member plans from — and writes
each round only the cells that changed by more than their field's
tolerance (a rate within 2 % of its snapshot value stays as it is), plus
who left and who joined. Every member holds the previous snapshot and
applies the same changes in the same way, so all hold the same table; an
8-byte digest of the result travels along, and a member whose result does
not match (or that holds no previous snapshot: a newcomer) reads the whole
snapshot, which the chief writes each round under its own key.

Rules every member applies alike (`apply`):
  members(r) = members(r-1) - dropped(r) + newcomers(r);
  rows of non-members are NaN (the planner imputes them, as before);
  the round field of every member is r (it arrived in round r);
  the steps field of every member is the k_i of the plan just run, when
  the round book passes it (every member holds the same plan);
  then each field's column operation (below) and the changed cells.

Column operations keep rounds in which every row moves at once cheap:
losses that fall together, rates that all rise after warm-up, a learning
rate schedule, the whole cluster's data running out. Per field the header
carries one of: nothing; "scale every member's value by f" (the chief
picks the median ratio of fresh to held values, when it strays from 1 by
more than half the field's tolerance); "set every member's value to v"
(when all fresh values are equal). Only the cells still beyond tolerance
after that travel as cells. Without it, such a round cost N² cells out of
the chief (12.8 MB at 1,024 workers, 2.4 GB at 10,000).

Noise: a rate measured over a round moves a little every round, and the
difference of two noisy samples passes 2 % often (one row in six with 1 %
noise), each such cell going to every member. So the chief compares a
change of up to CONFIRM_BEYOND tolerances through the cell's running mean
(SMOOTHING), which must be beyond tolerance twice in a row in the same
direction before it travels, as that mean (`changed_cells`' `pending`, a
ChangeRecord); larger changes travel at once. Sending the latest sample
instead left the snapshot at the extreme that set it off, and noise sent
it back: three times the cells.

A round's changes beyond a byte budget per member wait for a later round
(`chief_changes`, delta_budget.py).

The tolerances make the snapshot a little stale (a rate at most 2 % off
its running mean, up to 8 % for a round or two while a change is
confirmed): the planner plans with it on every member alike, so agreement
holds; the cost is a few % of a round's time for a worker whose rate
drifted.
No TensorFlow.
"""

import base64
import hashlib
import struct

import numpy as np

from oscars_tf.policy import records
from oscars_tf.protocol import delta_budget
from oscars_tf.protocol import dense_columns

WIDTH = records.ROW_WIDTH  # a snapshot's columns: records.Column
# Relative change that puts a cell in the round's changes (0: any change).
# The period rules read loss, divergence, sync cost and learning rate only
# through means, medians and maxima over the table.
TOLERANCE = np.array([{"rate": 0.02, "loss": 0.05, "divergence": 0.1,
                       "sync_cost": 0.1}.get(f, 0.0) for f in records.FIELDS])
# A change beyond this many tolerances travels at once (changed_cells).
CONFIRM_BEYOND = 4.0
# The weight of a round's fresh value in a cell's running mean: noise
# shrinks by sqrt(1/3); a jump of more than 2 (up to 4) tolerances still
# travels a round late, a smaller one two or more rounds late
# (changed_cells).
SMOOTHING = 0.5
# magic, round, workers, epoch_done, newcomers, dropped, changed cells,
# digest of the resulting snapshot, column operations, dense blocks
_HEADER = struct.Struct("<4sqiqiii8sBB")
_MAGIC = b"otd4"
_CELL = np.dtype([("worker", "<i4"), ("field", "u1"), ("value", "<f4")])
# One per field: what to do to every member's value of it (only those
# other than KEEP travel, as (field, op, value)).
_COLUMN = np.dtype([("op", "u1"), ("value", "<f4")])
_COLUMN_OP = np.dtype([("field", "u1"), ("op", "u1"), ("value", "<f4")])
KEEP, SCALE, SET = 0, 1, 2


def empty(n):
  """The snapshot before round 0: no rows."""
  return np.full((n, WIDTH), np.nan, np.float32)


def digest(snapshot):
  return hashlib.blake2b(np.ascontiguousarray(snapshot).tobytes(),
                         digest_size=8).digest()


def next_snapshot(previous, members, round_, expected_steps=None):
  """The rules before the changes: non-members' rows NaN, members'
  round field `round_` and, given `expected_steps` (k_i by worker), their
  steps field k_i."""
  snap = previous.copy()
  is_member = np.zeros(len(snap), bool)
  is_member[list(members)] = True
  snap[~is_member] = np.nan
  snap[is_member, records.Column.ROUND] = round_
  if expected_steps is not None:
    steps = np.asarray(expected_steps, np.float32)
    snap[is_member, records.Column.STEPS] = steps[is_member]
  return snap


def member_rows(rows, members):
  """The members' rows of `rows` (a sequence of row tuples, None for
  non-members) as one float32 array, NaN-padded to WIDTH; an array is
  taken as the members' rows already (the chief makes it once a round)."""
  if isinstance(rows, np.ndarray):
    if rows.shape[1:] == (WIDTH,) and rows.dtype == np.float32:
      return rows
    fresh = np.full((len(rows), WIDTH), np.nan, np.float32)
    fresh[:, :min(WIDTH, rows.shape[1])] = rows[:, :WIDTH]
    return fresh
  listed = [rows[j] for j in members]
  try:
    table = np.array(listed, np.float32)
  except ValueError:  # rows of different lengths
    table = None
  fresh = np.full((len(members), WIDTH), np.nan, np.float32)
  if table is not None and table.ndim == 2:
    width = min(WIDTH, table.shape[1])
    fresh[:, :width] = table[:, :width]
    return fresh
  for i, r in enumerate(listed):
    fresh[i, :min(WIDTH, len(r))] = r[:WIDTH]
  return fresh


def column_ops(base, rows, members):
  """Per field (KEEP / SCALE / SET, value) that brings the members'
  column of `base` closest to `rows` in one number (module docstring)."""
  members = list(members)
  ops = np.zeros(WIDTH, _COLUMN)
  fresh, old = member_rows(rows, members), base[members]
  for f in range(WIDTH):
    if f == records.Column.ROUND or not members:
      continue
    new = fresh[:, f]
    if np.isfinite(new).all() and (new == new[0]).all():
      if not (old[:, f] == new[0]).all():
        ops[f] = (SET, new[0])
      continue
    if TOLERANCE[f] > 0:
      held = old[:, f]
      usable = np.isfinite(new) & np.isfinite(held) & (held != 0)
      if usable.any():
        ratio = np.float32(np.median(new[usable] / held[usable]))
        if np.isfinite(ratio) and ratio > 0 and (
            abs(ratio - 1) > TOLERANCE[f] / 2):
          ops[f] = (SCALE, ratio)
  return ops


def apply_columns(snap, members, ops):
  members = list(members)
  for f in np.nonzero(ops["op"])[0]:
    value = np.float32(ops["value"][f])
    if ops["op"][f] == SCALE:
      snap[members, f] = snap[members, f] * value
    else:
      snap[members, f] = value
  return snap


def changed_cells(base, rows, members, pending=None):
  """(worker, field, value) of the members' cells of `rows` (a sequence of
  row tuples, None for non-members) that differ from `base` beyond their
  tolerance; `base` is the snapshot after `next_snapshot` and
  `apply_columns`.

  `pending` (the chief's ChangeRecord, updated in place) filters noise out
  (module docstring): a cell within CONFIRM_BEYOND tolerances of `base` is
  compared through its running mean, which must be beyond tolerance two
  rounds in a row in the same direction, and travels as that mean; a
  larger change, a NaN change and an exact field travel at once as
  measured. With 1 % noise on every rate, 1,024 workers: 2.3 MB out of the
  chief per round without it."""
  members = list(members)
  fresh = member_rows(rows, members)
  old = base[members]
  values = fresh
  with np.errstate(invalid="ignore", divide="ignore"):
    change = fresh - old
    differs = np.abs(change) > TOLERANCE * np.abs(old)
    if pending is not None:
      at_once = (np.abs(change) > CONFIRM_BEYOND * TOLERANCE * np.abs(old)
                 ) | (TOLERANCE == 0)
      smooth = np.isfinite(old) & np.isfinite(fresh) & (old != 0) & ~at_once
      deviation = np.where(smooth, SMOOTHING * (fresh / old - 1) + (
          1 - SMOOTHING) * pending.deviation[members], 0).astype(np.float32)
      values = np.where(smooth, old * (1 + deviation), fresh)
      differs = np.where(smooth, np.abs(deviation) > TOLERANCE, differs)
      direction = np.sign(np.where(smooth, deviation, change)).astype(np.int8)
      waits = differs & ~((direction == pending.direction[members]) | at_once)
      differs &= ~waits
      pending.reset()  # a non-member's record is stale when it rejoins
      pending.direction[members] = np.where(waits, direction, 0)
      pending.deviation[members] = np.where(differs, 0, deviation)
  differs |= np.isnan(fresh) != np.isnan(old)
  differs[:, records.Column.ROUND] = False  # set by the rules
  where_i, where_f = np.nonzero(differs)
  cells = np.empty(len(where_i), _CELL)
  cells["worker"] = np.asarray(members, np.int32)[where_i]
  cells["field"] = where_f
  cells["value"] = values[where_i, where_f]
  return cells


class ChangeRecord:
  """The chief's memory of each cell between rounds (changed_cells):
  `deviation`, the running mean of its fresh values relative to the
  snapshot (0 once it travels); `direction`, the sign of its last change
  beyond tolerance that did not travel (0: none)."""

  def __init__(self, n):
    self.deviation = np.zeros((n, WIDTH), np.float32)
    self.direction = np.zeros((n, WIDTH), np.int8)

  def reset(self):
    self.deviation[:] = 0
    self.direction[:] = 0

  def wait(self, cells, base):
    """`cells` changed `base` but did not travel (delta_budget.py): each is
    held as seen, so that it travels as soon as the budget lets it (a NaN
    on either side travels anyway)."""
    worker, field = cells["worker"], cells["field"]
    with np.errstate(invalid="ignore", divide="ignore"):
      seen = cells["value"] / base[worker, field] - 1
    held = np.isfinite(seen)
    self.deviation[worker[held], field[held]] = seen[held]
    self.direction[worker[held], field[held]] = np.sign(seen[held])


def chief_changes(previous, rows, members, round_, pending, listed=0,
                  expected_steps=None,
                  bytes_per_member=delta_budget.BYTES_PER_MEMBER):
  """The chief's side of `Changes.apply`: (snapshot, ops, blocks, cells)
  of the round whose members' `rows` these are, from the `previous`
  snapshot; `listed`: how many newcomers and dropped the round's changes
  name. The changes beyond `bytes_per_member` a member wait for a later
  round (delta_budget.py; None: none wait)."""
  snap = next_snapshot(previous, members, round_, expected_steps)
  fresh = member_rows(rows, members)
  ops = column_ops(snap, fresh, members)
  snap = apply_columns(snap, members, ops)
  cells = changed_cells(snap, fresh, members, pending)
  limit = delta_budget.limit(
      len(members), _HEADER.size + _COLUMN_OP.itemsize * np.count_nonzero(
          ops["op"]) + 4 * listed, bytes_per_member)
  blocks, cells, waiting = delta_budget.within(cells, members, snap,
                                               TOLERANCE, limit)
  pending.wait(waiting, snap)
  snap = apply_cells(dense_columns.apply(snap, members, blocks), cells)
  return snap, ops, blocks, cells


def pending_changes(n):
  """The chief's `pending` for changed_cells: nothing seen yet."""
  return ChangeRecord(n)


def apply_cells(snap, cells):
  snap[cells["worker"], cells["field"]] = cells["value"]
  return snap


def encode(round_, n, epoch_done, newcomers, dropped, cells, snap_digest,
           ops=None, blocks=()):
  """One round's changes as store text (base64: the coordination
  service's values are UTF-8 text)."""
  if ops is None:
    ops = np.zeros(WIDTH, _COLUMN)
  fields = np.nonzero(ops["op"])[0]
  listed = np.empty(len(fields), _COLUMN_OP)
  listed["field"] = fields
  listed["op"] = ops["op"][fields]
  listed["value"] = ops["value"][fields]
  return base64.b64encode(b"".join((
      _HEADER.pack(_MAGIC, round_, n, epoch_done, len(newcomers),
                   len(dropped), len(cells), snap_digest, len(listed),
                   len(blocks)),
      listed.tobytes(), np.asarray(newcomers, "<i4").tobytes(),
      np.asarray(dropped, "<i4").tobytes(), cells.tobytes(),
      dense_columns.pack(blocks)))).decode("ascii")


class Changes:
  """One round's changes as decoded: header fields, lists and cells."""

  def __init__(self, text):
    data = base64.b64decode(text)
    (magic, self.round, self.n, self.epoch_done, k, d, c, self.digest,
     o, b) = _HEADER.unpack_from(data)
    if magic != _MAGIC:
      raise ValueError(f"not a table delta (magic {magic!r})")
    at = _HEADER.size
    listed = np.frombuffer(data, _COLUMN_OP, o, at)
    at += listed.nbytes
    self.ops = np.zeros(WIDTH, _COLUMN)
    self.ops["op"][listed["field"]] = listed["op"]
    self.ops["value"][listed["field"]] = listed["value"]
    self.newcomers = tuple(np.frombuffer(data, "<i4", k, at).tolist())
    at += 4 * k
    self.dropped = tuple(np.frombuffer(data, "<i4", d, at).tolist())
    at += 4 * d
    self.cells = np.frombuffer(data, _CELL, c, at)
    self._blocks = (data, at + self.cells.nbytes, b)  # need the members

  def members_after(self, previous_members):
    gone = set(self.dropped)
    return tuple(sorted({j for j in previous_members if j not in gone} |
                        set(self.newcomers)))

  def apply(self, previous, previous_members, expected_steps=None):
    """(snapshot, members) of this round from the previous round's, or
    None when the result's digest does not match the chief's."""
    members = self.members_after(previous_members)
    snap = next_snapshot(previous, members, self.round, expected_steps)
    data, at, count = self._blocks
    blocks, _ = dense_columns.unpack(data, at, count, len(members))
    snap = apply_columns(snap, members, self.ops)
    snap = apply_cells(dense_columns.apply(snap, members, blocks), self.cells)
    if digest(snap) != self.digest:
      return None
    return snap, members
