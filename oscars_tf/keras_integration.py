"""Makes `model.fit/evaluate/predict` correct under OscarsStrategy, unchanged.

`OscarsStrategy()` installs thin wrappers around Keras 3's TensorFlow trainer
methods; they act only for models built under an OscarsStrategy and leave all
other models alone. For `fit` they:

* shard the training input across workers (each worker its own part, equal
  in size so every worker runs the same number of steps per epoch);
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

  def on_epoch_begin(self, epoch, logs=None):
    # Validation and callbacks ran since the last round ended: not compute.
    self._extended.mark_round_start()

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

  def on_train_end(self, logs=None):
    self._extended.sync_now()
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


def _prepare_fit(model, extended, args):
  """Rewrites `fit` arguments for this worker (see module docstring)."""
  info = extended._cluster  # pylint: disable=protected-access
  if model.jit_compile:
    logging.info("oscars_tf: XLA is turned off for the train step, which "
                 "holds the averaging collective.")
    model.jit_compile = False
  extended.track(model, model.optimizer)
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
  if isinstance(x, tf.data.Dataset):
    x = _shard_dataset(x, w, i, args["steps_per_epoch"])
  elif _is_array_like(x):
    x, y, sw = _shard_arrays((x, y, sw), w, i)
  else:
    warnings.warn(f"oscars_tf: cannot shard a {type(x).__name__} across "
                  "workers; each worker reads all of it. Give each worker its "
                  "own stream (e.g. seed by strategy.worker_index).")
  args.update(x=x, y=y, sample_weight=sw)
  if args["verbose"] in ("auto", 1) and not info.is_chief:
    args["verbose"] = 2  # one line per epoch; the progress bar is the chief's
  args["callbacks"] = _worker_callbacks(list(args["callbacks"] or []), info)
  return args


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
      cb.log_dir = os.path.join(cb.log_dir, f"worker_{info.worker_index}")
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
    with _no_sharding(extended), _peer_errors_explained(extended):
      return original(self, **call)
  return fit


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
