"""tf_keras' inputs under OscarsStrategy: one worker's share, planned epochs.

`FLAVOUR` tells `fit_inputs` how tf_keras shards and streams a `Sequence`
and splits validation data. Planned epochs (Adaptive schedule) run through
`_PlannedDataHandler`, whose epochs the plan ends. Inside
`handlers_released()`, every DataHandler keeps the iterators it hands out,
and they are deleted off the training thread when the call returns
(deferred_release). `get_data_handler` is installed by `tf_keras.install()`.
"""

import contextlib
import functools

import tensorflow as tf
import tf_keras
from tf_keras.src.engine import data_adapter

from oscars_tf.frontends import deferred_release
from oscars_tf.frontends import fit_inputs


class ShardedSequence(fit_inputs.BatchShard, tf_keras.utils.Sequence):
  """One worker's shard of a Sequence (see `fit_inputs.BatchShard`).

  Parallel loading is `fit`'s (`workers`, `use_multiprocessing`), as for
  any Sequence.
  """

  def __init__(self, data, num_workers, index):
    super().__init__()
    self.data, self.num_workers, self.index = data, num_workers, index

  def on_epoch_end(self):
    self.data.on_epoch_end()


class StreamSequence(tf_keras.utils.Sequence):
  """A Sequence's batches in an order of this worker's own (a permutation
  per pass, seeded by the worker and the pass): each batch is drawn about
  once per cluster epoch.

  tf_keras iterates a Sequence once per iterator (`range(len(seq))`, a list
  of that length with `workers`), so the stream is `passes` passes long
  (about 65536 batches) and `_PlannedDataHandler` repeats it. Loading in
  parallel (`workers > 1`) keeps drawing new permutations (its enqueuer calls
  `on_epoch_end` after each pass); with one loader the pattern repeats after
  those batches.
  """

  def __init__(self, data, index):
    super().__init__()
    self.data, self.index = data, index
    self.passes = max(1, -(-65536 // len(data)))
    self._first_pass = 0  # the order's pass this stream's first batch is in
    self._order = fit_inputs.OwnBatchOrder(index)

  def __len__(self):
    return len(self.data) * self.passes

  def __getitem__(self, i):
    length = len(self.data)
    return self.data[self._order.batch(self._first_pass * length + i,
                                       length)]

  def on_epoch_end(self):
    self._first_pass += self.passes
    self.data.on_epoch_end()


def split_validation(arrays, fraction):
  # tf_keras' own split (the last part), so validation_split means what it
  # means without us.
  return data_adapter.train_validation_split(arrays,
                                             validation_split=fraction)


FLAVOUR = fit_inputs.Flavour(
    name="tf_keras", py_dataset_types=(tf_keras.utils.Sequence,),
    shard_py_dataset=ShardedSequence, stream_py_dataset=StreamSequence,
    split_validation=split_validation)


class _PlannedDataHandler(data_adapter.DataHandler):
  """tf_keras' DataHandler for a stream whose epochs the plan ends.

  One endless iterator serves the whole `fit`; each epoch yields steps
  (`steps_per_execution` at a time) until the round that ends the epoch has
  ended on this worker, which happens on every worker at the same round
  (`round_book.epoch_over`). Validation builds its own, finite handler.
  """

  def __init__(self, *args, **kwargs):
    model = kwargs.get("model")
    strategy = (model.distribute_strategy if model is not None else
                tf.distribute.get_strategy())
    self._round_book = strategy.extended.round_book
    # -1 is tf_keras' "no epoch length" (an endless input is refused
    # without it); the plan gives the length.
    kwargs["steps_per_epoch"] = -1
    super().__init__(*args, **kwargs)

  def _infer_steps(self, steps, dataset):
    return None  # no warning that training "runs indefinitely": it doesn't

  def _validate_data_handler(self):
    # tf_keras refuses steps_per_execution > 1 on an input of unknown
    # length, for fear of a partial execution at its end; the stream is
    # endless and rounds end at execution boundaries.
    pass

  def _configure_dataset_and_inferred_steps(self, strategy, x,
                                            steps_per_epoch, class_weight,
                                            distribute):
    # A Sequence stream is finite to tf_keras (its adapter iterates it once
    # per iterator): repeat it, on the adapter so the base class applies
    # class weights and distributes as usual.
    dataset = self._adapter.get_dataset()
    if dataset.cardinality() != tf.data.INFINITE_CARDINALITY:
      endless = dataset.repeat()
      self._adapter.get_dataset = lambda: endless
    super()._configure_dataset_and_inferred_steps(
        strategy, x, steps_per_epoch, class_weight, distribute)

  def enumerate_epochs(self):
    # One iterator for all epochs; the adapter's epoch end (which stops a
    # Sequence's loader threads or processes) once, when `fit` is over.
    iterator = iter(self._dataset)
    stream = getattr(self._adapter, "_keras_sequence", None)
    try:
      for epoch in range(self._initial_epoch, self._epochs):
        if epoch > self._initial_epoch and isinstance(stream, StreamSequence):
          stream.data.on_epoch_end()  # the user's, between agreed epochs
        yield epoch, iterator
    finally:
      self._adapter.on_epoch_end()

  def steps(self):
    # A resumed step count (BackupAndRestore with save_freq in batches)
    # has no meaning in a planned epoch: each starts at step 0.
    self._initial_step = 0
    self._current_step = 0
    spe = int(self._steps_per_execution.numpy())
    self._step_increment = spe - 1
    # The first step always: `epoch_over` is reset by the epoch's begin
    # callback, but must never end an epoch before it started.
    while self._current_step == 0 or not self._round_book.epoch_over:
      yield self._current_step
      self._current_step += spe


def wrap_get_data_handler(original):
  """`fit` builds its DataHandler through `data_adapter.get_data_handler`:
  a planned stream (marked by `fit_inputs`) gets `_PlannedDataHandler`.
  Inside `handlers_released`, handlers are remembered with the iterators
  they hand out, to be deleted off the training thread."""

  @functools.wraps(original)
  def get_data_handler(*args, **kwargs):
    x = kwargs.get("x", args[0] if args else None)
    if getattr(x, "_oscars_planned_epochs", False):
      handler = _PlannedDataHandler(*args, **kwargs)
    else:
      handler = original(*args, **kwargs)
    if _handlers_made:
      _handlers_made[-1].append(_keeping_iterators(handler))
    return handler
  return get_data_handler


_handlers_made = []  # one list per (nested) call inside handlers_released


class _KeepsIterators:
  """A DataHandler that also keeps its epoch iterators, the latest two
  (tf_keras' hold them only in a generator's frame, deleted as `fit`'s loop
  ends; see deferred_release.keep_latest)."""

  def enumerate_epochs(self):
    self.oscars_kept_iterators = []
    for epoch, iterator in super().enumerate_epochs():
      # `fit` holds the last epoch's iterator until it takes this one.
      deferred_release.keep_latest(self.oscars_kept_iterators, iterator)
      yield epoch, iterator


@functools.lru_cache(maxsize=None)
def _keeping_class(cls):
  return type(cls.__name__, (_KeepsIterators, cls), {})


def _keeping_iterators(handler):
  # A class swap, not an attribute: a bound method stored on the instance
  # would make a cycle, which Python's collector frees on any thread.
  handler.__class__ = _keeping_class(type(handler))
  return handler


@contextlib.contextmanager
def handlers_released():
  """Deletes the call's input iterators off this thread when it returns
  (see deferred_release: a deletion can block for seconds)."""
  _handlers_made.append([])
  try:
    yield
  finally:
    deferred_release.release(_handlers_made.pop())
