"""Tests for oscars-launch (the launcher imports no TensorFlow)."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from oscars_tf import errors
from oscars_tf.cli import launch
from oscars_tf.tools import netns
from oscars_tf.tools import worker_processes

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]
WORKER = ("import json, os, sys, time; "
          "c = json.loads(os.environ['TF_CONFIG']); i = c['task']['index']; ")


def _launch(args, code, timeout=60, env=None):
  return subprocess.run(LAUNCH + args + ["--", sys.executable, "-c",
                                         WORKER + code],
                        capture_output=True, text=True, timeout=timeout,
                        env=env, check=False)


def test_tf_configs_are_distinct_loopback_workers():
  configs = [json.loads(c) for c in launch.tf_configs(3)]
  addresses = configs[0]["cluster"]["worker"]
  assert len(set(addresses)) == 3
  assert all(a.startswith("127.0.0.1:") for a in addresses)
  assert [c["task"]["index"] for c in configs] == [0, 1, 2]
  assert all(c["cluster"] == configs[0]["cluster"] for c in configs)


def test_output_is_prefixed_with_the_worker_index():
  proc = _launch(["--num_workers", "2"],
                 "print('hello', i, c['cluster']['worker'][i])")
  assert proc.returncode == 0, proc.stderr
  for i in range(2):
    assert re.search(rf"^\[{i}\] hello {i} 127\.0\.0\.1:\d+$", proc.stdout,
                     re.MULTILINE), proc.stdout
  assert re.search(r"all 2 workers finished \(their exits \d+\.\d\d s "
                   r"apart\)\.", proc.stderr), proc.stderr


def test_a_failing_worker_ends_the_job_within_seconds():
  start = time.monotonic()
  proc = _launch(["--num_workers", "3", "--grace_seconds", "2"],
                 "sys.exit(3) if i == 1 else time.sleep(120)")
  elapsed = time.monotonic() - start
  assert proc.returncode == 1
  assert "worker 1 exited with code 3" in proc.stderr
  assert elapsed < 20, elapsed


def test_timeout_stops_the_job():
  proc = _launch(["--num_workers", "2", "--timeout", "2",
                  "--grace_seconds", "1"], "time.sleep(120)")
  assert proc.returncode == 124 and "--timeout" in proc.stderr


def test_missing_command_is_a_usage_error():
  proc = subprocess.run(LAUNCH + ["--num_workers", "2"], capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode != 0 and "give the worker command" in proc.stderr


def test_bad_worker_count_names_the_flag():
  proc = subprocess.run(LAUNCH + ["--num_workers", "0", "--", "true"],
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode != 0 and "num_workers" in proc.stderr


def test_a_command_that_cannot_start_is_one_clear_line(tmp_path):
  not_executable = tmp_path / "train.py"
  not_executable.write_text("print('hi')\n")
  for command, reason in (("no-such-command-oscars", "No such file"),
                          (str(not_executable), "Permission denied")):
    proc = subprocess.run(LAUNCH + ["--num_workers", "2", "--", command],
                          capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"oscars-launch: error: cannot start worker 0's command "
        f"{command!r}: {reason}" + ("" if reason == "Permission denied" else
                                    " or directory") + "."), proc.stderr


def test_a_job_whose_last_task_cannot_start_stops_the_ones_started():
  # The workers start first; the coordinator's command is missing.
  marker = f"oscars-start-test-{os.getpid()}"
  with pytest.raises(errors.WorkerStartError,
                     match="cannot start coordinator's command"):
    worker_processes.Job(
        [sys.executable, "-c", f"import time; time.sleep(120)  # {marker}"],
        2, coordinator_command=["no-such-command-oscars"])
  left = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          left.append(pid)
    except OSError:
      continue
  assert not left, left


# keep_going: the worker is lost and the job succeeds; --nokeep_going: it
# is killed too (no wait for ever) and, as any death there, fails the job.
@pytest.mark.parametrize("keep_going, failed_as, lost", [(True, None, [1]),
                                                         (False, 1, [])])
def test_a_worker_left_behind_by_the_finished_chief_is_killed(
    capsys, keep_going, failed_as, lost):
  # Issue 43: a dropped worker stopped for good (SIGSTOP, a hang) kept the
  # launcher waiting after the others had finished: without --timeout,
  # forever.
  job = worker_processes.Job(
      [sys.executable, "-c", WORKER + "import signal\n"
       "if i == 1:\n  os.kill(os.getpid(), signal.SIGSTOP)\n"], 2)
  start = time.monotonic()
  codes, failed = job.wait(timeout=60, grace=1, keep_going=keep_going,
                           after_chief=1.0)
  assert failed == failed_as and codes == [0, -signal.SIGKILL], codes
  assert list(job.lost) == lost
  assert time.monotonic() - start < 30
  assert ("worker 1 still ran 1 s after the chief finished (stalled, or "
          "dropped and never back); killed it.") in capsys.readouterr().err


def test_simulated_step_time_reaches_the_workers_and_is_labelled():
  proc = _launch(["--num_workers", "2", "--simulate_step_time",
                  "20ms*1,3"],
                 "print('sim', os.environ['OSCARS_SIMULATE_STEP_TIME'])")
  assert proc.returncode == 0, proc.stderr
  assert "[1] sim 20ms*1,3" in proc.stdout
  assert "SIMULATED heterogeneity" in proc.stderr
  assert "worker 1 sleeps 60.0 ms per step" in proc.stderr


@pytest.mark.parametrize("spec, says", [
    ("fast", "not a time"),
    # Written for another job: more multipliers, or a change of a worker
    # the job does not have.
    ("20ms*1,2,3", "3 multipliers for 2 workers"),
    ("20ms;2:4x@60s", "worker 2 changes"),
])
def test_bad_simulated_step_time_is_a_usage_error(spec, says):
  proc = _launch(["--num_workers", "2", "--simulate_step_time", spec],
                 "print('started')")
  assert proc.returncode != 0 and "--simulate_step_time" in proc.stderr
  assert says in proc.stderr and "Traceback" not in proc.stderr
  assert "started" not in proc.stdout


def test_restarts_start_every_worker_again_after_the_chief_dies():
  # Attempt 0: the chief kills itself with SIGKILL while worker 1 is busy;
  # attempt 1: both finish.
  code = ("a = os.environ['OSCARS_LAUNCH_ATTEMPT']; print('attempt', a); "
          "os.kill(os.getpid(), 9) if (a, i) == ('0', 0) else "
          "time.sleep(120 if a == '0' else 0)")
  start = time.monotonic()
  proc = _launch(["--num_workers", "2", "--restarts", "2",
                  "--grace_seconds", "1"], code)
  assert proc.returncode == 0, proc.stderr
  assert time.monotonic() - start < 30
  assert "worker 0 was killed by SIGKILL" in proc.stderr
  assert "restart 1 of 2" in proc.stderr
  assert "restart 2 of 2" not in proc.stderr
  assert proc.stdout.count("attempt 1") == 2


def test_a_killed_worker_is_lost_and_the_others_go_on():
  # Worker 1 dies by a signal; the chief finishes: the job succeeds, and the
  # launcher says which worker it lost. No restart.
  code = ("os.kill(os.getpid(), 9) if i == 1 else time.sleep(1); "
          "print('chief done')")
  proc = _launch(["--num_workers", "2", "--restarts", "2",
                  "--grace_seconds", "1"], code)
  assert proc.returncode == 0, proc.stderr
  assert "worker 1 was killed by SIGKILL; the others go on" in proc.stderr
  assert "finished without worker(s) [1]" in proc.stderr
  assert "restart" not in proc.stderr
  assert "chief done" in proc.stdout


def test_nokeep_going_makes_any_death_end_the_job():
  code = "os.kill(os.getpid(), 9) if i == 1 else time.sleep(60)"
  start = time.monotonic()
  proc = _launch(["--num_workers", "2", "--nokeep_going",
                  "--grace_seconds", "1"], code)
  assert proc.returncode == 1
  assert time.monotonic() - start < 30
  assert "worker 1 was killed by SIGKILL; stopped the other" in proc.stderr


def test_restarts_are_bounded():
  proc = _launch(["--num_workers", "2", "--restarts", "1",
                  "--grace_seconds", "1"], "sys.exit(5 if i == 0 else 0)")
  assert proc.returncode == 1
  assert proc.stderr.count("restarting all 2 workers") == 1
  assert "worker 0 exited with code 5; stopped the other" in proc.stderr


# Attempt 0 of a lost peer: worker 1 dies by SIGKILL; worker 0 waits until
# it is gone (its /proc entry a zombie or reaped), then ends on an uncaught
# WorkerLostError as a survivor of the collective does (exit code 75, set
# by the hook the strategy installs). Later attempts finish, unless ALWAYS.
_LOSE_A_PEER = (
    "from oscars_tf import errors; from oscars_tf.distribute import epochs; "
    "epochs.note_uncaught_errors(); "
    "a = os.environ['OSCARS_LAUNCH_ATTEMPT']; print('attempt', a); "
    "d = os.environ['DIR']; lose = a == '0' or 'ALWAYS' in os.environ\n"
    "v, s = int(os.environ.get('VICTIM', 1)), int(os.environ.get('MATE', 0))\n"
    "def gone(pid):\n"
    "  try:\n"
    "    return open(f'/proc/{pid}/stat').read().split(')')[-1].split()[0]"
    " in 'ZX'\n"
    "  except OSError:\n"
    "    return True\n"
    "if lose and i == v:\n"
    "  open(f'{d}/w1-{a}', 'w').write(str(os.getpid())); "
    "os.kill(os.getpid(), 9)\n"
    "if lose and i not in (v, s):\n"
    "  time.sleep(30)  # outside the failed collective: trains on\n"
    "if lose and i == s:\n"
    "  end = time.monotonic() + 20\n"
    "  while time.monotonic() < end and not (os.path.exists(f'{d}/w1-{a}') "
    "and open(f'{d}/w1-{a}').read() and gone(open(f'{d}/w1-{a}').read())):\n"
    "    time.sleep(0.02)\n"
    "  e = errors.WorkerLostError(f'worker {i}: a peer is gone')\n"
    "  e.peers = [s, v]  # the failed collective's members (exit_notes)\n"
    "  raise e\n")


def _lose_a_peer(tmp_path, args, always=False, workers=2, victim=1, mate=0):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(
      [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
             VICTIM=str(victim), MATE=str(mate))
  if always:
    env["ALWAYS"] = "1"
  return _launch(["--num_workers", str(workers), "--grace_seconds", "1"] +
                 args, _LOSE_A_PEER, env=env)


def test_a_peer_lost_in_a_collective_restarts_the_job_by_itself(tmp_path):
  proc = _lose_a_peer(tmp_path, [])
  assert proc.returncode == 0, proc.stderr
  assert "worker 1 was killed by SIGKILL" in proc.stderr
  assert "WorkerLostError: worker 0: a peer is gone" in proc.stderr
  assert "lost-peer restart 1 of 3" in proc.stderr
  assert "lost-peer restart 2" not in proc.stderr
  assert proc.stdout.count("attempt 1") == 2


def test_a_peer_lost_in_a_group_collective_without_the_chief_restarts_too(
    tmp_path):
  # Worker 2 dies inside a speed group's collective with worker 1; the
  # chief, in another group, trains on. Worker 1's 75 ends the job, and all
  # three restart from the newest state (worker 1's round state).
  proc = _lose_a_peer(tmp_path, [], workers=3, victim=2, mate=1)
  assert proc.returncode == 0, proc.stderr
  assert "worker 2 was killed by SIGKILL" in proc.stderr
  assert "WorkerLostError: worker 1: a peer is gone" in proc.stderr
  assert "lost-peer restart 1 of 3" in proc.stderr
  assert proc.stdout.count("attempt 1") == 3


def test_lost_peer_restarts_are_bounded_and_other_failures_are_not_restarted(
    tmp_path):
  proc = _lose_a_peer(tmp_path, ["--lost_peer_restarts", "1"], always=True)
  assert proc.returncode == 1
  assert proc.stderr.count("restarting all 2 workers") == 1
  assert ("worker 0 exited with code 75 (it lost a peer, or the job); "
          "stopped the other" in proc.stderr)
  # Code 75 without a death is no lost peer; --restarts=0 is kept.
  proc = _launch(["--num_workers", "2", "--grace_seconds", "1"],
                 "sys.exit(75)")
  assert proc.returncode == 1 and "restarting" not in proc.stderr
  # With --nokeep_going a death ends the job (only --restarts restarts).
  (tmp_path / "nokeep").mkdir()
  proc = _lose_a_peer(tmp_path / "nokeep", ["--nokeep_going"])
  assert proc.returncode == 1 and "restarting" not in proc.stderr


# Worker 2 is killed and dropped cleanly; later worker 1 loses the job on
# its own (a WorkerLostError outside any collective: exit 75, its note
# names no peer). The chief trains on and finishes.
_LOSE_ALONE_AFTER_A_DEATH = (
    "from oscars_tf import errors; from oscars_tf.distribute import epochs; "
    "epochs.note_uncaught_errors(); d = os.environ['DIR']\n"
    "def wait_for(name):\n"
    "  end = time.monotonic() + 20\n"
    "  while time.monotonic() < end and not os.path.exists(f'{d}/{name}'):\n"
    "    time.sleep(0.02)\n"
    "if i == 2:\n"
    "  os.kill(os.getpid(), 9)\n"
    "if i == 1:\n"
    "  wait_for('dropped-2')\n"
    "  raise errors.WorkerLostError('worker 1: cut off from the job')\n"
    "wait_for('lost-1')\n"
    "print('chief finished', flush=True)\n")


# Worker 1's process is a wrapper whose own child dies by SIGKILL, and
# which takes 1.5 s to die the same way: the survivor (worker 0) has exited
# 75 by the time the launcher can see the death.
_DEATH_SEEN_LATE = (
    "import signal, subprocess\n"
    "from oscars_tf import exit_notes\n"
    "d = os.environ['DIR']\n"
    "if i == 1:\n"
    "  subprocess.run([sys.executable, '-c', 'import os; open(os.environ['\n"
    "    + '\"DIR\"] + \"/victim\", \"w\").write(str(os.getpid())); '\n"
    "    + 'os.kill(os.getpid(), 9)'])\n"
    "  time.sleep(1.5)\n"
    "  os.kill(os.getpid(), signal.SIGKILL)\n"
    "end = time.monotonic() + 20\n"
    "while not os.path.exists(f'{d}/victim') and time.monotonic() < end:\n"
    "  time.sleep(0.02)\n"
    "pid = int(open(f'{d}/victim').read())\n"
    "while os.path.exists(f'/proc/{pid}') and time.monotonic() < end:\n"
    "  time.sleep(0.02)\n"
    "exit_notes.write([0, 1])\n"
    "sys.exit(75)\n")


def test_a_survivors_exit_75_seen_before_its_peers_death_is_a_lost_peer(
    tmp_path, capsys):
  # The launcher used to end the job on the chief's 75 at once, as a 75 of
  # no death's, when the death came through a wrapper or a loaded machine a
  # poll later; CI saw it (the job was stopped, not restarted).
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  job = worker_processes.Job(
      [sys.executable, "-c", WORKER + _DEATH_SEEN_LATE], 2,
      env=dict(os.environ, DIR=str(tmp_path), PYTHONPATH=root))
  codes, failed = job.wait(timeout=60, grace=1, keep_going=True)
  assert codes == [errors.PEER_LOST_EXIT_CODE, -signal.SIGKILL], (
      codes, capsys.readouterr())
  assert failed == 0 and job.lost_a_peer(failed), (failed, job.exited)


def test_a_lone_exit_75_after_a_cleanly_dropped_death_is_a_lone_loss(
    tmp_path):
  # Issue 43: one earlier death made every later 75 look like its
  # collective's survivor: the job was ended (here: restarted) and the
  # healthy chief got SIGTERM, saving nothing.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(
      [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  proc = subprocess.Popen(
      LAUNCH + ["--num_workers=3", "--grace_seconds=1", "--", sys.executable,
                "-c", WORKER + _LOSE_ALONE_AFTER_A_DEATH],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  lines = []
  try:
    # The launcher's lines tell the test (and the chief) what happened.
    for line in proc.stderr:
      lines.append(line)
      if "worker 2 was killed by SIGKILL; the others go on" in line:
        (tmp_path / "dropped-2").write_text("")
      if "worker 1 exited with code 75" in line:
        (tmp_path / "lost-1").write_text("")
    out = proc.stdout.read()
    proc.wait(timeout=60)
  finally:
    proc.kill()
  err = "".join(lines)
  assert proc.returncode == 0, err
  assert "worker 1 exited with code 75 (it lost a peer, or the job); the " \
         "others go on" in err
  assert "restart" not in err and "stopped the other" not in err, err
  assert "chief finished" in out
  assert "the job finished without worker(s) [1, 2]" in err


# A worker that listens like TensorFlow's gRPC server does (0.0.0.0:port),
# says where, and waits for the test to try it from outside the job.
_LISTENER = ("import socket; s = socket.socket(); "
             "s.bind(('0.0.0.0', 0)); s.listen(); "
             "print('port', s.getsockname()[1], 'ifaces', "
             "sorted(n for _, n in socket.if_nameindex()), flush=True); "
             "time.sleep(6)")


def _reachable_from_outside(args):
  proc = subprocess.Popen(LAUNCH + args + ["--num_workers=1", "--",
                                           sys.executable, "-c",
                                           WORKER + _LISTENER],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)
  try:
    line = proc.stdout.readline()
    port = int(re.search(r"port (\d+)", line).group(1))
    ifaces = re.search(r"ifaces (\[.*\])", line).group(1)
    import socket  # pylint: disable=g-import-not-at-top
    try:
      socket.create_connection(("127.0.0.1", port), timeout=2).close()
      reached = True
    except OSError:
      reached = False
    return reached, ifaces
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


_SLEEPER = """
import os, sys, time
with open(os.path.join(sys.argv[1], f"sleeper-{os.getpid()}"), "w") as f:
  f.write(os.environ["OSCARS_EXIT_NOTES"])  # the job's scratch directory
time.sleep(120)
"""


def _running(pid):
  """Whether `pid` runs (a zombie, left for whoever reaps it, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _wait_for(condition, timeout):
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_nothing_a_worker_started_outlives_its_killed_launcher(tmp_path):
  """Issue 43, item 9: the parent-death signal ends each worker's own
  process (here `sh`) when the launcher is killed with SIGKILL, but not what
  it started (here `python`); the job's guard (tools/job_guard.py) kills
  the workers' process groups. Before it, both sleepers were alive 5 s
  after the kill. The guard also removes the job's scratch directory (the
  workers' exit notes), which the killed launcher could not: before, every
  such kill left one in the temporary directory."""
  sleeper = tmp_path / "sleeper.py"
  sleeper.write_text(_SLEEPER)
  launcher = subprocess.Popen(
      LAUNCH + ["--num_workers", "2", "--", "sh", "-c",
                f"{sys.executable} {sleeper} {tmp_path}; true"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  pids = []
  try:
    assert _wait_for(lambda: len(list(tmp_path.glob("sleeper-*"))) == 2,
                     60), "the sleepers did not start"
    pids = [int(p.name.split("-")[1]) for p in tmp_path.glob("sleeper-*")]
    (scratch,) = {p.read_text() for p in tmp_path.glob("sleeper-*")}
    assert os.path.isdir(scratch)
    launcher.kill()
    launcher.wait(10)
    assert _wait_for(lambda: not any(_running(p) for p in pids), 15), [
        p for p in pids if _running(p)]
    assert _wait_for(lambda: not os.path.exists(scratch), 15)
  finally:
    launcher.kill()
    for pid in pids:
      if _running(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("exit_code,launcher_code", [(0, 0), (3, 1)],
                         ids=["finished", "failed"])
def test_what_an_exited_worker_left_running_ends_with_the_job(
    tmp_path, exit_code, launcher_code):
  """A worker that exits (here `sh`, its code) while something it started
  still runs in its group (here a `python` sleeper it put in the
  background): the launcher stops that too when the job ends, whether the
  job finished or failed. Before, a reaped worker's group was never
  signalled: both sleepers outlived the launcher."""
  sleeper = tmp_path / "sleeper.py"
  sleeper.write_text(_SLEEPER)
  started = tmp_path / "started"
  pids = []
  launcher = subprocess.Popen(
      LAUNCH + ["--num_workers", "2", "--grace_seconds", "5", "--", "sh",
                "-c", f"{sys.executable} {sleeper} {tmp_path} & "
                f"while [ ! -e {started} ]; do sleep 0.05; done; "
                f"exit {exit_code}"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    assert _wait_for(lambda: len(list(tmp_path.glob("sleeper-*"))) == 2,
                     60), "the sleepers did not start"
    pids = [int(p.name.split("-")[1]) for p in tmp_path.glob("sleeper-*")]
    started.touch()  # the workers exit now, their sleepers running
    assert launcher.wait(60) == launcher_code
    assert not [p for p in pids if _running(p)]
  finally:
    launcher.kill()
    for pid in pids:
      if _running(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_job_that_ends_by_itself_dismisses_its_guard():
  """The guard exits when the job is done, killing nothing: a finished
  job leaves no guard behind."""
  job = worker_processes.Job([sys.executable, "-c", "pass"], 1,
                             out=io.StringIO())
  codes, failed = job.wait(timeout=60)
  assert (codes, failed) == ([0], None)
  guard = job._guard._proc  # pylint: disable=protected-access
  assert guard.poll() == 0
  assert not os.path.exists(job._notes)  # pylint: disable=protected-access


def test_the_job_listens_in_a_private_network_by_default():
  if netns.unshare_command() is None:
    pytest.skip("this machine allows no private network namespace "
                "(unshare with root or user namespaces)")
  reached, ifaces = _reachable_from_outside([])
  assert ifaces == "['lo']"
  assert not reached  # 0.0.0.0 inside the job is not this machine's
  # The same worker on the machine's network is reachable: the check can
  # fail.
  reached, ifaces = _reachable_from_outside(["--network=host"])
  assert reached and ifaces != "['lo']"


def test_isolated_network_without_support_is_a_usage_error(monkeypatch):
  # No `unshare` on PATH: auto warns and goes on, isolated refuses.
  monkeypatch.setenv("PATH", "/nonexistent")
  proc = subprocess.run(LAUNCH + ["--num_workers=1", "--network=isolated",
                                  "--", sys.executable, "-c", "print(1)"],
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode != 0
  assert "--network=isolated: this machine allows no private" in proc.stderr
  proc = subprocess.run(LAUNCH + ["--num_workers=1", "--", sys.executable,
                                  "-c", "print('ran')"],
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 0 and "ran" in proc.stdout
  assert "listen on all interfaces (0.0.0.0)" in proc.stderr


# Signals to the launcher. Each worker writes pid_<i> (pid, parent pid,
# network interfaces) and blocks; worker 1 ignores SIGTERM, SIGINT and
# SIGHUP, so only the SIGKILL after --grace_seconds stops it; the others
# write signal_<i> with the signal they got. Every worker also ends itself
# after 120 s, so a broken launcher leaves nothing behind for long.
_PID_WORKER = r"""
import json, os, signal, socket, sys, time
i = json.loads(os.environ['TF_CONFIG'])['task']['index']
def write(name, data):
  path = os.path.join(sys.argv[1], name)
  with open(path + '.tmp', 'w') as f:
    json.dump(data, f)
  os.replace(path + '.tmp', path)
def on_signal(signum, frame):
  write(f'signal_{i}', signum)
  os._exit(128 + signum)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
  signal.signal(s, signal.SIG_IGN if i == 1 else on_signal)
write(f'pid_{i}', {'pid': os.getpid(), 'ppid': os.getppid(),
                   'ifaces': sorted(n for _, n in socket.if_nameindex())})
end = time.monotonic() + 120
while time.monotonic() < end:
  time.sleep(0.2)
"""
_GRACE = 1.0


def _proc_stat(pid):
  """(state, start time) of a process, or None when there is none."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rpartition(")")[2].split()
  except (FileNotFoundError, ProcessLookupError):
    return None
  return fields[0], fields[19]


def _alive(pid, start):
  stat = _proc_stat(pid)
  return stat is not None and stat[0] != "Z" and stat[1] == start


def _wait_for_workers(outdir, n, launcher, timeout=30):
  """Each worker's pid file, once all n exist; with the start time."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    paths = [outdir / f"pid_{i}" for i in range(n)]
    if all(p.exists() for p in paths):
      workers = [json.loads(p.read_text()) for p in paths]
      for w in workers:
        w["start"] = _proc_stat(w["pid"])[1]
      return workers
    assert launcher.poll() is None, "the launcher exited before its workers"
    time.sleep(0.05)
  raise AssertionError(f"no {n} pid files after {timeout}s")


def _wait_until_dead(workers, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    alive = [w["pid"] for w in workers if _alive(w["pid"], w["start"])]
    if not alive:
      return []
    time.sleep(0.05)
  return alive


def _signals_as_in_a_terminal():
  """The forwarded signals at their defaults in the launcher: a suite run
  under `nohup` (or in the background) would pass SIGHUP (SIGINT) ignored
  down to it, and the launcher rightly keeps an ignored signal ignored."""
  for sig in (signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("network", ["host", "auto"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT,
                                 signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_every_worker(sig, network, tmp_path):
  if network == "auto" and netns.unshare_command() is None:
    pytest.skip("this machine allows no private network namespace "
                "(unshare with root or user namespaces)")
  with open(tmp_path / "stderr", "w") as err:
    launcher = subprocess.Popen(
        LAUNCH + [f"--network={network}", "--num_workers=3",
                  f"--grace_seconds={_GRACE}", "--", sys.executable, "-c",
                  _PID_WORKER, str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        preexec_fn=_signals_as_in_a_terminal)
  workers = []
  try:
    workers = _wait_for_workers(tmp_path, 3, launcher)
    # The workers' parent is the process we signal, also through `unshare`
    # (it execs in place): the parent-death signal hangs on it.
    assert [w["ppid"] for w in workers] == [launcher.pid] * 3
    if network == "auto":
      assert all(w["ifaces"] == ["lo"] for w in workers), workers
    sent = time.monotonic()
    launcher.send_signal(sig)
    code = launcher.wait(timeout=_GRACE + 20)
    assert _wait_until_dead(workers, timeout=_GRACE + 10) == []
    took = time.monotonic() - sent
    stderr = (tmp_path / "stderr").read_text()
    if sig == signal.SIGKILL:
      assert code == -signal.SIGKILL
      return
    assert code == 128 + sig, stderr
    # Forwarded as it came, to every worker; worker 1 ignored it and was
    # SIGKILLed after the grace period.
    for i in (0, 2):
      assert json.loads((tmp_path / f"signal_{i}").read_text()) == sig
    assert not (tmp_path / "signal_1").exists()
    assert (f"got {sig.name}; forwarded it to every worker and stopped them "
            "all; SIGKILL to worker(s) [1]") in stderr, stderr
    assert _GRACE <= took < _GRACE + 10, took
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()
    for w in workers:
      if _alive(w["pid"], w["start"]):
        os.kill(w["pid"], signal.SIGKILL)


@pytest.mark.parametrize("environ, args, expected", [
    ({}, [], "2 ERROR"),
    ({"TF_CPP_MIN_LOG_LEVEL": "0", "GRPC_VERBOSITY": "DEBUG"}, [],
     "0 DEBUG"),
    ({"TF_CPP_MIN_LOG_LEVEL": "0"}, ["--tf_log_level=3"], "3 ERROR"),
], ids=["default", "environment_wins", "flag_wins"])
def test_workers_start_with_tensorflow_logging_quiet(environ, args,
                                                     expected):
  env = {k: v for k, v in os.environ.items()
         if k not in launch.QUIET_ENV}
  env.update(environ)
  proc = _launch(["--num_workers=2", "--network=host"] + args,
                 "print('env', os.environ.get('TF_CPP_MIN_LOG_LEVEL'), "
                 "os.environ.get('GRPC_VERBOSITY'))", env=env)
  assert proc.returncode == 0, proc.stderr
  for i in range(2):
    assert f"[{i}] env {expected}" in proc.stdout, proc.stdout


def test_a_line_cut_off_by_a_killed_worker_is_ended():
  # A worker killed mid-print leaves a partial line: the launcher ends it,
  # so the next attempt's first line is not glued to it.
  out = io.StringIO()
  worker_processes._pump(io.BytesIO(b"first\nCGROUP"), "[1] ", out)  # pylint: disable=protected-access
  assert out.getvalue() == "[1] first\n[1] CGROUP\n"
