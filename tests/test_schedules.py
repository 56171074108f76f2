"""Tests for oscars_tf.schedules (pure policy, no TensorFlow)."""

import dataclasses
import sys
import warnings

import numpy as np
import pytest

from oscars_tf import schedules
from oscars_tf.policy import records


def _table(rates, hosts=None):
  entries = tuple(records.TableEntry(rate=r, round=0) for r in rates)
  return records.StepRateTable(entries, tuple(hosts or ["h"] * len(rates)))


def test_fixed_period_for_everyone_and_one_group():
  p = schedules.Fixed(every=4).plan(_table([10.0, 5.0, 2.5]), 1)
  assert p.local_steps == (4, 4, 4)
  assert p.groups == ((0, 1, 2),) and p.global_sync
  assert p.weights == pytest.approx((1 / 3,) * 3)


def test_fixed_warmup_averages_every_step_then_period():
  s = schedules.Fixed(every=5, warmup_steps=3)
  steps = [s.plan(_table([1.0, 1.0]), r).local_steps[0] for r in range(5)]
  assert steps == [1, 1, 1, 5, 5]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True, None])
def test_fixed_rejects_bad_period(bad):
  with pytest.raises(ValueError, match="every"):
    schedules.Fixed(every=bad)


def test_fixed_rejects_negative_warmup():
  with pytest.raises(ValueError, match="warmup_steps"):
    schedules.Fixed(every=2, warmup_steps=-1)


def test_pointless_warmup_warns():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    schedules.Fixed(every=1, warmup_steps=5)
  assert any("no effect" in str(w.message) for w in caught)


@pytest.mark.parametrize("make, plain", [
    (lambda n: schedules.Fixed(n.int64(8), n.int64(2)),
     lambda: schedules.Fixed(8, 2)),
    (lambda n: schedules.Adaptive(max_group_size=n.int32(4),
                                  max_overshoot=n.float32(0.5),
                                  min_utilization=n.float64(0.9)),
     lambda: schedules.Adaptive(max_group_size=4, max_overshoot=0.5,
                                min_utilization=0.9)),
], ids=["fixed", "adaptive"])
def test_numpy_scalars_are_taken_as_the_plain_numbers(make, plain):
  """A NumPy scalar (from a config array, a sweep) went into the
  schedule's JSON fingerprint as given: a TypeError at the first step of a
  cluster run only (one worker never fingerprints)."""
  schedule = make(np)
  assert schedule.fingerprint() == plain().fingerprint()
  assert schedule.config() == plain().config()


def test_fingerprint_is_stable_and_distinguishes_configs():
  a, b = schedules.Fixed(4), schedules.Fixed(4)
  assert a.fingerprint() == b.fingerprint()
  assert a.fingerprint() != schedules.Fixed(5).fingerprint()
  assert 0 <= a.fingerprint() < 2**24  # exact in a float32 collective


def test_policy_protocol_and_tools_import_no_tensorflow():
  import subprocess  # pylint: disable=g-import-not-at-top
  # Every module of the TensorFlow-free layers, found by walking their
  # subpackages so that a new module is covered too, plus the public
  # TensorFlow-free modules.
  code = ("import importlib, pkgutil, sys, oscars_tf\n"
          "names = ['oscars_tf.schedules', 'oscars_tf.simulate',"
          " 'oscars_tf.cli.launch', 'oscars_tf.data', 'oscars_tf.checkpoint',"
          " 'oscars_tf.frontends.shared_order']\n"
          "for pkg in ('policy', 'protocol', 'tools'):\n"
          "  mod = importlib.import_module('oscars_tf.' + pkg)\n"
          "  names += ['oscars_tf.%s.%s' % (pkg, m.name)"
          " for m in pkgutil.iter_modules(mod.__path__)]\n"
          "for name in names:\n"
          "  importlib.import_module(name)\n"
          "  assert 'tensorflow' not in sys.modules, (\n"
          "      name + ' imported tensorflow')\n"
          "assert len(names) >= 14, names\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _loss_table(loss, lr=0.1, divergence=float("nan")):
  e = records.TableEntry(rate=1.0, round=0, loss=loss, learning_rate=lr,
                           divergence=divergence)
  return records.StepRateTable((e, e), ("h", "h"))


def test_adacomm_shrinks_the_period_with_the_loss():
  config = schedules.Adaptive(initial_period=16)
  rule = schedules.AdaComm()
  state = rule.init(16)
  state = rule.update(state, _loss_table(4.0), config)   # seeds loss_0
  assert state.period == 16 and state.initial_loss == 4.0
  state = rule.update(state, _loss_table(1.0), config)   # sqrt(1/4) * 16
  assert state.period == 8
  assert rule.update(state, _loss_table(float("nan")), config) == state


def test_quadratic_rule_follows_the_learning_rate():
  rule = schedules.QuadraticSync(beta=0.2, base_period=2)
  state = rule.init(16)
  assert rule.update(state, _loss_table(1.0, lr=0.1), None).period == 4
  assert rule.update(state, _loss_table(1.0, lr=0.02), None).period == 100
  assert rule.update(state, _loss_table(1.0, lr=1.0), None).period == 2


def test_divergence_band_keeps_divergence_inside():
  rule = schedules.DivergenceBand(low=0.01, high=0.1, factor=2)
  state = rule.init(16)
  assert rule.update(state, _loss_table(1, divergence=0.5), None).period == 8
  assert rule.update(state, _loss_table(1, divergence=0.001), None).period == 32
  assert rule.update(state, _loss_table(1, divergence=0.05), None).period == 16


def _cost_table(costs, rates):
  entries = tuple(records.TableEntry(rate=r, round=3, sync_cost=c)
                  for c, r in zip(costs, rates))
  return records.StepRateTable(entries, ("h",) * len(entries))


def test_cost_aware_keeps_averaging_under_its_share_of_the_round():
  rule = schedules.CostAware(max_overhead=0.1, smoothing=1.0, base=None)
  state = rule.init(16)
  # 10 ms to average, fastest 20 steps/s (50 ms steps): T >= 90 ms, 2 steps.
  cheap = rule.update(state, _cost_table([0.01, 0.01], [20.0, 20.0]), None)
  assert cheap.period == 2 and cheap.sync_cost == pytest.approx(0.01)
  # A slow link, 1 s to average: T >= 9 s, 180 steps of the fastest.
  slow = rule.update(state, _cost_table([1.0, 1.2], [20.0, 10.0]), None)
  assert slow.period == 180
  # Averaging at most 10 % of the round: c / (T + c) <= 0.1 either way.
  for s, c in ((cheap, 0.01), (slow, 1.0)):
    assert c / (s.period / 20.0 + c) <= 0.1 + 1e-9


def test_cost_aware_takes_the_last_arrival_and_smooths():
  rule = schedules.CostAware(max_overhead=0.5, smoothing=0.5, base=None)
  state = rule.init(16)
  # The early worker also waited 0.9 s for the late one: not averaging cost.
  state = rule.update(state, _cost_table([1.0, 0.1], [10.0, 10.0]), None)
  assert state.sync_cost == pytest.approx(0.1) and state.period == 1
  state = rule.update(state, _cost_table([0.5, 0.5], [10.0, 10.0]), None)
  assert state.sync_cost == pytest.approx(0.3)  # half old, half new
  assert state.period == 3


def test_cost_aware_without_measurements_keeps_the_period():
  rule = schedules.CostAware(base=None)
  state = rule.init(16)
  nan = float("nan")
  assert rule.update(state, _cost_table([nan, nan], [5.0, 5.0]), None) == (
      state)
  assert rule.update(state, _cost_table([0.1, 0.1], [nan, nan]), None) == (
      state)


def test_cost_aware_keeps_its_cost_through_a_round_that_measured_none():
  # A round whose collectives were new reports no cost (RoundBook): the
  # floor stays where the rounds before put it.
  rule = schedules.CostAware(max_overhead=0.1, smoothing=0.5, base=None)
  state = rule.init(16)
  state = rule.update(state, _cost_table([0.1, 0.1], [20.0, 20.0]), None)
  nan = float("nan")
  kept = rule.update(state, _cost_table([nan, nan], [20.0, 20.0]), None)
  assert kept.sync_cost == pytest.approx(0.1) and kept.period == 18


def test_cost_aware_counts_no_cost_of_a_round_a_member_could_not_measure():
  # A member that met a new collective reports none; the others waited
  # for its setup in a global sync, so their costs are not the averaging's.
  rule = schedules.CostAware(max_overhead=0.1, smoothing=0.5, base=None)
  state = dataclasses.replace(rule.init(16), sync_cost=0.1)
  nan = float("nan")
  entries = (records.TableEntry(rate=20.0, round=5, sync_cost=0.7),
             records.TableEntry(rate=20.0, round=5, sync_cost=nan),
             records.TableEntry(rate=20.0, round=5, sync_cost=0.8))
  table = records.StepRateTable(entries, ("h",) * 3)
  assert rule.update(state, table, None).sync_cost == pytest.approx(0.1)
  # A row from an earlier round (a worker dropped since) is not this
  # round's: its missing cost does not void the others'.
  entries = entries[:1] + (records.TableEntry(rate=20.0, round=2),) + (
      entries[2:])
  table = records.StepRateTable(entries, ("h",) * 3)
  assert rule.update(state, table, None).sync_cost == pytest.approx(0.4)


@pytest.mark.parametrize("kwargs", [{"max_overhead": 0}, {"max_overhead": 1},
                                    {"max_overhead": -0.1}, {"smoothing": 0},
                                    {"smoothing": 1.5}])
def test_cost_aware_rejects_bad_arguments(kwargs):
  with pytest.raises(ValueError, match="CostAware"):
    schedules.CostAware(**kwargs)


def _cost_loss_table(cost, loss, rate=20.0, n=4):
  entries = tuple(records.TableEntry(rate=rate, round=3, sync_cost=cost,
                                     loss=loss) for _ in range(n))
  return records.StepRateTable(entries, ("h",) * n)


def test_cost_aware_takes_the_longer_of_adacomm_and_the_cost_floor():
  config = schedules.Adaptive(initial_period=16)
  rule = schedules.CostAware(max_overhead=0.1, smoothing=1.0)
  state = rule.init(16)
  state = rule.update(state, _cost_loss_table(0.005, 4.0), config)
  assert state.period == 16  # AdaComm's start; the cost allows 1
  state = rule.update(state, _cost_loss_table(0.005, 1.0), config)
  assert state.period == 8  # AdaComm: 16 * sqrt(1 / 4)
  state = rule.update(state, _cost_loss_table(1.0, 1.0), config)
  assert state.period == 180  # the cost: 9 s of 20 steps/s
  state = rule.update(state, _cost_loss_table(0.005, 1.0), config)
  assert state.period == 8  # cheap again: AdaComm's, not a ratchet


def test_cost_aware_keeps_a_scaling_base_rule_on_its_own_period():
  band = schedules.DivergenceBand(low=0.01, high=0.1, factor=2)
  rule = schedules.CostAware(max_overhead=0.1, smoothing=1.0, base=band)
  state = rule.init(16)
  drifting = records.StepRateTable(
      (records.TableEntry(rate=20.0, round=3, sync_cost=1.0,
                          divergence=0.5),) * 2, ("h", "h"))
  state = rule.update(state, drifting, None)
  assert state.period == 180 and state.base.period == 8
  state = rule.update(state, drifting, None)
  assert state.base.period == 4  # halved from its own 8, not from 180


def test_cost_aware_rejects_a_bad_base():
  with pytest.raises(TypeError, match="base"):
    schedules.CostAware(base="adacomm")
  with pytest.raises(TypeError, match="base"):
    schedules.CostAware(base=schedules.CostAware())
  with pytest.raises(TypeError, match="base"):
    schedules.CostAware(base=schedules.AdaComm)  # the class, not a rule


def test_yes_no_arguments_take_bools_only():
  assert schedules.Adaptive(adaptive_global=np.bool_(False)).adaptive_global \
      is False
  assert schedules.OuterMomentum(nesterov=False).nesterov is False
  with pytest.raises(ValueError, match="nesterov"):
    schedules.OuterMomentum(nesterov="False")  # bool("False") is True


def test_the_default_period_follows_the_averaging_cost():
  """Adaptive(): AdaComm's rounds where averaging is cheap, long where not."""
  schedule = schedules.Adaptive()
  assert isinstance(schedule.period_rule, schedules.CostAware)
  assert isinstance(schedule.period_rule.base, schedules.AdaComm)
  first = schedule.plan(_cost_table([float("nan")] * 4, [20.0] * 4), 1)
  cheap = schedule.plan(_cost_table([0.005] * 4, [20.0] * 4), 2, first.state)
  costly = schedule.plan(_cost_table([2.0] * 4, [20.0] * 4), 2, first.state)
  assert first.local_steps == (16,) * 4
  assert cheap.local_steps == (16,) * 4  # no loss yet: AdaComm's start
  assert costly.local_steps == (256,) * 4  # the cost, up to max_period
  alone = schedules.Adaptive(period_rule=schedules.CostAware(base=None))
  assert alone.plan(_cost_table([0.005] * 4, [20.0] * 4), 2,
                    first.state).local_steps == (1,) * 4


def test_a_row_without_a_sync_cost_reads_as_unmeasured():
  table = records.StepRateTable.from_rows([[5.0, 1, 0.5, 0.0, 0.1, 8, 1, 0]],
                                          ["h"])
  assert table.entries[0].steps == 8
  assert table.entries[0].sync_cost != table.entries[0].sync_cost  # NaN


@pytest.mark.parametrize("kwargs, match", [
    ({"grouping": "rack"}, "grouping"),
    ({"weighting": "loss"}, "weighting"),
    ({"max_group_size": 1}, "max_group_size"),
    ({"max_groupings": 0}, "max_groupings"),
    ({"initial_period": 0}, "initial_period"),
    ({"min_period": 8, "initial_period": 4}, "min_period <="),
    ({"straggler_ratio": -1}, "straggler_ratio"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"period_rule": "adacomm"}, "period_rule"),
    # A rule's class has init and update too: refused, not failed later.
    ({"period_rule": schedules.AdaComm}, "period_rule"),
    ({"divergence_low": 0.5, "divergence_high": 0.01}, "divergence_low <"),
    ({"adaptive_global": "no"}, "adaptive_global"),
])
def test_adaptive_rejects_bad_arguments(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    schedules.Adaptive(**kwargs)


def test_divergence_band_rejects_inverted_band():
  with pytest.raises(ValueError, match="low < high"):
    schedules.DivergenceBand(low=0.5, high=0.1)


@pytest.mark.parametrize("rule, state_type", [
    (schedules.Constant(), "ConstantState"),
    (schedules.AdaComm(), "AdaCommState"),
    (schedules.CostAware(), "CostAwareState"),
    (schedules.QuadraticSync(), "QuadraticSyncState"),
    (schedules.DivergenceBand(), "DivergenceBandState")])
def test_each_rule_has_a_frozen_state_of_its_own_and_updates_purely(
    rule, state_type):
  from oscars_tf.policy import period_rules  # pylint: disable=g-import-not-at-top
  state = rule.init(16.0)
  assert type(state) is getattr(period_rules, state_type)
  assert state.period == 16.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    state.period = 1.0
  table = records.StepRateTable(
      (records.TableEntry(rate=20.0, round=3, loss=2.0, learning_rate=0.05,
                          divergence=0.5, sync_cost=0.2),) * 2, ("h", "h"))
  before = state.to_json()
  config = schedules.Adaptive(period_rule=rule)
  after = rule.update(state, table, config)
  assert state.to_json() == before  # the old state is untouched
  assert type(after) is type(state)
  assert rule.update(state, table, config) == after  # the same every time


def test_schedules_declare_what_the_planner_and_round_book_read():
  fixed = schedules.Fixed(4)
  assert (fixed.weighting, fixed.max_group_size, fixed.max_groupings,
          fixed.max_overshoot, fixed.min_utilization) == (
              "work", None, None, None, None)
  adaptive = schedules.Adaptive(weighting="equal", max_group_size=8,
                                max_groupings=3, max_overshoot=0.2,
                                min_utilization=None)
  assert (adaptive.weighting, adaptive.max_group_size, adaptive.max_groupings,
          adaptive.max_overshoot, adaptive.min_utilization) == (
              "equal", 8, 3, 0.2, None)
  # Declared on the base class: not in a schedule's config (fingerprint).
  assert "weighting" not in fixed.config()


def test_a_period_rule_of_ones_own_needs_init_update_and_config():
  class Halving:

    def init(self, period):
      return schedules.Constant().init(period)

    def update(self, state, table, config):
      del table, config
      return dataclasses.replace(state, period=state.period / 2)

    def config(self):
      return {"rule": "Halving"}

  schedule = schedules.Adaptive(period_rule=Halving(), initial_period=16,
                                min_utilization=None)
  p = schedule.plan(_table([10.0, 10.0]), 1)
  assert p.state.period == 8.0 and p.local_steps == (8, 8)

  class UpdateOnly:

    def update(self, state, table, config):
      return state
  with pytest.raises(TypeError, match="period_rule"):
    schedules.Adaptive(period_rule=UpdateOnly())
  with pytest.raises(TypeError, match="base"):
    schedules.CostAware(base=UpdateOnly())


def test_the_period_rules_module_example_runs():
  from oscars_tf.policy import period_rules  # pylint: disable=g-import-not-at-top
  example = period_rules.__doc__.split("Example:\n", 1)[1]
  scope = {}
  exec(compile("\n".join(line[2:] for line in example.splitlines()),  # pylint: disable=exec-used
               "example", "exec"), scope)
  assert scope["state"].period == 8.0
