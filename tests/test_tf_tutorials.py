"""TensorFlow's multi-worker tutorials under OscarsStrategy, and the
`tf.distribute` multi-worker surface they use.

tutorial_programs.py holds the programs of "Multi-worker training with Keras"
and "Custom training loop with MultiWorkerMirroredStrategy" with the strategy
line changed; here they run as two real worker processes over gRPC on
loopback, one of them 3x slower (SIMULATED step times), each run bounded.
"""

import json
import os
import pathlib
import sys
import time

import numpy as np
import pytest

import job_log
import multiworker
from oscars_tf import cluster as cluster_lib
from oscars_tf.cli import launch

pytestmark = pytest.mark.timeout(420)

PROGRAM = str(pathlib.Path(__file__).with_name("tutorial_programs.py"))
ENV = {"OSCARS_SIMULATE_STEP_TIME": "20ms*1,3", "TUTORIAL_STEPS": "6"}


def _run(tutorial, outdir, tf_configs=None, timeout=300, env=None):
  """Runs `tutorial` on 2 workers (TF_CONFIG per worker: `tf_configs`, else
  oscars-launch's 'worker' jobs); returns the reports by (type, id)."""
  log = job_log.JobLog()
  job = launch.Job(
      [sys.executable, PROGRAM, tutorial, str(outdir)], 2,
      env=multiworker.worker_env(dict(ENV, **(env or {}))), out=log,
      worker_env={i: {"TF_CONFIG": c} for i, c in enumerate(tf_configs)}
      if tf_configs else None)
  start = time.monotonic()
  try:
    codes, failed = job.wait(timeout=timeout, grace=3)
  finally:
    job.stop(grace=1)
  seconds = time.monotonic() - start
  tail = "\n".join(
      line for line in log.text().splitlines()
      if "GRPC error" not in line and "from peer" not in line)[-6000:]
  assert failed is None and codes == [0, 0], (
      f"{tutorial}: codes {codes}, failed {failed} after {seconds:.0f} s:\n"
      f"{tail}")
  print(f"{tutorial} tutorial: 2 workers in {seconds:.1f} s")
  reports = {}
  for name in os.listdir(outdir):
    if name.startswith("report_") and name.endswith(".json"):
      with open(os.path.join(outdir, name)) as f:
        report = json.load(f)
      reports[(report["task_type"], report["task_id"])] = report
  return reports


def _arrays(outdir, task_type, task_id):
  return np.load(os.path.join(outdir, f"trained_{task_type}_{task_id}.npz"))


def _files_under(path):
  return sorted(os.path.relpath(os.path.join(d, f), path)
                for d, _, files in os.walk(path) for f in files)


def _check_roles(report, task_type, task_id, index, workers):
  """What `strategy.cluster_resolver` / `strategy.extended` told the worker."""
  chief = index == 0
  assert (report["task_type"], report["task_id"]) == (task_type, task_id)
  assert report["resolver_class"] == "SimpleClusterResolver"
  assert report["worker_index"] == index and report["is_chief"] == chief
  assert report["tutorial_is_chief"] == chief  # the tutorial's _is_chief
  assert report["should_checkpoint"] == report["should_save_summary"] == chief
  assert report["experimental_should_init"] is True
  assert report["in_multi_worker_mode"] is True
  assert report["between_graph"] is True
  spec = report["cluster_spec"]
  assert sum(len(spec.get(job, [])) for job in ("chief", "worker")) == workers
  assert report["master"] == "grpc://" + spec[task_type][task_id]
  assert report["rpc_layer"] == "grpc" and report["environment"] == ""
  assert report["num_accelerators"] == {}  # CPU workers


def test_keras_tutorial_saves_one_model_that_loads(tmp_path):
  """"Multi-worker training with Keras": fit, save on every worker (the
  non-chief to a temporary directory it removes), load, checkpoint, restore,
  BackupAndRestore; 'worker' jobs only, worker 0 the chief."""
  import keras  # pylint: disable=g-import-not-at-top
  reports = _run("keras", tmp_path)
  assert sorted(reports) == [("worker", 0), ("worker", 1)]
  for i in range(2):
    _check_roles(reports[("worker", i)], "worker", i, i, workers=2)
  chief, other = reports[("worker", 0)], reports[("worker", 1)]

  # Only the chief's files remain, at the tutorial's paths.
  model_path = tmp_path / "keras-model.keras"
  assert chief["write_model_path"] == str(model_path)
  assert other["write_model_path"] == str(
      tmp_path / "workertemp_1" / "keras-model.keras")
  files = _files_under(tmp_path)
  assert [f for f in files if f.endswith(".keras")] == ["keras-model.keras"]
  assert [f for f in files if "workertemp" in f] == []  # removed
  assert not (tmp_path / "backup").exists()  # the chief's, done with
  assert chief["latest_checkpoint"] == other["latest_checkpoint"] == str(
      tmp_path / "ckpt" / "ckpt-1")

  # fit ends with the same weights everywhere; the chief's file holds them.
  trained = [_arrays(tmp_path, "worker", i)["trained"] for i in range(2)]
  assert np.array_equal(trained[0], trained[1])
  loaded = keras.models.load_model(model_path)
  flat = np.concatenate([w.ravel() for w in loaded.get_weights()])
  assert np.array_equal(flat, trained[0])
  for report in (chief, other):  # each worker loaded / restored the chief's
    assert report["loaded_minus_trained"] == 0.0
    assert report["restored_minus_trained"] == 0.0
    assert report["backup_epochs"] == 3  # no stale backup was restored
  assert chief["final_sum"] == other["final_sum"]
  assert chief["loss"] == other["loss"]


def _chief_job_configs():
  chief, worker = launch.free_ports(2)
  cluster = {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"]}
  return [json.dumps({"cluster": cluster, "task": {"type": t, "index": 0}})
          for t in ("chief", "worker")]


def test_ctl_tutorial_with_a_chief_job_checkpoints_on_the_chief(tmp_path):
  """"Custom training loop with MultiWorkerMirroredStrategy" on a cluster
  with a 'chief' job: the chief is ('chief', 0), worker 0 is not. Under
  Fixed(every=6) rounds end with the tutorial's epochs of 6 steps."""
  reports = _run("ctl", tmp_path, tf_configs=_chief_job_configs(),
                 env={"TUTORIAL_SCHEDULE": "fixed:6"})
  assert sorted(reports) == [("chief", 0), ("worker", 0)]
  chief, other = reports[("chief", 0)], reports[("worker", 0)]
  _check_roles(chief, "chief", 0, 0, workers=2)
  _check_roles(other, "worker", 0, 1, workers=2)

  assert chief["write_checkpoint_dir"] == str(tmp_path / "ckpt")
  assert other["write_checkpoint_dir"] == str(
      tmp_path / "workertemp_0" / "ckpt")
  files = _files_under(tmp_path)
  assert [f for f in files if "workertemp" in f] == []  # removed
  assert [f for f in files if f.startswith("ckpt")] == [
      "ckpt/checkpoint", "ckpt/ckpt-3.data-00000-of-00001",
      "ckpt/ckpt-3.index"]  # one per epoch, max_to_keep=1
  assert chief["loss"][-1] < chief["loss"][0]
  for report in (chief, other):
    assert report["stats"]["local_step"] == 18
    assert report["stats"]["syncs"] == 3

  # Both workers end with the same model, the one in the chief's last
  # checkpoint (epoch 2 was the last saved), and both restore that one.
  mine, theirs = (_arrays(tmp_path, "chief", 0),
                  _arrays(tmp_path, "worker", 0))
  assert np.array_equal(mine["trained"], theirs["trained"])
  assert np.array_equal(mine["restored"], mine["trained"])
  assert np.array_equal(theirs["restored"], mine["trained"])
  assert chief["latest_checkpoint"] == other["latest_checkpoint"]
  assert chief["restored_epoch"] == other["restored_epoch"] == 2


def test_ctl_tutorial_as_is_ends_under_the_adaptive_default(tmp_path):
  """The CTL tutorial with only the strategy line changed (`OscarsStrategy()`,
  Adaptive) and a 3x slower worker ends by itself on both workers."""
  # The tutorial's waits bounded at 90 s, inside the job's 180: beside the
  # other test stream's jobs on 2 cores the chief once took over 30 s to
  # write its last checkpoint after the other worker's last epoch.
  reports = _run("ctl", tmp_path, timeout=180,
                 env={"TUTORIAL_BARRIER_S": "90"})
  chief, other = reports[("worker", 0)], reports[("worker", 1)]
  _check_roles(chief, "worker", 0, 0, workers=2)
  _check_roles(other, "worker", 1, 1, workers=2)
  mine, theirs = (_arrays(tmp_path, "worker", 0),
                  _arrays(tmp_path, "worker", 1))
  assert np.array_equal(mine["restored"], mine["trained"])
  assert np.array_equal(theirs["restored"], mine["trained"])
  print("last steps not averaged; max weight difference between workers: "
        f"{np.max(np.abs(mine['trained'] - theirs['trained']))}")


def test_tf_input_pipeline_on_workers_with_two_devices(tmp_path):
  """TF's distributed iterator reduces a plain tensor across workers in
  multi-worker mode (to count who still has data); here it stays local."""
  reports = _run("several_devices", tmp_path, timeout=120)
  first, second = reports[("worker", 0)], reports[("worker", 1)]
  assert first["in_multi_worker_mode"] and second["in_multi_worker_mode"]
  # Worker i takes every 2nd batch, split across its two devices.
  assert first["batches"] == [[[0, 1], [2, 3]], [[8], [9]]]
  assert second["batches"] == [[[4, 5], [6, 7]]]


def test_one_worker_without_tf_config_answers_as_mwms_does():
  """No cluster: MultiWorkerMirroredStrategy reports an empty cluster spec
  and task_type/task_id None (the tutorials' `_is_chief` says chief)."""
  import oscars_tf  # pylint: disable=g-import-not-at-top
  strategy = oscars_tf.OscarsStrategy()
  resolver = strategy.cluster_resolver
  assert (resolver.task_type, resolver.task_id) == (None, None)
  assert resolver.cluster_spec().as_dict() == {}
  assert resolver.master() == "" and resolver.num_accelerators() == {}
  extended = strategy.extended
  assert extended.should_checkpoint and extended.should_save_summary
  assert extended.experimental_should_init
  assert not extended._in_multi_worker_mode()  # pylint: disable=protected-access
  assert extended.experimental_between_graph
  assert extended._task_type is None and extended._task_id is None  # pylint: disable=protected-access


def test_a_given_resolver_is_handed_back():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import oscars_tf  # pylint: disable=g-import-not-at-top
  given = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({}))
  strategy = oscars_tf.OscarsStrategy(cluster_resolver=given)
  assert strategy.cluster_resolver is given
  assert strategy.extended._cluster_resolver is given  # pylint: disable=protected-access


@pytest.mark.parametrize("task, index, chief", [
    (("chief", 0), 0, True), (("worker", 0), 1, False),
    (("worker", 1), 2, False)])
def test_resolver_follows_tf_conventions_with_a_chief_job(task, index, chief):
  from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-import-not-at-top
  info = cluster_lib.from_tf_config(json.dumps({
      "cluster": {"chief": ["h0:1000"], "worker": ["h1:1000", "h2:1000"]},
      "task": {"type": task[0], "index": task[1]},
      "environment": "cloud", "rpc_layer": "grpc"}))
  resolver = cluster_lib.resolver_for(
      info, [f"/job:{task[0]}/replica:0/task:{task[1]}/device:GPU:{i}"
             for i in range(2)])
  assert (resolver.task_type, resolver.task_id) == task
  assert info.worker_index == index and info.is_chief == chief
  spec = resolver.cluster_spec()
  assert multi_worker_util.is_chief(spec, *task) == chief
  assert multi_worker_util.id_in_cluster(spec, *task) == index
  assert resolver.master() == "grpc://" + spec.task_address(*task)
  assert resolver.num_accelerators() == {"GPU": 2}
  assert resolver.environment == "cloud" and resolver.rpc_layer == "grpc"
