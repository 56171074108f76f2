"""Input iterators released off the training thread.

Deleting a tf.data iterator whose pipeline is autotuned (Keras' adapters for
arrays and PyDatasets use AUTOTUNE) waits for the iterator's autotune thread
to end, which it does at that thread's next wake-up: seconds later in a long
`fit` (measured: up to 5-10 s, on one worker at random). On the training
thread at the end of `fit`, that made one worker's `fit` return that much
after the others' (issue 16). The last references are dropped on a daemon
thread instead. At exit the process waits for those threads (bounded), so
that TensorFlow is not torn down under a deletion in progress.
"""

import atexit
import threading
import time

JOIN_AT_EXIT_S = 60.0
KEEP_LATEST = 2  # input iterators kept per loop (see keep_latest)

_lock = threading.Lock()
_threads = []
_registered = []


def release(holder):
  """Drops the objects in the list `holder` (emptied) on a daemon thread.

  The caller must hold no other reference to them, or the deletion happens
  wherever that reference goes.
  """
  if not holder:
    return
  box = [list(holder)]  # only the thread will hold the inner list
  holder.clear()
  thread = threading.Thread(target=_drop, args=(box,), daemon=True,
                            name="oscars-release-iterators")
  with _lock:
    if not _registered:
      atexit.register(_join_at_exit)
      _registered.append(True)
    _threads[:] = [t for t in _threads if t.is_alive()] + [thread]
  thread.start()


def keep_latest(kept, item=None, count=KEEP_LATEST):
  """Appends `item` to the list `kept` (unless None or the last one there)
  and releases all but the latest `count` off this thread.

  For input iterators a Keras loop also holds in a local variable: while
  the loop may still hold the one before the latest (until it takes the
  latest), `count` is 2; once it has taken the latest, 1. Older ones, held
  only here, go on a thread of their own: the loop's variable is never the
  last reference, and memory stays bounded over many epochs.
  """
  if item is not None and not (kept and kept[-1] is item):
    kept.append(item)
  if len(kept) > count:
    old = kept[:-count]
    del kept[:-count]
    release(old)


def pending():
  """Release threads still deleting (for tests)."""
  with _lock:
    return [t for t in _threads if t.is_alive()]


def _drop(box):
  box.pop()


def _join_at_exit():
  deadline = time.monotonic() + JOIN_AT_EXIT_S
  for thread in pending():
    thread.join(max(0.0, deadline - time.monotonic()))
