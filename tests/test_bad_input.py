"""Bad input across workers: each a clear error within seconds, no hang.

(Single-process bad input is tested where it is parsed: TF_CONFIG in
test_cluster.py, strategy arguments in test_strategy.py, flags in
test_train.py, schedules in test_schedules.py.)
"""

import time

import numpy as np
import pytest

import multiworker


@pytest.mark.slow
@pytest.mark.parametrize("params, error, words", [
    ({"odd_dtype_worker": 1}, "WorkerMismatchError", "shapes/dtypes"),
    ({"extra_layer_worker": 1}, "WorkerMismatchError", "variable count"),
    ({"odd_schedule_worker": 1}, "WorkerMismatchError", "schedule"),
    ({"averaging_dtype": [None, "bfloat16"]}, "WorkerMismatchError",
     "averaging_dtype"),
    ({"compression": [None, "int4"]}, "WorkerMismatchError", "compression"),
    ({"empty_data": True}, "ValueError", "no training data"),
    # A loop of trials making a strategy each: the second one's rounds met
    # the first one's keys (AlreadyExistsError inside TensorFlow).
    ({"second_strategy": True}, "ValueError",
     "already made an OscarsStrategy in its cluster"),
])
def test_workers_that_disagree_or_have_no_data_fail_clearly(params, error,
                                                            words):
  start = time.monotonic()
  result = multiworker.run("fit", 2, dict(params, timeout=20),
                           expect_success=False, kill_on_failure=False,
                           timeout=120)
  assert time.monotonic() - start < 60
  assert all(c not in (0, None) for c in result.codes), (
      result.codes, result.failed, result.outputs, result.tail())
  for out in result.outputs:
    assert out["error"] == error, out
    assert words in out["message"], out


def test_fewer_samples_than_workers_is_refused_before_training():
  import keras  # pylint: disable=g-import-not-at-top

  from oscars_tf.frontends import fit_inputs  # pylint: disable=g-import-not-at-top
  del keras
  with pytest.raises(ValueError, match="1 training sample"):
    fit_inputs.check_has_samples(np.zeros((1, 4)), 2)
  fit_inputs.check_has_samples(np.zeros((2, 4)), 2)
