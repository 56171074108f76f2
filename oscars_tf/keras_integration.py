"""Makes `model.fit/evaluate/predict` correct under OscarsStrategy, unchanged.

`OscarsStrategy()` installs thin wrappers around Keras 3's TensorFlow trainer
methods; they act only for models built under an OscarsStrategy and leave all
other models alone. For `fit` they:

* give each worker its own training input: under the Adaptive schedule an
  endless shuffled stream per worker, with cluster-wide epochs that the plan
  ends at a round boundary (fast workers take more of an epoch's steps);
  otherwise an equal shard per worker, so all run the same steps per epoch;
* add one callback that averages the model at the end of each epoch (before
  validation, so validation, checkpoints and early stopping see the averaged
  model), averages the epoch logs over workers (so every worker's
  EarlyStopping takes the same decision), and averages once more at the end;
* let only the chief write checkpoints/backups, and give each other worker
  its own TensorBoard sub-directory, so workers never race on one path.

`evaluate` and `predict` run on every worker over the whole input, with no
collective: after `fit` all workers hold the same averaged model, so they all
return the same numbers.
"""

import contextlib
import functools
import inspect
import os
import warnings

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from oscars_tf import errors

_installed = False


def _oscars_extended(model):
  strategy = getattr(model, "_distribute_strategy", None)
  extended = getattr(strategy, "extended", None)
  return extended if hasattr(extended, "sync_now") else None


@contextlib.contextmanager
def _no_sharding(extended):
  extended._suppress_sharding += 1  # pylint: disable=protected-access
  try:
    yield
  finally:
    extended._suppress_sharding -= 1  # pylint: disable=protected-access


class AveragingCallback(keras.callbacks.Callback):
  """Averages the model at epoch ends and keeps workers' decisions equal."""

  def __init__(self, extended):
    super().__init__()
    self._extended = extended
    self._in_fit = False

  def on_train_begin(self, logs=None):
    self._in_fit = True
    self._first_step_done = False

  def on_train_batch_end(self, batch, logs=None):
    if not self._first_step_done:  # once per fit
      self._first_step_done = True
      self._extended.mark_first_step_done()

  def on_epoch_begin(self, epoch, logs=None):
    # Plans the epoch's last round when epochs are cluster-wide, and starts
    # the compute clock (validation and callbacks since the last round end
    # are not compute).
    self._extended.begin_epoch(epoch)

  def on_test_begin(self, logs=None):
    if self._in_fit:  # validation inside fit: evaluate the averaged model
      self._extended.sync_now()

  def on_epoch_end(self, epoch, logs=None):
    self._extended.sync_now()
    if logs:
      keys = sorted(k for k, v in logs.items()
                    if isinstance(v, (int, float, np.number)) or
                    (hasattr(v, "shape") and not v.shape))
      means = self._extended.average_numbers([float(logs[k]) for k in keys])
      logs.update(zip(keys, means))
    # A worker that rejoined after a stall missed epochs: it stops with the
    # others, at the cluster's last epoch, not at its own.
    if self._extended.cluster_epoch(epoch) >= self.params["epochs"] - 1:
      self.model.stop_training = True

  def on_train_end(self, logs=None):
    self._extended.sync_now()
    self._extended.end_training()
    self._extended.finish_logs()
    self._in_fit = False


def _shard_arrays(data, num_workers, index):
  """Every num_workers-th row from `index`, truncated to an equal count."""
  leaves = [a for a in tf.nest.flatten(data) if a is not None]
  n = len(leaves[0])
  usable = n - n % num_workers
  if n % num_workers:
    logging.info("oscars_tf: %d of %d samples are left out of each epoch so "
                 "every worker gets the same number.", n - usable, n)
  return tf.nest.map_structure(
      lambda a: None if a is None else a[index:usable:num_workers], data)


def _is_array_like(data):
  leaves = tf.nest.flatten(data)
  return bool(leaves) and all(
      isinstance(a, (np.ndarray, tf.Tensor)) or
      type(a).__module__.startswith("pandas") for a in leaves)


def _shard_dataset(ds, num_workers, index, steps_per_epoch):
  card = int(ds.cardinality())
  if card >= 0:
    if card < num_workers:
      raise ValueError(f"the training dataset has {card} batch(es), fewer than "
                       f"the {num_workers} workers; each needs at least one.")
    ds = ds.take(card - card % num_workers)
  elif card == tf.data.UNKNOWN_CARDINALITY and steps_per_epoch is None:
    warnings.warn("oscars_tf: the training dataset's length is unknown; pass "
                  "steps_per_epoch so every worker runs the same number of "
                  "steps per epoch.")
  return ds.shard(num_workers, index)


def _planned_stream(extended, args):
  """(stream, cluster steps per epoch) for epochs shared by the cluster.

  Each worker draws batches from its own endless stream; an epoch ends when
  the cluster as a whole has taken a data set's worth of steps (fast workers
  more of them), at the round boundary the plan sets, where Keras' epoch
  loop sees `epoch_over` (see PlannedEpochIterator). Returns None where the
  epoch length cannot be known.
  """
  info = extended._cluster  # pylint: disable=protected-access
  w, i = info.num_workers, info.worker_index
  x, y, sw = args["x"], args["y"], args["sample_weight"]
  spe = args["steps_per_epoch"]
  if isinstance(x, tf.data.Dataset):
    card = int(x.cardinality())
    if spe is None and card < 0:
      return None
    target = spe * w if spe else card
    stream = x.shard(w, i).repeat()
  elif _is_array_like(x):
    batch = args["batch_size"] or 32
    data = tuple(a for a in (x, y, sw) if a is not None)
    n = len(tf.nest.flatten(x)[0])
    target = spe * w if spe else -(-n // batch)
    stream = tf.data.Dataset.from_tensor_slices(data)
    if args["shuffle"]:
      stream = stream.shuffle(n, seed=1000 + i, reshuffle_each_iteration=True)
    else:
      stream = stream.shard(w, i)
    stream = stream.repeat().batch(batch, drop_remainder=True)
  else:
    return None
  stream._oscars_planned_epochs = True  # pylint: disable=protected-access
  return stream, target


def _prepare_fit(model, extended, args):
  """Rewrites `fit` arguments for this worker (see module docstring)."""
  info = extended._cluster  # pylint: disable=protected-access
  if model.jit_compile:
    logging.info("oscars_tf: XLA is turned off for the train step, which "
                 "holds the averaging collective.")
    model.jit_compile = False
  extended.track(model, model.optimizer)
  if not getattr(extended, "_logdir", None):  # log next to Keras' TensorBoard
    for cb in args["callbacks"] or []:
      if isinstance(cb, keras.callbacks.TensorBoard):
        extended.set_logdir(cb.log_dir)
  _check_has_samples(args["x"], info.num_workers)
  if not info.is_multi_worker:
    return args
  w, i = info.num_workers, info.worker_index
  x, y, sw = args["x"], args["y"], args["sample_weight"]
  if args["validation_split"] and args["validation_data"] is None:
    from keras.src.trainers.data_adapters import array_slicing  # pylint: disable=g-import-not-at-top
    (x, y, sw), args["validation_data"] = (
        array_slicing.train_validation_split(
            (x, y, sw), validation_split=args["validation_split"]))
    args["validation_split"] = 0.0
  args.update(x=x, y=y, sample_weight=sw)
  extended._epoch_target = None  # pylint: disable=protected-access
  planned = (extended.plans_epochs() and model.steps_per_execution == 1 and
             _planned_stream(extended, args))
  if planned:
    stream, extended._epoch_target = planned  # pylint: disable=protected-access
    args.update(x=stream, y=None, sample_weight=None, batch_size=None,
                steps_per_epoch=None, shuffle=False)
  else:
    if extended.plans_epochs():
      warnings.warn("oscars_tf: epochs are per worker here (the epoch length "
                    "is unknown, or steps_per_execution > 1), so fast workers "
                    "wait for slow ones at each epoch end; pass "
                    "steps_per_epoch and steps_per_execution=1 for "
                    "cluster-wide epochs.")
    if isinstance(x, tf.data.Dataset):
      x = _shard_dataset(x, w, i, args["steps_per_epoch"])
    elif _is_array_like(x):
      x, y, sw = _shard_arrays((x, y, sw), w, i)
    else:
      warnings.warn(f"oscars_tf: cannot shard a {type(x).__name__} across "
                    "workers; each worker reads all of it. Give each worker "
                    "its own stream (e.g. seed by strategy.worker_index).")
    args.update(x=x, y=y, sample_weight=sw)
  if args["verbose"] in ("auto", 1) and not info.is_chief:
    args["verbose"] = 2  # one line per epoch; the progress bar is the chief's
  args["callbacks"] = _worker_callbacks(list(args["callbacks"] or []), info)
  return args


def _check_has_samples(x, num_workers):
  """Empty training data would stop a worker deep inside Keras' iterator
  (a bare StopIteration) while its peers wait for it: fail clearly here."""
  if _is_array_like(x):
    n = len(tf.nest.flatten(x)[0])
  elif isinstance(x, tf.data.Dataset) and int(x.cardinality()) >= 0:
    n = int(x.cardinality())
  else:
    return
  if n == 0:
    raise ValueError("oscars_tf: `fit` got no training data (0 samples or "
                     "batches); every worker needs at least one batch.")
  if n < num_workers:
    raise ValueError(f"oscars_tf: `fit` got {n} training sample(s) or "
                     f"batch(es) for {num_workers} workers; each worker needs "
                     "at least one.")


def _worker_callbacks(callbacks, info):
  """Chief-only writes and per-worker log directories."""
  if info.is_chief:
    return callbacks
  for cb in callbacks:
    if isinstance(cb, keras.callbacks.ModelCheckpoint):
      cb._save_model = lambda *a, **k: None  # pylint: disable=protected-access
    elif isinstance(cb, keras.callbacks.BackupAndRestore):
      cb._save_model = lambda *a, **k: None  # pylint: disable=protected-access
      cb.delete_checkpoint = False
    elif isinstance(cb, keras.callbacks.TensorBoard):
      own = f"worker_{info.worker_index}"
      if os.path.basename(os.path.normpath(cb.log_dir)) != own:  # once only
        cb.log_dir = os.path.join(cb.log_dir, own)
  return callbacks


def _wrap_fit(original):
  signature = inspect.signature(original)

  @functools.wraps(original)
  def fit(self, *args, **kwargs):
    extended = _oscars_extended(self)
    if extended is None:
      return original(self, *args, **kwargs)
    bound = signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    call = dict(bound.arguments)
    call.pop("self")
    call = _prepare_fit(self, extended, call)
    call["callbacks"] = [AveragingCallback(extended)] + list(
        call["callbacks"] or [])
    with _no_sharding(extended), _peer_errors_explained(extended), \
        _planned_epoch_iterator():
      return original(self, **call)
  return fit


@contextlib.contextmanager
def _planned_epoch_iterator():
  """Lets the plan decide when each epoch's data ends (see below)."""
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  original = trainer.TFEpochIterator
  trainer.TFEpochIterator = _planned_iterator_class(original)
  try:
    yield
  finally:
    trainer.TFEpochIterator = original


@functools.lru_cache(maxsize=None)
def _planned_iterator_class(base):

  class PlannedEpochIterator(base):
    """Keras' epoch iterator, for a stream whose epochs the plan ends.

    One endless iterator serves the whole `fit` (no per-epoch iterator to
    build); each epoch yields steps until the round that ends the epoch has
    ended on this worker, which happens on every worker at the same round.
    """

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self._planned = getattr(kwargs.get("x"), "_oscars_planned_epochs",
                              False)
      self._stream = None

    def _enumerate_iterator(self):
      if not self._planned:
        yield from super()._enumerate_iterator()
        return
      if self._stream is None:
        self._stream = iter(self._get_iterator())
      rounds = self._distribute_strategy.extended._rounds  # pylint: disable=protected-access
      step = 0
      while not rounds.epoch_over:
        yield step, step, self._stream
        step += 1

  return PlannedEpochIterator


_PEER_ERRORS = (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
                tf.errors.CancelledError, tf.errors.AbortedError)


@contextlib.contextmanager
def _peer_errors_explained(extended):
  """Turns a failed averaging collective inside the step into a clear error."""
  try:
    yield
  except _PEER_ERRORS as e:
    if "Collective" not in str(e):
      raise
    info = extended._cluster  # pylint: disable=protected-access
    kind = ("did not arrive in time" if isinstance(
        e, tf.errors.DeadlineExceededError) else "is gone")
    raise errors.WorkerLostError(
        f"worker {info.worker_index}: a peer {kind} at an averaging point "
        f"({type(e).__name__}); a worker may have died, stalled, or stopped "
        "training earlier than the others. This process's collectives are "
        "now aborted: restart the job (from a checkpoint).") from e


def _wrap_unsharded(original):
  @functools.wraps(original)
  def method(self, *args, **kwargs):
    extended = _oscars_extended(self)
    if extended is None:
      return original(self, *args, **kwargs)
    with _no_sharding(extended):
      return original(self, *args, **kwargs)
  return method


def install():
  """Installs the wrappers once per process (idempotent)."""
  global _installed
  if _installed:
    return
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  cls = trainer.TensorFlowTrainer
  cls.fit = _wrap_fit(cls.fit)
  cls.evaluate = _wrap_unsharded(cls.evaluate)
  cls.predict = _wrap_unsharded(cls.predict)
  _installed = True
