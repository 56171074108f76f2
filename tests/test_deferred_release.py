"""Tests for oscars_tf.frontends.deferred_release: with stand-ins (no
TensorFlow), and with TensorFlow's real lost wake-up in a child process."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

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


def _run_child(program, timeout=120):
  """(stdout, seconds from the child's last line to its exit)."""
  proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(program)],
                          stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  lines = []
  try:
    for line in proc.stdout:
      lines.append((line.strip(), time.monotonic()))
    assert proc.wait(timeout) == 0, lines
  finally:
    proc.kill()
  return [line for line, _ in lines], time.monotonic() - lines[-1][1]


def test_a_deletion_blocked_in_progress_does_not_hold_the_exit():
  # Blocked past JOIN_AT_EXIT_S (TensorFlow's lost wake-up, see the
  # module), a deletion no longer holds the process: it used to, for up to
  # 60 s.
  out, exit_s = _run_child("""
      import threading
      from oscars_tf.frontends import deferred_release

      entered = threading.Event()

      class Blocked:
        def __del__(self):
          entered.set()
          threading.Event().wait(30)
          print("deleted", flush=True)

      deferred_release.release([Blocked()])
      assert entered.wait(30)
      print("main ends", flush=True)
      """)
  assert out == ["main ends"], out
  assert exit_s < 10, exit_s  # the blocked deletion would take 30 s


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"),
                    reason="needs os.sched_setaffinity and SCHED_IDLE (Linux)")
def test_tensorflows_lost_wake_up_blocks_a_deletion_but_not_release_or_exit():
  """The real thing: two autotuned tf.data iterators read for 3 s by a busy
  loop on one CPU. Deleting one waits for its autotune thread's next timer
  (5.1 s after its start: about 2 s here, see the module docstring).
  release() of the other returns at once, and the process exits without
  waiting for its deletion. The deleting threads run under SCHED_IDLE, so
  that the autotune thread they wake preempts them (Linux lets any normal
  thread preempt an idle-policy one at wake-up) and sleeps again before
  they mark the iterator cancelled: the wake-up is lost every time, not
  only under load. (At nice 19 instead it was lost in most runs, not all:
  a clean-clone CI run missed it four times in a row.)"""
  program = """
      import os, threading, time
      os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
      import tensorflow as tf
      from oscars_tf.frontends import deferred_release

      def stream():
        return iter(tf.data.Dataset.range(10**9).map(
            lambda x: x * 2, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
                tf.data.AUTOTUNE))

      direct, released = stream(), [stream()]
      start = time.monotonic()
      while time.monotonic() - start < 3.0:
        next(direct)
        next(released[0])
        spin = time.monotonic() + 0.004  # a training step's compute
        while time.monotonic() < spin:
          pass
      def at_idle_policy(work):
        # A thread of its own (and the threads it starts) under SCHED_IDLE;
        # the autotune threads and this one stay normal.
        def run():
          os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
          work()
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

      start = time.monotonic()
      held = [direct]
      del direct
      at_idle_policy(held.clear)
      print(f"direct {time.monotonic() - start:.3f}", flush=True)
      start = time.monotonic()
      at_idle_policy(lambda: deferred_release.release(released))
      print(f"released {time.monotonic() - start:.3f}", flush=True)
      """
  # The lost wake-up is TensorFlow's race, made certain by the idle policy
  # above on one CPU; a run that still missed it would check nothing, so
  # such a run is tried again.
  for _ in range(3):
    out, exit_s = _run_child(program)
    times = dict(line.split() for line in out)
    if float(times["direct"]) > 1.0:
      break
  # The deletion on this thread waited out the lost wake-up: the test can
  # fail if TensorFlow fixes it (then this module's reason is gone).
  assert float(times["direct"]) > 1.0, out
  assert float(times["released"]) < 0.5, out
  # The exit with a real blocked deletion pending: bounded loosely, as a
  # loaded machine's TensorFlow teardown alone took 1.7 s in a CI run (the
  # test above checks the exit against a 30 s block, exactly).
  assert exit_s < 5.0, (exit_s, out)


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
