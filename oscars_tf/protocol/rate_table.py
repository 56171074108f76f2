"""The global step-rate table: measure, publish, read.

Each worker measures its compute step rate as an exponential moving average
of steps / compute time, where compute time excludes the time it waits for
and communicates with the others. At every round end the rows go through the
chief's membership decision (membership.py), so all members plan from the
same snapshot; at most once a second each worker also publishes its row under
its own key of the coordination service's key-value store, so any worker can
read the whole table at any time (`OscarsStrategy.step_rate_table()`).
"""

import json
import math

from absl import logging

from oscars_tf.policy import records
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import store_keys

PUBLISH_EVERY_S = 1.0


class RateMeter:
  """EMA of compute steps per second, reset when the speed really changes.

  The first sample seeds it. A sample more than `change` times above or
  below the average replaces it outright: a worker that became 4x slower is
  planned at its new speed from the next round on, not after several rounds
  of averaging the old speed away.
  """

  def __init__(self, alpha=0.5, change=1.5):
    if not 0 < alpha <= 1:
      raise ValueError(f"RateMeter: alpha must be in (0, 1], got {alpha!r}.")
    if not change > 1:
      raise ValueError(f"RateMeter: change must be > 1, got {change!r}.")
    self.alpha = alpha
    self.change = change
    self.rate = math.nan

  def add(self, steps, seconds):
    if steps <= 0 or not seconds > 0 or not math.isfinite(seconds):
      return self.rate
    sample = steps / seconds
    if (not math.isfinite(self.rate) or sample > self.rate * self.change or
        sample < self.rate / self.change):
      self.rate = sample
    else:
      self.rate = self.alpha * sample + (1 - self.alpha) * self.rate
    return self.rate

  def reset(self, rate=math.nan):
    self.rate = rate


def publish(store, worker, entry: records.TableEntry, plan_digest: str):
  """Writes this worker's row to `store` (a coordination_store.ContextStore)."""
  kv_store.put(store, store_keys.table_row(worker), json.dumps({
      "rate": entry.rate, "round": entry.round, "loss": entry.loss,
      "divergence": entry.divergence, "learning_rate": entry.learning_rate,
      "plan": plan_digest}))


class RowPublisher:
  """One worker's published row. The rows are for people and tools (plans
  come from the round's decision), so it is refreshed at most every
  `every_s`: two RPCs to the coordination service per round would cost
  short rounds dearly."""

  def __init__(self, worker, every_s=PUBLISH_EVERY_S):
    self.worker = worker
    self.every_s = every_s
    self._last = -math.inf

  def maybe_publish(self, store, entry, plan, now):
    """Publishes `entry` and `plan`'s digest (made only then) unless the
    last publication is younger than `every_s` at `now`; never raises:
    training goes on without it."""
    if now - self._last < self.every_s:
      return
    self._last = now
    try:
      publish(store, self.worker, entry, plan.digest())
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("oscars_tf: could not publish the rate row: %s", e)


def read_all(store, num_workers, timeout_s=2.0):
  """Every worker's latest published row (None where none is published)."""
  rows = []
  for w in range(num_workers):
    try:
      rows.append(json.loads(store.get(store_keys.table_row(w), timeout_s)))
    except kv_store.KeyMissing:
      rows.append(None)
  return rows
