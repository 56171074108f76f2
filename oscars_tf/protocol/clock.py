"""The protocol's time: the real clock, or one a test gives it.

Protocol code that waits (deadlines, pauses between polls, an in-memory
store's blocking reads) asks a clock instead of the `time` module: the
protocol classes and functions take `clock=None`, the real one. Tests give
them a virtual clock that moves only while every worker thread waits on it
(tests/fake_clock.py), so a straggler timeout of seconds passes at once and
threads are ordered by what they wait for, not by sleeps. No TensorFlow.
"""

import threading
import time


class Clock:
  """Real time: time.monotonic and time.sleep, a threading.Condition's
  waits (kv_store.MemoryStore waits through its store's clock)."""

  def monotonic(self):
    return time.monotonic()

  def sleep(self, seconds):
    time.sleep(seconds)

  def left(self, deadline):
    """Seconds until `deadline` (a monotonic time), at least 0."""
    return max(0.0, deadline - self.monotonic())

  def condition(self):
    """A condition variable whose waits this clock times."""
    return threading.Condition()

  def wait_for(self, condition, predicate, timeout):
    """condition.wait_for(predicate, timeout), `condition` held: whether
    `predicate()` came true within `timeout` seconds."""
    return condition.wait_for(predicate, timeout)

  def notify_all(self, condition):
    """Wakes the waiters on `condition` (held): state they wait on moved."""
    condition.notify_all()


REAL = Clock()


def real_unless(clock):
  """`clock`, or the real one for None."""
  return REAL if clock is None else clock
