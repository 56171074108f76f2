"""The step-rate table and the plan: what the planner reads and writes.

No TensorFlow. Both are frozen dataclasses that every member holds alike;
`Plan.digest()` is the short hash workers log every round to show it.
"""

import dataclasses
import enum
import hashlib
import json
import math
from typing import Tuple

import numpy as np

from oscars_tf.policy.planner_state import PlannerState


class Column(enum.IntEnum):
  """A row's fields by their place on the wire: a row travels as floats in
  this order (FIELDS), and the code that works on the table as a float
  array (its changes, its columns) names a column by it."""
  RATE = 0
  ROUND = 1
  LOSS = 2
  DIVERGENCE = 3
  LEARNING_RATE = 4
  STEPS = 5
  HEALTHY = 6
  EXHAUSTED = 7
  SYNC_COST = 8


# TableEntry's fields in its order (test_rate_table.py checks it): the
# entry's values go on the wire in it.
FIELDS = tuple(c.name.lower() for c in Column)
ROW_WIDTH = len(FIELDS)  # floats in a row


@dataclasses.dataclass(frozen=True)
class TableEntry:
  """One worker's row: what it measured, and in which round."""
  rate: float = math.nan           # compute steps/s (EMA), waits excluded
  round: int = -1                  # round the row was measured in
  loss: float = math.nan           # training loss at that round's end
  divergence: float = math.nan     # distance from the group mean / its norm
  learning_rate: float = math.nan  # the optimizer's learning rate then
  steps: int = 0                   # local steps it ran in that round
  healthy: bool = True             # its weights were all finite then
  exhausted: bool = False          # its data for the epoch had run out
  # Seconds its previous averaging point took, arrival to averaged model
  # (the exchange, any wait for the group, the collective).
  sync_cost: float = math.nan

  def to_values(self):
    """The row as it travels: floats in FIELDS order."""
    return [float(getattr(self, f)) for f in FIELDS]

  @classmethod
  def from_values(cls, values):
    """The entry of a row of floats in FIELDS order. A shorter row (from
    before a field was added) reads 0 past its end, and NaN as its
    sync cost; a non-finite round reads -1 and non-finite steps 0."""
    if len(values) > ROW_WIDTH:
      raise ValueError(f"TableEntry: a row has at most {ROW_WIDTH} fields, "
                       f"got {len(values)}.")
    full = [float(x) for x in values] + [0.0] * (ROW_WIDTH - len(values))
    if len(values) <= Column.SYNC_COST:
      full[Column.SYNC_COST] = math.nan  # a row without one
    rnd, steps = full[Column.ROUND], full[Column.STEPS]
    return cls(rate=full[Column.RATE],
               round=int(rnd) if math.isfinite(rnd) else -1,
               loss=full[Column.LOSS], divergence=full[Column.DIVERGENCE],
               learning_rate=full[Column.LEARNING_RATE],
               steps=int(steps) if math.isfinite(steps) else 0,
               healthy=full[Column.HEALTHY] > 0.5,
               exhausted=full[Column.EXHAUSTED] > 0.5,
               sync_cost=full[Column.SYNC_COST])


@dataclasses.dataclass(frozen=True)
class StepRateTable:
  """The global view: a row per worker, and the host of each worker."""
  entries: Tuple[TableEntry, ...]
  hosts: Tuple[str, ...]

  def __post_init__(self):
    if len(self.entries) != len(self.hosts):
      raise ValueError("StepRateTable: one host per entry is required.")

  @classmethod
  def from_rows(cls, rows, hosts):
    """From a sequence of per-worker sequences in FIELDS order."""
    try:
      table = np.asarray(rows, dtype=float)
    except ValueError:  # rows of different lengths
      table = None
    if table is not None and table.ndim == 2:
      return cls(_entries_of(table), tuple(hosts))
    # Rows of different lengths: one at a time.
    return cls(tuple(map(TableEntry.from_values, rows)), tuple(hosts))

  @property
  def size(self):
    return len(self.entries)


def _entries_of(table):
  """TableEntry per row of an n x width float array, as from_rows makes
  them one at a time, but column by column (10,000 workers: milliseconds;
  a Python loop over every cell took a quarter of the chief's round)."""
  n, width = table.shape
  full = np.zeros((n, ROW_WIDTH))
  full[:, :min(width, ROW_WIDTH)] = table[:, :ROW_WIDTH]
  if width <= Column.SYNC_COST:
    full[:, Column.SYNC_COST] = math.nan  # rows without one
  columns = [full[:, c] for c in Column]
  rnd, steps = columns[Column.ROUND], columns[Column.STEPS]
  columns[Column.ROUND] = np.where(np.isfinite(rnd), rnd, -1).astype(np.int64)
  columns[Column.STEPS] = np.where(np.isfinite(steps), steps,
                                   0).astype(np.int64)
  for flag in (Column.HEALTHY, Column.EXHAUSTED):
    columns[flag] = columns[flag] > 0.5
  return tuple(map(_entry, *(c.tolist() for c in columns)))


def _entry(*values):
  """TableEntry(*values) (values in FIELDS order), its fields set at once:
  a frozen dataclass's __init__ sets them one by one through
  object.__setattr__, which took half of from_rows at 10,000 workers
  (TableEntry has no __post_init__)."""
  entry = object.__new__(TableEntry)
  entry.__dict__.update(zip(FIELDS, values))
  return entry


@dataclasses.dataclass(frozen=True)
class Plan:
  """The next round, for every worker."""
  round: int
  time_budget: float                 # T, seconds
  local_steps: Tuple[int, ...]       # k_i >= 1
  groups: Tuple[Tuple[int, ...], ...]
  weights: Tuple[float, ...]         # within each group they sum to 1
  update_scales: Tuple[float, ...]   # FedNova: tau_eff / k_i; else 1
  global_sync: bool
  stragglers: Tuple[int, ...]
  rates: Tuple[float, ...]           # the rates planned with (imputed)
  state: PlannerState
  epoch_end: bool = False            # the epoch ends with this round
  imputed: Tuple[int, ...] = ()      # planned at the median: no usable rate

  def group_of(self, worker: int) -> Tuple[int, ...]:
    for g in self.groups:
      if worker in g:
        return g
    raise KeyError(f"worker {worker} is in no group of plan {self.round}")

  def to_json(self) -> str:
    """Canonical JSON (floats to 12 significant digits) for the digest."""
    body = _map_floats(dataclasses.asdict(self),
                       lambda x: float(f"{x:.12g}") if isinstance(x, float)
                       else x)
    return json.dumps(body, sort_keys=True, separators=(",", ":"))

  def digest(self) -> str:
    """8 hex digits; equal plans have equal digests on every worker.

    Computed once per plan (it serializes every field: O(workers)); the
    plan is frozen, so the cached value stays right."""
    cached = self.__dict__.get("_digest")
    if cached is None:
      h = hashlib.sha256()
      _hash_into(h, self)
      cached = h.hexdigest()[:8]
      object.__setattr__(self, "_digest", cached)
    return cached


_LOW_BITS = np.uint64(0xFFF)  # ~12 significant digits kept, as to_json
_TAGGED_FLOAT = np.dtype([("tag", "S1"), ("bits", np.uint64)])  # packed


def _hash_into(h, value):
  """Feeds `value` (dataclasses, nested tuples of numbers, bools, None) to
  `h` as bytes:
  a whole tuple of numbers at a time (10,000 workers: milliseconds, where
  JSON took most of a second)."""
  if isinstance(value, PlannerState):  # its fields as they were flat
    for name, v in value.digest_items():
      h.update(name.encode() + b"=")
      _hash_into(h, v)
  elif dataclasses.is_dataclass(value):
    for f in dataclasses.fields(value):
      if not f.metadata.get("digest", True):
        continue
      h.update(f.name.encode() + b"=")
      _hash_into(h, getattr(value, f.name))
  elif isinstance(value, (tuple, list)):
    h.update(b"(%d" % len(value))
    kinds = set(map(type, value))  # one pass in C (10,000 rates: 1 ms)
    if kinds == {int}:
      h.update(b"i" + np.asarray(value, np.int64).tobytes())
    elif kinds == {float}:
      bits = np.asarray(value, np.float64).view(np.uint64) & ~_LOW_BITS
      h.update(b"f" + bits.tobytes())
    elif kinds and all(issubclass(k, float) for k in kinds):
      # numpy floats among them: the bytes the per-element branch below
      # feeds (b"f" and the bits, each), made at once (10,000 rates: 50 ms
      # one by one).
      each = np.empty(len(value), _TAGGED_FLOAT)
      each["tag"] = b"f"
      each["bits"] = (np.asarray(value, np.float64).view(np.uint64)
                      & ~_LOW_BITS)
      h.update(each.tobytes())
    else:
      for v in value:
        _hash_into(h, v)
    h.update(b")")
  elif isinstance(value, float):
    h.update(b"f" + (np.float64(value).view(np.uint64) & ~_LOW_BITS).tobytes())
  else:
    h.update(repr(value).encode() + b";")


def _map_floats(x, fn):
  if isinstance(x, dict):
    return {k: _map_floats(v, fn) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_map_floats(v, fn) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return repr(x)
  return fn(x)
