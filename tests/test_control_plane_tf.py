"""benchmarks/control_plane_tf.py runs a round against TensorFlow's real
coordination service and ends by itself: four processes over gRPC, one
client killed off mid-run (the chief drops it), every process gone at the
end. It measures; no timing is asserted."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


# --dedicated_service: the service in a `coordinator` task of its own
# (oscars_tf/cli/coordinator.py's setup), not in the chief's process.
@pytest.mark.parametrize("dedicated", [False, True])
def test_four_tasks_over_the_real_service_measure_and_end(tmp_path,
                                                          dedicated):
  out = tmp_path / "cp_tf.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "control_plane_tf.py"),
       "--clients=4", "--rounds=5", "--warmup=1", "--slot_s=0.5",
       "--death_round=3", f"--log={tmp_path / 'tasks.log'}",
       f"--dedicated_service={dedicated}",
       f"--result_json={out}"], capture_output=True, text=True, timeout=170,
      cwd=ROOT, env=conftest.bare_env())
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "SIMULATED" in proc.stdout
  result = json.loads(out.read_text())
  assert result["heterogeneity"] == "SIMULATED"
  assert result["store"] == "tensorflow coordination service"
  assert result["stopped"] is None
  [r] = result["results"]
  n = r["workers"]
  assert n == 4 and r["rounds"] == 3, r  # rounds 1..4 less the death round
  assert r["kv_ops"] <= 4 * n + 8 and r["kv_ops_max"] <= 4 * n + 8, r
  assert r["bytes_out_of_chief_mb"] > 0, r
  assert r["chief_cpu_ms"] > 0 and r["chief_wall_ms"] > 0, r
  assert r["client_get_ms_p50"] > 0 and r["client_set_ms_p50"] > 0, r
  assert r["dropped"] == 1, r  # the client that exited, seen gone
  assert r["client_private_mb"] > 0 and r["chief_rss_mb"] > 0, r
  assert len(r["pids"]) == n + dedicated
  assert not [p for p in r["pids"] if _alive(p)], r["pids"]
  assert r["dedicated_service"] == dedicated
  assert (r["service_slot_cpu_ms"] > 0 if dedicated else
          r["service_slot_cpu_ms"] is None), r
  assert ("in chief" in proc.stdout) != dedicated, proc.stdout


def test_light_clients_as_threads_count_as_workers_and_die_with_their_process(
    tmp_path):
  """Nine logical workers in three processes (the chief's, two of four
  light clients each): every client's keys, ops and bytes are its own, and
  the last process's exit drops all four of its clients at once."""
  out = tmp_path / "cp_tf.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "control_plane_tf.py"),
       "--clients=9", "--clients_per_process=4", "--rounds=6", "--warmup=2",
       "--slot_s=0.5", "--death_round=4", f"--log={tmp_path / 'tasks.log'}",
       f"--result_json={out}"], capture_output=True, text=True, timeout=170,
      cwd=ROOT, env=conftest.bare_env())
  assert proc.returncode == 0, proc.stderr[-2000:]
  [r] = json.loads(out.read_text())["results"]
  assert r["workers"] == 9 and r["processes"] == 3, r
  assert r["clients_per_process"] == 4 and len(r["pids"]) == 3, r
  assert r["dropped"] == 4, r  # the last process's four clients
  # Before the death: 8 posts, 8 reads, the chief's reads of 8 arrivals
  # and a few of its own; after it, 4 fewer clients.
  assert 2 * 4 + 4 <= r["kv_ops"] <= 4 * 9 + 8, r
  # The clients post the plan's k_i as their steps, so a round's changes
  # are a header, not every member's steps (which a whole row of 9 would
  # take: 9 x 13 bytes and more, per client).
  per_read = 1e6 * r["bytes_out_of_chief_mb"] / 8
  assert 0 < per_read < 9 * 13, r
  assert r["chief_slot_cpu_ms"] >= r["chief_cpu_ms"] > 0, r
  assert not [p for p in r["pids"] if _alive(p)], r["pids"]


def test_hosts_post_their_rows_once_and_pass_the_decision_on_in_files(
    tmp_path):
  """Nine logical workers on three logical hosts of three: each host's
  leader posts its host's rows and reads the decision; the members it
  acknowledged post nothing and read the decision from its file
  (protocol/host_arrivals.py, host_relay.py); the last process's exit,
  a whole host and one more, ends nothing but those clients."""
  out = tmp_path / "cp_tf.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "control_plane_tf.py"),
       "--clients=9", "--clients_per_process=4", "--workers_per_host=3",
       "--rounds=6", "--warmup=2", "--slot_s=2", "--death_round=4",
       f"--log={tmp_path / 'tasks.log'}", f"--result_json={out}"],
      capture_output=True, text=True, timeout=170, cwd=ROOT,
      env=conftest.bare_env())
  assert proc.returncode == 0, proc.stderr[-2000:]
  [r] = json.loads(out.read_text())["results"]
  assert r["workers"] == 9 and r["dropped"] == 4, r
  # 8 light clients, 6 of them before the death and 3 after it not their
  # host's leader: without the files all 8 (then 4) post and read.
  assert r["client_posts"] < 4 and r["client_file_reads"] >= 1, r
  assert r["kv_ops_max"] < 2 * 8 + 8, r
  assert not [p for p in r["pids"] if _alive(p)], r["pids"]
