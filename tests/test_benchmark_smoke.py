"""Smoke tests of the job-timing benchmarks (a benchmark is not a test).

Each runs --quick on a small setting and checks that the JSON has every
field with sane values (and the figure exists).
"""

import json
import pathlib
import subprocess
import sys

import pytest

import multiworker

BENCHMARK = (pathlib.Path(__file__).resolve().parent.parent / "benchmarks" /
             "heterogeneous.py")
ROW_FIELDS = {"profile", "strategy", "period", "simulated_step_time",
              "time_to_target_s", "accuracy_at_budget", "final_accuracy",
              "train_time_s", "utilization", "utilization_mean",
              "utilization_second_half_mean", "real_compute_share",
              "bytes_sent", "collectives", "steps", "curve", "chosen",
              "end_spread_s", "exit_spread_s"}


def _sane_end_spreads(row):
  # How far apart the workers' training returned and their processes
  # exited: measured (not asserted small; benchmarks/fit_end_spread.py).
  assert row["end_spread_s"] is not None and row["end_spread_s"] >= 0, row
  assert row["exit_spread_s"] is not None and row["exit_spread_s"] >= 0, row


def test_quick_benchmark_writes_complete_sane_results(tmp_path):
  pytest.importorskip("matplotlib")
  out, png = tmp_path / "het.json", tmp_path / "het.png"
  proc = subprocess.run(
      [sys.executable, str(BENCHMARK), "--quick", "--num_workers=2",
       "--epochs=1", "--periods=4", "--base_step_time=5ms",
       "--target_accuracy=0.5", "--time_budget=1", f"--result_json={out}",
       f"--png={png}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=420, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "SIMULATED" in proc.stdout
  result = json.loads(out.read_text())
  assert result["simulated"] is True
  assert png.stat().st_size > 1000 and result["png"] == str(png)
  rows = result["rows"]
  assert sorted(r["strategy"] for r in rows) == sorted(
      ["sync_tf", "sync", "local_sgd", "oscars"])
  for r in rows:
    assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
    assert r["profile"] == "hetero" and "5ms*1,4" in r["simulated_step_time"]
    assert r["train_time_s"] > 0
    assert 0 <= r["final_accuracy"] <= 1 and 0 <= r["accuracy_at_budget"] <= 1
    assert r["time_to_target_s"] is None or r["time_to_target_s"] > 0
    assert len(r["utilization"]) == 2
    assert all(0 <= u <= 1 for u in r["utilization"])
    assert 0 <= r["utilization_mean"] <= 1
    assert 0 <= r["real_compute_share"] <= 1
    assert all(b > 0 for b in r["bytes_sent"])
    assert all(c >= 1 for c in r["collectives"])
    assert all(s > 0 for s in r["steps"])
    assert r["curve"] and all(0 <= a <= 1 and t > 0 for t, a in r["curve"])
    _sane_end_spreads(r)
  sync = next(r for r in rows if r["strategy"] == "sync_tf")
  assert sync["steps"][0] == sync["steps"][1]  # synchronous: equal steps
  overhead = result["overhead"]
  assert overhead["plain_step_ms"] > 0 and overhead["overhead_ratio"] > 0
  assert {g["goal"].split(":")[0] for g in result["goals"]} >= {"hetero"}


REAL = BENCHMARK.parent / "real_conditions.py"
REAL_ROW_FIELDS = {"profile", "strategy", "period", "repeat", "launcher",
                   "emulated", "time_to_target_s", "final_accuracy",
                   "train_time_s", "job_wall_s", "utilization", "bytes_sent",
                   "collectives", "steps", "curve", "chosen",
                   "end_spread_s", "exit_spread_s"}


def test_quick_real_conditions_benchmark_runs_under_real_cpu_quotas(
    tmp_path):
  """--quick, 2 workers: EMULATED CPU quotas (cgroups) through the
  launcher, each strategy a real job; the JSON is complete and sane."""
  pytest.importorskip("matplotlib")
  if not cpu_limits_usable():
    pytest.skip("no writable cgroup cpu controller here (needs root)")
  out, png = tmp_path / "real.json", tmp_path / "real.png"
  proc = subprocess.run(
      [sys.executable, str(REAL), "--quick", "--num_workers=2",
       "--cpu_ratios=1,0.5", "--epochs=1", "--model=cnn",
       "--target_accuracy=0.5", f"--result_json={out}", f"--png={png}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=420, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "EMULATED" in proc.stdout and "SIMULATED" not in proc.stdout
  result = json.loads(out.read_text())
  assert result["emulated"] is True
  assert result["config"]["cpu_limits"] == [1.0, 0.5]
  assert png.stat().st_size > 1000
  rows = result["rows"]
  assert sorted(r["strategy"] for r in rows) == ["local_sgd", "oscars",
                                                  "sync_tf"]
  for r in rows:
    assert REAL_ROW_FIELDS <= set(r), REAL_ROW_FIELDS - set(r)
    assert r["profile"] == "cpu_uneven"
    assert "--cpu_limit=1,0.5" in r["launcher"]
    assert 0 <= r["final_accuracy"] <= 1 and r["train_time_s"] > 0
    assert len(r["utilization"]) == 2
    assert all(0 <= u <= 1 for u in r["utilization"])
    assert all(b > 0 for b in r["bytes_sent"])
    assert r["curve"] and all(0 <= a <= 1 and t > 0 for t, a in r["curve"])
    _sane_end_spreads(r)
  assert any(g["goal"].startswith("cpu_uneven: oscars vs sync_tf")
             for g in result["goals"])


SPREAD = BENCHMARK.parent / "fit_end_spread.py"


def test_quick_fit_end_spread_benchmark_measures_fit_ends_and_exits(
    tmp_path):
  """--quick on the slow_model profile (3 workers, in-model sleeps,
  SIMULATED): one job's fit-end and exit spreads, in the table and JSON."""
  out = tmp_path / "spread.json"
  proc = subprocess.run(
      [sys.executable, str(SPREAD), "--quick", "--profiles=slow_model",
       f"--result_json={out}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=420, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "slow_model  SIMULATED" in proc.stdout, proc.stdout[-2000:]
  result = json.loads(out.read_text())
  (row,) = result["rows"]
  assert (row["profile"], row["workers"], row["epochs"]) == (
      "slow_model", 3, 1)
  (run,) = row["runs"]
  assert len(run["workers"]) == 3 and run["fit_wall_s"] > 0
  assert run["end_spread_s"] >= 0 and run["exit_spread_s"] >= 0
  assert row["within_goal"] == int(run["within_goal"])


def cpu_limits_usable():
  from oscars_tf.tools import cpu_limits  # pylint: disable=g-import-not-at-top
  try:
    cpu_limits.CpuLimits([1.0]).detect()
  except cpu_limits.CpuLimitError:
    return False
  return True


WORKLOADS = BENCHMARK.parent / "real_workloads.py"


def test_real_workloads_trains_the_language_model_and_reports_it(tmp_path):
  """A tiny run of the language-model benchmark (2 workers, even profile,
  a few steps): every row has its curve in bits per byte, its target,
  round ends and periods; the goals are reported."""
  out = tmp_path / "lm.json"
  proc = subprocess.run(
      [sys.executable, str(WORKLOADS), "--profiles=even", "--num_workers=2",
       "--cpu_ratios=1,1", "--strategies=sync_tf,oscars", "--epochs=2",
       "--steps_per_epoch=12", "--eval_windows=128", "--d_model=32",
       # Reaches train.py, which refuses a flag it does not know.
       "--oscars_args=--outer_momentum=0,--outer_learning_rate=1",
       f"--result_json={out}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=420, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "EMULATED" in proc.stdout and "SIMULATED" not in proc.stdout
  result = json.loads(out.read_text())
  assert result["config"]["oscars_args"] == [
      "--outer_momentum=0", "--outer_learning_rate=1"]
  rows = {r["strategy"]: r for r in result["rows"]}
  assert sorted(rows) == ["oscars", "sync_tf"]
  for r in rows.values():
    assert len(r["curve"]) == 2 and all(
        t > 0 and 0 < bpb < 9 for t, bpb in r["curve"]), r["curve"]
    assert r["target_bpb"] == rows["sync_tf"]["target_bpb"]
    assert len(r["utilization"]) == 2 and all(b > 0 for b in r["bytes_sent"])
    _sane_end_spreads(r)
  oscars = rows["oscars"]
  assert oscars["averagings"] >= 2 and oscars["epoch_end_rounds"] >= 1
  assert sum(oscars["periods"].values()) >= 2
  assert rows["sync_tf"]["time_to_target_s"] is not None
  assert any(g["goal"].startswith("even: oscars vs sync_tf")
             for g in result["goals"])


def test_real_workloads_reports_a_failed_job_and_goes_on(tmp_path):
  """A job that fails (here: past its --timeout) is a reported result, not
  the end of the whole run."""
  out = tmp_path / "lm.json"
  proc = subprocess.run(
      [sys.executable, str(WORKLOADS), "--profiles=even", "--num_workers=2",
       "--cpu_ratios=1,1", "--strategies=sync_tf,oscars", "--d_model=32",
       "--timeout=3", f"--result_json={out}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=300, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  result = json.loads(out.read_text())
  assert result["rows"] == [], result["rows"]
  failed = {r["strategy"]: r["failed"] for r in result["failed_jobs"]}
  assert sorted(failed) == ["oscars", "sync_tf"], failed
  assert all("ran past --timeout=3s" in why for why in failed.values()), failed
  assert "FAILED even oscars rep 0" in proc.stdout, proc.stdout[-3000:]


STARTUP = BENCHMARK.parent / "model_startup.py"


def test_model_startup_benchmark_times_fits_against_plain_keras(tmp_path):
  """Two small fits a worker, plain Keras and int4 (2 workers over gRPC):
  every fit timed, the later ones against plain Keras; a bad option is a
  usage error before anything starts."""
  out = tmp_path / "startup.json"
  proc = subprocess.run(
      [sys.executable, str(STARTUP), "--options=plain,int4", "--models=2",
       "--steps=6", f"--result_json={out}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=300, env=multiworker.worker_env(), check=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "no heterogeneity" in proc.stdout, proc.stdout[-2000:]
  result = json.loads(out.read_text())
  plain, int4 = result["rows"]
  assert (plain["option"], int4["option"]) == ("plain", "int4")
  for row in (plain, int4):
    assert len(row["fits_s"]) == 2 and min(row["fits_s"]) > 0, row
    assert row["later_fit_median_s"] == row["fits_s"][1], row
  assert plain["vs_plain"] == 1.0 and int4["vs_plain"] > 0, result
  bad = subprocess.run(
      [sys.executable, str(STARTUP), "--options=plain,int3"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=60, env=multiworker.worker_env(), check=False)
  assert bad.returncode != 0 and "unknown ['int3']" in bad.stdout, bad.stdout
