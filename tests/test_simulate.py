"""Tests for oscars_tf.simulate (SIMULATED heterogeneity profiles)."""

import pytest

from oscars_tf.simulate import StepTimeProfile


def test_base_and_multipliers():
  p = StepTimeProfile.parse("20ms*1,1,2,4")
  assert [p.seconds(i, 0, 0.0) for i in range(5)] == pytest.approx(
      [0.02, 0.02, 0.04, 0.08, 0.02])


def test_changes_by_time_and_by_step():
  p = StepTimeProfile.parse("0.01s;2:4x@60s;1:3x@100")
  assert p.seconds(2, 0, 59.9) == pytest.approx(0.01)
  assert p.seconds(2, 0, 60.0) == pytest.approx(0.04)
  assert p.seconds(1, 99, 1e6) == pytest.approx(0.01)
  assert p.seconds(1, 100, 0.0) == pytest.approx(0.03)


def test_empty_spec_is_inactive():
  assert not StepTimeProfile.parse("").active
  assert not StepTimeProfile.parse("0").active


def test_description_says_simulated():
  lines = StepTimeProfile.parse("10ms*1,2;1:4x@5s").describe(2)
  assert all("SIMULATED" in line for line in lines)
  assert "worker 1 sleeps 20.0 ms per step" in lines[1]
  assert "worker 1 becomes 4x after 5s" in lines[2]


# nan (was: no delay, silently) and inf (an OverflowError in time.sleep
# inside the training step) are refused as multipliers too.
@pytest.mark.parametrize("spec", ["fast", "20ms*1,x", "20ms*-1",
                                  "20ms;2:4x", "-5ms", "20ms*1,nan",
                                  "20ms*1,inf"])
def test_bad_specs_are_clear_errors(spec):
  with pytest.raises(ValueError, match="simulate_step_time"):
    StepTimeProfile.parse(spec)


@pytest.mark.parametrize("spec", [0.02, 20, b"20ms"])
def test_a_spec_that_is_not_a_string_is_a_clear_error(spec):
  with pytest.raises(ValueError, match="must be a string"):
    StepTimeProfile.parse(spec)


def test_a_spec_for_another_job_names_the_workers_it_lacks():
  StepTimeProfile.parse("20ms*1,2;1:3x@5").check_workers(2)  # fits
  with pytest.raises(ValueError, match="3 multipliers for 2 workers"):
    StepTimeProfile.parse("20ms*1,2,4").check_workers(2)
  with pytest.raises(ValueError, match=r"worker 2 changes.*0\.\.1"):
    StepTimeProfile.parse("20ms;2:4x@60s").check_workers(2)
