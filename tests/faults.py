"""Helpers of the fault-injection tests: launch examples/train.py jobs and
find their worker processes. Every wait is bounded."""

import atexit
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

import forked_launch
import multiworker
from oscars_tf.tools import worker_netns

TRAIN = str(pathlib.Path(__file__).resolve().parent.parent / "examples" /
            "train.py")
# The fault tests' launcher (forked_launch.py) and where it records the
# workers it forked (one directory per test process).
FORKED_LAUNCH = str(pathlib.Path(__file__).with_name("forked_launch.py"))
FORKED_DIR = tempfile.mkdtemp(prefix="oscars_forked_")
atexit.register(shutil.rmtree, FORKED_DIR, ignore_errors=True)


def _train_processes():
  """[(pid, argv, env)] of the live train.py processes: those started as
  plain processes, from /proc, and those forked (forked_launch.py)."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
      if TRAIN not in argv:
        continue
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split("=", 1) for kv in
                   f.read().decode(errors="replace").split("\0") if "=" in kv)
    except OSError:
      continue
    found.append((int(pid), argv, env))
  return found + [p for p in forked_launch.forked(FORKED_DIR)
                  if TRAIN in p[1]]


def workers_of(marker):
  """{task index: pid} of the live train.py processes whose argv has marker."""
  return {json.loads(env["TF_CONFIG"])["task"]["index"]: pid
          for pid, argv, env in _train_processes()
          if any(marker in a for a in argv) and "TF_CONFIG" in env}


def restarted(marker):
  """Whether a train.py process whose argv has marker belongs to a
  restarted attempt of its job (OSCARS_LAUNCH_ATTEMPT above 0)."""
  return any(any(marker in a for a in argv) and
             env.get("OSCARS_LAUNCH_ATTEMPT", "0") != "0"
             for _, argv, env in _train_processes())


def appears(path, timeout, launcher):
  """Whether `path` exists within `timeout` s (False at once when the
  launcher has exited)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and launcher.poll() is None:
    if path.exists():
      return True
    time.sleep(0.05)
  return path.exists()


def wait_for(predicate, timeout, what, launcher=None):
  """Polls `predicate` until true; fails at `timeout`, or at once when the
  `launcher` (a Popen) has exited without it, with the job's output."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return
    if launcher is not None and launcher.poll() is not None:
      out, err = launcher.communicate()
      raise AssertionError(
          f"the job exited ({launcher.returncode}) before {what}:\n"
          f"{out[-2000:]}\n{err[-3000:]}")
    time.sleep(0.05)
  raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def launch(num_workers, train_args, launcher_args=(), prefix=None, env=None):
  """Starts `oscars-launch ... -- python train.py ...`; returns the Popen.
  `env`: variables added to the job's environment."""
  command = [sys.executable, FORKED_LAUNCH,
             f"--num_workers={num_workers}", "--grace_seconds=2",
             *launcher_args, "--", sys.executable, TRAIN, *train_args]
  return subprocess.Popen(command, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=multiworker.worker_env(
                              dict(env or {}, **{
                                  forked_launch.FORKED_DIR: FORKED_DIR})),
                          start_new_session=True, cwd=prefix)


def finish(launcher, timeout):
  """(stdout, stderr) of a launched job; kills it all past `timeout`."""
  try:
    return launcher.communicate(timeout=timeout)
  finally:
    kill(launcher)


def kill(launcher):
  """Kills the launcher's whole process group (its workers too)."""
  if launcher.poll() is None:
    os.killpg(launcher.pid, 9)
    launcher.wait()


def epoch_of(checkpoint_dir):
  """The epoch of the chief's latest checkpoint (0 before the first)."""
  return checkpoint_of(checkpoint_dir).get("epoch", 0)


def checkpoint_of(checkpoint_dir):
  """The chief's latest checkpoint's state (last.json), or {}."""
  path = pathlib.Path(checkpoint_dir) / "last.json"
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return {}


def settled_accuracy(result, last=3):
  """Mean test accuracy of the last `last` epochs of a train.py result.

  The digits test set has 360 images, and one epoch's accuracy moves by a
  point or more from the next: comparing single final epochs of two runs
  measures that noise. (Both numbers are reported.)
  """
  curve = result["curve"][-last:]
  return sum(c["test_accuracy"] for c in curve) / len(curve)


def final_lines(out):
  """{worker: [test accuracy, loss]} from each train.py worker's last line
  (in the launcher's "[index] ..." output)."""
  lines = {}
  for line in out.splitlines():
    if "optimizer steps" in line and line.startswith("["):
      worker = int(line[1:line.index("]")])
      lines[worker] = line.split(": ", 1)[1].split(", ")[:2]
  return lines


@contextlib.contextmanager
def network_namespaces(n, subnet, prefix="oscars"):
  """`n` namespaces on a bridge (worker_netns.WorkerNamespaces), removed
  at the end; the test is skipped, saying why, where the machine refuses
  (no root, no iproute2)."""
  if os.geteuid() != 0:
    pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
  spaces = worker_netns.WorkerNamespaces(n, subnet, prefix=prefix)
  try:
    spaces.create()
  except (subprocess.CalledProcessError, OSError) as e:
    spaces.remove()
    pytest.skip(f"cannot create network namespaces here: "
                f"{getattr(e, 'stderr', e)}")
  try:
    yield spaces
  finally:
    spaces.remove()

