"""The training binary examples/train.py, its flags, data sets and loops.

Multi-worker runs are real processes over gRPC on loopback, launched the way
users launch them (oscars_tf.cli.launch), each with a hard timeout.
"""

import json
import os
import pathlib
import subprocess
import sys
import urllib.error

import numpy as np
import pytest

import fake_cgroups
import multiworker
from oscars_tf import data

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TRAIN = str(EXAMPLES / "train.py")


def _train(*flags, timeout=120):
  return subprocess.run([sys.executable, TRAIN, *flags],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, timeout=timeout,
                        env=multiworker.worker_env(), check=False)


@pytest.mark.parametrize("flag, names", [
    ("--dataset=imagenet", ["--dataset", "digits", "synthetic", "mnist"]),
    ("--batch_size=-4", ["--batch_size", "positive"]),
    ("--strategy=horovod", ["--strategy", "oscars", "local_sgd",
                            "multi_worker_mirrored"]),
    ("--model=resnet", ["--model", "mlp", "cnn"]),
    ("--epochs=0", ["--epochs", "positive"]),
    ("--learning_rate=-1", ["--learning_rate"]),
    ("--min_period=32", ["--min_period", "--initial_period"]),
    ("--period_rule=fast", ["--period_rule", "cost", "adacomm"]),
    ("--max_train_seconds=5", ["--max_train_seconds", "parameter_server"]),
    ("--max_overhead=1.5", ["--max_overhead"]),
    ("--model=transformer_lm", ["--dataset=stdlib_text",
                                "--model=transformer_lm"]),
    ("--dataset=stdlib_text", ["--dataset=stdlib_text",
                               "--model=transformer_lm"]),
    ("--seq_len=0", ["--seq_len"]),
    ("--compression=int2", ["--compression", "int8", "int4"]),
    ("--compression=int4 --averaging_dtype=bfloat16",
     ["--compression", "--averaging_dtype=float32"]),
    ("--compression=int8 --strategy=mirrored",
     ["--compression", "OscarsStrategy only"]),
    ("--overlap --strategy=mirrored", ["--overlap", "OscarsStrategy only"]),
    ("--overlap_always --strategy=multi_worker_mirrored",
     ["--overlap_always", "OscarsStrategy only"]),
    ("--tf_heartbeat_timeout=60", ["--tf_heartbeat_timeout",
                                   "multi_worker_mirrored only"]),
    ("--outer_learning_rate=0.7", ["--outer_learning_rate",
                                   "--outer_momentum"]),
    ("--outer_momentum=0.9 --outer_learning_rate=0",
     ["--outer_learning_rate", "must be > 0"]),
    ("--outer_momentum=0.5 --strategy=mirrored",
     ["--outer_momentum", "OscarsStrategy only"]),
    ("--deterministic", ["--deterministic", "local_sgd", "not oscars"]),
    ("--strategy=multi_worker_mirrored --simulate_step_time=fast",
     ["--simulate_step_time", "20ms*1,1,2,4"]),
    ("--strategy=oscars --period=4", ["--period", "--strategy=local_sgd"]),
    ("--deterministic --strategy=local_sgd --optimizer=adam",
     ["--deterministic", "--optimizer_state=average"]),
    # Refused at start: it failed the chief at the first epoch's end, and a
    # restore found nothing (os paths), so every restart began at epoch 0.
    ("--checkpoint_dir=gs://bucket/run", ["--checkpoint_dir", "URL",
                                          "mount"]),
    ("--deterministic --strategy=local_sgd --optimizer=sgd --warmup_steps=3",
     ["--deterministic", "--warmup_steps"]),
])
def test_a_bad_flag_exits_with_one_line_naming_it(flag, names):
  proc = _train(*flag.split(), timeout=60)
  assert proc.returncode != 0
  first = proc.stderr.strip().splitlines()[0]
  for name in names:
    assert name in first, first
  assert "Traceback" not in proc.stderr


_HEARTBEATS = """
import json, os, sys
from absl import flags
from tensorflow.python.eager import context
from oscars_tf.cli import flags as oscars_flags
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [
    "localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}})
flags.FLAGS(["prog", "--strategy=multi_worker_mirrored"] + sys.argv[1:])
oscars_flags._configure_heartbeats(None, flags.FLAGS.tf_heartbeat_timeout)
c = context.context().coordination_service
print(json.dumps([c.heartbeat_timeout_in_ms, c.service_leader,
                  [(j.name, j.num_tasks) for j in c.coordinated_job_list]]))
"""


def test_tf_heartbeat_timeout_configures_mwms_coordination_service():
  # What MultiWorkerMirroredStrategy would configure itself, with the
  # timeout; it keeps a service configured before it is built.
  proc = subprocess.run(
      [sys.executable, "-c", _HEARTBEATS, "--tf_heartbeat_timeout=90"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60,
      env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  timeout_ms, leader, jobs = json.loads(proc.stdout.strip().splitlines()[-1])
  assert timeout_ms == 90000
  assert leader == "/job:worker/replica:0/task:0"
  assert jobs == [["worker", 2]]


def test_mwms_with_keras_fit_is_refused_with_the_reason():
  proc = _train("--strategy=multi_worker_mirrored", "--loop=fit", timeout=60)
  assert proc.returncode != 0
  assert "--loop=custom" in proc.stderr.strip().splitlines()[0]


def test_a_cnn_on_a_flat_data_set_is_one_clear_line():
  proc = _train("--model=cnn", "--dataset=synthetic", timeout=120)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py:") and "--model=mlp" in last, last
  assert "Traceback" not in proc.stderr


def test_an_unreachable_download_says_what_to_use_instead(monkeypatch):
  import keras  # pylint: disable=g-import-not-at-top

  def offline(*args, **kwargs):
    raise urllib.error.URLError("[Errno -3] Temporary failure in name "
                                "resolution")
  monkeypatch.setattr(keras.datasets.fashion_mnist, "load_data", offline)
  with pytest.raises(data.DatasetUnavailableError) as e:
    data.load("fashion_mnist")
  text = str(e.value)
  assert "fashion_mnist" in text and "--dataset=digits" in text
  assert "Temporary failure" in text


def test_offline_data_sets_have_their_shapes_and_are_deterministic():
  (x, y), (xt, yt) = data.load("digits")
  assert x.shape[1:] == (8, 8, 1) and x.dtype == np.float32
  assert 0 <= x.min() and x.max() <= 1 and set(np.unique(y)) == set(range(10))
  assert len(x) + len(xt) == 1797
  (s, sy), _ = data.load("synthetic", num_samples=1000, seed=3)
  (s2, _), _ = data.load("synthetic", num_samples=1000, seed=3)
  assert s.shape == (800, 32) and np.array_equal(s, s2)
  with pytest.raises(ValueError, match="choose one of"):
    data.load("nope")


def test_a_transformer_on_stdlib_text_learns_in_bits_per_byte(tmp_path):
  # One worker under the default strategy (oscars), a few steps of the
  # tf.data pipeline per epoch: fewer bits per byte than guessing (8).
  result = tmp_path / "text.json"
  proc = _train("--dataset=stdlib_text", "--model=transformer_lm",
                "--epochs=2", "--steps_per_epoch=25", "--batch_size=16",
                "--seq_len=32", "--eval_windows=256", "--optimizer=adam",
                "--learning_rate=0.003", f"--result_json={result}",
                f"--checkpoint_dir={tmp_path / 'ckpt'}", timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(result.read_text())
  assert (r["dataset"], r["model"], r["seq_len"]) == (
      "stdlib_text", "transformer_lm", 32)
  assert r["optimizer_step"] == 50 and r["steps_per_epoch"] == 25
  bits = [c["val_bits_per_byte"] for c in r["curve"]]
  assert len(bits) == 2 and bits[-1] == r["val_bits_per_byte"]
  assert np.isfinite(r["val_bits_per_byte"]) and r["val_bits_per_byte"] < 7
  assert r["val_bits_per_byte"] == pytest.approx(r["test_loss"] / np.log(2))
  assert r["train_windows"] > r["validation_windows"] > 0
  assert (tmp_path / "ckpt" / "last.json").exists()


def test_strategy_flags_build_the_schedules_they_name():
  from absl import flags  # pylint: disable=g-import-not-at-top

  from oscars_tf import schedules  # pylint: disable=g-import-not-at-top
  from oscars_tf.cli import flags as oscars_flags  # pylint: disable=g-import-not-at-top
  values = flags.FLAGS
  try:
    values(["prog", "--strategy=local_sgd", "--period=4",
            "--warmup_steps=2"])
    assert oscars_flags.make_schedule(values).config() == (
        schedules.Fixed(4, warmup_steps=2).config())
    values.unparse_flags()
    values(["prog", "--strategy=sync"])
    assert oscars_flags.make_schedule(values).every == 1
    values.unparse_flags()
    for strategy in ("sync", "oscars"):  # a fixed period's flags: refused
      values(["prog", f"--strategy={strategy}", "--warmup_steps=3"])
      with pytest.raises(ValueError, match="--warmup_steps applies to "
                         "--strategy=local_sgd"):
        oscars_flags.make_schedule(values)
      values.unparse_flags()
    values(["prog", "--period_rule=quadratic", "--grouping=speed",
            "--initial_period=32"])
    schedule = oscars_flags.make_schedule(values)
    assert isinstance(schedule.period_rule, schedules.QuadraticSync)
    assert schedule.grouping == "speed" and schedule.initial_period == 32
    assert schedule.max_overshoot is None
    assert schedule.min_utilization == schedules.DEFAULT_MIN_UTILIZATION
    values.unparse_flags()
    values(["prog", "--max_overshoot=0.02", "--min_utilization=0.97",
            "--max_group_size=16", "--max_groupings=4"])
    schedule = oscars_flags.make_schedule(values)
    assert (schedule.max_overshoot, schedule.min_utilization,
            schedule.max_group_size, schedule.max_groupings) == (
                0.02, 0.97, 16, 4)
    values.unparse_flags()
    values(["prog", "--min_utilization=0"])  # off
    assert oscars_flags.make_schedule(values).min_utilization is None
    values.unparse_flags()
    with pytest.raises(flags.IllegalFlagValueError):
      values(["prog", "--min_utilization=1.5"])
  finally:
    values.unparse_flags()


def test_outer_flags_build_the_outer_optimizer():
  from absl import flags  # pylint: disable=g-import-not-at-top

  from oscars_tf.cli import flags as oscars_flags  # pylint: disable=g-import-not-at-top
  values = flags.FLAGS
  try:
    values(["prog"])
    assert oscars_flags.make_outer_optimizer(values) is None
    values.unparse_flags()
    values(["prog", "--outer_momentum=0.5"])
    assert repr(oscars_flags.make_outer_optimizer(values)) == (
        "OuterMomentum(learning_rate=1.0, momentum=0.5, nesterov=True)")
    values.unparse_flags()
    values(["prog", "--outer_momentum=0.9", "--outer_learning_rate=0.7"])
    assert repr(oscars_flags.make_outer_optimizer(values)) == (
        "OuterMomentum(learning_rate=0.7, momentum=0.9, nesterov=True)")
  finally:
    values.unparse_flags()


def test_averaging_dtype_flag_reaches_oscars_strategies_only():
  from absl import flags  # pylint: disable=g-import-not-at-top

  from oscars_tf.cli import flags as oscars_flags  # pylint: disable=g-import-not-at-top
  values = flags.FLAGS
  assert oscars_flags.FLAGS is values  # importing it defined the flags
  try:
    values(["prog", "--strategy=local_sgd", "--averaging_dtype=bfloat16"])
    assert values.averaging_dtype == "bfloat16"
    values.unparse_flags()
    values(["prog"])
    assert values.averaging_dtype == "float32"
    values.unparse_flags()
    with pytest.raises(flags.IllegalFlagValueError, match="bfloat16"):
      values(["prog", "--averaging_dtype=int8"])
    values.unparse_flags()
    with pytest.raises(flags.IllegalFlagValueError,
                       match="OscarsStrategy only"):
      values(["prog", "--strategy=mirrored", "--averaging_dtype=float16"])
  finally:
    values.unparse_flags()


def _launch_train(tmp_path, name, *flags, workers=2, timeout=240):
  result = tmp_path / f"{name}.json"
  codes, failed, log = multiworker.run_command(
      [sys.executable, TRAIN, f"--result_json={result}", *flags], workers,
      timeout=timeout)
  assert failed is None and codes == [0] * workers, log[-4000:]
  return json.loads(result.read_text()), log


def test_two_workers_reach_the_stated_accuracy_and_resume(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  first, log = _launch_train(tmp_path, "first", "--epochs=2",
                             f"--checkpoint_dir={ckpt}")
  assert first["initial_epoch"] == 0 and len(first["per_worker"]) == 2
  assert all(w["steps"] > 0 for w in first["per_worker"])
  assert "worker 1/2 epoch 2/2" in log  # one line per epoch on non-chiefs
  saved = json.loads((tmp_path / "ckpt" / "last.json").read_text())
  assert saved["epoch"] == 2 and saved["optimizer_step"] == (
      first["optimizer_step"])
  second, _ = _launch_train(tmp_path, "second", "--epochs=4",
                            f"--checkpoint_dir={ckpt}")
  # Resumed: starts at the saved epoch, and the optimizer's step count
  # continues from the saved one instead of restarting at zero. (How many
  # steps the chief takes in two epochs depends on the machine's load: the
  # count is checked against its own, not a number.)
  assert second["initial_epoch"] == 2
  assert [c["epoch"] for c in second["curve"]] == [3, 4]
  # The timed steps leave out the first (start-up): one more was taken.
  resumed_steps = second["per_worker"][0]["steps"] + 1
  assert resumed_steps > 1
  assert second["optimizer_step"] == saved["optimizer_step"] + resumed_steps
  assert second["test_accuracy"] >= 0.93, second
  assert not [p for p in os.listdir(ckpt) if p.startswith(".tmp")]
  # Resumed once more, finished (a restart after the last checkpoint):
  # nothing to train, and its numbers say so. Before, each worker's steps
  # were every earlier attempt's, over a wall time of 0.
  third, _ = _launch_train(tmp_path, "third", "--epochs=4",
                           f"--checkpoint_dir={ckpt}")
  assert third["initial_epoch"] == 4 and third["curve"] == []
  assert third["optimizer_step"] == second["optimizer_step"]
  assert [w["steps"] for w in third["per_worker"]] == [0, 0], third


def test_mwms_custom_loop_and_simulated_delays(tmp_path):
  result, log = _launch_train(
      tmp_path, "mwms", "--strategy=multi_worker_mirrored", "--epochs=3",
      "--simulate_step_time=2ms*1,2")
  steps = [w["steps"] for w in result["per_worker"]]
  assert steps[0] == steps[1] > 0  # synchronous: equal steps
  assert result["test_accuracy"] >= 0.85
  assert "SIMULATED" in log


def test_custom_loop_example_trains_two_workers_to_equal_models():
  codes, failed, log = multiworker.run_command(
      [sys.executable, str(EXAMPLES / "custom_loop.py"), "--epochs=3"], 2,
      timeout=240)
  assert failed is None and codes == [0, 0], log[-4000:]
  last = {}
  for line in log.splitlines():
    if "epoch 3 loss" in line:
      worker = line.split("worker ")[1].split(":")[0]
      last[worker] = float(line.split("test accuracy ")[1].split()[0])
  assert len(last) == 2 and len(set(last.values())) == 1, log[-2000:]
  assert min(last.values()) >= 0.9


def test_compare_prints_both_runs():
  proc = subprocess.run(
      [sys.executable, str(EXAMPLES / "compare.py"), "--epochs=1"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=240, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-3000:]
  rows = [line for line in proc.stdout.splitlines()
          if line.startswith(("no strategy", "OscarsStrategy"))]
  assert len(rows) == 2, proc.stdout[-2000:]
  for row in rows:
    accuracy = float(row.split()[-4])
    assert 0.5 < accuracy <= 1.0, row


def _ps_job(tmp_path, simulate, *train_flags):
  """A 2-worker, 1-ps job of train.py under the launcher: (process, the
  chief's result)."""
  result = tmp_path / "ps.json"
  proc = subprocess.run(
      [sys.executable, "-m", "oscars_tf.cli.launch", "--num_workers=2",
       "--num_ps=1", "--grace_seconds=3", "--timeout=400",
       f"--simulate_step_time={simulate}", "--", sys.executable, TRAIN,
       "--strategy=parameter_server", "--dataset=digits", "--model=mlp",
       f"--result_json={result}", *train_flags],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=460, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  return proc, json.loads(result.read_text())


def test_parameter_server_baseline_under_the_launcher(tmp_path):
  # oscars-launch starts the chief, 2 worker and 1 ps tasks; the job ends
  # when the chief is done. Worker 1 is SIMULATED 4x slower, so the
  # asynchronous workers take unequal steps.
  proc, r = _ps_job(tmp_path, "10ms*1,4", "--epochs=2")
  assert "the chief finished; stopped the 2 worker and 1 ps" in proc.stdout
  print(f"parameter_server: test accuracy {r['test_accuracy']:.4f}, steps "
        f"{[w['steps'] for w in r['per_worker']]}")
  assert r["strategy"] == "parameter_server" and r["workers"] == 2
  assert r["test_accuracy"] >= 0.8, r  # chance: 0.1
  curve = r["curve"]
  assert [c["epoch"] for c in curve] == [1, 2]
  assert 0 < curve[0]["train_time_s"] < curve[1]["train_time_s"]
  # A data set's worth of steps per epoch over the cluster (1437 digits in
  # batches of 32), the first one start-up.
  assert r["optimizer_step"] == 2 * 45
  workers = r["per_worker"]
  assert sum(w["steps"] for w in workers) == 2 * 45 - 1
  assert all(w["steps"] > 0 for w in workers)
  assert workers[0]["steps"] > workers[1]["steps"]  # the faster one
  for w, per_step in zip(workers, (0.01, 0.04)):
    assert w["simulated_s"] == pytest.approx(per_step * w["steps"])
    assert w["bytes_sent"] > 0 and w["collectives"] == w["steps"]
  assert r["simulated_step_time"] == "10ms*1,4"


def test_parameter_server_stops_mid_epoch_at_max_train_seconds(tmp_path):
  # 45 steps an epoch at 20 + 5 steps/s (SIMULATED 50 ms, 200 ms): about
  # 1.8 s each; a 0.5 s cap stops the first epoch part-way.
  _, r = _ps_job(tmp_path, "50ms*1,4", "--epochs=3",
                 "--max_train_seconds=0.5")
  assert [c["epoch"] for c in r["curve"]] == [1], r["curve"]
  assert 1 < r["optimizer_step"] < 45, r["optimizer_step"]
  # Past the cap by at most the steps queued then (4 per worker), and what
  # a loaded 2-core machine adds to them (the other test stream's jobs
  # stall a process for seconds): the margin is the machine's. The epochs
  # and optimizer steps above show the stop.
  assert 0.5 <= r["curve"][0]["train_time_s"] < 0.5 + 8 * 0.2 + 4.0, r


@pytest.mark.parametrize("strategy", ["oscars", "multi_worker_mirrored"])
def test_cpu_limit_from_ready_applies_at_the_first_training_step(
    tmp_path, strategy):
  # Start-up and tracing run unlimited; the quota holds from the step where
  # every strategy's clock starts (a synchronous first step waits for the
  # slowest worker's tracing; Oscars' would not, and was charged for it).
  fake_cgroups.real_base()  # skips without usable cgroups
  result = tmp_path / "limited.json"
  proc = subprocess.run(
      [sys.executable, "-m", "oscars_tf.cli.launch", "--num_workers=2",
       "--cpu_limit=1,0.5", "--cpu_limit_from=ready", "--timeout=300", "--",
       sys.executable, TRAIN, f"--strategy={strategy}", "--dataset=digits",
       "--model=mlp", "--epochs=1", f"--result_json={result}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=360, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "never applied its CPU limit" not in proc.stdout
  workers = json.loads(result.read_text())["per_worker"]
  assert [w["cpu_limit"] for w in workers] == [1.0, 0.5]
  assert [w["limited_from_step"] for w in workers] == [1, 1], workers
  # The local step is timed after training, under the quota.
  assert all(w["real_step_s"] > 0 for w in workers)


def test_parameter_server_outside_its_cluster_says_how_to_launch_it():
  proc = _train("--strategy=parameter_server", timeout=120)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py:") and "--num_ps" in last, last
  proc = _train("--strategy=parameter_server", "--loop=fit", timeout=60)
  assert proc.returncode != 0
  assert "--loop=fit" in proc.stderr.strip().splitlines()[0]


@pytest.mark.parametrize("strategy", ["mirrored", "default"])
def test_one_process_strategies_refuse_a_cluster(monkeypatch, strategy):
  # Each task would train a model of its own and write the same files.
  from absl import flags  # pylint: disable=g-import-not-at-top

  from oscars_tf.cli import flags as oscars_flags  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("TF_CONFIG", json.dumps({
      "cluster": {"worker": ["localhost:1", "localhost:2"]},
      "task": {"type": "worker", "index": 1}}))
  values = flags.FLAGS
  try:
    values(["prog", f"--strategy={strategy}"])
    with pytest.raises(ValueError, match=f"--strategy={strategy} trains on "
                       "one process's devices, but this process is one of 2 "
                       "tasks"):
      oscars_flags.make_strategy(values)
  finally:
    values.unparse_flags()


def test_parameter_server_without_a_chief_and_ps_exits_instead_of_serving():
  # Without `oscars-launch --num_ps` every task is a worker: each one would
  # serve forever, waiting for a chief that never comes.
  env = dict(multiworker.worker_env(), TF_CONFIG=json.dumps({
      "cluster": {"worker": ["localhost:1", "localhost:2"]},
      "task": {"type": "worker", "index": 0}}))
  proc = subprocess.run([sys.executable, TRAIN, "--strategy=parameter_server",
                         "--loop=custom"], capture_output=True, text=True,
                        timeout=120, env=env, check=False)
  assert proc.returncode != 0
  assert ("--strategy=parameter_server needs a cluster with a chief, "
          "workers and ps tasks: oscars-launch --num_ps 1") in proc.stderr
  assert "Traceback" not in proc.stderr
