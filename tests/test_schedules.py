"""Tests for oscars_tf.schedules (pure policy, no TensorFlow)."""

import sys
import warnings

import pytest

from oscars_tf import schedules


def test_fixed_period():
  s = schedules.Fixed(every=4)
  assert [s.next_sync_step(k) for k in (0, 4, 8)] == [4, 8, 12]


def test_fixed_every_one_is_every_step():
  s = schedules.Fixed(every=1)
  steps, k = [], 0
  for _ in range(5):
    k = s.next_sync_step(k)
    steps.append(k)
  assert steps == [1, 2, 3, 4, 5]


def test_warmup_averages_every_step_then_period():
  s = schedules.Fixed(every=5, warmup_steps=3)
  steps, k = [], 0
  for _ in range(6):
    k = s.next_sync_step(k)
    steps.append(k)
  assert steps == [1, 2, 3, 8, 13, 18]


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


def test_fingerprint_is_stable_and_distinguishes_configs():
  a, b = schedules.Fixed(4), schedules.Fixed(4)
  assert a.fingerprint() == b.fingerprint()
  assert a.fingerprint() != schedules.Fixed(5).fingerprint()
  assert 0 <= a.fingerprint() < 2**24  # exact in a float32 collective


def test_policy_layer_imports_no_tensorflow():
  import subprocess  # pylint: disable=g-import-not-at-top
  code = ("import sys, oscars_tf.schedules, oscars_tf.launch, oscars_tf.data;"
          "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
