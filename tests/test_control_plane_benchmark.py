"""benchmarks/control_plane.py runs and its numbers are sane (it measures;
no timing is asserted): the protocol's key-value operations per round are
O(workers) and its live keys do not grow with rounds or faults."""

import json
import pathlib
import subprocess
import sys

import pytest

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_control_plane_benchmark_writes_complete_sane_results(tmp_path):
  out = tmp_path / "cp.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "control_plane.py"),
       "--workers=16,64", "--rounds=8", "--fault_round=4",
       f"--result_json={out}"], capture_output=True, text=True, timeout=300,
      cwd=ROOT, env=conftest.bare_env())
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "SIMULATED" in proc.stdout
  result = json.loads(out.read_text())
  assert result["heterogeneity"] == "SIMULATED"
  by_n = {r["workers"]: r for r in result["results"]}
  assert set(by_n) == {16, 64}
  for n, r in by_n.items():
    # Per worker and round: its row set, read and deleted, the decision read.
    assert r["kv_ops"] <= 4 * n + 8, r
    assert r["live_keys_max"] <= 16, r  # bounded: not per worker or round
    assert r["dropped"] == 2 and r["rejoined"] == 1, r  # a death, a stall
    assert 0 < r["utilization"] <= 1 and r["chief_cpu_ms"] > 0, r
    # Averaging bytes per worker against the ring bound: a ring of g < N
    # sends less; a sync host by host sends the host's rings twice.
    assert 0 < r["averaging_mean_over_bound"] <= r[
        "averaging_max_over_bound"] < 5, r


def test_with_deltas_the_members_read_changes_not_the_whole_table(tmp_path):
  # 64 workers whose rows hold still between rounds: the chief's bytes out
  # per round are the arrivals and a header per member (about 0.01 MB),
  # where the whole decision to every member is about 0.2 MB.
  out = tmp_path / "cp.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "control_plane.py"),
       "--workers=64", "--rounds=8", "--fault_round=4",
       "--distribution=deltas", f"--result_json={out}"],
      capture_output=True, text=True, timeout=300, cwd=ROOT,
      env=conftest.bare_env())
  assert proc.returncode == 0, proc.stderr[-2000:]
  r = json.loads(out.read_text())["results"][0]
  assert r["dropped"] == 2 and r["rejoined"] == 1, r
  assert r["live_keys_max"] <= 16, r
  assert r["bytes_out_of_chief_mb"] < 0.05, r


@pytest.mark.parametrize("shape, most", [
    (["--hosts=2", "--per_host=2"], 1.0),
    # hosts of 3 and 2, each cut to fit: within 5 % of the bound
    (["--hosts=2", "--per_host=3", "--gone=5"], 1.05)])
def test_the_global_sync_benchmark_runs_both_averagers(tmp_path, shape,
                                                       most):
  # Runs both averagers on 2 emulated hosts of logical devices (it checks
  # their sums against NumPy itself): shard by shard sends the ring bound,
  # host by host about twice it.
  out = tmp_path / "gs.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "global_sync.py"),
       *shape, "--params=1001", "--repeats=1",
       f"--result_json={out}"], capture_output=True, text=True, timeout=300,
      cwd=ROOT / "benchmarks",
      env=conftest.bare_env(CUDA_VISIBLE_DEVICES="",
                           TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "no heterogeneity" in proc.stdout
  rows = {r["averager"]: r for r in json.loads(out.read_text())["results"]}
  assert rows["shard by shard"]["sent_max_over_bound"] < most + 1e-9
  assert rows["host by host"]["sent_mean_over_bound"] > 1.5
  assert all(r["median_s"] > 0 for r in rows.values())
