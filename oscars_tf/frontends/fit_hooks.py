"""What the strategy adds to a Keras `fit`, whatever the Keras flavour.

Each flavour's callbacks call these at the matching points; nothing here
imports Keras. The rule that keeps workers from waiting on each other:
every exchange outside the training step is entered by every member at
the same point of `fit`, because each point is reached only through an
agreement, and none waits for a stalled member longer than the straggler
timeout (the logs and the stop vote go through the chief, agreement.py):

* the end of an epoch's training is agreed through the round protocol
  (`extended.epochs.finish`), whatever the input and however many steps
  each worker took;
* validation, the epoch's logs and the stop decision then follow on all
  workers in the same order; `stop_training` set on any worker (by
  EarlyStopping, TerminateOnNaN, a user's callback, Keras running out of
  data) stops every worker after the same epoch.
"""

import functools


class FitHooks:
  """The strategy's part of one `fit` call on one worker."""

  def __init__(self, extended, epochs):
    self._extended = extended
    self._epochs = epochs
    self._first_step_done = False
    self.in_fit = False

  def train_begin(self):
    self.in_fit = True
    self._first_step_done = False
    # Checks and broadcasts the model now rather than at the first step: a
    # worker with no data of its own still starts with the others.
    self._extended.start()

  def train_batch_end(self):
    if not self._first_step_done:
      self._first_step_done = True
      self._extended.mark_first_step_done()

  def epoch_begin(self, epoch):
    # Plans the epoch's last round when epochs are cluster-wide, and starts
    # the compute clock (validation and callbacks are not compute).
    self._extended.epochs.begin(epoch)

  def test_begin(self):
    """Validation inside `fit`: it sees the model averaged at the epoch's
    agreed end (evaluate outside `fit` runs no collective)."""
    if self.in_fit:
      self._extended.epochs.finish()

  def epoch_end(self, logs):
    """Ends the epoch with the others and averages `logs` in place, so every
    worker's callbacks (EarlyStopping, ReduceLROnPlateau, checkpoints) see
    the same numbers and take the same decisions."""
    self._extended.epochs.finish()
    if not logs:
      return
    keys = sorted(k for k, v in logs.items() if _is_number(v))
    means = self._extended.average_numbers([float(logs[k]) for k in keys])
    logs.update(zip(keys, means))

  def should_stop(self, epoch, stop_training):
    """After every callback's `on_epoch_end`: stop on all workers if any
    wants to, and at the cluster's last epoch (a worker that rejoined after
    a stall missed epochs: it stops with the others, not at its own count).
    """
    votes = self._extended.average_numbers([1.0 if stop_training else 0.0])
    # At its own last epoch `fit` ends by itself, as without the strategy
    # (a stop there would skip the input's last on_epoch_end in tf_keras).
    return bool(votes[0] > 0) or (
        epoch < self._epochs - 1 and
        self._extended.epochs.cluster_epoch(epoch) >= self._epochs - 1)

  def train_end(self):
    self._extended.epochs.finish()
    self._extended.epochs.read_in_order(None)  # a read ahead stops waiting
    self._extended.epochs.end_training()
    self._extended.round_logs.finish_logs()
    self.in_fit = False


def with_hooks(hooks, callbacks, callback_base, tf_logs=False):
  """`callbacks` between the strategy's two: the first ends each epoch with
  the others and averages its logs before any user callback sees them; the
  last agrees on stopping after all of them. `callback_base` is the
  flavour's Callback class; `tf_logs` says the two take tensor logs (so
  tf_keras need not convert every step's logs to numpy)."""
  first, last = _callback_classes(callback_base, tf_logs)
  return [first(hooks)] + list(callbacks) + [last(hooks)]


@functools.lru_cache(maxsize=None)
def _callback_classes(base, tf_logs):

  class EpochCallback(base):
    """First callback: the agreed epoch end and averaged logs."""

    def __init__(self, hooks):
      super().__init__()
      self._hooks = hooks
      if tf_logs:
        self._supports_tf_logs = True

    def on_train_begin(self, logs=None):
      self._hooks.train_begin()

    def on_train_batch_end(self, batch, logs=None):
      self._hooks.train_batch_end()

    def on_epoch_begin(self, epoch, logs=None):
      self._hooks.epoch_begin(epoch)

    def on_test_begin(self, logs=None):
      self._hooks.test_begin()

    def on_epoch_end(self, epoch, logs=None):
      self._hooks.epoch_end(logs)

    def on_train_end(self, logs=None):
      self._hooks.train_end()

  class StopCallback(base):
    """Last callback: whether to stop, agreed by all workers."""

    def __init__(self, hooks):
      super().__init__()
      self._hooks = hooks
      if tf_logs:
        self._supports_tf_logs = True

    def on_epoch_end(self, epoch, logs=None):
      self.model.stop_training = self._hooks.should_stop(
          epoch, self.model.stop_training)

  return EpochCallback, StopCallback


def _is_number(v):
  if isinstance(v, bool):
    return False
  if isinstance(v, (int, float)):
    return True
  shape = getattr(v, "shape", None)
  return shape is not None and not shape and hasattr(v, "dtype")
