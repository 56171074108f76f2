"""A round's changes are held to a byte budget per member
(protocol/delta_budget.py): the farthest-off changes travel first, the rest
wait and travel later, members still hold the chief's snapshot bit for bit,
and what must travel (first rows, exact fields) always does."""

import numpy as np

from oscars_tf.policy import records
from oscars_tf.protocol import delta_budget
from oscars_tf.protocol import table_deltas

RATE, LOSS, STEPS = (records.Column.RATE, records.Column.LOSS,
                     records.Column.STEPS)
N = 10_000


def _rows(rates, losses=1.0):
  rows = np.full((len(rates), table_deltas.WIDTH), np.nan, np.float32)
  rows[:, RATE] = rates
  rows[:, LOSS] = losses
  rows[:, records.Column.LEARNING_RATE:records.Column.SYNC_COST] = (
      0.1, 5, 1, 0)  # learning rate, steps, healthy, exhausted
  return rows


class _Job:
  """The chief's side and one member's, round after round."""

  def __init__(self, n, bytes_per_member=delta_budget.BYTES_PER_MEMBER):
    self.members = tuple(range(n))
    self.pending = table_deltas.pending_changes(n)
    self.chief = self.member = table_deltas.empty(n)
    self.round = 0
    self.bytes_per_member = bytes_per_member

  def round_of(self, rows):
    """The store text of the round's changes; checks the member's result
    against the chief's."""
    self.chief, ops, blocks, cells = table_deltas.chief_changes(
        self.chief, rows, self.members, self.round, self.pending,
        bytes_per_member=self.bytes_per_member)
    text = table_deltas.encode(self.round, len(self.members), 0, (), (),
                               cells, table_deltas.digest(self.chief), ops,
                               blocks)
    held = table_deltas.Changes(text).apply(self.member, self.members)
    assert held is not None, "the member's snapshot differs from the chief's"
    self.member = held[0]
    assert self.member.tobytes() == self.chief.tobytes()
    self.round += 1
    return text


def test_a_noisy_round_at_10000_workers_stays_within_the_budget():
  rng = np.random.default_rng(0)
  rates = (10 * rng.lognormal(0, 0.5, N)).astype(np.float32)
  job = _Job(N)
  first = job.round_of(_rows(rates))
  # The first table is never held back: every rate travels in round 0.
  assert len(first) > N and np.isfinite(job.member[:, RATE]).all()
  # Then 3,000 rates move 3 to 30 % at once: far more than fits.
  moved = rng.choice(N, 3000, replace=False)
  factor = np.ones(N, np.float32)
  factor[moved] = rng.uniform(1.03, 1.3, 3000).astype(np.float32)
  new_rates = rates * factor
  before = job.member[:, RATE].copy()
  text = job.round_of(_rows(new_rates))
  assert len(text) <= delta_budget.BYTES_PER_MEMBER
  changed = np.flatnonzero(job.member[:, RATE] != before)
  assert 0 < len(changed) < len(moved)
  # The farthest off travelled first: every change beyond the confirmation
  # threshold (it travels at once) that waits is smaller than every change
  # that travelled.
  off = new_rates / before - 1
  at_once = np.flatnonzero(off > table_deltas.CONFIRM_BEYOND *
                           table_deltas.TOLERANCE[RATE])
  waiting = np.setdiff1d(at_once, changed)
  assert len(waiting) and off[waiting].max() <= off[changed].min()
  # The rest arrive in later rounds, each within the budget.
  for _ in range(40):
    if (np.abs(job.member[:, RATE] / new_rates - 1) <= 0.021).all():
      break
    assert len(job.round_of(_rows(new_rates))) <= (
        delta_budget.BYTES_PER_MEMBER)
  else:
    raise AssertionError("changes that waited never arrived")


def test_exact_fields_travel_even_beyond_the_budget():
  rng = np.random.default_rng(1)
  rates = (10 * rng.lognormal(0, 0.5, N)).astype(np.float32)
  job = _Job(N)
  job.round_of(_rows(rates))
  rows = _rows(rates * rng.uniform(1.1, 1.3, N).astype(np.float32))
  rows[::2, STEPS] = 7  # half the members took other steps than planned
  job.round_of(rows)
  assert (job.member[::2, STEPS] == 7).all()
  assert (job.member[1::2, STEPS] == 5).all()


def test_below_the_floor_nothing_waits():
  n = 512  # every rate and loss moves: two blocks, 2.8 KB a member
  rng = np.random.default_rng(2)
  rates = (10 * rng.lognormal(0, 0.5, n)).astype(np.float32)
  job, unbounded = _Job(n), _Job(n, bytes_per_member=None)
  for rows in (_rows(rates), _rows(rates * rng.uniform(
      1.03, 1.5, n).astype(np.float32), rng.uniform(0.5, 1, n))):
    assert job.round_of(rows) == unbounded.round_of(rows)
  assert delta_budget.limit(n, 0) * 4 / 3 * n >= delta_budget.FLOOR_BYTES - n


def test_a_budget_of_none_never_holds_anything_back():
  assert delta_budget.limit(N, 100, None) is None


def test_a_first_table_with_noisy_losses_sends_every_rate_then_the_losses():
  rng = np.random.default_rng(3)
  rates = (10 * rng.lognormal(0, 0.5, N)).astype(np.float32)
  losses = rng.lognormal(0, 0.3, N).astype(np.float32)
  job = _Job(N)
  job.round_of(_rows(rates, losses))
  assert np.isfinite(job.member[:, RATE]).all()
  # The rates took more than the budget: the losses wait, then travel a
  # span of members (one block) a round.
  assert not np.isfinite(job.member[:, LOSS]).any()
  job.round_of(_rows(rates, losses))
  held = np.isfinite(job.member[:, LOSS])
  assert 0 < held.sum() < N and held[:held.sum()].all()
  for _ in range(12):
    if np.isfinite(job.member[:, LOSS]).all():
      break
    assert len(job.round_of(_rows(rates, losses))) <= (
        delta_budget.BYTES_PER_MEMBER)
  else:
    raise AssertionError("the first losses never all arrived")
