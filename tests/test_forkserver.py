"""The fork server the multi-process tests start workers from
(forkserver.py): a forked worker behaves as `python SCRIPT ARGS...` would,
ends as a process does, and what it cannot run as such is left to Popen."""

import json
import os
import signal
import sys

import pytest

import forkserver
import multiworker

_SCRIPT = """
import json, os, sys
import tensorflow as tf
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "mine": os.environ.get("OSCARS_FORK_TEST"),
    "gone": os.environ.get("OSCARS_FORK_TEST_SERVER_ONLY"),
    "own_group": os.getpgid(0) == os.getpid(), "pid": os.getpid(),
    "op": int(tf.constant(2) + 1), "stdin": sys.stdin.read()}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "raise":
  previous = sys.excepthook
  def hook(*exc_info):
    print("the script's hook saw", exc_info[0].__name__, file=sys.stderr)
    previous(*exc_info)
  sys.excepthook = hook
  raise RuntimeError("raised in the script")
if sys.argv[1] == "interrupt":
  raise KeyboardInterrupt
if sys.argv[1] == "sleep":
  import time
  time.sleep(300)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  env = multiworker.worker_env({"OSCARS_FORK_TEST_SERVER_ONLY": "1"})
  s = forkserver.ForkServer(env)
  assert s.alive, "the server did not start or is not one thread"
  script = tmp_path_factory.mktemp("scripts") / "child.py"
  script.write_text(_SCRIPT)
  yield s, str(script)
  s.close()


def _env(**extra):
  return multiworker.worker_env(extra)


def test_a_forked_child_is_the_script_run_as_a_fresh_process(server, tmp_path,
                                                             monkeypatch):
  s, script = server
  monkeypatch.chdir(tmp_path)
  p = s.spawn([sys.executable, script, "3", "x"], _env(OSCARS_FORK_TEST="y"))
  assert p is not None
  out, err = p.stdout.read().decode(), p.stderr.read().decode()
  assert p.wait(timeout=60) == 3, err
  seen = json.loads(out)
  assert seen["argv"] == [script, "3", "x"]
  assert seen["path0"] == os.path.dirname(os.path.realpath(script))
  assert seen["cwd"] == str(tmp_path)
  assert seen["mine"] == "y" and seen["gone"] is None  # the request's env
  assert seen["own_group"] and seen["pid"] == p.pid
  assert seen["op"] == 3 and seen["stdin"] == ""
  assert err.strip().endswith("to stderr")
  assert "to stderr" not in out


def test_an_uncaught_error_goes_to_sys_excepthook_and_exits_1(server):
  # As in a fresh interpreter: the strategy's hook records an uncaught
  # error, and its exit handlers then do not wait for the others.
  s, script = server
  p = s.spawn([sys.executable, script, "raise"], _env())
  err = p.stderr.read().decode()
  assert p.wait(timeout=60) == 1
  assert "the script's hook saw RuntimeError" in err
  assert "RuntimeError: raised in the script" in err


@pytest.mark.parametrize("arg, code", [("interrupt", -signal.SIGINT),
                                       ("256", 0), ("-1", 255)])
def test_exit_codes_are_the_interpreter_s(server, arg, code):
  s, script = server
  p = s.spawn([sys.executable, script, arg], _env())
  p.stdout.read()
  assert p.wait(timeout=60) == code


def test_a_killed_child_reports_the_signal_and_closing_kills_the_rest(
    tmp_path):
  s = forkserver.ForkServer(_env())
  assert s.alive
  script = str(tmp_path / "sleeper.py")
  try:
    with open(script, "w") as f:
      f.write("import sys, time\nprint('up', flush=True)\ntime.sleep(300)\n")
    a = s.spawn([sys.executable, script], _env())
    b = s.spawn([sys.executable, script], _env())
    assert a.stdout.readline() == b"up\n" == b.stdout.readline()
    os.killpg(a.pid, signal.SIGKILL)
    assert a.wait(timeout=30) == -signal.SIGKILL
    assert b.poll() is None
    s.close()
    assert b.wait(timeout=30) < 0
    # Killed with the server: its pipe ends.
    assert b.stdout.read() == b""
  finally:
    s.close()


def test_what_a_fresh_process_would_do_otherwise_is_left_to_popen(server):
  s, script = server
  assert s.spawn([sys.executable, "-c", "print(1)"], _env()) is None
  assert s.spawn(["/bin/echo", script], _env()) is None
  # Read when TensorFlow is imported: the server's own value would win.
  assert s.spawn([sys.executable, script, "0"],
                 _env(TF_CPP_MIN_LOG_LEVEL="0")) is None


def test_a_reused_pid_does_not_report_the_earlier_child_s_exit():
  # The kernel reuses pids (pid_max is 32768 here, and each TensorFlow
  # worker spends dozens on its threads): a child forked on the pid of one
  # that already ended must not read that one's exit code as its own. A
  # clean-clone CI run saw a still-running worker reported as exited.
  import socket  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  client = object.__new__(forkserver.ForkServer)
  mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
  client._sock, client._codes = mine, {}
  client._replies, client._lock = forkserver.queue.Queue(), threading.Lock()
  client.exited, client.alive = threading.Condition(), True
  client.env = {}
  threading.Thread(target=client._read, daemon=True).start()
  # What the server sends: the earlier child 4242 ended with 0, then the
  # new request is forked on the same pid.
  theirs.send(json.dumps({"exit": 4242, "code": 0}).encode())
  theirs.send(json.dumps({"pid": 4242}).encode())
  child = client.spawn([sys.executable, "script.py"], {})
  assert child.pid == 4242
  assert child.poll() is None
  theirs.send(json.dumps({"exit": 4242, "code": 3}).encode())
  assert child.wait(timeout=10) == 3
  for f in (child.stdout, child.stderr):
    f.close()
  mine.close()
  theirs.close()
