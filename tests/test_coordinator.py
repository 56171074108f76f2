"""The coordinator task (oscars_tf/cli/coordinator.py, oscars-launch
--coordinator): who may run it, when it stops, and how a job's processes
treat it. The real job with one is in test_faults.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from oscars_tf.cli import coordinator
from oscars_tf.tools import worker_processes

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]


def _gone_sequence(*answers):
  """is_gone answering `answers` in turn, then the last one for ever."""
  it = iter(answers)
  last = [answers[-1]]

  def is_gone(address):
    assert address == "h:1"
    last[0] = next(it, last[0])
    return last[0]
  return is_gone


def test_it_serves_until_the_chief_has_come_up_and_gone():
  stop = threading.Event()
  is_gone = _gone_sequence(True, True, False, False, True)
  assert coordinator.wait_for_chief("h:1", 60.0, 0.0, stop, is_gone)
  assert not stop.is_set()


def test_a_chief_that_never_comes_up_is_an_error_after_the_timeout():
  stop = threading.Event()
  assert not coordinator.wait_for_chief("h:1", 0.0, 0.0, stop,
                                        _gone_sequence(True))


def test_a_signal_stops_it_while_the_chief_runs():
  stop = threading.Event()
  stop.set()
  assert coordinator.wait_for_chief("h:1", 60.0, 0.0, stop,
                                    _gone_sequence(False))


def test_a_chief_whose_name_no_longer_resolves_is_gone():
  # (A refused connection: test_cluster.py.)
  assert coordinator.chief_gone("no-such-host.invalid:2222")
  with socket.create_server(("127.0.0.1", 0)) as listener:
    port = listener.getsockname()[1]
    assert not coordinator.chief_gone(f"localhost:{port}")


def test_a_worker_task_cannot_run_it():
  env = dict(os.environ, TF_CONFIG=json.dumps({
      "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
      "task": {"type": "worker", "index": 1}}))
  proc = subprocess.run([sys.executable, "-m", "oscars_tf.cli.coordinator"],
                        env=env, capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 1
  assert "this task is worker:1" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_the_strategy_refuses_a_coordinator_task():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import oscars_tf  # pylint: disable=g-import-not-at-top
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["localhost:1", "localhost:2"],
                           "coordinator": ["localhost:3"]}),
      task_type="coordinator", task_id=0, rpc_layer="grpc")
  with pytest.raises(oscars_tf.errors.ClusterConfigError,
                     match="python -m oscars_tf.cli.coordinator"):
    oscars_tf.OscarsStrategy(cluster_resolver=resolver)


SHOW_TASK = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
             "print(c['task']['type'], sorted(c['cluster']), flush=True); ")


def test_a_job_stops_its_coordinator_when_the_workers_are_done(tmp_path):
  # The workers end once the coordinator has printed (a file says so,
  # waited for 30 s at most); the coordinator runs until stopped.
  ready = tmp_path / "printed"
  wait = (f"import pathlib, time; t = time.monotonic() + 30\n"
          f"while not pathlib.Path({str(ready)!r}).exists() and "
          f"time.monotonic() < t: time.sleep(0.01)\n")
  out = _Lines()
  job = worker_processes.Job(
      [sys.executable, "-c", SHOW_TASK + "\n" + wait], 2, out=out,
      coordinator_command=[sys.executable, "-c", SHOW_TASK + (
          f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); "
          "time.sleep(120)")])
  codes, failed = job.wait(timeout=60, grace=2.0)
  assert failed is None, codes
  assert codes[:2] == [0, 0] and codes[2] == -signal.SIGTERM, codes
  assert job.name(2) == "coordinator"
  assert "[coordinator] coordinator ['coordinator', 'worker']" in out.lines
  assert "[1] worker ['coordinator', 'worker']" in out.lines


def test_a_coordinator_that_fails_ends_the_job():
  job = worker_processes.Job(
      [sys.executable, "-c", "import time; time.sleep(120)"], 2,
      out=_Lines(), coordinator_command=[sys.executable, "-c",
                                         "raise SystemExit(3)"])
  codes, failed = job.wait(timeout=60, grace=2.0)
  assert failed == 2 and codes[2] == 3, codes
  assert all(c is not None for c in codes)  # the workers were stopped


def test_the_coordinators_death_is_no_lost_peer_even_seen_with_the_75s(
    tmp_path):
  # Issue 43: the workers exit 75 once their coordination service is gone.
  # A launcher that saw that 75 and the coordinator's SIGKILL in one poll
  # (a loaded machine) took it for a peer lost in a collective and
  # restarted the job, which then finished: exit 0. Here the workers exit
  # once the coordinator is dead (a zombie, or reaped), and a long poll
  # sees both at once.
  pid_file = tmp_path / "coordinator"
  job = worker_processes.Job(
      [sys.executable, "-c", f"import os, sys, time\n"
       f"p = {str(pid_file)!r}; t = time.monotonic() + 30\n"
       "def dead():\n"
       "  try:\n"
       "    s = open(f'/proc/{open(p).read()}/stat').read()\n"
       "  except OSError:\n"
       "    return os.path.exists(p)\n"
       "  return s.rpartition(')')[2].split()[0] == 'Z'\n"
       "while not dead() and time.monotonic() < t: time.sleep(0.01)\n"
       "sys.exit(75)"], 2, out=_Lines(),
      coordinator_command=[sys.executable, "-c", "import os, time; "
                           f"time.sleep(1); p = {str(pid_file)!r}; "
                           "open(p + '.tmp', 'w').write(str(os.getpid())); "
                           "os.rename(p + '.tmp', p); "
                           "os.kill(os.getpid(), 9)"])
  codes, failed = job.wait(timeout=60, grace=2.0, poll=4.0, keep_going=True)
  assert failed == 2 and codes[2] == -signal.SIGKILL, (codes, failed)
  assert not job.lost_a_peer(failed)
  assert not job.lost_a_peer(0)  # nor had the chief's 75 been named


@pytest.mark.parametrize("flags, message", [
    (["--num_workers=2", "--num_ps=1"], "not with --num_ps"),
    (["--num_workers=2", "--network=emulated"], "not with --network=emul"),
    (["--num_workers=1"], "2 or more"),
])
def test_launcher_coordinator_flag_misuse_is_a_usage_error(flags, message):
  proc = subprocess.run(LAUNCH + ["--coordinator"] + flags + ["--", "true"],
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 1 and message in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr


class _Lines:
  """A text sink collecting whole lines (Job's pumps write line by line)."""

  def __init__(self):
    self.lines = []
    self._lock = threading.Lock()

  def write(self, text):
    with self._lock:
      self.lines.extend(text.splitlines())

  def flush(self):
    pass
