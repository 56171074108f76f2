"""Legacy Keras 2 (`tf_keras`): `model.fit/evaluate/predict` correct under
OscarsStrategy.

Every hook into tf_keras' internals is here, each with why; `HOOKS` lists
them and `missing_hooks()` names those a tf_keras upgrade moved (guarded by
`tests/test_frontends.py`). `install()` wraps the methods of
`tf_keras.Model` with `method_wrappers` (what the wrappers do, whatever the
flavour), as `keras3` does; `_FRONTEND` says what tf_keras does its own
way: its callbacks, which let only the chief write checkpoints and backups
and give each other worker its own TensorBoard directory, its progress bar
of planned epochs, and its data handlers (`tf_keras_inputs`).

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

from absl import logging
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
import tf_keras
from tf_keras.src import callbacks as callbacks_lib
from tf_keras.src.distribute import distributed_file_utils
from tf_keras.src.engine import data_adapter
from tf_keras.src.engine import training
from tf_keras.src.mixed_precision import loss_scale_optimizer

from oscars_tf.frontends import method_wrappers
from oscars_tf.frontends import tf_keras_inputs

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
    # Mixed precision's list of strategies (read through the module by
    # the policy, the layers and LossScaleOptimizer).
    (loss_scale_optimizer, "strategy_supports_loss_scaling"),
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


def _planned_progbar(verbose):
  return _PlannedProgbar() if verbose != 0 else None


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
      cb.log_dir = method_wrappers.worker_log_dir(cb.log_dir,
                                                  info.worker_index)
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


def _fixed_steps_per_execution(model):
  """The model's steps per execution, no longer tuned during `fit`."""
  if model.autotune_steps_per_execution:
    # Rounds end at execution boundaries, the same number of steps on every
    # worker; tuning it per worker would break that.
    logging.warning("oscars_tf: steps_per_execution='auto' is not tuned "
                    "under OscarsStrategy; it stays at %d.",
                    int(model.steps_per_execution.numpy()))
    model.autotune_steps_per_execution = False
  return int(model.steps_per_execution.numpy())


def _wrap_local_counters(original):
  @functools.wraps(original)
  def method(self, *args, **kwargs):
    if _FRONTEND.extended_of(self) is not None:
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


_FRONTEND = method_wrappers.Frontend(
    strategy_attribute="distribute_strategy",
    inputs=tf_keras_inputs.FLAVOUR,
    callback_base=tf_keras.callbacks.Callback,
    tensorboard_type=tf_keras.callbacks.TensorBoard,
    steps_per_execution=_fixed_steps_per_execution,
    worker_callbacks=_worker_callbacks,
    planned_progbar=_planned_progbar,
    # Planned epochs get their DataHandler through `get_data_handler`.
    input_scope=lambda planned: tf_keras_inputs.handlers_released(),
    # tf_keras converts every step's logs to numpy (a sync per step) unless
    # all callbacks with batch hooks take tensors; the strategy's ignore them.
    tf_logs=True,
    before_call=_local_batch_counters,
    after_fit=_remove_backup_temp_dirs)


def _allow_loss_scaling(original):
  """tf_keras allows a mixed-precision policy and LossScaleOptimizer only
  under strategies it lists, those where every variable has one copy per
  compute replica (each replica unscales its own gradients). OscarsStrategy
  mirrors a worker's variables on its devices as MirroredStrategy does, and
  each worker applies its own gradients: the condition holds. Keras 3 has
  no such list."""

  @functools.wraps(original)
  def supports():
    if original():
      return True
    from oscars_tf.distribute import strategy  # pylint: disable=g-import-not-at-top
    return isinstance(tf.distribute.get_strategy(), strategy.OscarsStrategy)
  return supports


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
  cls.fit = _FRONTEND.wrap_fit(cls.fit)
  cls.evaluate = _FRONTEND.wrap_unsharded(cls.evaluate)
  cls.predict = _FRONTEND.wrap_unsharded(cls.predict)
  cls.test_on_batch = _wrap_local_counters(cls.test_on_batch)
  cls.predict_on_batch = _wrap_local_counters(cls.predict_on_batch)
  data_adapter.get_data_handler = tf_keras_inputs.wrap_get_data_handler(
      data_adapter.get_data_handler)
  loss_scale_optimizer.strategy_supports_loss_scaling = _allow_loss_scaling(
      loss_scale_optimizer.strategy_supports_loss_scaling)
  _installed = True
