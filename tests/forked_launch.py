"""oscars-launch, its workers forked from a server that imported TensorFlow
once (forkserver.py), for the fault tests' many short launched jobs.

    python forked_launch.py LAUNCHER_FLAGS -- python train.py ...

Each worker of those jobs, and of every restart, spent about 5.7 s of CPU
importing TensorFlow and Keras on this project's 2-core machine. Everything
else is the launcher as users run it (oscars_tf.cli.launch): its flags,
attempts, restarts, signals and exit codes. A worker the server cannot
fork (forkserver.ForkServer.spawn) starts as a plain process, as does
every worker when OSCARS_TEST_FORKSERVER=0. The launcher's own process
handling is tested as users start it (test_launch.py). The job runs on
the machine's network (--network=host) unless the flags say otherwise:
the private network's namespace is joined in a step before exec, which a
forked worker cannot take (test_launch.py tests it).

A forked worker's /proc/PID/cmdline and environ are the server's, so each
is recorded in the directory $OSCARS_TEST_FORKED_DIR (`forked()` reads it
back for faults.py, which finds its victims by command line).
"""

import functools
import json
import os
import sys

import forkserver
from oscars_tf.cli import launch
from oscars_tf.cli import launch_attempts
from oscars_tf.tools import worker_processes

FORKED_DIR = "OSCARS_TEST_FORKED_DIR"


def _start_time(pid):
  """The process' start time in clock ticks (/proc/PID/stat field 22):
  with the pid, it names one process, whatever reuses the pid later."""
  with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
    return int(f.read().rpartition(")")[2].split()[19])


def _record(directory, pid, command, env):
  try:
    entry = {"argv": list(command), "env": dict(env),
             "start": _start_time(pid)}
  except (OSError, ValueError, IndexError):
    return  # it has ended already
  path = os.path.join(directory, str(pid))
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(entry, f)
  os.replace(path + ".tmp", path + ".json")


def forked(directory):
  """[(pid, argv, env)] of the live workers recorded in `directory`."""
  found = []
  for name in os.listdir(directory) if os.path.isdir(directory) else []:
    if not name.endswith(".json"):
      continue
    pid = int(name[:-len(".json")])
    try:
      with open(os.path.join(directory, name), encoding="utf-8") as f:
        entry = json.load(f)
      if _start_time(pid) != entry["start"]:
        continue  # the pid is another process' now
    except (OSError, ValueError, IndexError):
      continue
    found.append((pid, entry["argv"], entry["env"]))
  return found


class _Spawner:
  """launch.Job's `spawn`; starts the server at the first worker, not
  before (a launcher that fails on its flags starts none)."""

  def __init__(self):
    self._spawn = None
    self._started = False

  def __call__(self, command, env):
    if not self._started:
      self._started = True
      self._spawn = forkserver.spawner(dict(os.environ))
    process = self._spawn(command, env) if self._spawn else None
    if process is not None and os.environ.get(FORKED_DIR):
      _record(os.environ[FORKED_DIR], process.pid, command, env)
    return process


if __name__ == "__main__":
  own = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv
  if not any(a.startswith("--network") for a in own):  # the launcher's own
    sys.argv.insert(1, "--network=host")
  launch_attempts.Job = functools.partial(worker_processes.Job,
                                          spawn=_Spawner())
  launch.run()
