"""benchmarks/lm_measures.py: what real_workloads.py reads from a language
model's run (curves in bits per byte, lower is better; round ends)."""

import pytest

import lm_measures

CURVE = [(10.0, 6.0), (20.0, 4.0), (30.0, 3.0)]


def test_values_between_epoch_ends_are_linear_and_none_outside():
  assert lm_measures.at_time(CURVE, 15.0) == pytest.approx(5.0)
  assert lm_measures.at_time(CURVE, 30.0) == pytest.approx(3.0)
  assert lm_measures.at_time(CURVE, 10.0) == pytest.approx(6.0)
  assert lm_measures.at_time(CURVE, 5.0) is None
  assert lm_measures.at_time(CURVE, 31.0) is None


def test_time_to_a_target_falls_between_the_epoch_ends_around_it():
  assert lm_measures.time_to(CURVE, 5.0) == pytest.approx(15.0)
  assert lm_measures.time_to(CURVE, 3.5) == pytest.approx(25.0)
  assert lm_measures.time_to(CURVE, 7.0) == pytest.approx(10.0)
  assert lm_measures.time_to(CURVE, 2.9) is None


def test_the_target_is_reached_at_its_fraction_of_the_reference_run():
  target = lm_measures.target_of(CURVE, 2 / 3)  # at t = 20
  assert target == pytest.approx(4.0)
  assert lm_measures.time_to(CURVE, target) == pytest.approx(20.0)
  assert lm_measures.target_of(CURVE, 0.1) == pytest.approx(3.0)  # no value


def test_periods_by_powers_of_two_and_rounds_ended_by_an_epoch_end():
  result = {"round_plans": [[8, 4], [12, 3], [1, 1], [40, 10], None],
            "rounds": [{"epoch_end": False}, {"epoch_end": True},
                       {"epoch_end": False}]}
  assert lm_measures.period_histogram(result) == {"1": 1, "8-15": 2,
                                                  "32-63": 1}
  assert list(lm_measures.period_histogram(result)) == ["1", "8-15", "32-63"]
  assert lm_measures.round_ends(result) == (3, 1)
  assert lm_measures.round_ends({}) == (0, 0)


def test_a_round_the_chief_spent_alone_is_not_an_averaging():
  # Each worker on a host of its own: host groups of one between global
  # syncs (the chief is worker 0).
  alone, everyone = [[0], [1], [2]], [[0, 1, 2]]
  result = {"rounds": [{"epoch_end": False}, {"epoch_end": False},
                       {"epoch_end": True}, {"epoch_end": True}],
            "round_groups": [alone, everyone, alone, [[0, 2], [1]]]}
  assert lm_measures.round_ends(result) == (2, 1)


def test_the_compute_ideal_is_the_sum_of_rates_over_n_slowest():
  assert lm_measures.compute_ideal([1, 1, 0.5, 0.25]) == pytest.approx(2.75)
  assert lm_measures.compute_ideal([0.5, 0.5]) == pytest.approx(1.0)


def test_paired_gaps_compare_each_local_run_with_its_seeds_sync_run():
  rows = [{"seed": 1, "run": "sync", "period": None, "bpb": 2.0},
          {"seed": 0, "run": "local", "period": 4, "bpb": 3.3},
          {"seed": 1, "run": "local", "period": 1, "bpb": 2.1},
          {"seed": 0, "run": "sync", "period": None, "bpb": 3.0},
          {"seed": 1, "run": "local", "period": 4, "bpb": 1.9},
          {"seed": 2, "run": "local", "period": 4, "bpb": 9.9}]  # no sync
  gaps = lm_measures.paired_gaps(rows)
  assert sorted(gaps) == [1, 4]
  assert gaps[1] == pytest.approx([0.05])
  assert gaps[4] == pytest.approx([0.1, -0.05])  # seed order
