"""Input iterators released off the training thread.

Deleting an autotuned tf.data iterator (autotuning is on by default, for
every pipeline) can block for seconds: its destructor cancels the
iterator's autotune thread and waits for it to end. TensorFlow's
cancellation wakes that thread before it marks the iterator cancelled
(tsl's CancellationManager runs its callbacks, then sets is_cancelled_),
and the woken thread, finding it not cancelled yet, sleeps out the rest of
its optimization period: up to 60 s, doubling from 10 ms over the
iterator's life. The wake-up is lost when the woken thread runs before the
deleting one finishes, which CPU contention makes likely: pinned to one
CPU beside a busy loop, deleting an iterator 7 s old took 3.2 s in every
try (its thread's next timer, at 10.2 s), and 0.001 s with autotuning off
or on an idle second core. On the training thread at the end of `fit`
that made one worker's `fit` return seconds after the others (issues 16
and 42).

So the last references are dropped on a daemon thread instead, and the
training thread must keep none (a loop variable left in a frame is
enough). At exit the process waits for those threads only briefly
(JOIN_AT_EXIT_S): a deletion still blocked then waits for a thread
TensorFlow left asleep, and the process ends without it, as it does with
TensorFlow's own background threads (checked: a deletion woken during the
interpreter's shutdown, exit code 0).
"""

import atexit
import threading
import time

JOIN_AT_EXIT_S = 0.2  # a deletion not hit by the lost wake-up takes ms
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
