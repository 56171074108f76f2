"""The fork server the multi-process tests start their workers from
(forkserver.py is its client; see there why).

    python forkserver_main.py FD

FD is one end of a SOCK_SEQPACKET socket pair. The server imports
TensorFlow once, checks that it is still one thread (a fork copies only the
calling thread: a lock another thread held would stay locked in the child),
says {"ready": ...}, then for each request {"argv", "env", "cwd"} with two
file descriptors (the child's stdout and stderr) forks a child that runs
`argv` as `python SCRIPT ARGS...` would, and replies {"pid": ...}. It reports
{"exit": pid, "code": returncode} when a child ends (a negative code: the
signal that killed it, as subprocess does). It stops, killing the children
left, when the socket closes.
"""

import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

_PR_SET_PDEATHSIG = 1


def _die_with(parent):
  import ctypes  # pylint: disable=g-import-not-at-top
  ctypes.CDLL(None, use_errno=True).prctl(
      _PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
  if os.getppid() != parent:
    os._exit(1)


def _stream(fd, unbuffered):
  raw = io.FileIO(fd, "w", closefd=False)
  return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                          encoding="utf-8", errors="backslashreplace",
                          line_buffering=not unbuffered,
                          write_through=unbuffered)


def _child(request, fds, server):
  """In the forked child: becomes `python SCRIPT ARGS...`; never returns."""
  code, interrupted = 1, False
  try:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    os.setsid()  # its own process group, as the tests' jobs start workers
    _die_with(server)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
      os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout, sys.stderr = _stream(1, unbuffered), _stream(2, True)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    script = request["argv"][1]
    sys.argv = list(request["argv"][1:])
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as python does
    if "numpy" in sys.modules:  # a fresh process would seed it afresh
      sys.modules["numpy"].random.seed()
    try:
      runpy.run_path(script, run_name="__main__")
      code = 0
    except SystemExit as e:
      if e.code is None or isinstance(e.code, int):
        code = e.code or 0
      else:
        print(e.code, file=sys.stderr)
    except BaseException as e:  # pylint: disable=broad-except
      # As the interpreter does: the script's own hook may record it (the
      # strategy's exit handlers act on an uncaught error).
      sys.excepthook(*sys.exc_info())
      interrupted = isinstance(e, KeyboardInterrupt)
    threading._shutdown()  # pylint: disable=protected-access
    import atexit  # pylint: disable=g-import-not-at-top
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    if interrupted:  # python ends itself with SIGINT then
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF if isinstance(code, int) else 1)


def _reap(sock, children):
  while children:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    children.discard(pid)
    sock.send(json.dumps({"exit": pid,
                          "code": os.waitstatus_to_exitcode(status)}).encode())


def main():
  sock = socket.socket(fileno=int(sys.argv[1]))
  _die_with(int(os.environ["OSCARS_FORKSERVER_PARENT"]))
  import tensorflow  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  threads = len(os.listdir("/proc/self/task"))
  sock.send(json.dumps({"ready": threads == 1, "threads": threads}).encode())
  if threads != 1:
    return
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  children = set()
  server = os.getpid()
  try:
    while True:
      ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
      if wake_r in ready:
        os.read(wake_r, 512)
      _reap(sock, children)
      if sock not in ready:
        continue
      message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
      if not message:
        return
      pid = os.fork()
      if pid == 0:
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        _child(json.loads(message), fds, server)
      for fd in fds:
        os.close(fd)
      children.add(pid)
      sock.send(json.dumps({"pid": pid}).encode())
  finally:
    for pid in children:
      try:
        os.killpg(pid, signal.SIGKILL)
      except OSError:
        pass


if __name__ == "__main__":
  main()
  os._exit(0)  # TensorFlow's teardown at exit costs a second of CPU
