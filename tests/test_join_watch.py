"""The start watcher (oscars_tf/runtime/join_watch.py): a task waiting for a
cluster that never assembles is told which tasks are missing and ended."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from oscars_tf.runtime import join_watch


def _refusing_address():
  """host:port of a bound socket that is not listening: connections to it
  are refused at once."""
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  return s, f"127.0.0.1:{s.getsockname()[1]}"


def test_absent_tasks_are_those_not_listening():
  listening = socket.create_server(("127.0.0.1", 0))
  held, refusing = _refusing_address()
  with listening, held:
    up = f"127.0.0.1:{listening.getsockname()[1]}"
    tasks = [("worker", 1, up), ("worker", 2, refusing),
             ("chief", 0, "no-such-host.invalid:1"), ("worker", 3, "x:y")]
    assert join_watch.absent_tasks(tasks, 0.5) == tasks[1:]


def test_a_started_task_ends_the_watch_and_is_left_alone():
  victim = subprocess.Popen([sys.executable, "-c",
                             "import time; time.sleep(60)"])
  read, write = os.pipe()
  try:
    os.close(write)  # the task started: EOF
    with os.fdopen(read) as started:
      assert join_watch.watch(victim.pid, "worker:0", [], 30.0, started) == 0
    assert victim.poll() is None
  finally:
    victim.kill()
    victim.wait()


def test_past_the_timeout_the_task_is_killed_and_the_absent_named(capfd):
  victim = subprocess.Popen([sys.executable, "-c",
                             "import time; time.sleep(60)"])
  held, refusing = _refusing_address()
  read, write = os.pipe()
  try:
    with held, os.fdopen(read) as started:
      code = join_watch.watch(victim.pid, "worker:0",
                              [("worker", 1, refusing)], 0.6, started,
                              report_s=0.2)
    assert code == 1
    assert victim.wait(timeout=10) == -9
  finally:
    os.close(write)
    if victim.poll() is None:
      victim.kill()
  err = capfd.readouterr().err
  assert "WARNING: oscars_tf: worker:0 has waited" in err
  assert (f"ERROR: oscars_tf: worker:0 stops: the cluster's tasks did not all "
          f"start within 1 s (not listening: worker:1 at {refusing})") in err


def _catches_sigterm(pid):
  """Whether process `pid` has a handler for SIGTERM (/proc's SigCgt)."""
  with open(f"/proc/{pid}/status") as f:
    caught = next(int(line.split()[1], 16) for line in f
                  if line.startswith("SigCgt:"))
  return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_sigterm_to_the_waiting_task_s_group_stops_the_task():
  """TensorFlow's handler keeps SIGTERM from a task while it waits for the
  cluster, so a stop (the launcher's, to the task's process group) waited
  for its grace period and SIGKILL. The watcher, in that group, gets it
  too and ends the task at once."""
  victim = subprocess.Popen([sys.executable, "-c",
                             "import time; time.sleep(60)"])
  spec = {"pid": victim.pid, "own": "worker:1", "timeout_s": 60.0,
          "tasks": []}
  watcher = subprocess.Popen(
      [sys.executable, "-S", join_watch.__file__, json.dumps(spec)],
      stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 30
    while not _catches_sigterm(watcher.pid):
      assert time.monotonic() < deadline, "the watcher never caught SIGTERM"
      time.sleep(0.01)
    watcher.send_signal(signal.SIGTERM)
    assert watcher.wait(timeout=10) == 1
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert "worker:1 got SIGTERM while it waited" in watcher.stderr.read()
  finally:
    for p in (watcher, victim):
      if p.poll() is None:
        p.kill()
        p.wait()
