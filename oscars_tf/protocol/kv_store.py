"""The key-value store the workers share: TensorFlow's coordination service.

The protocol modules (membership.py, rate_table.py) take any object with
`set`, `get` and `delete` (and, optionally, `concurrent_reads`: how many
`get`s it serves at once to good effect, and `read_dir`: every key under a
directory in one call, or None); tests and the control-plane
benchmark give them a `MemoryStore` (the keys: store_keys.py). This
module imports TensorFlow only when a `ContextStore` is made.
"""

import bisect
import concurrent.futures
import threading

from oscars_tf.protocol import clock as clock_lib

PROBE_EVERY_S = 0.5  # a reader checks a late writer's process this often


class KeyMissing(Exception):
  """`get` found no value for the key within its timeout."""


def value_unless_gone(store, key, deadline, gone, clock=None):
  """`key`'s value, or None if it is not set by `deadline` (monotonic, of
  `clock`: clock.py) or `gone()` turns True first (checked every
  PROBE_EVERY_S while waiting)."""
  clock = clock_lib.real_unless(clock)
  while True:
    try:
      return store.get(key, min(PROBE_EVERY_S, clock.left(deadline)))
    except KeyMissing:
      if clock.left(deadline) <= 0 or gone():
        return None


def values_unless_gone(store, keys, deadline, gone=None, clock=None):
  """[value_unless_gone(store, keys[i], deadline, lambda: gone(i)), ...],
  read `store.concurrent_reads` keys at a time.

  One `get` is a round trip to the service (about 0.6 ms on loopback, most
  of it waiting): the chief reading N arrivals one by one spends N round
  trips. Thread t reads keys t, t + w, t + 2w, ... in turn, so a late key
  holds up only its own thread's later keys, and none past `deadline`.
  `gone(i)`: whether the writer of keys[i] is known to be gone."""
  gone = gone or (lambda i: False)
  width = min(int(getattr(store, "concurrent_reads", 1)), len(keys))
  if width <= 1:
    return [value_unless_gone(store, k, deadline, lambda i=i: gone(i), clock)
            for i, k in enumerate(keys)]
  values = [None] * len(keys)
  stop = threading.Event()  # the caller is gone: the readers give up

  def read_stride(first):
    for i in range(first, len(keys), width):
      values[i] = value_unless_gone(
          store, keys[i], deadline, lambda i=i: stop.is_set() or gone(i),
          clock)
  futures = []
  try:
    try:
      pool = _readers(width)
      for t in range(width):
        futures.append(pool.submit(read_stride, t))
    except RuntimeError:
      # The interpreter is exiting (the chief waits for the others from an
      # atexit handler, after the pools stopped taking work): the strides
      # not handed to a thread are read here, one key at a time.
      for t in range(len(futures), width):
        read_stride(t)
    for f in futures:
      f.result()
  finally:
    stop.set()
  return values


_POOL = {"pool": None, "width": 0, "lock": threading.Lock()}


def _readers(width):
  """One process-wide pool of reader threads (made once, not per round)."""
  with _POOL["lock"]:
    if _POOL["width"] < width:
      if _POOL["pool"] is not None:
        _POOL["pool"].shutdown(wait=False)
      _POOL["pool"] = concurrent.futures.ThreadPoolExecutor(
          width, thread_name_prefix="oscars-kv-read")
      _POOL["width"] = width
    return _POOL["pool"]


def value_now(store, key):
  """`key`'s value now (a get of 1 ms), or None."""
  try:
    return store.get(key, 0.001)
  except KeyMissing:
    return None


def put(store, key, value):
  """Sets a key that may exist already (the service refuses to overwrite)."""
  store.delete(key)
  store.set(key, value)


class MemoryStore:
  """An in-memory store with the coordination service's semantics: `get`
  blocks until the key exists or the timeout passes, `set` refuses to
  overwrite, `delete` removes a directory too. For one process: protocol
  tests and the control-plane benchmark. `clock` (clock.py): whose time
  `get`'s timeout is (None: the real one)."""

  def __init__(self, clock=None):
    self.data = {}
    self._sorted = []  # data's keys in order: a directory is one slice
    self.clock = clock_lib.real_unless(clock)
    self._cv = self.clock.condition()

  def set(self, key, value):
    with self._cv:
      if key in self.data:
        raise KeyError(f"{key} exists")
      self.data[key] = value
      bisect.insort(self._sorted, key)
      self.clock.notify_all(self._cv)

  def get(self, key, timeout_s):
    with self._cv:
      if not self.clock.wait_for(self._cv, lambda: key in self.data,
                                 timeout_s):
        raise KeyMissing(key)
      return self.data[key]

  def delete(self, key):
    """Deletes `key` and, as the coordination service does, every key
    under it as a directory ("key/..."): one call clears a round."""
    with self._cv:
      if key in self.data:
        del self.data[key]
        del self._sorted[bisect.bisect_left(self._sorted, key)]
      first, end = self._under(key + "/")
      for k in self._sorted[first:end]:
        del self.data[k]
      del self._sorted[first:end]

  def read_dir(self, directory, timeout_s):
    """{key: value} of every key under `directory` + "/" now (the
    service's GetKeyValueDir); never waits."""
    del timeout_s
    with self._cv:
      first, end = self._under(directory + "/")
      return {k: self.data[k] for k in self._sorted[first:end]}

  def _under(self, prefix):
    """The slice of `_sorted` whose keys start with `prefix`: a binary
    search, not a scan of every key (a soak holds thousands)."""
    first = bisect.bisect_left(self._sorted, prefix)
    # Every key starting with `prefix` sorts before prefix + the last
    # code point.
    return first, bisect.bisect_left(self._sorted, prefix + "\U0010ffff",
                                     first)
