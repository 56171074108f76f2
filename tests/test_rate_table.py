"""Tests for oscars_tf.protocol.rate_table.RateMeter (pure Python)."""

import math

import pytest

from oscars_tf.protocol.rate_table import RateMeter


def test_first_sample_seeds_then_moving_average():
  m = RateMeter(alpha=0.5)
  assert math.isnan(m.rate)
  assert m.add(10, 1.0) == 10.0
  assert m.add(12, 1.0) == pytest.approx(11.0)


def test_a_real_change_of_speed_is_taken_at_once():
  m = RateMeter(alpha=0.5, change=1.5)
  m.add(40, 1.0)
  assert m.add(10, 1.0) == 10.0   # 4x slower: no averaging with the past
  assert m.add(40, 1.0) == 40.0   # and back


def test_empty_or_broken_samples_are_ignored():
  m = RateMeter()
  m.add(10, 1.0)
  for steps, seconds in ((0, 1.0), (5, 0.0), (5, float("nan")), (5, -1.0)):
    assert m.add(steps, seconds) == 10.0


@pytest.mark.parametrize("kwargs", [{"alpha": 0}, {"alpha": 1.5},
                                    {"change": 1.0}])
def test_bad_arguments(kwargs):
  with pytest.raises(ValueError):
    RateMeter(**kwargs)
