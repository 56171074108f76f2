"""A round's table changes held to a byte budget per member; the rest wait.

Every member reads the round's changes (table_deltas.py) from the chief, so
changes of B bytes cost N·B out of the chief. Most rounds take a few hundred
bytes a member; rounds in which noise moves many rates at once take more
(1 % noise on every rate at 10,000 workers: 20 MB, 31 MB in the worst
round). So the changes of values the members hold already are held to
BYTES_PER_MEMBER of store text a member and round (more while the whole
round stays under FLOOR_BYTES out of the chief: jobs of up to about 1,000
workers never wait), the farthest off (in tolerances) first; the rest wait
for a later round, as the snapshot holds them on every member alike, so
plans still agree.

What never waits: exact fields (steps, healthy, exhausted, learning rate,
...: a worker's data running out must be known at once), and a rate new to
the snapshot or gone from it (NaN on one side: a member's first row, as in
the first table). Holding back first rates was measured (10,000 workers,
lognormal rates): 8 rounds with most rates planned at the median (the
planner imputes what it does not hold), utilization 0.20 in them against
0.75. Other first values (loss, divergence, sync cost, read only through
means and medians over the values held) go first among the rest, in member
order, so a first table with noisy losses (a second column: 2 bytes a
member and worker) arrives over a few rounds.
No TensorFlow.
"""

import numpy as np

from oscars_tf.policy import records
from oscars_tf.protocol import dense_columns

# Store text (base64) each member reads per round, at most, beyond what
# always travels (members that left or joined, exact fields).
BYTES_PER_MEMBER = 1_700
# A round under this many bytes out of the chief in all never waits.
FLOOR_BYTES = 1_700_000


def limit(members, overhead, bytes_per_member=BYTES_PER_MEMBER):
  """Bytes of cells and blocks a round's changes may take among `members`
  members, `overhead` bytes of header and lists besides; None: no limit."""
  if bytes_per_member is None:
    return None
  text = max(FLOOR_BYTES / max(1, members), bytes_per_member)
  return int(text * 3 / 4) - overhead  # base64: 4 characters per 3 bytes


def within(cells, members, base, tolerance, limit_bytes):
  """(blocks, cells, waiting cells): the changes `cells` of the snapshot
  `base` (dense_columns.split's blocks and cells) within `limit_bytes`,
  those that must travel and then the farthest off, and those that wait."""
  members = np.asarray(members, np.int64)  # once, not per split below
  blocks, left = dense_columns.split(cells, members, tolerance)
  if limit_bytes is None or _cost(blocks, left) <= limit_bytes:
    return blocks, left, cells[:0]
  order, must = by_need(cells, base, tolerance)
  lo, hi = must, len(cells)  # the most cells that fit: lo <= k <= hi
  while lo < hi:
    k = (lo + hi + 1) // 2
    if _cost(*dense_columns.split(cells[order[:k]], members, tolerance)
             ) <= limit_bytes:
      lo = k
    else:
      hi = k - 1
  blocks, left = dense_columns.split(cells[order[:lo]], members, tolerance)
  return blocks, left, cells[order[lo:]]


def by_need(cells, base, tolerance):
  """(indices of `cells` in the order they travel, how many of them must
  travel): exact fields and rates with NaN on either side; then the others,
  NaN on either side first, in member order, then the farthest off their
  held value (in tolerances)."""
  field = cells["field"]
  old = base[cells["worker"], field].astype(np.float64)
  new = cells["value"].astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    off = np.abs(new / old - 1) / tolerance[field]
  first = np.isnan(old) | np.isnan(new)
  must = (tolerance[field] == 0) | (first & (field == records.Column.RATE))
  kind = np.where(must, 0, np.where(first, 1, 2))
  farthest = np.where(kind == 2, -np.nan_to_num(off, nan=np.inf), 0.0)
  return np.lexsort((farthest, kind)), int(must.sum())  # stable


def _cost(blocks, cells):
  return dense_columns.size(blocks) + cells.nbytes
