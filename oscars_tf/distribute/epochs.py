"""When epochs begin and end, agreed by every worker.

A `fit` epoch under the Adaptive schedule is cluster-wide: the plan ends it
at a round every worker reaches (`Rounds.begin_epoch` with a target). In
every other case each worker's data, or its loop, ends on its own, and
`finish` ends the epoch together: the worker ends its round with the steps
it took, marked out of data, and takes part in the next rounds with no steps
of its own until every member is out of data (see plan_changes.with_arrivals).
Whatever the input, no worker waits at a collective another never reaches.
"""

import atexit
import gc
import os
import sys
import threading

from absl import logging

from oscars_tf import errors
from oscars_tf import exit_notes
from oscars_tf import schedules as schedules_lib

_uncaught_error = threading.Event()
_peer_lost = threading.Event()


def note_uncaught_errors():
  """Remembers that the process is ending on an uncaught error, and makes
  one that is a WorkerLostError exit with errors.PEER_LOST_EXIT_CODE (the
  hook is installed once per process)."""
  previous = sys.excepthook
  if getattr(previous, "_oscars_notes_errors", False):
    return

  def hook(exc_type, exc, tb):
    _uncaught_error.set()
    if isinstance(exc, errors.WorkerLostError):
      _peer_lost.set()
      exit_notes.write(getattr(exc, "peers", None))
    previous(exc_type, exc, tb)
  hook._oscars_notes_errors = True  # pylint: disable=protected-access
  sys.excepthook = hook
  # Registered before the strategy's own exit handlers, so it runs after
  # them (atexit is last in, first out).
  atexit.register(_exit_if_peer_lost)


def _exit_if_peer_lost():
  # After an uncaught exception Python exits with 1 whatever atexit does;
  # only os._exit sets another code. It also skips TensorFlow's teardown,
  # which has nothing to save once the collectives are aborted.
  if _peer_lost.is_set():
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):
        pass
    os._exit(errors.PEER_LOST_EXIT_CODE)


def teardown_quickly(round_logs):
  """At exit, after the last round: Python's final garbage collection
  walks TensorFlow's whole object graph, 0.5 s of CPU and 3 s under a
  0.18-CPU quota (measured), so the slowest worker's process ended seconds
  after the others' (issue 42). The round logs and the default summary
  writer are flushed, then the collector is frozen: the exit frees the
  memory all the same, but objects in reference cycles are not finalized
  (a summary writer of the user's should be closed or flushed; Keras'
  TensorBoard callback closes its own)."""
  # Imported here: this module stays free of TensorFlow (a process that
  # registered this handler, the strategy's, has it loaded already).
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    round_logs.finish_logs()  # flushed, and the timeline if not written
    tf.summary.flush()
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("oscars_tf: could not flush summaries at exit: %s", e)
  gc.freeze()


# Checks of `epoch_over` in a row without a counted step before a loop is
# taken for one whose updates the strategy cannot see (a real loop takes a
# step between two checks).
_UNCOUNTED_CHECKS = 1000


class Epochs:
  """One worker's epochs: planned targets, agreed ends, end of training."""

  def __init__(self, rounds, cluster, schedule, averages, end_round_now):
    """`averages()`: whether rounds average anything yet (a model is
    tracked and stepping); `end_round_now()`: ends the round at once on
    this worker, entering its collectives (eager)."""
    self._rounds = rounds
    self._book = rounds.book
    self._cluster = cluster
    self._schedule = schedule
    self._averages = averages
    self._end_round_now = end_round_now
    self._target = None     # fit: cluster steps per planned epoch
    self._order = None      # fit: the shared sample order read, if any
    self._end_step = None   # custom loop: this worker's last step
    self._polled = (None, 0)  # custom loop: (local step, checks at it)

  def plans(self):
    """Whether `fit` epochs are cluster-wide (the Adaptive schedule)."""
    return (self._cluster.is_multi_worker and
            isinstance(self._schedule, schedules_lib.Adaptive))

  def set_target(self, cluster_steps):
    """`fit`'s planned epochs: cluster-wide steps per epoch, or None."""
    self._target = cluster_steps

  def read_in_order(self, order, first_epoch=0):
    """`fit`'s shared sample order (frontends/shared_order.py) hears this
    worker's part of each planned round from now on, from epoch
    `first_epoch`; None: `fit` is over (a read still waiting for a plan
    returns)."""
    if self._order is not None:
      self._order.close()
    self._order = order
    self._book.listen_slices(order.add_slice if order else None)
    if order is not None:
      self._book.tell_first_slice(self._target, first_epoch)

  def begin(self, epoch=None):
    """Keras epoch start: plan the epoch's end if it is cluster-wide."""
    if epoch is not None:
      self._book.epoch_index = epoch
    self._rounds.begin_epoch(self._target)
    self._book.mark_round_start()

  def begin_custom(self, cluster_steps, epoch=None):
    """A custom loop's epoch of `cluster_steps` steps over all workers."""
    if self.plans():  # the plan ends it at a round boundary
      self._target, self._end_step = cluster_steps, None
    else:  # equal shares: each worker takes its part, then all average
      self._target = None
      self._end_step = (int(self._rounds.local_step.numpy()) +
                        -(-cluster_steps // self._cluster.num_workers))
    self.begin(epoch)

  def cluster_epoch(self, epoch):
    """The cluster's number for this worker's `epoch` (they differ after
    the worker was dropped and rejoined: it missed epochs)."""
    return epoch + self._book.epoch_offset

  def custom_over(self):
    """Whether a custom loop's epoch is over on this worker."""
    step = int(self._rounds.local_step.numpy())
    over = (self._book.epoch_over if self._end_step is None else
            step >= self._end_step)
    if not over:
      self._check_steps_counted(step)
    return over

  def _check_steps_counted(self, step):
    """A loop whose updates are not counted (applied outside
    `strategy.run`) would check for ever: no round ends, no epoch end."""
    last, checks = self._polled
    checks = checks + 1 if step == last else 1
    self._polled = (step, checks)
    if checks >= _UNCOUNTED_CHECKS:
      raise RuntimeError(
          f"strategy.epoch_over was checked {checks} times without a "
          "training step counted on this worker: the loop's updates are "
          "not seen. Apply the gradients inside strategy.run (one call per "
          "step), as docs/keras.md's custom loops do.")

  def finish(self):
    """Ends this worker's epoch together with the others (eager; see the
    module docstring). Where the plan ends epochs, they are already over on
    every worker at the same round."""
    book = self._book
    if not self._averages() or book.epoch_over:
      return
    book.exhausted = True
    while not book.epoch_over:
      self._end_round_now()

  def end_training(self):
    """The chief tells workers still dropped that training is over."""
    if self._book.membership is not None:
      try:
        self._book.membership.finish(self._book.round)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("oscars_tf: could not mark the end of training: %s",
                        e)

  def leave_at_exit(self, timeout):
    """At every exit: a worker says it is done; the chief waits for the
    members to say so (see Membership.wait_until_done), not after an
    uncaught error of its own (the others fail without it anyway)."""
    membership = self._book.membership
    if membership is None:
      return
    if membership.me != 0:
      membership.say_done()
    elif not _uncaught_error.is_set():
      membership.wait_until_done(timeout)

  def finish_at_exit(self):
    """At the exit of a process whose training loop ended by itself (a
    custom loop that never called `begin_epoch`/`end_training`): take part
    in the rounds, with no steps of its own, until every worker's loop has
    ended, so a worker still training never waits for one that left. Not
    after an uncaught error: the others then drop this worker."""
    if _uncaught_error.is_set() or not self._cluster.is_multi_worker:
      return
    try:
      self.finish()
      self.end_training()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("oscars_tf: worker %d could not end its last round at "
                      "exit: %s", self._cluster.worker_index, e)
