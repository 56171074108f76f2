"""Compact binary forms of a round's rows and decisions. No TensorFlow.

Per-worker JSON cost the chief most of its round at 1,000 workers
(dataclasses.asdict and json over every row), so rows and decisions travel
as packed little-endian numbers: a fixed header (struct), the member lists
as int32 arrays, the members' rows as one float32 array (members x width);
the chief's plan for newcomers (rare, a small dict) stays JSON.

The coordination service's Python API returns values decoded as UTF-8
(context.get_config_key_value), so arbitrary bytes cannot be stored: every
value is base64 text (4/3 of the bytes, still far below the JSON).

Every member decodes the same text, so all hold the same float32 values;
the chief plans from the decoded decision too (distributions.py), never from
the float64 rows it read, or its plan would differ in the last bits.
"""

import base64
import binascii
import collections.abc
import json
import struct

import numpy as np

ROW_DTYPE = np.dtype("<f4")
ID_DTYPE = np.dtype("<i4")
# magic, round, workers, epoch_done, members, newcomers, dropped, row width,
# chief-plan bytes
_HEADER = struct.Struct("<4sqiqiiiii")
_MAGIC = b"ocd1"


def encode_row(row):
  """A worker's table row (floats, NaN allowed) as store text."""
  return base64.b64encode(np.asarray(row, "<f8").tobytes()).decode("ascii")


def rows_array(n, texts):
  """`texts` ({worker: encode_row text}) as one n x width float64 array,
  NaN-padded to the widest row and NaN for the workers not in it. Rows of
  one unpadded width (9 fields: 72 bytes) are decoded as one text: the
  chief reads one a member each round (10,000 workers: 2 ms, not 11)."""
  workers, values = list(texts), list(texts.values())
  raw = None
  if len(set(map(len, values))) == 1:
    raw = binascii.a2b_base64("".join(values))
    # A padded text ends the decoding early: then one at a time.
    if len(raw) != len(values) * len(binascii.a2b_base64(values[0])):
      raw = None
  if raw is not None:
    rows = np.frombuffer(raw, "<f8").reshape(len(values), -1)
    table = np.full((n, rows.shape[1]), np.nan)
    table[workers] = rows
    return table
  raws = [binascii.a2b_base64(t) for t in values]
  table = np.full((n, max(map(len, raws), default=0) // 8), np.nan)
  for j, r in zip(workers, raws):
    table[j, :len(r) // 8] = np.frombuffer(r, "<f8")
  return table


def encode_decision(decision):
  """`decision` (membership.Decision) as compact store text."""
  return base64.b64encode(decision_bytes(decision)).decode("ascii")


def decision_bytes(decision):
  members = np.asarray(decision.members, ID_DTYPE)
  if decision.row_array is not None:
    return table_bytes(decision.round, len(decision.row_array),
                       decision.epoch_done, members, decision.newcomers,
                       decision.dropped, decision.row_array[members],
                       decision.chief_plan)
  width = max((len(decision.rows[j]) for j in decision.members
               if decision.rows[j] is not None), default=0)
  listed = [decision.rows[j] for j in decision.members]
  if all(r is not None and len(r) == width for r in listed):
    rows = np.array(listed, ROW_DTYPE).reshape(len(members), width)
  else:  # rows of different lengths: one at a time, NaN-padded
    rows = np.full((len(members), width), np.nan, ROW_DTYPE)
    for i, r in enumerate(listed):
      if r is not None:
        rows[i, :len(r)] = r
  return table_bytes(decision.round, len(decision.rows), decision.epoch_done,
                     members, decision.newcomers, decision.dropped, rows,
                     decision.chief_plan)


def table_bytes(round_, n, epoch_done, members, newcomers, dropped,
                member_rows, chief_plan=None):
  """A decision's bytes from its parts; `member_rows`: the members' rows,
  one per member in order (members x width)."""
  rows = np.ascontiguousarray(member_rows, ROW_DTYPE)
  plan = (b"" if chief_plan is None else
          json.dumps(chief_plan, allow_nan=True).encode())
  return b"".join((
      _HEADER.pack(_MAGIC, round_, n, epoch_done, len(members),
                   len(newcomers), len(dropped), rows.shape[1], len(plan)),
      np.asarray(members, ID_DTYPE).tobytes(),
      np.asarray(newcomers, ID_DTYPE).tobytes(),
      np.asarray(dropped, ID_DTYPE).tobytes(), rows.tobytes(), plan))


def decode_decision(text, decision_type):
  """The decision `encode_decision` wrote, as a `decision_type`
  (membership.Decision) whose `row_array` holds the rows as one n x width
  float64 array (NaN for non-members)."""
  return decision_from_bytes(base64.b64decode(text), decision_type)


def decision_from_bytes(data, decision_type):
  (magic, round_, n, epoch_done, m, k, d, width,
   plan_len) = _HEADER.unpack_from(data)
  if magic != _MAGIC:
    raise ValueError(f"not a compact decision (magic {magic!r})")
  at = _HEADER.size

  def take(count, dtype):
    nonlocal at
    out = np.frombuffer(data, dtype, count, at)
    at += count * dtype.itemsize
    return out
  members = take(m, ID_DTYPE)
  newcomers = take(k, ID_DTYPE)
  dropped = take(d, ID_DTYPE)
  member_rows = take(m * width, ROW_DTYPE).reshape(m, width)
  plan = json.loads(data[at:at + plan_len]) if plan_len else None
  table = np.full((n, width), np.nan)
  table[members] = member_rows
  return decision_with_array(decision_type, round_, members, newcomers,
                             dropped, table, epoch_done, plan)


def decision_with_array(decision_type, round_, members, newcomers, dropped,
                        table, epoch_done, plan):
  """A `decision_type` over `table` (n x width, NaN rows for non-members):
  `rows` as tuples for callers that index them, `row_array` kept whole."""
  members = tuple(int(j) for j in members)
  return decision_type(
      round=int(round_), members=members,
      newcomers=tuple(int(j) for j in newcomers),
      dropped=tuple(int(j) for j in dropped), rows=RowView(table, members),
      epoch_done=int(epoch_done), chief_plan=plan, row_array=table)


class RowView(collections.abc.Sequence):
  """A decision's rows over its n x width array: row j as a tuple of
  floats, None for a non-member; made when asked for (every member decodes
  a 10,000-row table each round, and the round book takes the array
  whole: tuples for all took 15 ms). Equal to, and hashes as, the tuple of
  its rows."""

  def __init__(self, table, members):
    self._table = table
    self._is_member = np.zeros(len(table), bool)
    self._is_member[list(members)] = True

  def __len__(self):
    return len(self._table)

  def __getitem__(self, j):
    if isinstance(j, slice):
      return tuple(self[i] for i in range(len(self))[j])
    return tuple(self._table[j].tolist()) if self._is_member[j] else None

  def __eq__(self, other):
    return isinstance(other, collections.abc.Sequence) and (
        tuple(self) == tuple(other))

  def __hash__(self):
    return hash(tuple(self))

  def __repr__(self):
    return repr(tuple(self))
