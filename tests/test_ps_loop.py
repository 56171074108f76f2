"""examples/ps_loop.py's pieces that run in one process: the SIMULATED
delays as TensorFlow ops, each worker's input stream and the result rows.
(The whole loop runs under the launcher in test_train.py.)"""

import pathlib
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from oscars_tf import simulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] /
                       "examples"))
import ps_loop  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.parametrize("spec", ["20ms*1,2,4", "5ms;1:3x@7",
                                  "10ms*1,1;0:2x@0.5s;1:4x@3", "0"])
def test_simulated_delays_as_ops_match_the_profile(spec):
  profile = simulate.StepTimeProfile.parse(spec)
  for worker in range(4):
    for step in (0, 2, 3, 6, 7, 50):
      for elapsed in (0.0, 0.49, 0.5, 10.0):
        got = float(ps_loop.simulated_delay(
            profile, tf.constant(worker), tf.constant(step, tf.int64),
            tf.constant(elapsed, tf.float64)))
        want = profile.seconds(worker, step, elapsed)
        assert got == pytest.approx(want), (worker, step, elapsed)


def _take(worker, profile, steps, n=10, batch=4):
  x = np.arange(n, dtype=np.float32)[:, None]
  y = np.arange(n, dtype=np.int32)
  ds = ps_loop.make_dataset(x, y, batch, 0, profile, tf.constant(worker))
  out, t = [], time.monotonic()
  for (xb, yb), delay, started_at in ds.take(steps):
    now = time.monotonic()
    assert np.array_equal(xb.numpy()[:, 0], yb.numpy())
    out.append((yb.numpy(), float(delay), float(started_at), now - t))
    t = now
  return out


def test_each_worker_draws_its_own_permutations_and_sleeps_its_delay():
  profile = simulate.StepTimeProfile.parse("30ms*1,3")
  fast, slow = _take(0, profile, 6), _take(1, profile, 6)
  for stream in (fast, slow):
    labels = np.concatenate([b for b, *_ in stream])
    # Every pass over the 10 examples is a permutation of them.
    for p in range(2):
      assert sorted(labels[10 * p:10 * (p + 1)]) == list(range(10))
  assert not np.array_equal(fast[0][0], slow[0][0])
  assert [d for _, d, _, _ in fast] == pytest.approx([0.03] * 6)
  assert [d for _, d, _, _ in slow] == pytest.approx([0.09] * 6)
  # The delay is slept when the batch is asked for (the first one also
  # pays the pipeline's start); started_at is the wall clock then.
  # Each batch sleeps its delay; the upper bound (the worker's own delay,
  # not the other's) on the median: one batch beside the other test
  # stream may come late by a descheduled process, not by a longer sleep.
  assert all(s >= 0.03 for *_, s in fast[1:]), fast
  assert all(s >= 0.09 for *_, s in slow[1:]), slow
  assert np.median([s for *_, s in fast[1:]]) < 0.08, fast
  assert np.median([s for *_, s in slow[1:]]) < 0.16, slow
  assert abs(fast[-1][2] - time.time()) < 5
  none = _take(0, simulate.StepTimeProfile.parse(""), 3)
  assert [d for _, d, _, _ in none] == [0.0] * 3


def test_result_rows_count_pulls_and_pushes_and_the_second_half():
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  weight_bytes = (3 * 2 + 2) * 4
  # Two epochs of 10 s of training, 5 s of evaluation between them: the
  # second half of the training time starts at 110.
  stats = {"steps": [3, 1], "simulated_s": [0.3, 0.4],
           "segments": [(100.0, 110.0), (115.0, 125.0)],
           "started": [(0, 101.0, 0.1), (1, 105.0, 0.4), (0, 109.9, 0.1),
                       (0, 116.0, 0.1)]}
  rows = ps_loop.per_worker_rows(stats, model, 20.0, 0.01)
  assert [r["steps"] for r in rows] == [3, 1]
  assert [r["bytes_sent"] for r in rows] == [2 * weight_bytes * 3,
                                             2 * weight_bytes]
  assert [r["collectives"] for r in rows] == [3, 1]
  assert rows[0]["compute_s"] == pytest.approx(0.3 + 3 * 0.01)
  assert rows[0]["utilization_second_half"] == pytest.approx(0.11 / 10)
  assert rows[1]["utilization_second_half"] == 0.0
  assert all(r["wall_time_s"] == 20.0 for r in rows)
