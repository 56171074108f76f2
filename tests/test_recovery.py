"""Recovery from a dead worker: oscars-launch --restarts and checkpoints.

A TF collective group cannot replace a member, so a worker killed with
SIGKILL is recovered by restarting the job: the launcher sees the death,
stops the others and starts all workers again, and examples/train.py resumes
from the chief's last averaged checkpoint. Real processes, real gRPC on
loopback, every wait bounded.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import multiworker

TRAIN = str(pathlib.Path(__file__).resolve().parent.parent / "examples" /
            "train.py")


def _workers_of(marker):
  """{task index: pid} of the live train.py processes whose argv has marker."""
  found = {}
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split("=", 1) for kv in
                   f.read().decode(errors="replace").split("\0") if "=" in kv)
    except OSError:
      continue
    if TRAIN in argv and any(marker in a for a in argv) and "TF_CONFIG" in env:
      found[json.loads(env["TF_CONFIG"])["task"]["index"]] = int(pid)
  return found


def _wait_for(predicate, timeout, what):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return
    time.sleep(0.05)
  raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_a_killed_worker_is_restarted_and_training_resumes(tmp_path):
  ckpt, result = tmp_path / "ckpt", tmp_path / "result.json"
  command = [sys.executable, "-m", "oscars_tf.launch", "--num_workers=2",
             "--restarts=1", "--grace_seconds=2", "--timeout=240", "--",
             sys.executable, TRAIN, "--epochs=6",
             "--simulate_step_time=20ms*1,1", f"--checkpoint_dir={ckpt}",
             f"--result_json={result}"]
  launcher = subprocess.Popen(command, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=multiworker.worker_env(),
                              start_new_session=True)
  try:
    _wait_for(lambda: (ckpt / "last.json").exists(), 120,
              "the first checkpoint")
    victim = _workers_of(str(ckpt)).get(1)
    assert victim, "worker 1 not found"
    killed_at_epoch = json.loads((ckpt / "last.json").read_text())["epoch"]
    os.kill(victim, signal.SIGKILL)
    out, err = launcher.communicate(timeout=240)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait()
  assert launcher.returncode == 0, (out[-3000:], err[-3000:])
  assert "worker 1 was killed by SIGKILL" in err
  assert "restart 1 of 1" in err
  final = json.loads(result.read_text())
  # The second attempt resumed at (or after) the checkpoint seen at the kill.
  assert final["initial_epoch"] >= killed_at_epoch >= 1
  assert [c["epoch"] for c in final["curve"]][-1] == 6
  assert final["test_accuracy"] >= 0.93, final
