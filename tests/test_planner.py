"""Tests for oscars_tf.policy.planner (pure Python, no TensorFlow).

Property tests run over random tables with hypothesis.
"""

import dataclasses
import json
import math
import time

from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest

from oscars_tf import schedules
from oscars_tf.policy import period_rules
from oscars_tf.policy import plan_changes
from oscars_tf.policy import planner
from oscars_tf.policy import planner_state
from oscars_tf.policy import records
from plan_tables import CONFIGS
from plan_tables import tables


@settings(max_examples=300, deadline=None)
@given(tables(), CONFIGS, st.integers(0, 12))
def test_every_worker_in_exactly_one_group_with_valid_weights(table, config,
                                                              round_):
  p = config.plan(table, round_)
  members = sorted(i for g in p.groups for i in g)
  assert members == list(range(table.size))
  for g in p.groups:
    assert math.isclose(sum(p.weights[i] for i in g), 1.0, rel_tol=1e-9)
    assert all(p.weights[i] > 0 for i in g)
  assert all(k >= 1 for k in p.local_steps)
  assert all(s > 0 and math.isfinite(s) for s in p.update_scales)
  assert p.time_budget > 0 and math.isfinite(p.time_budget)


@settings(max_examples=300, deadline=None)
@given(tables(), CONFIGS, st.integers(0, 12))
def test_local_steps_ordered_like_the_rates(table, config, round_):
  p = config.plan(table, round_)
  for i in range(table.size):
    for j in range(table.size):
      if p.rates[i] > p.rates[j]:
        assert p.local_steps[i] >= p.local_steps[j]


@settings(max_examples=200, deadline=None)
@given(tables(), CONFIGS, st.integers(0, 12))
def test_identical_inputs_give_identical_plans(table, config, round_):
  a = config.plan(table, round_)
  b = config.plan(records.StepRateTable(tuple(table.entries),
                                          tuple(table.hosts)), round_)
  assert a == b and a.to_json() == b.to_json() and a.digest() == b.digest()


@settings(max_examples=100, deadline=None)
@given(tables(), CONFIGS, st.integers(0, 12))
def test_the_digest_tells_any_change_of_the_plan(table, config, round_):
  p = config.plan(table, round_)
  changed = {
      "round": p.round + 1, "time_budget": p.time_budget * 1.01 + 1e-9,
      "local_steps": (p.local_steps[0] + 1,) + p.local_steps[1:],
      "groups": tuple(reversed(p.groups)) if len(p.groups) > 1 else (
          p.groups[0] + (99,),),
      "weights": (p.weights[0] + 0.01,) + p.weights[1:],
      "global_sync": not p.global_sync, "stragglers": p.stragglers + (99,),
      "epoch_end": not p.epoch_end, "imputed": p.imputed + (99,),
      "state": dataclasses.replace(p.state, rule=dataclasses.replace(
          p.state.rule, period=p.state.period + 1.0))}
  for field, value in changed.items():
    assert dataclasses.replace(p, **{field: value}).digest() != p.digest(), (
        field)
  assert dataclasses.replace(p).digest() == p.digest()  # equal: equal


@settings(max_examples=200, deadline=None)
@given(tables(), st.integers(0, 12))
def test_bad_and_stale_rates_are_planned_at_the_median(table, round_):
  config = schedules.Adaptive()
  rates, bad = planner.usable_rates(table, round_, config.max_staleness)
  assert all(math.isfinite(r) and r > 0 for r in rates)
  good = [r for i, r in enumerate(rates) if i not in bad]
  for i in bad:
    if good:
      assert min(good) <= rates[i] <= max(good)


def _table_of_rates(*rates):
  return records.StepRateTable(
      tuple(records.TableEntry(rate=r, round=0) for r in rates),
      ("a",) * len(rates))


@settings(max_examples=200, deadline=None)
@given(tables(), st.integers(1, 12))
# Two workers arrive last together (20 steps at 15/s, 2 at 1.5/s: 4/3 s);
# the one whose nearest step count set the end is the second.
@example(_table_of_rates(1.0, 15.0, 1.5), 1)
def test_every_worker_fills_the_round_to_its_latest_arrival(table, round_):
  """k_i = rate_i * T to the nearest step sets the round's end, its latest
  arrival (within half a step of T; the slowest worker, whose steps T is a
  whole number of, exactly at T); then every worker takes as many whole
  steps as end by it: none arrives after the end, none a step or more
  before it."""
  p = schedules.Adaptive().plan(table, round_)
  arrivals = [k / r for k, r in zip(p.local_steps, p.rates)]
  end = max(arrivals)
  # Whichever of the workers arriving last set the end.
  assert any(end - p.time_budget <= 0.5 / p.rates[j] * (1 + 1e-6) or
             p.local_steps[j] == 1
             for j, a in enumerate(arrivals) if a >= end * (1 - 1e-12))
  for k, r, arrival in zip(p.local_steps, p.rates, arrivals):
    assert k >= 1 and arrival <= end
    assert end - arrival < 1 / r * (1 + 1e-6)
  slowest = min(p.rates)
  steps = p.time_budget * slowest
  assert steps == pytest.approx(round(steps))


def test_steps_follow_the_rates():
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=r, round=3) for r in (40.0, 40.0, 20.0, 10.0)),
      ("h",) * 4)
  p = schedules.Adaptive(initial_period=16).plan(table, 4)
  assert p.local_steps == (16, 16, 8, 4)
  assert p.weights == pytest.approx((16 / 44, 16 / 44, 8 / 44, 4 / 44))
  assert p.time_budget == pytest.approx(0.4)


def test_straggler_gets_one_step_and_stretches_the_budget():
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=r, round=0) for r in (100.0, 100.0, 0.5)),
      ("h",) * 3)
  p = schedules.Adaptive(initial_period=16).plan(table, 1)
  assert p.stragglers == (2,)
  assert p.local_steps[2] == 1 and p.time_budget == pytest.approx(2.0)


def test_fednova_scales_normalize_updates():
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=r, round=0) for r in (40.0, 10.0)), ("h",) * 2)
  p = schedules.Adaptive(weighting="normalized", initial_period=8).plan(table,
                                                                         1)
  assert p.local_steps == (8, 2) and p.weights == (0.5, 0.5)
  tau = 0.5 * 8 + 0.5 * 2
  assert p.update_scales == pytest.approx((tau / 8, tau / 2))


def test_host_groups_then_global_every_few_rounds():
  hosts = ("a", "a", "b", "b")
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=10.0, round=0) for _ in hosts), hosts)
  config = schedules.Adaptive(global_every=3, adaptive_global=False)
  state, kinds = None, []
  for r in range(1, 7):
    p = config.plan(table, r, state)
    state = p.state
    kinds.append("G" if p.global_sync else "h")
    if not p.global_sync:
      assert p.groups == ((0, 1), (2, 3))
  assert kinds == ["h", "h", "G", "h", "h", "G"]


def test_speed_groups_have_similar_rates_and_bounded_size():
  rates = (80.0, 10.0, 79.0, 11.0, 40.0, 41.0)
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=r, round=0) for r in rates), ("h",) * 6)
  config = schedules.Adaptive(grouping="speed", max_group_size=2,
                              global_every=100)
  p = config.plan(table, 1)
  assert p.groups == ((0, 2), (1, 3), (4, 5))


def test_missing_rows_are_named_in_the_plan():
  """The plan names the workers planned at the median (the caller logs a
  change of that set once, not every round)."""
  table = records.StepRateTable(
      (records.TableEntry(rate=10.0, round=5),
       records.TableEntry(rate=math.nan, round=5),
       records.TableEntry(rate=10.0, round=0)), ("h",) * 3)
  p = schedules.Adaptive().plan(table, 6)
  assert p.imputed == (1, 2)
  assert p.rates == (10.0, 10.0, 10.0)


def test_planner_time_for_ten_thousand_workers():
  """Not a speed assertion: records the time for the closing note."""
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=1.0 + (i % 97), round=0) for i in range(10000)),
      tuple(f"host{i // 8}" for i in range(10000)))
  start = time.perf_counter()
  p = schedules.Adaptive(max_group_size=8).plan(table, 1)
  elapsed = time.perf_counter() - start
  assert len(p.local_steps) == 10000
  print(f"planner: 10,000 workers in {elapsed * 1000:.1f} ms")


def test_epoch_end_round_shrinks_the_budget_not_the_arrival_order():
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=r, round=3) for r in (40.0, 20.0, 10.0)),
      ("h",) * 3)
  p = schedules.Adaptive(initial_period=16).plan(table, 4)
  assert p.local_steps == (16, 8, 4)
  assert plan_changes.fit_to_epoch(p, 100) is p          # far from the end
  last = plan_changes.fit_to_epoch(p, 14)               # half a round left
  assert last.epoch_end and last.global_sync
  assert last.local_steps == (8, 4, 2)
  assert last.time_budget == pytest.approx(0.2)
  for k, r in zip(last.local_steps, last.rates):
    assert abs(k / r - last.time_budget) < 1 / r  # within one of its steps
  uneven = dataclasses.replace(p, rates=(41.0, 19.5, 9.7))
  for remaining in range(1, 45):  # 45 = 1.5 rounds + 3: not the last round
    last = plan_changes.fit_to_epoch(uneven, remaining)
    # The epoch is one pass over the data: exactly what was left (each
    # worker takes at least one step).
    assert sum(last.local_steps) == max(remaining, 3), remaining
    assert min(last.local_steps) >= 1
  assert plan_changes.fit_to_epoch(uneven, 45) is uneven


def test_poisoned_members_get_no_weight_and_the_rest_renormalize():
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=r, round=3) for r in (40.0, 40.0, 20.0, 10.0)),
      ("h",) * 4)
  p = schedules.Adaptive(initial_period=16, grouping="global").plan(table, 4)
  healthy = [True, False, True, True]
  weights = [plan_changes.healthy_weight(p, i, healthy) for i in range(4)]
  assert weights[1] == 0.0
  assert sum(weights) == pytest.approx(1.0)
  # The healthy members keep their relative weights.
  assert weights[0] / weights[2] == pytest.approx(p.weights[0] / p.weights[2])
  # Nobody healthy in the group: the weights stay (nothing sound to average).
  assert plan_changes.healthy_weight(p, 0, [False] * 4) == p.weights[0]
  rows = [[40.0, 3, 1.0, 0.0, 0.1, 16, 1.0], [40.0, 3, 1.0, 0.0, 0.1, 16, 0.0]]
  parsed = records.StepRateTable.from_rows(rows, ("h", "h"))
  assert [e.healthy for e in parsed.entries] == [True, False]


def test_global_every_follows_the_drift_measured_at_global_syncs():
  # Issue 19: the divergence read was each worker's distance to its group
  # mean (small), so cross-group drift of 4x divergence_high still doubled
  # global_every 4 -> 64. A row carries the divergence of the round two
  # before the one planned; here it is high only when that round was global.
  config = schedules.Adaptive(grouping="speed", max_group_size=2,
                              global_every=4, divergence_high=0.05)
  n, state, was_global = 4, None, []
  everies = []
  for r in range(60):
    measured_global = len(was_global) >= 2 and was_global[-2]
    div = 4 * config.divergence_high if measured_global else 0.001
    table = records.StepRateTable(tuple(
        records.TableEntry(rate=10.0 + i, round=r, divergence=div)
        for i in range(n)), ("h",) * n)
    p = planner.plan(table, config, r, state)
    state = p.state
    was_global.append(p.global_sync)
    everies.append(state.global_every)
  assert everies[-1] == 1, everies
  assert max(everies) <= 4, everies


def test_max_overshoot_keeps_every_arrival_near_the_time_budget():
  # 1,024 lognormal rates (sigma 0.5): rounding k_i to the nearest step
  # lets some worker arrive about a quarter of T late, and the round lasts
  # until then (the others fill it with steps); with max_overshoot none
  # arrives past T (1 + 0.02): shorter rounds, a little less compute.
  from oscars_tf import schedules  # pylint: disable=g-import-not-at-top
  rates = np.random.default_rng(0).lognormal(0.0, 0.5, 1024) * 10
  table = records.StepRateTable(
      tuple(records.TableEntry(rate=float(r), round=0) for r in rates),
      tuple(f"h{i // 8}" for i in range(1024)))

  def share(max_overshoot):
    p = schedules.Adaptive(grouping="speed", max_overshoot=max_overshoot,
                           min_utilization=None).plan(table, 1)  # T's rule
    compute = np.array(p.local_steps) / np.array(p.rates)
    assert min(p.local_steps) >= 1
    return compute.mean() / compute.max(), compute.max() / p.time_budget
  plain, plain_late = share(None)
  capped, capped_late = share(0.02)
  assert plain_late > 1.2 and capped_late <= 1.02 + 1e-9
  assert plain > 0.9 and capped > 0.9, (plain, capped)
  with pytest.raises(ValueError, match="max_overshoot"):
    schedules.Adaptive(max_overshoot=-1)


def test_min_utilization_lengthens_t_by_whole_slow_steps_until_reached():
  # Issue 14's goal: 97 % of the simulated cluster's time computing at
  # 1,024 lognormal workers (sigma 0.5). At the period rule's T the median
  # worker takes about 8 steps: whole steps leave about 93 % even with
  # every worker filling the round to its latest arrival; min_utilization
  # (on by default) lengthens T until the plan reaches its target.
  from oscars_tf import schedules  # pylint: disable=g-import-not-at-top
  rates = np.random.default_rng(0).lognormal(0.0, 0.5, 1024) * 10
  table = records.StepRateTable(
      tuple(records.TableEntry(rate=float(r), round=0) for r in rates),
      tuple(f"h{i // 8}" for i in range(1024)))
  plain = schedules.Adaptive(grouping="speed",
                             min_utilization=None).plan(table, 1)
  filled = schedules.Adaptive(grouping="speed",
                              min_utilization=0.97).plan(table, 1)
  default = schedules.Adaptive(grouping="speed").plan(table, 1)
  assert 0.9 < planner.planned_utilization(plain.local_steps,
                                           plain.rates) < 0.97
  assert planner.planned_utilization(filled.local_steps,
                                     filled.rates) >= 0.97
  assert planner.planned_utilization(
      default.local_steps, default.rates) >= schedules.DEFAULT_MIN_UTILIZATION
  assert default.time_budget >= filled.time_budget
  slowest, fastest = min(rates), max(rates)
  slow_steps = filled.time_budget * slowest
  assert abs(slow_steps - round(slow_steps)) < 1e-9  # whole slowest steps
  assert filled.time_budget > plain.time_budget
  assert filled.time_budget <= 256 / fastest + 1e-9  # max_period's bound
  # Capped by max_period: the best T within it, not a longer one.
  capped = schedules.Adaptive(grouping="speed", max_period=40,
                              min_utilization=0.999).plan(table, 1)
  assert capped.time_budget <= 40 / fastest + 1 / slowest
  # A cluster already at the target keeps its T.
  even = records.StepRateTable(
      tuple(records.TableEntry(rate=10.0, round=0) for _ in range(8)),
      ("h",) * 8)
  assert (schedules.Adaptive().plan(even, 1).time_budget
          == schedules.Adaptive(min_utilization=None).plan(even, 1)
          .time_budget)
  for bad in (0, 1.5, True, "0.9"):
    with pytest.raises(ValueError, match="min_utilization"):
      schedules.Adaptive(min_utilization=bad)


# -- the planner's state: the period rule's own, nested ----------------------

RULES = {
    "Constant": schedules.Constant,
    "AdaComm": schedules.AdaComm,
    "CostAware": schedules.CostAware,
    "CostAware(base=None)": lambda: schedules.CostAware(base=None),
    "CostAware(base=DivergenceBand)": lambda: schedules.CostAware(
        max_overhead=0.3, base=schedules.DivergenceBand()),
    "QuadraticSync": lambda: schedules.QuadraticSync(beta=0.3),
    "DivergenceBand": schedules.DivergenceBand,
}


def _rule_run(rule, rounds=12):
  """The plans of 12 rounds of 8 workers on 2 hosts whose table reports
  losses, learning rates, divergences and averaging costs (some rounds
  none)."""
  config = schedules.Adaptive(period_rule=rule, grouping="speed",
                              max_group_size=4, global_every=2)
  hosts = tuple(f"h{i // 4}" for i in range(8))
  state, plans = None, []
  for r in range(rounds):
    entries = tuple(records.TableEntry(
        rate=10.0 * (1 + i % 4) * (1 + 0.01 * ((7 * r + i) % 5)), round=r,
        loss=4.0 / (1 + r), divergence=(0.001, 0.02, 0.3)[r % 3],
        learning_rate=0.1 / (1 + r),
        sync_cost=math.nan if r % 4 == 0 else (0.001, 0.02, 0.2)[r % 3])
        for i in range(8))
    p = config.plan(records.StepRateTable(entries, hosts), r, state)
    state = p.state
    plans.append((config, records.StepRateTable(entries, hosts), p))
  return plans


# The last plan's digest of each `_rule_run`, as the planner gave it when
# every rule's fields lived in one flat state: the digest hashes the state
# as it was (PlannerState.digest_items), so plans stay byte-identical.
DIGESTS_BEFORE_RULE_STATES = {
    "Constant": "76e62a07", "AdaComm": "2a9a9ce6", "CostAware": "ca934d5d",
    "CostAware(base=None)": "8d5c8040",
    "CostAware(base=DivergenceBand)": "2feb2808",
    "QuadraticSync": "38e3e815", "DivergenceBand": "76e62a07"}


@pytest.mark.parametrize("name", sorted(RULES))
def test_plans_are_byte_identical_to_those_of_the_flat_state(name):
  *_, (_, _, last) = _rule_run(RULES[name]())
  assert last.digest() == DIGESTS_BEFORE_RULE_STATES[name]


def test_fixed_plans_are_byte_identical_to_those_of_the_flat_state():
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=r, round=2) for r in (10.0, 5.0, 2.5)),
                                ("a", "a", "b"))
  schedule = schedules.Fixed(4, warmup_steps=1)
  first = schedule.plan(table, 0)
  assert (first.digest(), schedule.plan(table, 3, first.state).digest()) == (
      "0eb1f471", "a822c1b1")
  assert isinstance(first.state.rule, period_rules.ConstantState)


@pytest.mark.parametrize("name", sorted(RULES))
def test_the_state_holds_the_rules_own_state(name):
  rule = RULES[name]()
  for _, _, p in _rule_run(rule, rounds=4):
    assert type(p.state.rule) is type(rule.init(1.0))
    assert p.state.period == p.state.rule.period
    if isinstance(rule, schedules.CostAware) and rule.base is None:
      assert p.state.rule.base is None
    elif isinstance(rule, schedules.CostAware):  # the base's, nested
      assert type(p.state.rule.base) is type(rule.base.init(1.0))


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_state_survives_a_rejoiners_json_round_trip(name):
  """The chief sends its state as JSON (round_book's chief plan); the
  rejoiner's copy plans the next round as the members do, byte for
  byte."""
  for config, table, p in _rule_run(RULES[name]()):
    text = json.dumps(planner_state.state_to_json(p.state), allow_nan=True)
    copy = planner_state.state_from_json(records.PlannerState,
                                         json.loads(text))
    assert json.dumps(copy.to_json(), allow_nan=True) == text
    assert json.dumps(copy.digest_items()) == json.dumps(
        p.state.digest_items())
    assert (config.plan(table, p.round + 1, copy).digest() ==
            config.plan(table, p.round + 1, p.state).digest())


def test_a_rule_states_json_names_its_rule_and_nests_its_base():
  state = schedules.CostAware(base=schedules.AdaComm()).init(8.0)
  assert state.to_json() == {
      "rule": "CostAware", "period": 8.0, "sync_cost": state.sync_cost,
      "base": {"rule": "AdaComm", "period": 8.0,
               "initial_loss": state.base.initial_loss}}
  again = period_rules.RuleState.from_json(
      json.loads(json.dumps(state.to_json())))
  assert isinstance(again, period_rules.CostAwareState)
  assert isinstance(again.base, period_rules.AdaCommState)
  assert again.period == 8.0 and math.isnan(again.base.initial_loss)
