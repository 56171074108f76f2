"""Legacy Keras 2 (`tf_keras`): `model.fit/evaluate/predict` correct under
OscarsStrategy.

Every hook into tf_keras' internals is here, each with why; `HOOKS` lists
them and `missing_hooks()` names those a tf_keras upgrade moved (guarded by
`tests/test_frontends.py`). `install()` wraps the methods of
`tf_keras.Model`; the wrappers act only for models built under an
OscarsStrategy.

As in `keras3`: `fit` gives each worker its share of the input
(`fit_inputs`), adds two callbacks (`fit_hooks`: the agreed epoch end and
log averaging before any other callback, the stop agreement after all of
them), lets only the chief write checkpoints and backups, and gives each
other worker its own TensorBoard directory. `evaluate` and `predict` run on
every worker over the whole input with no collective.

tf_keras distributes datasets itself (its `DataHandler` calls
`strategy.experimental_distribute_dataset`), which would shard them by
worker a second time: all three methods run inside `extended.unsharded()`.
Inputs (shards, planned epochs, iterators deleted off the training thread)
are in `tf_keras_inputs`. tf_keras' test and predict steps update mirrored batch
counters, which the strategy would take for training steps: they are made
worker-local (`_local_batch_counters`).
"""

import functools
import inspect
import os

import tensorflow as tf
import tf_keras
from absl import logging
from tensorflow.python.ops import resource_variable_ops
from tf_keras.src import callbacks as callbacks_lib
from tf_keras.src.distribute import distributed_file_utils
from tf_keras.src.engine import data_adapter, training

from oscars_tf.frontends import fit_hooks, fit_inputs, tf_keras_inputs

_installed = False

# Every tf_keras internal this module relies on: (what, attribute). Checked,
# with the instance attributes, by `missing_hooks()`; keep in step with the
# code below.
HOOKS = (
    # The methods wrapped by `install()`, and `fit`'s argument names.
    (training.Model, "fit"), (training.Model, "evaluate"),
    (training.Model, "predict"), (training.Model, "test_on_batch"),
    (training.Model, "predict_on_batch"),
    # Batch counters updated inside the test/predict step (made worker-local
    # by `_local_batch_counters`), and the cached step functions using them.
    (training.Model, "make_test_function"),
    (training.Model, "make_predict_function"),
    # `fit` builds its DataHandler through this module attribute.
    (data_adapter, "get_data_handler"),
    # `_PlannedDataHandler` overrides/reads these.
    (data_adapter, "DataHandler"),
    (data_adapter.DataHandler, "_infer_steps"),
    (data_adapter.DataHandler, "_validate_data_handler"),
    (data_adapter.DataHandler, "_configure_dataset_and_inferred_steps"),
    (data_adapter.DataHandler, "enumerate_epochs"),
    (data_adapter.DataHandler, "steps"),
    # tf_keras' own validation split, so `validation_split` keeps its meaning.
    (data_adapter, "train_validation_split"),
    # Chief-only writes.
    (callbacks_lib.ModelCheckpoint, "_save_model"),
    (callbacks_lib.BackupAndRestore, "_backup"),
    (callbacks_lib.TensorBoard, "_get_log_write_dir"),
    (callbacks_lib.TensorBoard, "_delete_tmp_write_dir"),
    (distributed_file_utils, "remove_temp_dirpath"),
    # The planned epochs' progress bar.
    (callbacks_lib.ProgbarLogger, "_finalize_progbar"),
)


def missing_hooks(instances=True):
  """The hooks of `HOOKS` this tf_keras lacks (names); with `instances`,
  also the instance attributes the module reads or replaces (it builds a
  small model, a DataHandler and a BackupAndRestore to look)."""
  missing = [f"{getattr(o, '__name__', o)}.{a}" for o, a in HOOKS
             if not hasattr(o, a)]
  params = inspect.signature(training.Model.fit).parameters
  missing += [f"Model.fit({name}=)" for name in (
      "x", "y", "batch_size", "epochs", "verbose", "callbacks",
      "validation_split", "validation_data", "shuffle", "sample_weight",
      "steps_per_epoch", "workers", "use_multiprocessing")
              if name not in params]
  if not instances or missing:
    return missing
  looked_at = {
      "Model()": (tf_keras.Sequential(), (
          "_test_counter", "_predict_counter", "test_function",
          "predict_function", "_steps_per_execution")),
      "DataHandler()": (data_adapter.DataHandler(
          tf.data.Dataset.range(2).batch(1)), (
              "_adapter", "_dataset", "_initial_epoch", "_initial_step",
              "_epochs", "_current_step", "_step_increment",
              "_steps_per_execution")),
      "BackupAndRestore()": (callbacks_lib.BackupAndRestore("/nonexistent"),
                             ("_supported_strategies", "backup_dir")),
      "ProgbarLogger()": (callbacks_lib.ProgbarLogger(), ("target",)),
  }
  for what, (obj, attrs) in looked_at.items():
    missing += [f"{what}.{a}" for a in attrs if not hasattr(obj, a)]
  return missing


def _oscars_extended(model):
  strategy = getattr(model, "distribute_strategy", None)
  extended = getattr(strategy, "extended", None)
  return extended if hasattr(extended, "unsharded") else None


# -- callbacks ----------------------------------------------------------------


class _PlannedProgbar(tf_keras.callbacks.ProgbarLogger):
  """tf_keras learns an endless input's epoch length at the end of the first
  epoch, from the model's train counter, which counts all of `fit`: a
  planned epoch's length is this worker's own and differs from epoch to
  epoch, so it is learnt anew each epoch from the steps seen."""

  def __init__(self):
    super().__init__(count_mode="steps")

  def on_epoch_begin(self, epoch, logs=None):
    self.target = None
    super().on_epoch_begin(epoch, logs)

  def _finalize_progbar(self, logs, counter):
    if self.target is None:
      counter = None  # use the steps seen this epoch
    super()._finalize_progbar(logs, counter)


def _worker_callbacks(callbacks, strategy, info):
  """Chief-only writes and per-worker log directories."""
  for cb in callbacks:
    if isinstance(cb, tf_keras.callbacks.BackupAndRestore):
      # It refuses strategies not on its list (it knows Mirrored and
      # MultiWorkerMirrored); ours keeps the same contract.
      cb._supported_strategies = (  # pylint: disable=protected-access
          tuple(cb._supported_strategies) + (type(strategy),))  # pylint: disable=protected-access
  if info.is_chief:
    return callbacks
  for cb in callbacks:
    # tf_keras lets non-chief workers write to a temporary directory
    # (`distributed_file_utils`, through the extended's `should_checkpoint`)
    # and delete it: a full save per epoch for nothing. They write nothing.
    if isinstance(cb, tf_keras.callbacks.ModelCheckpoint):
      cb._save_model = lambda *a, **k: None  # pylint: disable=protected-access
    elif isinstance(cb, tf_keras.callbacks.BackupAndRestore):
      # All workers restore from the chief's backup at `fit` start; the
      # temporary directory its `on_train_begin` makes here is removed when
      # `fit` ends (`_remove_backup_temp_dirs`).
      cb._backup = lambda *a, **k: None  # pylint: disable=protected-access
    elif isinstance(cb, tf_keras.callbacks.TensorBoard):
      # tf_keras would write non-chief logs to a temporary directory and
      # delete them at the end; each worker keeps its own instead.
      own = f"worker_{info.worker_index}"
      if os.path.basename(os.path.normpath(cb.log_dir)) != own:  # once only
        cb.log_dir = os.path.join(cb.log_dir, own)
      cb._get_log_write_dir = lambda cb=cb: cb.log_dir  # pylint: disable=protected-access
      cb._delete_tmp_write_dir = lambda: None  # pylint: disable=protected-access
  return callbacks


def _remove_backup_temp_dirs(callbacks, strategy, info):
  if info.is_chief:
    return
  for cb in callbacks:
    if (isinstance(cb, tf_keras.callbacks.BackupAndRestore) and
        tf.io.gfile.exists(cb.backup_dir)):
      try:
        distributed_file_utils.remove_temp_dirpath(cb.backup_dir, strategy)
      except tf.errors.OpError as e:
        logging.warning("oscars_tf: could not remove %s's temporary "
                        "directory: %s", cb.backup_dir, e)


# -- fit ----------------------------------------------------------------------


def _prepare_fit(model, extended, args):
  """Rewrites `fit` arguments for this worker; returns (args, planned)."""
  info = extended.cluster
  if model.jit_compile:
    # The train step holds the averaging collective and py_functions, which
    # XLA cannot compile.
    logging.info("oscars_tf: XLA is turned off for the train step, which "
                 "holds the averaging collective.")
    model.jit_compile = False
  if model.autotune_steps_per_execution:
    # Rounds end at execution boundaries, the same number of steps on every
    # worker; tuning it per worker would break that.
    logging.warning("oscars_tf: steps_per_execution='auto' is not tuned "
                    "under OscarsStrategy; it stays at %d.",
                    int(model.steps_per_execution.numpy()))
    model.autotune_steps_per_execution = False
  extended.track(model, model.optimizer)
  extended.set_steps_per_execution(int(model.steps_per_execution.numpy()))
  planned = fit_inputs.rewrite_fit_args(
      extended, args, tf_keras_inputs.FLAVOUR, tf_keras.callbacks.TensorBoard)
  if not extended.cluster.is_multi_worker:
    return args, False
  args["callbacks"] = _worker_callbacks(args["callbacks"],
                                        model.distribute_strategy, info)
  if planned and args["verbose"] != 0:
    args["callbacks"].append(_PlannedProgbar())
  return args, planned


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
    _local_batch_counters(self)
    call, _ = _prepare_fit(self, extended, call)
    hooks = fit_hooks.FitHooks(extended, call["epochs"])
    user_callbacks = list(call["callbacks"])
    # tf_keras converts every step's logs to numpy (a sync per step) unless
    # all callbacks with batch hooks take tensors; these ignore them.
    call["callbacks"] = fit_hooks.with_hooks(
        hooks, user_callbacks, tf_keras.callbacks.Callback, tf_logs=True)
    peer_errors = extended.peer_errors_explained("an averaging point",
                                                 collectives_only=True)
    try:
      with extended.unsharded(), peer_errors, \
          tf_keras_inputs.handlers_released():
        return original(self, **call)
    finally:
      extended.epochs.read_in_order(None)
      _remove_backup_temp_dirs(user_callbacks, self.distribute_strategy,
                               extended.cluster)
  return fit


def _wrap_unsharded(original):
  @functools.wraps(original)
  def method(self, *args, **kwargs):
    extended = _oscars_extended(self)
    if extended is None:
      return original(self, *args, **kwargs)
    _local_batch_counters(self)
    with extended.unsharded(), tf_keras_inputs.handlers_released():
      return original(self, *args, **kwargs)
  return method


def _wrap_local_counters(original):
  @functools.wraps(original)
  def method(self, *args, **kwargs):
    if _oscars_extended(self) is not None:
      _local_batch_counters(self)
    return original(self, *args, **kwargs)
  return method


@tf.__internal__.tracking.no_automatic_dependency_tracking
def _local_batch_counters(model):
  """Makes the test and predict batch counters plain (worker-local)
  variables.

  tf_keras counts test and predict batches in mirrored variables that the
  test/predict step updates inside `strategy.run`; the strategy takes a
  `strategy.run` that updates a distributed variable for a training step
  and would count evaluation batches as training steps, and end rounds
  (collectives) inside `evaluate` and `predict`. A plain variable is not
  seen. (They only feed the progress bar; `no_automatic_dependency_tracking`
  keeps them out of the model's weights, as tf_keras' own.)
  """
  for name in ("_test_counter", "_predict_counter"):
    counter = getattr(model, name)
    if isinstance(counter, tf.distribute.DistributedValues):
      # A subclass is constructed as itself, past the strategy's variable
      # creator (which only `tf.Variable(...)` goes through).
      setattr(model, name, resource_variable_ops.ResourceVariable(
          int(counter.numpy()), dtype=tf.int64, trainable=False))
      # The cached step functions hold the old counter.
      if name == "_test_counter":
        model.test_function = None
      else:
        model.predict_function = None


def install():
  """Installs the wrappers once per process (idempotent)."""
  global _installed
  if _installed:
    return
  missing = missing_hooks(instances=False)
  if missing:
    logging.warning("oscars_tf: tf_keras %s lacks %s; its fit may not work "
                    "under OscarsStrategy.", tf_keras.__version__,
                    ", ".join(missing))
  cls = training.Model
  cls.fit = _wrap_fit(cls.fit)
  cls.evaluate = _wrap_unsharded(cls.evaluate)
  cls.predict = _wrap_unsharded(cls.predict)
  cls.test_on_batch = _wrap_local_counters(cls.test_on_batch)
  cls.predict_on_batch = _wrap_local_counters(cls.predict_on_batch)
  data_adapter.get_data_handler = tf_keras_inputs.wrap_get_data_handler(
      data_adapter.get_data_handler)
  _installed = True
