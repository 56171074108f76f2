"""Poison guard: a worker with non-finite weights is never averaged in.

Three real workers over gRPC on loopback; one worker's first kernel is set
to NaN at the start of epoch 1 (Adam, so its optimizer slots turn NaN too).
"""

import math

import numpy as np

import multiworker


def test_a_nan_worker_is_left_out_reset_and_logged(tmp_path):
  job = multiworker.run("fit", 3, {
      "every": 4, "epochs": 3, "optimizer": "adam", "lr": 0.01,
      "poison_at_epoch": [1, 1], "tensorboard": True, "timeout": 60})
  outs = job.outputs
  weights = [np.asarray(o["weights"]) for o in outs]
  # Nobody was corrupted, and the poisoned worker holds the others' model.
  assert all(np.isfinite(w).all() for w in weights)
  np.testing.assert_allclose(weights[1], weights[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weights[2], weights[0], rtol=1e-5, atol=1e-6)
  assert all(math.isfinite(s) for s in outs[1]["optimizer_slots"])
  assert min(o["test_accuracy"] for o in outs) >= 0.9
  # Every worker saw the event at the same round, once.
  events = [[r["round"] for r in o["rounds"] if r["poisoned"]] for o in outs]
  assert events[0] and events == [events[0]] * 3, events
  assert all(r["poisoned"] == [1] for o in outs for r in o["rounds"]
             if r["poisoned"])
  assert "worker(s) [1] have non-finite weights" in job.log
  # ... and it shows in TensorBoard.
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(
      f"{job.outdir}/tb/worker_0",
      size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  values = [float(tf.make_ndarray(e.tensor_proto))
            for e in acc.Tensors("oscars/poisoned_workers")]
  assert values.count(1.0) == len(events[0]) and max(values) == 1.0


def test_a_nan_worker_alone_in_its_group_takes_the_others_model_at_once():
  """Issue 43: the only worker of host 127.0.0.2 is alone in its group
  (grouped by host, no global sync planned); poisoned, it kept its NaN
  weights and slots. Its round now becomes a sync of all members."""
  job = multiworker.run("fit", 3, {
      "adaptive": {"grouping": "host", "global_every": 64,
                   "adaptive_global": False, "initial_period": 4,
                   "max_period": 8},  # rounds within an epoch: not global
      "epochs": 2, "batch_size": 8, "optimizer": "adam", "lr": 0.01,
      "record": True,
      "poison_at_epoch": [2, 1], "timeout": 60},
      hosts=["127.0.0.1", "127.0.0.1", "127.0.0.2"])
  outs = job.outputs
  poisoned = [r for r in outs[2]["rounds"] if r["poisoned"]]
  assert poisoned and all(r["poisoned"] == [2] for r in poisoned)
  assert [(r["global_sync"], r["group"]) for r in poisoned] == [
      (True, [0, 1, 2])]  # once: repaired in that round
  proj = {r["step"]: np.asarray(r["proj"]) for r in outs[2]["records"]}
  assert np.isfinite(proj[poisoned[0]["end_step"]]).all()
  assert np.isfinite(outs[2]["weights"]).all()
  assert all(math.isfinite(s) for s in outs[2]["optimizer_slots"])
