"""Numbers agreed between rounds (agreement.py) on an in-memory store.

Workers are threads; the real store and real stalls are exercised by
test_faults.py (a worker stopped at an epoch end).
"""

import threading

import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from fake_store import run_threads
from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.protocol import agreement
from oscars_tf.protocol import store_keys


def _workers(store, n, straggler=0.5, decision=5.0):
  return [agreement.Agreements(store, i, straggler, decision,
                               clock=store.clock)
          for i in range(n)]


def test_every_member_reads_every_members_numbers():
  store = FakeStore()
  ws = _workers(store, 3)
  out, errors = run_threads([lambda w=w: w.gather(7, (0, 1, 2), [w.me, 1.0])
                             for w in ws])
  assert errors == [None] * 3
  assert out[0] == out[1] == out[2] == {0: [0, 1], 1: [1, 1], 2: [2, 1]}
  assert agreement.mean(out[0], 2) == [1.0, 1.0]


def test_a_stalled_member_is_left_out_and_the_others_agree_in_time():
  store = FakeStore(FakeClock())
  ws = _workers(store, 3, straggler=0.3)
  release = threading.Event()

  def stalled():
    assert release.wait(10)  # stopped until the others are done
    return ws[2].gather(0, (0, 1, 2), [9.0])

  out, errors = run_threads([lambda: ws[0].gather(0, (0, 1, 2), [1.0]),
                             lambda: ws[1].gather(0, (0, 1, 2), [3.0])],
                            clock=store.clock)
  assert errors == [None, None]
  assert out[0] == out[1] == {0: [1.0], 1: [3.0]}
  release.set()
  late, errors = run_threads([stalled], clock=store.clock)
  assert errors == [None]
  assert late[0] == out[0]  # back, it reads the decision the others took
  # Nothing is left behind: the result alone stays, for late readers.
  assert sorted(store.data) == [store_keys.agreement(0, 0)]


def test_agreements_at_one_round_are_told_apart_in_call_order():
  store = FakeStore()
  ws = _workers(store, 2)

  def twice(w):
    first = w.gather(3, (0, 1), [w.me])
    return first, w.gather(3, (0, 1), [10 + w.me])

  out, errors = run_threads([lambda w=w: twice(w) for w in ws])
  assert errors == [None, None]
  assert out[0] == out[1] == ({0: [0], 1: [1]}, {0: [10], 1: [11]})


def test_only_members_are_waited_for():
  store = FakeStore(FakeClock())
  ws = _workers(store, 3, straggler=30.0)
  t0 = store.clock.monotonic()
  out, errors = run_threads([lambda w=w: w.gather(1, (0, 1), [w.me])
                             for w in ws[:2]], timeout=10, clock=store.clock)
  assert errors == [None, None]
  assert out[0] == {0: [0], 1: [1]}
  assert store.clock.monotonic() == t0  # no wait for 2


def test_a_silent_chief_is_a_clear_error():
  store = FakeStore(FakeClock())
  ws = _workers(store, 2, decision=0.2)
  with pytest.raises(PeerTimeoutError, match="chief .* no result"):
    ws[1].gather(0, (0, 1), [1.0])


def test_results_kept_in_the_store_are_bounded(monkeypatch):
  monkeypatch.setattr(agreement, "KEEP_RESULTS", 5)
  store = FakeStore()
  chief = agreement.Agreements(store, 0, 0.01, 1.0)
  for r in range(50):
    chief.gather(r, (0,), [float(r)])
  assert len(store.data) == 5


def test_a_member_whose_process_is_gone_is_not_waited_for():
  store = FakeStore(FakeClock())
  chief = agreement.Agreements(store, 0, 30.0, 60.0, is_gone=lambda j: j == 2,
                               clock=store.clock)
  other = agreement.Agreements(store, 1, 30.0, 60.0, clock=store.clock)
  t0 = store.clock.monotonic()
  out, errors = run_threads([lambda: chief.gather(4, (0, 1, 2), [1.0]),
                             lambda: other.gather(4, (0, 1, 2), [2.0])],
                            timeout=10, clock=store.clock)
  assert errors == [None, None] and out[0] == out[1] == {0: [1.0], 1: [2.0]}
  assert store.clock.monotonic() - t0 < 1.0  # asked, not 30 s waited


def test_the_chief_leaves_an_exchange_only_once_every_other_has_read():
  # The chief hosts the store: leaving first (e.g. to raise on a mismatch)
  # would take it away from a worker still reading.
  store = FakeStore(FakeClock())
  clock = store.clock
  chief, other = _workers(store, 2, decision=30.0)
  left = []

  def chief_exchange():
    texts = chief.exchange("x", "a", (0, 1))
    left.append(clock.monotonic())
    return texts

  def worker_1_reading_slowly():
    store.set(store_keys.exchange_text("x", 0, 1), "b")  # posted, not read
    clock.sleep(5.0)
    assert not left, "the chief left before worker 1 had read"
    store.set(store_keys.exchange_read("x", 0, 1), "1")  # worker 1 has read
  t0 = clock.monotonic()
  out, errors = run_threads([chief_exchange, worker_1_reading_slowly],
                            clock=clock)
  assert errors == [None, None] and out[0] == {0: "a", 1: "b"}
  assert left == [t0 + 5.0]  # as soon as worker 1 had read
  # A worker says so once it has read.
  got, errors = run_threads([lambda w=w: w.exchange("y", str(w.me), (0, 1))
                             for w in (chief, other)], clock=clock)
  assert errors == [None, None] and got[1] == {0: "0", 1: "1"}
  assert store_keys.exchange_read("y", 0, 1) in store.data


def test_a_worker_whose_read_mark_lands_as_the_chief_leaves_keeps_the_texts():
  # Worker 1's "read" lands in the store, the chief sees it and leaves with
  # the service before the reply: the set fails, but worker 1 has every
  # text, so it goes on with them (then raises a mismatch, say) instead of
  # reporting a lost service.
  store = FakeStore(FakeClock())
  chief, other = _workers(store, 2, decision=30.0)
  read_key = store_keys.exchange_read("x", 0, 1)
  plain_set = store.set

  def set_then_lose_the_reply(key, value):
    plain_set(key, value)
    if key == read_key:
      raise WorkerLostError("the coordination service cannot be reached")
  store.set = set_then_lose_the_reply
  out, errors = run_threads([lambda w=w: w.exchange("x", str(w.me), (0, 1))
                             for w in (chief, other)], clock=store.clock)
  assert errors == [None, None], errors
  assert out == [{0: "0", 1: "1"}] * 2
  # Before it has every text, a lost service is still the error it is.
  store.set = plain_set
  lone = _workers(FakeStore(FakeClock()), 2)[1]

  def lost(key, value):
    raise WorkerLostError("the coordination service cannot be reached")
  lone.store.set = lost
  with pytest.raises(WorkerLostError):
    lone.exchange("x", "1", (0, 1))
