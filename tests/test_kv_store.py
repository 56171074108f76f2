"""kv_store.values_unless_gone: a round's keys read several at a time, in
key order, each None when not set by the deadline or its writer is gone."""

import threading
import time

import pytest

from oscars_tf.protocol import kv_store
from tests import fake_store


class _Store(kv_store.MemoryStore):

  def __init__(self, width):
    super().__init__()
    self.concurrent_reads = width
    self.readers = set()  # threads that called get
    self._lock = threading.Lock()

  def get(self, key, timeout_s):
    with self._lock:
      self.readers.add(threading.get_ident())
    return super().get(key, timeout_s)


class _BarrierStore(kv_store.MemoryStore):
  """Every get waits until `parties` gets are in flight at once: reads one
  at a time would break the barrier (its timeout) and fail."""

  def __init__(self, parties):
    super().__init__()
    self.concurrent_reads = parties
    self.barrier = threading.Barrier(parties, timeout=10)

  def get(self, key, timeout_s):
    self.barrier.wait()
    return super().get(key, timeout_s)


@pytest.mark.parametrize("width", [1, 4, 16])
def test_values_come_back_in_key_order_and_missing_ones_as_none(width):
  store = _Store(width)
  keys = [f"r/{j}" for j in range(37)]
  for j in range(37):
    if j % 5:
      store.set(keys[j], f"v{j}")
  values = kv_store.values_unless_gone(store, keys, time.monotonic() + 0.2)
  assert values == [f"v{j}" if j % 5 else None for j in range(37)]
  if width == 1:
    assert len(store.readers) == 1  # the caller's thread only


def test_the_reads_are_in_flight_at_the_same_time():
  store = _BarrierStore(4)
  keys = [f"r/{j}" for j in range(8)]
  for k in keys:
    store.set(k, k)
  assert kv_store.values_unless_gone(
      store, keys, time.monotonic() + 30) == keys


def test_a_key_set_while_reading_is_read_and_a_gone_writer_is_not_waited():
  store = fake_store.FakeStore()
  keys = ["r/0", "r/1", "r/2"]
  store.set("r/0", "a")
  gone_asked = threading.Event()

  def gone(i):
    if i == 2:
      gone_asked.set()
      return True
    return False

  def late_writer():  # after the reader has given up on r/2 (gone)
    assert gone_asked.wait(30)
    store.set("r/1", "b")
  writer = threading.Thread(target=late_writer, daemon=True)
  writer.start()
  values = kv_store.values_unless_gone(
      store, keys, time.monotonic() + 60, gone)
  writer.join(10)
  assert values == ["a", "b", None]


def test_no_waiting_when_the_deadline_has_passed():
  store = _Store(4)
  store.set("j/3", "asked")
  keys = [f"j/{j}" for j in range(6)]
  assert kv_store.values_unless_gone(store, keys, time.monotonic() - 1) == [
      None, None, None, "asked", None, None]


def test_a_reader_that_raises_reaches_the_caller():
  class Broken(kv_store.MemoryStore):
    concurrent_reads = 3

    def get(self, key, timeout_s):
      raise RuntimeError(f"service down reading {key}")
  with pytest.raises(RuntimeError, match="service down"):
    kv_store.values_unless_gone(Broken(), ["a", "b", "c", "d"],
                                time.monotonic() + 5)


def test_reads_from_an_atexit_handler_still_read_every_key():
  # The chief waits for the others' "done" from an atexit handler, after
  # Python's thread pools stopped taking work: the reads go on in the
  # caller's thread (else the chief left at once and took the store).
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import textwrap  # pylint: disable=g-import-not-at-top
  program = textwrap.dedent("""
      import atexit, time
      from oscars_tf.protocol import kv_store

      class Store(kv_store.MemoryStore):
        concurrent_reads = 4

      store = Store()
      for j in range(6):
        store.set(f"k/{j}", str(j))
      kv_store.values_unless_gone(store, ["k/0", "k/1"], time.monotonic() + 1)

      def at_exit():
        keys = [f"k/{j}" for j in range(7)]
        print("READ", kv_store.values_unless_gone(
            store, keys, time.monotonic() + 0.2))
      atexit.register(at_exit)
  """)
  proc = subprocess.run([sys.executable, "-c", program], capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "READ ['0', '1', '2', '3', '4', '5', None]" in proc.stdout, (
      proc.stdout, proc.stderr[-2000:])


def test_the_memory_store_deletes_and_reads_a_directory_not_its_neighbours():
  store = kv_store.MemoryStore()
  for key in ("r/1", "r/1/a", "r/1/b/c", "r/10", "r/10/a", "r/1x", "r/0/a",
              "s/1/a", "r/1/\u00e9"):
    store.set(key, key.upper())
  assert store.read_dir("r/1", 0) == {"r/1/a": "R/1/A", "r/1/b/c": "R/1/B/C",
                                      "r/1/\u00e9": "R/1/\u00c9"}
  assert store.read_dir("r/2", 0) == {}
  store.delete("r/1")
  assert sorted(store.data) == ["r/0/a", "r/10", "r/10/a", "r/1x", "s/1/a"]
  store.delete("r/10/a")
  store.delete("nothing")
  assert sorted(store.data) == ["r/0/a", "r/10", "r/1x", "s/1/a"]
  store.set("r/1/a", "again")  # a deleted key can be set again
  assert store.read_dir("r", 0) == {"r/0/a": "R/0/A", "r/1/a": "again",
                                    "r/10": "R/10", "r/1x": "R/1X"}
