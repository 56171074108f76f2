"""Watches a task's start from outside its process: a worker that waits for
a cluster that never assembles must not hang silently.

TensorFlow's runtime start (`context.ensure_initialized`) waits for every
task to register with the coordination service; on the service's own task
TensorFlow 2.21 waits with no deadline, holding the GIL, so no thread of the
waiting process can report or give up. This module runs as a small process
of its own (the standard library only, `python -S`): every REPORT_S it names
the tasks whose address takes no TCP connection yet, and past the timeout it
says so and ends the waiting task. The task closes the watcher's stdin once
it has started (or by dying), which ends the watcher. A SIGTERM to the
task's process group (a stop) ends the waiting task too: TensorFlow's own
handler holds it meanwhile.

    python -S join_watch.py '{"pid": ..., "own": "worker:0", "timeout_s": ...,
                              "tasks": [["worker", 1, "host:port"], ...]}'
"""

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

REPORT_S = 15.0


def absent_tasks(tasks, connect_timeout_s=1.0):
  """The (job, index, address) of `tasks` whose address refuses a TCP
  connection (not started, or not yet listening)."""
  out = []
  for job, index, address in tasks:
    host, _, port = address.rpartition(":")
    try:
      socket.create_connection((host.strip("[]"), int(port)),
                               connect_timeout_s).close()
    except (OSError, ValueError):
      out.append((job, index, address))
  return out


def _say(level, message):
  print(f"{level}: oscars_tf: {message}", file=sys.stderr, flush=True)


class _Terminated(Exception):
  """SIGTERM reached the watcher (main installs the handler)."""


def _terminate(signum, frame):
  del signum, frame
  raise _Terminated()


def watch(pid, own, tasks, timeout_s, started, report_s=REPORT_S):
  """Waits for `started` (a readable file: EOF once the task started) up to
  `timeout_s`; returns 0 then, else kills `pid` and returns 1."""
  try:
    return _watch(pid, own, tasks, timeout_s, started, report_s)
  except _Terminated:
    # A stop (the launcher's, Slurm's) reaches the task's process group,
    # so the watcher too; the task ignores it while TensorFlow waits.
    _say("WARNING", f"{own} got SIGTERM while it waited for the cluster's "
         "other tasks: it stops (TensorFlow holds its main thread, so with "
         "SIGKILL).")
    _kill(pid)
    return 1


def _kill(pid):
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _watch(pid, own, tasks, timeout_s, started, report_s):
  begin = time.monotonic()
  while True:
    left = timeout_s - (time.monotonic() - begin)
    if left > 0 and select.select([started], [], [], min(report_s, left))[0]:
      return 0
    waited = time.monotonic() - begin
    absent = ", ".join(f"{j}:{i} at {a}" for j, i, a in absent_tasks(tasks))
    absent = absent or "every address takes connections"
    if waited < timeout_s:
      _say("WARNING", f"{own} has waited {waited:.0f} s for the cluster's "
           f"other tasks to start (not listening yet: {absent}).")
      continue
    _say("ERROR", f"{own} stops: the cluster's tasks did not all start within "
         f"{timeout_s:.0f} s (not listening: {absent}). Check their addresses "
         "in TF_CONFIG and that every task was started; a slow start needs "
         "OscarsStrategy(join_timeout=...). TensorFlow holds the task's main "
         "thread, so it is stopped with SIGKILL.")
    _kill(pid)
    return 1


class Watcher:
  """The task's side: starts the watcher process; `stop()` once started."""

  def __init__(self, own, tasks, timeout_s):
    spec = {"pid": os.getpid(), "own": own, "timeout_s": timeout_s,
            "tasks": [list(t) for t in tasks]}
    try:
      self._proc = subprocess.Popen(
          [sys.executable, "-S", os.path.abspath(__file__), json.dumps(spec)],
          stdin=subprocess.PIPE)
    except OSError as e:  # an embedded interpreter: start unwatched
      _say("WARNING", f"{own} starts without a join watch ({e}).")
      self._proc = None

  def stop(self):
    if self._proc is None:
      return
    self._proc.stdin.close()  # EOF: the task started
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m oscars_tf.runtime.join_watch",
      description="Watches one task's start (the strategy runs it; not a "
      "command for users): names the tasks not listening yet and ends the "
      "task past its join timeout.")
  parser.add_argument("spec", help='JSON: {"pid", "own", "timeout_s", '
                      '"tasks": [[job, index, "host:port"], ...]}')
  spec = json.loads(parser.parse_args(argv).spec)
  signal.signal(signal.SIGTERM, _terminate)
  return watch(spec["pid"], spec["own"], [tuple(t) for t in spec["tasks"]],
               spec["timeout_s"], sys.stdin)


if __name__ == "__main__":
  sys.exit(main())
