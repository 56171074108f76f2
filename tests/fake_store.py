"""An in-memory stand-in for the coordination service's key-value store,
and a way to run one thread per simulated worker (protocol tests)."""

import os
import threading

import pytest

from fake_clock import FakeClock
from oscars_tf.protocol import kv_store


class FakeStore(kv_store.MemoryStore):
  """The in-memory store, and a way for a test to wait for a key. It says
  it serves 4 reads at once, as the real service does (16), so that the
  protocol tests walk the threaded reads (kv_store.values_unless_gone);
  on a FakeClock one (the clock does not count kv_store's reader threads:
  fake_clock.py). `clock`: whose time its waits are (None: the real one)."""

  def __init__(self, clock=None):
    super().__init__(clock)
    self.concurrent_reads = 1 if isinstance(clock, FakeClock) else 4

  def wait_for_key(self, key, timeout_s=10):
    """Blocks until `key` is set (what another thread has done by then);
    `timeout_s` is the store's clock's."""
    with self._cv:
      assert self.clock.wait_for(self._cv, lambda: key in self.data,
                                 timeout_s), key


def run_threads(fns, timeout=20, clock=None):
  """Runs each fn in a thread; returns their results (or raises theirs).
  `clock`: a FakeClock that counts the threads (its time moves only when
  they all wait on it); `timeout` is real seconds all the same."""
  out, errors = [None] * len(fns), [None] * len(fns)

  def call(i):
    try:
      out[i] = fns[i]()
    except BaseException as e:  # pylint: disable=broad-except
      errors[i] = e
  # Counted from here, before any starts: no jump passes one by.
  targets = [call if clock is None else clock.counted(call) for _ in fns]
  threads = [threading.Thread(target=t, args=(i,), daemon=True)
             for i, t in enumerate(targets)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout)
    assert not t.is_alive(), "a worker thread hung"
  return out, errors


def give_to_another_user(path, uid=65534):
  """chown `path` to `uid`, or skip: it needs root, and a sandbox's user
  namespace (Bazel's linux-sandbox) may map no other user (EINVAL)."""
  try:
    os.chown(path, uid, -1)
  except OSError as e:
    pytest.skip(f"cannot give a file to another user here: {e.strerror}")
