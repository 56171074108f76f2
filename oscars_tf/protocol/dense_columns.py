"""A field that changed for many members as one byte per member.

The first table (every rate is new to every member) and any round in which
most rows move unevenly would send a 9-byte cell per changed value to every
member: at 1,024 workers, 12.8 MB out of the chief for the rates alone. A
field in which most members' values changed goes instead as a *block*: a
code per member in member order (one byte), on a geometric scale of ratio
r from the smallest value, so a value arrives within a factor sqrt(r) of
what was measured. r is 1 + half the field's tolerance, or wider where
the values span more than 254 such steps, but at most 1 + twice it: a
value arrives within a quarter to the whole of its tolerance (lognormal
rates, sigma 0.5: 0.6 % at 1,024 workers, 0.8 % at 10,000), which the
snapshot may be off anyway.

Every member must hold the same float32 numbers: the scale is built by
repeated float32 multiplication (correctly rounded on every machine, unlike
exp or pow), from the two float32 numbers the block carries.
No TensorFlow.
"""

import struct

import numpy as np

_BLOCK = struct.Struct("<Bffii")  # field, smallest value, ratio, span
LEVELS = 254            # codes 0..253 are values on the scale
NAN, KEEP = 254, 255    # the value becomes NaN / the member's is unchanged
# Below this many members a first table is under 50 KB out of the chief:
# rows stay as measured.
MIN_MEMBERS = 64


def scale(low, ratio):
  """The LEVELS float32 values of a block's scale, the same on every
  member (sequential float32 products)."""
  values = np.empty(LEVELS, np.float32)
  value, ratio = np.float32(low), np.float32(ratio)
  for k in range(LEVELS):
    values[k] = value
    value = np.float32(value * ratio)
  return values


def split(cells, members, tolerance):
  """(blocks, the cells left): with MIN_MEMBERS or more, the fields whose
  cells cost more than a byte per member of their span go as blocks
  (field, low, ratio, codes in member order, the member position of the
  first code); their non-positive or infinite values stay cells.
  `tolerance` by field."""
  members = np.asarray(members, np.int64)
  blocks, keep = [], np.ones(len(cells), bool)
  if len(members) < MIN_MEMBERS:
    return blocks, cells
  for f in np.unique(cells["field"]):
    mine = cells["field"] == f
    values = cells["value"][mine].astype(np.float64)
    coded = np.isnan(values) | (np.isfinite(values) & (values > 0))
    at = np.searchsorted(members, cells["worker"][mine][coded])
    if not tolerance[f] > 0 or not len(at) or (  # a cell: worker, field,
        cells.dtype.itemsize * len(at) <=       # value
        at.max() - at.min() + 1 + _BLOCK.size):
      continue
    positive = values[coded & ~np.isnan(values)]
    low = np.float32(positive.min()) if len(positive) else np.float32(1.0)
    span = float(positive.max()) / float(low) if len(positive) else 1.0
    ratio = np.float32(max(1.0 + tolerance[f] / 2,
                           span ** (1.0 / (LEVELS - 1))))
    if ratio > 1.0 + 2 * tolerance[f]:
      continue  # too wide a spread for one byte: cells
    levels = scale(low, ratio)
    start = int(at.min())
    codes = np.full(int(at.max()) + 1 - start, KEEP, np.uint8)
    codes[at - start] = _nearest(levels, values[coded])
    blocks.append((int(f), low, ratio, codes, start))
    keep[np.flatnonzero(mine)[coded]] = False
  return blocks, cells[keep]


def _nearest(levels, values):
  """The code of the level nearest each value (in ratio), NAN for NaN."""
  with np.errstate(invalid="ignore", divide="ignore"):
    logs = np.log(levels.astype(np.float64))
    x = np.log(values)
    k = np.clip(np.searchsorted(logs, x), 1, LEVELS - 1)
    below = np.abs(x - logs[k - 1]) <= np.abs(logs[k] - x)
    codes = np.where(below, k - 1, k)
  return np.where(np.isnan(values), NAN, codes).astype(np.uint8)


def apply(snap, members, blocks):
  """Sets the members' values of each block's field (in place)."""
  members = np.asarray(members, np.int64)
  for field, low, ratio, codes, start in blocks:
    levels = np.append(scale(low, ratio), np.float32(np.nan))
    set_ = np.flatnonzero(codes != KEEP)
    snap[members[start + set_], field] = levels[codes[set_]]
  return snap


def size(blocks):
  """Bytes `pack(blocks)` takes."""
  return sum(_BLOCK.size + len(b[3]) for b in blocks)


def pack(blocks):
  return b"".join(_BLOCK.pack(f, low, ratio, start, len(codes)) +
                  codes.tobytes() for f, low, ratio, codes, start in blocks)


def unpack(data, at, count, size_):
  """(blocks, offset after them): `count` blocks from `data` at `at`, of
  `size_` members in all (a block's span must lie within them)."""
  blocks = []
  for _ in range(count):
    f, low, ratio, start, length = _BLOCK.unpack_from(data, at)
    at += _BLOCK.size
    if start < 0 or length < 0 or start + length > size_:
      raise ValueError(f"a dense block spans members {start} to "
                       f"{start + length}, of {size_}")
    codes = np.frombuffer(data, np.uint8, length, at)
    at += length
    blocks.append((f, np.float32(low), np.float32(ratio), codes, start))
  return blocks, at
