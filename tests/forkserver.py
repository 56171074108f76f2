"""Worker processes forked from a server that imported TensorFlow once.

Importing TensorFlow costs each worker process about 4.5 s of CPU on this
project's 2-core machine, a third or more of a short multi-process test;
the suite starts a few hundred such workers. `spawn` starts `python
SCRIPT ARGS...` as a child of one long-lived server (forkserver_main.py)
that has TensorFlow imported but not started (no op run, one thread), so
the child skips the import and starts TensorFlow's runtime itself, as a
fresh process would. Each child is a real process with its own pid,
process group, environment, stdout and stderr pipes; it runs the script
with `runpy`. Workers that launch.Job starts for the tests come from here
(multiworker.py); the launcher's own tests start it as users do.

Anything the server cannot do as a fresh process would (another
interpreter, flags before the script, an environment that differs in what
is read at import, a step to run before exec) gets None, and the caller
starts the process itself. So does everything when the server cannot
start, or is not one thread after the import.
"""

import atexit
import json
import os
import queue
import socket
import subprocess
import sys
import threading

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "forkserver_main.py")
# Read when TensorFlow, NumPy or Python start: a request must agree with
# the server on them (PYTHONUNBUFFERED is applied per child).
_IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "TF_CPP", "TF_ENABLE", "TF_XLA",
                         "XLA_", "OMP_", "MKL", "CUDA", "OPENBLAS",
                         "TF_USE_LEGACY_KERAS")
_UNCHECKED = frozenset({"PYTHONUNBUFFERED"})
_READY_TIMEOUT_S = 120


def _import_time_env(env):
  return {k: v for k, v in env.items()
          if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _UNCHECKED}


class ForkedProcess:
  """The subset of subprocess.Popen that launch.Job uses."""

  def __init__(self, server, pid, stdout, stderr):
    self._server = server
    self.pid = pid
    self.stdout, self.stderr = stdout, stderr
    self.returncode = None

  def poll(self):
    if self.returncode is None:
      self.returncode = self._server.exit_code(self.pid)
    return self.returncode

  def wait(self, timeout=None):
    with self._server.exited:
      if not self._server.exited.wait_for(lambda: self.poll() is not None,
                                          timeout):
        raise subprocess.TimeoutExpired(str(self.pid), timeout)
    return self.returncode


class ForkServer:
  """One server and the reader of its messages."""

  def __init__(self, env):
    self.env = dict(env)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self._sock = mine
    self._codes = {}
    self._replies = queue.Queue()
    self._lock = threading.Lock()
    self.exited = threading.Condition()  # notified when a child ends
    self.alive = False
    self._proc = subprocess.Popen(
        [sys.executable, SERVER, str(theirs.fileno())],
        env=dict(self.env, OPENBLAS_NUM_THREADS="1",
                 OSCARS_FORKSERVER_PARENT=str(os.getpid())),
        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
    theirs.close()
    mine.settimeout(_READY_TIMEOUT_S)
    try:
      ready = json.loads(mine.recv(1 << 16) or b"{}")
    except (OSError, ValueError):
      ready = {}
    mine.settimeout(None)
    if not ready.get("ready"):
      print(f"forkserver: not used ({ready or 'did not start'}); workers "
            "start as plain processes", file=sys.stderr)
      self.close()
      return
    self.alive = True
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    while True:
      try:
        message = self._sock.recv(1 << 16)
      except OSError:
        message = b""
      if not message:  # the server is gone: so are its children
        self.alive = False
        self._replies.put(None)
        with self.exited:
          self.exited.notify_all()
        return
      message = json.loads(message)
      if "exit" in message:
        with self.exited:
          self._codes[message["exit"]] = message["code"]
          self.exited.notify_all()
      else:
        self._replies.put(message)

  def exit_code(self, pid):
    if pid in self._codes:
      return self._codes[pid]
    return None if self.alive else -9

  def spawn(self, command, env):
    """A ForkedProcess running `command`, or None (see module docstring)."""
    if not (self.alive and len(command) >= 2 and
            command[0] == sys.executable and command[1].endswith(".py") and
            _import_time_env(env) == _import_time_env(self.env)):
      return None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    request = json.dumps({"argv": list(command), "env": dict(env),
                          "cwd": os.getcwd()}).encode()
    try:
      with self._lock:
        socket.send_fds(self._sock, [request], [out_w, err_w])
        reply = self._replies.get(timeout=60)
    finally:
      os.close(out_w)
      os.close(err_w)
    if not reply or "pid" not in reply:
      os.close(out_r)
      os.close(err_r)
      return None
    # The kernel reuses pids: an earlier child's exit on this pid was sent
    # (and read) before the reply, as it was reaped before the fork.
    with self.exited:
      self._codes.pop(reply["pid"], None)
    return ForkedProcess(self, reply["pid"], os.fdopen(out_r, "rb"),
                         os.fdopen(err_r, "rb"))

  def close(self):
    self.alive = False
    try:  # shutdown, not only close: it wakes the reader's recv
      self._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self._sock.close()
    try:
      self._proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()


_servers = {}


def spawner(env):
  """launch.Job's `spawn` for workers with environment `env`: a server per
  distinct import-time environment, started on first use; None where the
  tests should not fork (OSCARS_TEST_FORKSERVER=0)."""
  if os.environ.get("OSCARS_TEST_FORKSERVER", "1") == "0":
    return None
  key = json.dumps(_import_time_env(env), sort_keys=True)
  if key not in _servers:
    _servers[key] = ForkServer(env)
  server = _servers[key]
  return server.spawn if server.alive else None


@atexit.register
def _close_all():
  for server in _servers.values():
    server.close()
