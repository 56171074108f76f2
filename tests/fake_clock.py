"""A virtual clock for the protocol tests: time moves only when every thread
it counts waits on it.

Protocol code waits through its clock (oscars_tf/protocol/clock.py):
deadlines, pauses between polls, the in-memory store's blocking reads. On a
FakeClock those waits take no real time: once every thread the clock
counts waits on it, the clock jumps to the earliest deadline among the
waiters and wakes them. A straggler timeout of seconds passes at once, and
what a thread does between two waits takes no time at all: a test's
timings are exact, however loaded the machine.

The clock counts the threads `run_threads(..., clock=)` starts (and any
inside `with clock.running():`). A counted thread must wait only through
the clock (its `sleep`, a store on it, its `event()`s): blocked elsewhere
(a threading.Event, a join) it holds time still. A thread the clock does
not count (the test's own) neither holds time nor moves it, but its
deadlines are waited for like the others': alone, it finds its waits over
at once. kv_store's reader threads are not counted, so a FakeStore on a
FakeClock reads one key at a time (test_kv_store.py tests the threaded
reads, in real time).
"""

import contextlib
import math
import threading
import time

from oscars_tf.protocol import clock as clock_lib

GUARD_S = 0.5    # a waiter looks again this often (real seconds)
STUCK_S = 60.0   # real seconds without a move: a counted thread is stuck


class _Waiter:
  __slots__ = ("deadline", "counted", "asleep")

  def __init__(self, deadline, counted):
    self.deadline, self.counted, self.asleep = deadline, counted, False


class FakeClock(clock_lib.Clock):
  """clock.Clock's interface over virtual time (seconds from `start`)."""

  def __init__(self, start=1000.0):
    self._cv = threading.Condition()
    self._now = float(start)
    self._running = 0        # counted threads not waiting on the clock
    self._asleep = set()     # waiters no jump or notification woke yet
    self._local = threading.local()
    self._moved = time.monotonic()  # real time of the last wake-up
    self.jumps = 0

  def monotonic(self):
    return self._now

  def sleep(self, seconds):
    with self._cv:
      self.wait_for(self._cv, lambda: False, seconds)

  def condition(self):
    """The clock's own condition: a store on this clock waits on it."""
    return self._cv

  def notify_all(self, condition):
    assert condition is self._cv, "a FakeClock wakes its own condition"
    self._wake()

  def wait_for(self, condition, predicate, timeout):
    assert condition is self._cv, "a FakeClock times its own condition"
    deadline = self._now + max(0.0, timeout) if timeout is not None else (
        math.inf)
    waiter = _Waiter(deadline, getattr(self._local, "counted", False))
    while True:
      if predicate():
        return True
      if self._now >= deadline:
        return False
      waiter.asleep = True
      self._asleep.add(waiter)
      if waiter.counted:
        self._running -= 1
      self._maybe_jump()  # which may wake this waiter at once
      if waiter.asleep:
        self._cv.wait(GUARD_S)
      if waiter.asleep:  # no jump and no notification: nothing moved
        waiter.asleep = False
        self._asleep.discard(waiter)
        if waiter.counted:
          self._running += 1
        if time.monotonic() - self._moved > STUCK_S:
          raise AssertionError(
              f"the fake clock stood still {STUCK_S:.0f} s: a thread it "
              f"counts ({self._running} running) is blocked elsewhere")

  def counted(self, fn):
    """`fn` to run in a new thread the clock counts from now on (before
    the thread starts, so no jump passes it by) until `fn` returns."""
    with self._cv:
      self._running += 1

    def run(*args, **kwargs):
      self._local.counted = True
      try:
        return fn(*args, **kwargs)
      finally:
        self._local.counted = False
        with self._cv:
          self._running -= 1
          self._maybe_jump()
    return run

  @contextlib.contextmanager
  def running(self):
    """Counts the calling thread inside the block."""
    with self._cv:
      self._running += 1
    self._local.counted = True
    try:
      yield self
    finally:
      self._local.counted = False
      with self._cv:
        self._running -= 1
        self._maybe_jump()

  def event(self):
    """A threading.Event-like flag whose `wait` is on this clock."""
    return _Event(self)

  def _wake(self):
    """Everyone waiting looks again (counted as running until it waits)."""
    for waiter in self._asleep:
      waiter.asleep = False
      if waiter.counted:
        self._running += 1
    self._asleep.clear()
    self._moved = time.monotonic()
    self._cv.notify_all()

  def _maybe_jump(self):
    """Every counted thread waits: time moves to the first deadline."""
    if self._running > 0 or not self._asleep:
      return
    target = min(w.deadline for w in self._asleep)
    if target == math.inf:
      return  # every waiter waits for ever: the guard says so in time
    self._now = max(self._now, target)
    self.jumps += 1
    self._wake()


class _Event:
  """set / is_set / wait(timeout), the wait in the clock's time."""

  def __init__(self, clock):
    self._clock = clock
    self._flag = False

  def set(self):
    with self._clock._cv:  # pylint: disable=protected-access
      self._flag = True
      self._clock._wake()  # pylint: disable=protected-access

  def is_set(self):
    return self._flag

  def wait(self, timeout=None):
    clock = self._clock
    with clock._cv:  # pylint: disable=protected-access
      return clock.wait_for(clock._cv, lambda: self._flag, timeout)  # pylint: disable=protected-access
