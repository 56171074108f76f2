"""The collected output of a `launch.Job`'s workers, for benchmarks and the
tests (tests/multiworker.py)."""

import io
import threading


class JobLog(io.TextIOBase):
  """A text sink for `launch.Job(out=...)`: the Job's pump threads, one per
  worker pipe, write to it at once, so writes take a lock."""

  def __init__(self):
    self._lock = threading.Lock()
    self._parts = []

  def write(self, s):
    with self._lock:
      self._parts.append(s)
    return len(s)

  def text(self):
    """Everything written so far."""
    with self._lock:
      return "".join(self._parts)
