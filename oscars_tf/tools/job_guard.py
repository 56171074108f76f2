"""A job's guard: nothing a job started outlives its launcher.

The kernel's parent-death signal (`die_with_parent`) ends
each worker's own process when the launcher dies, even by SIGKILL, but not
what that process started: the Python of a shell wrapper
(`oscars-launch -- sh run.sh`), a worker's own subprocesses. They live on
in the worker's process group, holding its CPU quota and ports.

The guard is a small process in a session of its own, started with the
job. The launcher tells it each task's process group over a pipe, and
`done` once the job is over. If the pipe closes first, the launcher is gone
however it ended, and the guard sends SIGKILL to every process group it was
told of, removes the job's scratch directories (it was told of those too),
then exits. A process that left its group (`setsid`) is beyond it.
Standard library only, run with `python -S`: it starts in tens of ms.

    python -S job_guard.py    # reads "+<pgid>" and "=<dir>" lines, then
                              # "done" or EOF
"""

import argparse
import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys

DONE = "done"


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache
def _prctl():
  """libc's prctl(2), or None where there is none (not Linux)."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None
  prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
  prctl.restype = ctypes.c_int
  return prctl


def die_with_parent():
  """A Popen preexec_fn: SIGKILL the child when its parent dies, or None.

  A launcher killed with SIGKILL runs no handler, so only the kernel can
  stop its workers: PR_SET_PDEATHSIG. The kernel sends it when the *thread*
  that started the child exits, so a Job must be started from a thread that
  outlives its workers (the launcher's main thread). Off Linux this returns
  None and only signal forwarding and process groups stop the workers.
  """
  prctl = _prctl()
  if prctl is None:
    return None
  parent = os.getpid()

  def preexec():
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # The parent died before prctl took hold.
      os.kill(os.getpid(), signal.SIGKILL)
  return preexec


class Guard:
  """The launcher's side: starts the guard, names the process groups."""

  def __init__(self):
    self._proc = subprocess.Popen(
        [sys.executable, "-S", os.path.abspath(__file__)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True)

  def watch(self, pgid):
    """Process group `pgid` is the job's: killed if the launcher dies."""
    self._send(f"+{int(pgid)}")

  def remove_after(self, path):
    """Directory `path` is the job's scratch: removed if the launcher dies
    (the launcher removes it itself when the job is done)."""
    self._send(f"={path}")

  def done(self):
    """The job is over: the guard exits, killing nothing."""
    if self._proc.stdin.closed:
      return
    self._send(DONE)
    try:
      self._proc.stdin.close()
    except OSError:
      pass
    try:
      self._proc.wait(5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()

  def _send(self, line):
    try:
      self._proc.stdin.write(line + "\n")
      self._proc.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
      pass  # the guard is gone: nothing left to tell it


def main(argv=None):
  argparse.ArgumentParser(
      prog="python -m oscars_tf.tools.job_guard",
      description="A launched job's guard (started by oscars-launch): "
      "reads '+<process group>' and '=<directory>' lines, then 'done'; if "
      "stdin closes first, kills the groups, removes the directories."
  ).parse_args(argv)
  groups, scratch = [], []
  for line in sys.stdin:
    line = line.strip()
    if line == DONE:
      return 0
    if line.startswith("+"):
      groups.append(int(line[1:]))
    elif line.startswith("="):
      scratch.append(line[1:])
  for pgid in groups:  # EOF first: the launcher died
    try:
      os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass  # already gone
  for path in scratch:  # after the kills: nothing writes there any more
    shutil.rmtree(path, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
