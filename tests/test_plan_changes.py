"""Tests for oscars_tf.policy.plan_changes: a plan restricted to a round's
members, its arrivals (members out of data), whole calls of
steps_per_execution, and the weights of a global sync host by host and in
racks (pure Python, no TensorFlow). Property tests run over random tables
with hypothesis.
"""

import math

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest

from oscars_tf import schedules
from oscars_tf.policy import period_rules
from oscars_tf.policy import plan_changes
from oscars_tf.policy import planner
from oscars_tf.policy import records
from plan_tables import CONFIGS
from plan_tables import tables


@settings(max_examples=60, deadline=None)
@given(tables(), CONFIGS, st.integers(0, 40), st.data())
def test_a_plan_restricted_to_members_leaves_the_others_alone(
    table, config, round_, data):
  plan = config.plan(table, round_)
  n = table.size
  members = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
  newcomers = data.draw(st.sets(st.sampled_from(sorted(members))))
  out = plan_changes.with_members(plan, members, newcomers)
  assert sorted(i for g in out.groups for i in g) == list(range(n))
  for g in out.groups:
    if any(i not in members for i in g):
      assert len(g) == 1  # an absent worker is in no collective
    assert math.isclose(sum(out.weights[i] for i in g), 1.0)
  if newcomers:  # they take the current model: one group of all members
    assert tuple(sorted(members)) in out.groups and out.global_sync
  else:  # members keep the groups they had, less the absent
    for g in plan.groups:
      kept = tuple(i for i in g if i in members)
      assert not kept or kept in out.groups
  assert out.local_steps == plan.local_steps
  assert plan_changes.with_members(plan, range(n)) is plan


@settings(max_examples=60, deadline=None)
@given(tables(), CONFIGS, st.integers(0, 40), st.data())
def test_no_group_of_members_is_left_without_a_sound_one(table, config,
                                                          round_, data):
  n = table.size
  members = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
  plan = plan_changes.with_members(config.plan(table, round_), members)
  sound = [i in members and data.draw(st.booleans()) for i in range(n)]
  out = plan_changes.with_sound_groups(plan, members, sound)
  member_groups = [g for g in out.groups if g[0] in members]
  if any(sound):  # every poisoned member has a model to take
    assert all(any(sound[i] for i in g) for g in member_groups)
  if out is not plan:  # a sync of all members, as for newcomers
    assert member_groups == [tuple(sorted(members))] and out.global_sync
    assert all(len(g) == 1 for g in out.groups if g[0] not in members)
    assert math.isclose(sum(out.weights[i] for i in members), 1.0)


def _even_plan(n=3, k=(6, 6, 2)):
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=float(s), round=3) for s in k), ("h",) * n)
  return schedules.Fixed(4).plan(table, 5)


def test_arrivals_without_exhausted_members_change_nothing():
  p = _even_plan()
  q, over = plan_changes.with_arrivals(p, (0, 1, 2), (4, 4, 4),
                                    (False, False, False))
  assert q is p and not over


def test_a_member_out_of_data_with_no_steps_takes_the_model():
  p = _even_plan()
  q, over = plan_changes.with_arrivals(p, (0, 1, 2), (4, 0, 4),
                                    (False, True, False))
  assert not over
  assert q.weights[1] == 0.0 and q.weights[0] == q.weights[2] == 0.5


def test_the_epoch_is_over_when_every_member_is_out_of_data():
  p = _even_plan()
  q, over = plan_changes.with_arrivals(p, (0, 2), (3, 9, 1),
                                    (True, False, True))
  assert over and q.epoch_end and q.global_sync
  assert q.groups[0] == (0, 2) and (1,) in q.groups
  assert q.weights[0] == pytest.approx(0.75) and q.weights[2] == (
      pytest.approx(0.25))


def test_an_over_epoch_where_nobody_stepped_is_a_plain_mean():
  p = _even_plan()
  q, over = plan_changes.with_arrivals(p, (0, 1, 2), (0, 0, 0), (True,) * 3)
  assert over and q.weights == pytest.approx((1 / 3,) * 3)


@settings(max_examples=200, deadline=None)
@given(tables(), st.integers(1, 8))
def test_quantized_steps_are_whole_calls_and_never_fewer(table, quantum):
  p = schedules.Adaptive().plan(table, 4)
  q = plan_changes.quantized(p, quantum)
  for k, kq in zip(p.local_steps, q.local_steps):
    assert kq % quantum == 0 and k <= kq < k + quantum
  for g in q.groups:
    assert sum(q.weights[i] for i in g) == pytest.approx(1.0)


def _global_sync_plan(steps):
  """A global sync of len(steps) workers weighted by their work."""
  n = len(steps)
  groups = (tuple(range(n)),)
  weights, scales = planner.weights_and_scales(groups, tuple(steps), "work")
  return records.Plan(round=3, time_budget=1.0, local_steps=tuple(steps),
                      groups=groups, weights=weights, update_scales=scales,
                      global_sync=True, stragglers=(), rates=(1.0,) * n,
                      state=records.PlannerState(
                          period_rules.ConstantState(4.0), global_every=4))


def _grouped_plan(groups, weights):
  n = len(weights)
  return records.Plan(round=1, time_budget=1.0, local_steps=(1,) * n,
                      groups=groups, weights=weights,
                      update_scales=(1.0,) * n, global_sync=False,
                      stragglers=(), rates=(1.0,) * n,
                      state=records.PlannerState(
                          period_rules.ConstantState(4.0), global_every=4))


def test_the_effective_group_size_counts_members_by_their_weights():
  equal = _grouped_plan(((0, 1, 2, 3),), (0.25,) * 4)
  assert plan_changes.effective_group_size(equal, 2) == pytest.approx(4.0)
  split = _grouped_plan(((0,), (1, 2)), (1.0, 0.5, 0.5))
  assert plan_changes.effective_group_size(split, 0) == 1.0
  assert plan_changes.effective_group_size(split, 1) == pytest.approx(2.0)
  # One member with most of the weight: its noise dominates the average.
  uneven = _grouped_plan(((0, 1, 2),), (0.8, 0.1, 0.1))
  assert plan_changes.effective_group_size(uneven, 1) == pytest.approx(
      1 / (0.64 + 0.01 + 0.01))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 10), st.data())
def test_a_sync_host_by_host_weighs_like_the_flat_healthy_average(n, data):
  # Issue 19: hierarchical parts used the raw weights while poisoned or
  # rejoining members contributed zeros, which shrank the model.
  hosts = data.draw(st.lists(st.sampled_from("ab"), min_size=n, max_size=n))
  steps = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
  sound = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
  members = list(range(n))
  p = _global_sync_plan(steps)
  parts = [plan_changes.host_part(p, i, hosts, members, sound) for i in members]
  composed = [parts[i].weight_in_host * parts[parts[i].host[0]].host_share
              for i in members]
  if any(sound):
    flat = [plan_changes.healthy_weight(p, i, sound) for i in members]
    assert composed == pytest.approx(flat)
    assert sum(composed) == pytest.approx(1.0)
  else:
    assert sum(composed) == pytest.approx(1.0)
  # Every member of a host agrees on the host's share and leader.
  for i in members:
    lead = parts[i].host[0]
    assert parts[i].host_share == pytest.approx(parts[lead].host_share)
    assert lead in parts[i].leaders


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 14), st.integers(2, 3), st.data())
def test_a_sync_in_racks_of_host_leaders_weighs_like_the_flat_average(
    n, max_leaders, data):
  # Issue 14: more host leaders than the group bound go in racks of at
  # most `max_leaders`, whose leaders sum once more: three weighted sums
  # that compose to the flat healthy weights, every ring within the bound.
  hosts = data.draw(st.lists(st.sampled_from("abcdefg"), min_size=n,
                             max_size=n))
  steps = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
  sound = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
  members = list(range(n))
  p = _global_sync_plan(steps)
  parts = [plan_changes.host_part(p, i, hosts, members, sound, max_leaders)
           for i in members]
  composed = [parts[i].weight_in_host * parts[parts[i].host[0]].host_share *
              parts[parts[i].leaders[0]].rack_share for i in members]
  assert sum(composed) == pytest.approx(1.0)
  if any(sound):
    flat = [plan_changes.healthy_weight(p, i, sound) for i in members]
    assert composed == pytest.approx(flat)
  hosts_count = len(set(hosts))
  for part in parts:
    assert len(part.leaders) <= max_leaders
    assert len(part.rack_leaders) == -(-hosts_count // max_leaders)
    assert part.leaders[0] in part.rack_leaders
    assert part.host[0] in part.leaders
