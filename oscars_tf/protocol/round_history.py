"""The finished rounds a worker keeps, bounded however long it runs. No
TensorFlow."""

import collections

HISTORY_KEEP = 10_000  # rounds kept (a long run stays bounded)
# The per-round lists over the cluster (CLUSTER_FIELDS: O(workers) each)
# stay in the newest rounds only, about this many cells in all and at least
# 100 rounds: with 10,000 workers the history then holds no more than a few
# tables, with 4 workers it holds them for every round kept.
HISTORY_CLUSTER_CELLS = 1_000_000
CLUSTER_FIELDS = ("table_rates", "planned_all", "groups", "members")


class RoundHistory(collections.deque):
  """One dict per finished round, the last HISTORY_KEEP of them; the
  cluster-wide lists (CLUSTER_FIELDS) only in the newest `full_rounds`."""

  def __init__(self, num_workers):
    super().__init__(maxlen=HISTORY_KEEP)
    self.full_rounds = min(HISTORY_KEEP, max(
        100, HISTORY_CLUSTER_CELLS // (len(CLUSTER_FIELDS) * num_workers)))

  def add(self, entry):
    self.append(entry)
    if len(self) > self.full_rounds:
      older = self[-self.full_rounds - 1]
      for field in CLUSTER_FIELDS:
        older.pop(field, None)
