"""A launched task's process group (`start_new_session`), after its leader.

Each task of a job leads a process group of its own, so that what it
starts (a shell wrapper's Python, a data loader's pool, `tensorboard &`)
can be stopped with it. That must hold after the task itself exited and
was reaped, too: its children live on in the group.
"""

import os


def alive(proc):
  """Whether the process group `proc` leads still has a process: the
  leader (a Popen-like, unreaped), or what it left running after it was
  reaped."""
  if proc.poll() is None:
    return True
  # The kernel keeps a reaped leader's pid allocated while its group has
  # a member, so no new process can hold it: a live pid means the group
  # is empty and the number was taken by an unrelated process.
  try:
    os.kill(proc.pid, 0)
    return False
  except ProcessLookupError:
    pass
  except PermissionError:
    return False
  try:
    os.killpg(proc.pid, 0)
    return True
  except (ProcessLookupError, PermissionError):
    return False


def signal_group(proc, sig):
  """Sends `sig` to the group `proc` leads, while it has a process."""
  if alive(proc):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      pass
