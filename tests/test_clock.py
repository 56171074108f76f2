"""The protocol's clock (protocol/clock.py) and the tests' virtual one
(fake_clock.py): real waits take real time; virtual time moves only when
every counted thread waits, to the first deadline, and never while one
runs."""

import time

import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from fake_store import run_threads
from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import kv_store


def test_the_real_clock_waits_in_real_time():
  store = kv_store.MemoryStore()  # on the real clock
  assert store.clock is clock_lib.REAL
  t0 = time.monotonic()
  with pytest.raises(kv_store.KeyMissing):
    store.get("k", 0.05)
  assert time.monotonic() - t0 >= 0.05
  assert clock_lib.REAL.left(clock_lib.REAL.monotonic() - 1) == 0.0


def test_a_wait_alone_ends_at_once_at_its_deadline():
  clock = FakeClock()
  store = FakeStore(clock)
  t0, real0 = clock.monotonic(), time.monotonic()
  with pytest.raises(kv_store.KeyMissing):
    store.get("k", 30.0)
  clock.sleep(100.0)
  assert clock.monotonic() - t0 == 130.0
  assert time.monotonic() - real0 < 5.0  # not 130 s


def test_time_stands_still_while_a_counted_thread_runs():
  clock = FakeClock()
  store = FakeStore(clock)
  busy = []

  def waiter():  # waits 10 s for a key the other sets after real work
    return store.get("k", 10.0), clock.monotonic()

  def worker():
    t = time.monotonic()
    while time.monotonic() - t < 0.2:  # real time, no wait on the clock
      busy.append(clock.monotonic())
    store.set("k", "v")
  t0 = clock.monotonic()
  out, errors = run_threads([waiter, worker], clock=clock)
  assert errors == [None, None]
  assert out[0] == ("v", t0)  # no virtual time passed
  assert set(busy) == {t0}


def test_sleepers_wake_in_the_order_of_their_deadlines():
  clock = FakeClock()
  woke = []

  def sleeper(seconds):
    clock.sleep(seconds)
    woke.append((seconds, clock.monotonic()))
  t0 = clock.monotonic()
  _, errors = run_threads([lambda s=s: sleeper(s) for s in (3.0, 1.0, 2.0)],
                          clock=clock)
  assert errors == [None] * 3
  assert woke == [(1.0, t0 + 1.0), (2.0, t0 + 2.0), (3.0, t0 + 3.0)]


def test_an_event_wait_is_in_virtual_time():
  clock = FakeClock()
  event = clock.event()
  t0 = clock.monotonic()
  assert not event.wait(5.0) and clock.monotonic() - t0 == 5.0

  def setter():
    clock.sleep(1.0)
    event.set()
  out, errors = run_threads([lambda: (event.wait(10.0), clock.monotonic()),
                             setter], clock=clock)
  assert errors == [None, None] and out[0] == (True, t0 + 6.0)
