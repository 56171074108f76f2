"""Keras 3's inputs under OscarsStrategy: one worker's share, planned epochs.

`FLAVOUR` tells `fit_inputs` how Keras 3 shards and streams a `PyDataset`
and splits validation data. `epoch_iterators()` swaps Keras' epoch iterator
for the length of a call: for planned epochs (Adaptive schedule) one whose
epochs the plan ends, and in every call one whose tf.data iterators are
deleted off the training thread when the call returns (deferred_release).
"""

import contextlib
import functools

import keras

from oscars_tf.frontends import deferred_release
from oscars_tf.frontends import fit_inputs


class ShardedPyDataset(fit_inputs.BatchShard, keras.utils.PyDataset):
  """One worker's shard of a PyDataset (see `fit_inputs.BatchShard`).

  `workers`, `use_multiprocessing` and `max_queue_size` are the wrapped
  dataset's, so its loading stays parallel.
  """

  def __init__(self, data, num_workers, index):
    super().__init__(workers=data.workers,
                     use_multiprocessing=data.use_multiprocessing,
                     max_queue_size=data.max_queue_size)
    self.data, self.num_workers, self.index = data, num_workers, index

  def on_epoch_begin(self):
    self.data.on_epoch_begin()

  def on_epoch_end(self):
    self.data.on_epoch_end()


class StreamPyDataset(keras.utils.PyDataset):
  """An endless stream of a PyDataset's batches, in an order of this
  worker's own (a permutation per pass, seeded by the worker and the pass):
  each batch is drawn about once per cluster epoch."""

  def __init__(self, data, index):
    super().__init__(workers=data.workers,
                     use_multiprocessing=data.use_multiprocessing,
                     max_queue_size=data.max_queue_size)
    self.data, self.index = data, index
    self._order = fit_inputs.OwnBatchOrder(index)

  @property
  def num_batches(self):
    return None  # endless: the plan ends each epoch

  def __getitem__(self, i):
    return self.data[self._order.batch(i, len(self.data))]

  # The adapter's one epoch spans the whole `fit`: its begin and end are
  # the first epoch's begin and the last one's end; `next_epoch` comes
  # between two agreed epochs, where Keras would call both.
  def on_epoch_begin(self):
    self.data.on_epoch_begin()

  def on_epoch_end(self):
    self.data.on_epoch_end()

  def next_epoch(self):
    self.data.on_epoch_end()
    self.data.on_epoch_begin()


def split_validation(arrays, fraction):
  # Keras' own split, so validation_split means what it means without us.
  from keras.src.trainers.data_adapters import array_slicing  # pylint: disable=g-import-not-at-top
  return array_slicing.train_validation_split(arrays,
                                              validation_split=fraction)


FLAVOUR = fit_inputs.Flavour(
    name="keras3", py_dataset_types=(keras.utils.PyDataset,),
    shard_py_dataset=ShardedPyDataset, stream_py_dataset=StreamPyDataset,
    split_validation=split_validation)


@contextlib.contextmanager
def epoch_iterators(planned=False):
  """The call's epoch iterators: planned ones (see below) if `planned`;
  all of them released off this thread when the call returns.

  Keras 3's `fit` (its validation too), `evaluate` and `predict` build their
  `TFEpochIterator` by name from the trainer module, so the class is swapped
  there for the length of the call, for one that remembers its instances.
  Keras drops its references as the call returns; ours are the last, and
  deferred_release deletes the tf.data iterators behind them on a thread of
  its own (a deletion can block for seconds).
  """
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  original = trainer.TFEpochIterator
  cls = original  # inside another call's scope: its `make`
  if isinstance(original, type):
    cls = _keeping_iterator_class(original)
    if planned:
      cls = _planned_iterator_class(cls)
  made = []

  def make(*args, **kwargs):
    made.append(cls(*args, **kwargs))
    return made[-1]

  trainer.TFEpochIterator = make
  try:
    yield
  finally:
    trainer.TFEpochIterator = original
    _close_streams(made)
    deferred_release.release(made)


def _close_streams(made):
  # A function of its own: a loop variable left in epoch_iterators' frame
  # held the last iterator past `release`, and it was deleted on the
  # training thread as the context closed (issue 42).
  for iterator in made:  # stops a PyDataset's loader threads now
    if hasattr(iterator, "close_stream"):
      iterator.close_stream()


@functools.lru_cache(maxsize=None)
def _keeping_iterator_class(base):

  class KeepingEpochIterator(base):
    """Keras' epoch iterator, also holding the tf.data iterators it hands
    out (the latest one or two; see deferred_release.keep_latest).

    `fit`, `evaluate` and `predict` hold the latest one in a loop variable.
    Once Keras itself drops it (a data set of unknown length ends each
    epoch that way), the loop variable is the last reference: the iterator
    was deleted on the training thread as the next epoch took its first
    batch, or as `fit` returned (measured on a loaded machine: one worker
    returned 0.8 to 2.5 s after the others, in 7 of 17 runs).
    """

    def _enumerate_iterator(self):
      # One list over all epochs, released with this object.
      kept = self.__dict__.setdefault("_oscars_kept_iterators", [])
      for begin, end, iterator in super()._enumerate_iterator():
        deferred_release.keep_latest(kept, iterator)
        yield begin, end, iterator
        # Resumed: the loop holds `iterator` now, not the one before.
        deferred_release.keep_latest(kept, count=1)

  return KeepingEpochIterator


@functools.lru_cache(maxsize=None)
def _planned_iterator_class(base):

  class PlannedEpochIterator(base):
    """Keras' epoch iterator, for a stream whose epochs the plan ends.

    One endless iterator serves the whole `fit`; each epoch yields steps
    (`steps_per_execution` at a time) until the round that ends the epoch
    has ended on this worker, which happens on every worker at the same
    round. Validation inside `fit` builds its own, finite iterator.
    """

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self._round_book = self._distribute_strategy.extended.round_book
      self._planned = getattr(kwargs.get("x"), "_oscars_planned_epochs",
                              False)
      self._stream = None
      self._closed = False

    def _enumerate_iterator(self):
      if not self._planned:
        yield from super()._enumerate_iterator()
        return
      if self._stream is None:
        # One "epoch" of the data adapter spans the whole fit (a PyDataset's
        # loader runs from here to close_stream).
        self.data_adapter.on_epoch_begin()
        self._stream = iter(self._get_iterator())
        self._closed = False
      else:  # a PyDataset's own epoch hooks, between agreed epochs
        stream = getattr(self.data_adapter, "py_dataset", None)
        if isinstance(stream, StreamPyDataset):
          stream.next_epoch()
      # The first batch always: Keras also iterates before the first epoch
      # begins (to build the model from one batch), when the last `fit`'s
      # epoch is still over.
      step = 0
      while step == 0 or not self._round_book.epoch_over:
        yield step, step + self.steps_per_execution - 1, self._stream
        step += self.steps_per_execution

    def reset(self):
      # Keras resets once after reading a batch to build the model, which
      # ends the adapter's epoch: the stream is opened anew. The old one is
      # deleted off this thread: its read-ahead may be waiting for a round
      # this worker has yet to train (frontends/shared_order.py), and
      # deleting an iterator waits for its reads.
      old = [self._stream, getattr(self, "_epoch_iterator", None)]
      self._stream = self._epoch_iterator = None
      super().reset()
      deferred_release.release(old)

    def close_stream(self):
      """Ends the adapter's epoch; the stream itself goes with this object
      (see epoch_iterators)."""
      if self._stream is not None and not self._closed:
        self._closed = True
        self.data_adapter.on_epoch_end()

  return PlannedEpochIterator
