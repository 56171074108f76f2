"""Tests for oscars_tf.frontends.deferred_release (no TensorFlow needed)."""

import subprocess
import sys
import textwrap
import threading

from oscars_tf.frontends import deferred_release


class _SlowToDelete:
  """Stands for a tf.data iterator whose deletion blocks (autotune)."""

  def __init__(self, gate, deleted_on):
    self.gate, self.deleted_on = gate, deleted_on

  def __del__(self):
    self.gate.wait(10)
    self.deleted_on.append(threading.current_thread())


def test_objects_are_deleted_off_the_calling_thread():
  gate, deleted_on = threading.Event(), []
  holder = [_SlowToDelete(gate, deleted_on) for _ in range(2)]
  deferred_release.release(holder)
  # Deleted here, release() would have waited out the gate (10 s) first.
  assert holder == [] and deleted_on == []
  gate.set()
  for thread in deferred_release.pending():
    thread.join(10)
  assert len(deleted_on) == 2
  assert threading.current_thread() not in deleted_on


def test_an_exiting_process_waits_for_deletions_in_progress():
  program = textwrap.dedent("""
      import sys, time
      from oscars_tf.frontends import deferred_release

      class Slow:
        def __del__(self):
          time.sleep(0.5)
          print("deleted", flush=True)

      deferred_release.release([Slow()])
      print("returned", flush=True)
      """)
  out = subprocess.run([sys.executable, "-c", program], capture_output=True,
                       text=True, timeout=60, check=True).stdout
  assert out.split() == ["returned", "deleted"], out


def test_keep_latest_holds_two_and_releases_older_ones_off_this_thread():
  gate, deleted_on = threading.Event(), []
  kept, ids = [], []
  for _ in range(4):  # only `kept` holds them, as for a Keras loop's iterators
    deferred_release.keep_latest(kept, _SlowToDelete(gate, deleted_on))
    ids.append(id(kept[-1]))
    deferred_release.keep_latest(kept, kept[-1])  # the same again: kept once
  assert [id(k) for k in kept] == ids[-deferred_release.KEEP_LATEST:]
  # The two older ones went to a release thread, which waits on the gate:
  # deleted here, the loop above would have blocked for 10 s.
  assert deleted_on == []
  gate.set()
  for thread in deferred_release.pending():
    thread.join(10)
  assert len(deleted_on) == 2
  assert threading.current_thread() not in deleted_on
  deferred_release.keep_latest(kept, count=1)  # all but the latest
  for thread in deferred_release.pending():
    thread.join(10)
  assert len(kept) == 1 and len(deleted_on) == 3
  kept.clear()  # the last, here (the gate is open)
  assert len(deleted_on) == 4
