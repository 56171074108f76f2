"""The finished rounds a worker keeps, bounded however long it runs. No
TensorFlow."""

import collections
import dataclasses
from typing import List
from typing import Optional

HISTORY_KEEP = 10_000  # rounds kept (a long run stays bounded)
# The per-round lists over the cluster (CLUSTER_FIELDS: O(workers) each)
# stay in the newest rounds only, about this many cells in all and at least
# 100 rounds: with 10,000 workers the history then holds no more than a few
# tables, with 4 workers it holds them for every round kept.
HISTORY_CLUSTER_CELLS = 1_000_000
CLUSTER_FIELDS = ("table_rates", "planned_all", "groups", "members")


@dataclasses.dataclass(frozen=True)
class RoundRecord:
  """One finished round as this worker saw it. Users read it as a dict
  (`as_dict`: `OscarsStrategy.round_history`), so its fields keep the
  names, order and list values that dict has; the cluster-wide lists
  (CLUSTER_FIELDS) are None once the history let them go."""
  round: int
  plan: str                 # the digest of the round's plan
  local_steps: int          # the steps this worker ran in it
  planned_steps: int        # its k_i in the plan
  group: List[int]          # its group in the plan
  global_sync: bool
  sharded_sync: bool        # across hosts, shard by shard
  epoch_end: bool
  compute_s: float          # arrival less the round's start, waits excluded
  wait_s: float             # arrival to the round's table
  comm_s: float             # the table to the averaged model
  arrived_at: float         # wall time (time.time()) of its arrival
  rate: float               # its rate meter after the round
  divergence: float
  loss: float               # its row of the round's table
  learning_rate: float
  table_rates: Optional[List[float]]  # every worker's rate in the table
  time_budget: float        # the plan's T
  end_step: int             # its local step at the averaging point
  stragglers: List[int]
  bytes_sent: int
  poisoned: List[int]       # members with non-finite weights
  members: Optional[List[int]]
  dropped: List[int]
  rejoined: List[int]
  groups: Optional[List[List[int]]]
  planned_all: Optional[List[int]]  # every worker's k_i
  # overlap=True (distribute/overlap.py): the seconds its averaging ran
  # beside the next round's compute, then those the worker waited for it
  # where it took it (at the next round end, or at once: overlap_s 0).
  overlap_s: float = 0.0
  take_wait_s: float = 0.0

  def as_dict(self):
    """The round as a dict, without the cluster lists let go. Its values
    are the record's own, not copies: `dataclasses.asdict` would copy
    10,000 workers' lists for every round a user reads."""
    out = dict(vars(self))  # its fields in order: a record holds no other
    for name in CLUSTER_FIELDS:
      if out[name] is None:
        del out[name]
    return out

  def without_cluster_lists(self):
    """The record with the cluster lists let go (None)."""
    return dataclasses.replace(self, **dict.fromkeys(CLUSTER_FIELDS))


class RoundHistory(collections.deque):
  """One RoundRecord per finished round, the last HISTORY_KEEP of them;
  the cluster-wide lists (CLUSTER_FIELDS) only in the newest
  `full_rounds`."""

  def __init__(self, num_workers):
    super().__init__(maxlen=HISTORY_KEEP)
    self.full_rounds = min(HISTORY_KEEP, max(
        100, HISTORY_CLUSTER_CELLS // (len(CLUSTER_FIELDS) * num_workers)))

  def amend(self, round_, change):
    """Replaces the record `r` of round `round_` by `change(r)` (an
    overlapped averaging ends after its round was recorded) and returns
    it; None if it is no longer kept."""
    for i in range(len(self) - 1, -1, -1):
      if self[i].round == round_:
        self[i] = change(self[i])
        return self[i]
      if self[i].round < round_:
        break
    return None

  def add(self, record):
    self.append(record)
    if len(self) > self.full_rounds:
      older = -self.full_rounds - 1
      self[older] = self[older].without_cluster_lists()
