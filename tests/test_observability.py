"""Summaries and timeline after a real 3-worker run, read back with
TensorBoard's own event reading API."""

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator

import multiworker

pytestmark = pytest.mark.timeout(300)


def _scalars(path):
  acc = event_accumulator.EventAccumulator(path, size_guidance={
      event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


def _values(acc, tag):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if tag in acc.Tags()["scalars"]:
    return [e.value for e in acc.Scalars(tag)]
  return [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]


@pytest.fixture(scope="module")
def logged_run():
  result = multiworker.run("fit", 3, {"adaptive": {}, "epochs": 2,
                                      "tensorboard": True,
                                      "simulate": "10ms*1,1,3"})
  return result, os.path.join(result.outdir, "tb")


def test_every_worker_writes_its_round_scalars(logged_run):
  _, logdir = logged_run
  for w in range(3):
    acc = _scalars(os.path.join(logdir, f"worker_{w}"))
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["tensors"])
    for name in ("rate", "local_steps", "wait_s", "comm_s", "compute_s",
                 "divergence", "bytes_sent", "time_budget"):
      assert f"oscars/{name}" in tags, (w, name, tags)
    rates = _values(acc, "oscars/rate")
    assert rates and all(v > 0 for v in rates)
    assert all(v >= 0 for v in _values(acc, "oscars/wait_s"))


def test_the_chief_writes_the_table_and_the_plan(logged_run):
  _, logdir = logged_run
  acc = _scalars(os.path.join(logdir, "cluster"))
  tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["tensors"])
  assert {f"oscars/table/rate/worker_{j}" for j in range(3)} <= tags
  assert "oscars/plan" in tags


def test_timelines_merge_into_one_trace(logged_run):
  _, logdir = logged_run
  proc = subprocess.run([sys.executable, "-m", "oscars_tf.observability",
                         "merge", logdir], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr
  events = json.load(open(os.path.join(logdir, "timeline.json")))
  spans = [e for e in events["traceEvents"] if e["ph"] == "X"]
  assert {e["tid"] for e in spans} == {0, 1, 2}
  assert {e["name"] for e in spans} == {"compute", "wait", "communicate"}
  assert all(e["dur"] >= 0 for e in spans)
