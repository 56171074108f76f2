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
  then the changed cells are set.

The tolerances make the snapshot a little stale (a rate at most 2 % off):
the planner plans with it on every member alike, so agreement holds; the
cost is up to 2 % of a round's time for a worker whose rate drifted.
No TensorFlow.
"""

import base64
import hashlib
import struct

import numpy as np

from oscars_tf.policy import records

WIDTH = len(records.FIELDS)
ROUND = records.FIELDS.index("round")
# Relative change that puts a cell in the round's changes (0: any change).
# The period rules read loss, divergence, sync cost and learning rate only
# through means, medians and maxima over the table.
TOLERANCE = np.array([{"rate": 0.02, "loss": 0.05, "divergence": 0.1,
                       "sync_cost": 0.1}.get(f, 0.0) for f in records.FIELDS])
# magic, round, workers, epoch_done, newcomers, dropped, changed cells,
# digest of the resulting snapshot
_HEADER = struct.Struct("<4sqiqiii8s")
_MAGIC = b"otd1"
_CELL = np.dtype([("worker", "<i4"), ("field", "u1"), ("value", "<f4")])


def empty(n):
  """The snapshot before round 0: no rows."""
  return np.full((n, WIDTH), np.nan, np.float32)


def digest(snapshot):
  return hashlib.blake2b(np.ascontiguousarray(snapshot).tobytes(),
                         digest_size=8).digest()


def next_snapshot(previous, members, round_):
  """The rules before the changes: non-members' rows NaN, members'
  round field `round_`."""
  snap = previous.copy()
  is_member = np.zeros(len(snap), bool)
  is_member[list(members)] = True
  snap[~is_member] = np.nan
  snap[is_member, ROUND] = round_
  return snap


def changed_cells(base, rows, members):
  """(worker, field, value) of the members' cells of `rows` (a sequence of
  row tuples, None for non-members) that differ from `base` beyond their
  tolerance; `base` is the snapshot after `next_snapshot`."""
  members = list(members)
  fresh = np.full((len(members), WIDTH), np.nan, np.float32)
  for i, j in enumerate(members):
    r = rows[j][:WIDTH]
    fresh[i, :len(r)] = r
  old = base[members]
  with np.errstate(invalid="ignore"):
    differs = np.abs(fresh - old) > TOLERANCE * np.abs(old)
  differs |= np.isnan(fresh) != np.isnan(old)
  differs[:, ROUND] = False  # set by the rules
  where_i, where_f = np.nonzero(differs)
  cells = np.empty(len(where_i), _CELL)
  cells["worker"] = np.asarray(members, np.int32)[where_i]
  cells["field"] = where_f
  cells["value"] = fresh[where_i, where_f]
  return cells


def apply_cells(snap, cells):
  snap[cells["worker"], cells["field"]] = cells["value"]
  return snap


def encode(round_, n, epoch_done, newcomers, dropped, cells, snap_digest):
  """One round's changes as store text (base64: the coordination
  service's values are UTF-8 text)."""
  return base64.b64encode(b"".join((
      _HEADER.pack(_MAGIC, round_, n, epoch_done, len(newcomers),
                   len(dropped), len(cells), snap_digest),
      np.asarray(newcomers, "<i4").tobytes(),
      np.asarray(dropped, "<i4").tobytes(), cells.tobytes()))).decode("ascii")


class Changes:
  """One round's changes as decoded: header fields, lists and cells."""

  def __init__(self, text):
    data = base64.b64decode(text)
    (magic, self.round, self.n, self.epoch_done, k, d, c,
     self.digest) = _HEADER.unpack_from(data)
    if magic != _MAGIC:
      raise ValueError(f"not a table delta (magic {magic!r})")
    at = _HEADER.size
    self.newcomers = tuple(np.frombuffer(data, "<i4", k, at).tolist())
    at += 4 * k
    self.dropped = tuple(np.frombuffer(data, "<i4", d, at).tolist())
    at += 4 * d
    self.cells = np.frombuffer(data, _CELL, c, at)

  def members_after(self, previous_members):
    gone = set(self.dropped)
    return tuple(sorted({j for j in previous_members if j not in gone} |
                        set(self.newcomers)))

  def apply(self, previous, previous_members):
    """(snapshot, members) of this round from the previous round's, or
    None when the result's digest does not match the chief's."""
    members = self.members_after(previous_members)
    snap = apply_cells(next_snapshot(previous, members, self.round),
                       self.cells)
    if digest(snap) != self.digest:
      return None
    return snap, members
