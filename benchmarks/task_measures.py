"""What a process of control_plane_tf.py's cluster measures of itself:
its memory, and its coordination-service operations (count, bytes read,
wall time) per round."""

import threading
import time

from oscars_tf.protocol import store_keys


def memory_mb():
  """This process's resident memory, MB: (now, peak, private). Most of
  the resident memory is TensorFlow's shared libraries, whose pages all
  the processes share; private pages are each process's own cost."""
  def kb(path, key):
    with open(path, encoding="utf-8") as f:
      return sum(int(line.split()[1]) for line in f
                 if line.split(":")[0] in key) / 1024
  return (kb("/proc/self/status", ("VmRSS",)),
          kb("/proc/self/status", ("VmHWM",)),
          kb("/proc/self/smaps_rollup", ("Private_Clean", "Private_Dirty")))


class CountingStore:
  """A ContextStore that counts its operations, bytes read and each
  operation's wall time, per round (`round` is set by the caller). The
  chief reads from several threads at once (kv_store.values_unless_gone):
  the counts are kept under a lock."""

  def __init__(self, store, concurrent_reads):
    self.store = store
    self.concurrent_reads = concurrent_reads
    self.round = -1
    self._lock = threading.Lock()
    self.ops = {}      # round -> operations
    self.bytes = {}    # round -> bytes of the values read
    self.times = []    # (round, "get"/"set"/"delete", seconds)
    self.published = {}  # round -> time.time() the decision was set

  def _count(self, kind, t0, nbytes=0):
    with self._lock:
      self.times.append((self.round, kind, time.perf_counter() - t0))
      self.ops[self.round] = self.ops.get(self.round, 0) + 1
      self.bytes[self.round] = self.bytes.get(self.round, 0) + nbytes

  def set(self, key, value):
    t0 = time.perf_counter()
    self.store.set(key, value)
    self._count("set", t0)
    round_ = store_keys.decision_round(key)
    if round_ is not None:
      self.published[round_] = time.time()

  def get(self, key, timeout_s):
    t0 = time.perf_counter()
    value = self.store.get(key, timeout_s)
    self._count("get", t0, len(value))
    return value

  def read_dir(self, directory, timeout_s):
    t0 = time.perf_counter()
    values = self.store.read_dir(directory, timeout_s)
    if values is not None:
      self._count("dir", t0, sum(map(len, values.values())))
    return values

  def delete(self, key):
    t0 = time.perf_counter()
    self.store.delete(key)
    self._count("delete", t0)
