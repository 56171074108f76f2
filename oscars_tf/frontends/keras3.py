"""Keras 3: `model.fit/evaluate/predict` correct under OscarsStrategy.

Every hook into Keras 3's internals is here, each with why; each is guarded
by `tests/test_frontends_keras3.py`, which fails loudly when a Keras upgrade
moves one. `install()` wraps the methods of Keras 3's TensorFlow trainer
with `method_wrappers` (what the wrappers do, whatever the flavour);
`_FRONTEND` says what Keras 3 does its own way: its callbacks, which let
only the chief write checkpoints and backups and give each other worker its
own TensorBoard directory, its progress bar of planned epochs, and its
epoch iterators (`keras3_inputs`).
"""

import inspect

import keras

from oscars_tf.frontends import keras3_inputs
from oscars_tf.frontends import method_wrappers

_installed = False


# -- callbacks ----------------------------------------------------------------


class _PlannedProgbar(keras.callbacks.ProgbarLogger):
  """Keras learns an endless input's epoch length from the first epoch and
  then counts past it ("22/21"): a planned epoch's length is this worker's
  own, and differs from epoch to epoch, so it is learnt anew each epoch."""

  def on_epoch_begin(self, epoch, logs=None):
    self.target = None
    super().on_epoch_begin(epoch, logs)


def _planned_progbar(verbose):
  return _PlannedProgbar() if verbose not in (0, 2) else None


def _worker_callbacks(callbacks, strategy, info):
  """Chief-only writes and per-worker log directories."""
  del strategy  # only tf_keras' callbacks need it
  if info.is_chief:
    return callbacks
  for cb in callbacks:
    # Keras' ModelCheckpoint and BackupAndRestore write from every process:
    # on a shared path the workers race and corrupt the file.
    if isinstance(cb, keras.callbacks.ModelCheckpoint):
      cb._save_model = lambda *a, **k: None  # pylint: disable=protected-access
    elif isinstance(cb, keras.callbacks.BackupAndRestore):
      cb._save_model = lambda *a, **k: None  # pylint: disable=protected-access
      cb.delete_checkpoint = False
    elif isinstance(cb, keras.callbacks.TensorBoard):
      cb.log_dir = method_wrappers.worker_log_dir(cb.log_dir,
                                                  info.worker_index)
  return callbacks


def _check_fit(model):
  """Keras 3 applies accumulated gradients in a `cond` whose branch needs
  the strategy's merge_call, which TensorFlow refuses there: under
  MirroredStrategy too, fit fails on its first step deep inside Keras."""
  steps = getattr(model.optimizer, "gradient_accumulation_steps", None)
  if steps:
    raise ValueError(
        f"OscarsStrategy: the optimizer's gradient_accumulation_steps={steps} "
        "cannot train under a tf.distribute strategy in Keras "
        f"{keras.__version__} (MirroredStrategy fails the same way): "
        "compile without it (and a larger batch_size where memory allows).")


_FRONTEND = method_wrappers.Frontend(
    strategy_attribute="_distribute_strategy",
    inputs=keras3_inputs.FLAVOUR,
    callback_base=keras.callbacks.Callback,
    tensorboard_type=keras.callbacks.TensorBoard,
    steps_per_execution=lambda model: model.steps_per_execution,
    worker_callbacks=_worker_callbacks,
    planned_progbar=_planned_progbar,
    input_scope=keras3_inputs.epoch_iterators,
    check_fit=_check_fit)


def missing_hooks():
  """The Keras 3 internals this module relies on that are not there."""
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  from keras.src.trainers import epoch_iterator  # pylint: disable=g-import-not-at-top
  from keras.src.trainers.data_adapters import array_slicing  # pylint: disable=g-import-not-at-top
  fit_args = set(inspect.signature(
      trainer.TensorFlowTrainer.fit).parameters)
  checks = {
      "trainer.TFEpochIterator": hasattr(trainer, "TFEpochIterator"),
      "fit(x, y, batch_size, steps_per_epoch, shuffle, sample_weight, "
      "validation_split, validation_data, callbacks, verbose, epochs)": {
          "x", "y", "batch_size", "steps_per_epoch", "shuffle",
          "sample_weight", "validation_split", "validation_data",
          "callbacks", "verbose", "epochs"} <= fit_args,
      "EpochIterator._enumerate_iterator/_get_iterator/reset/data_adapter":
          all(hasattr(epoch_iterator.EpochIterator, a) for a in (
              "_enumerate_iterator", "_get_iterator", "reset")),
      "array_slicing.train_validation_split": hasattr(
          array_slicing, "train_validation_split"),
      "ModelCheckpoint._save_model": hasattr(
          keras.callbacks.ModelCheckpoint, "_save_model"),
      "BackupAndRestore._save_model": hasattr(
          keras.callbacks.BackupAndRestore, "_save_model"),
      "ProgbarLogger.target": "target" in vars(keras.callbacks.ProgbarLogger()),
      "compile(steps_per_execution)": "steps_per_execution" in
          inspect.signature(keras.Model.compile).parameters,
  }
  return [name for name, ok in checks.items() if not ok]


def install():
  """Installs the wrappers once per process (idempotent)."""
  global _installed
  if _installed:
    return
  if keras.backend.backend() != "tensorflow":
    _refuse_backend(keras.backend.backend())
    _installed = True
    return
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  cls = trainer.TensorFlowTrainer
  cls.fit = _FRONTEND.wrap_fit(cls.fit)
  cls.evaluate = _FRONTEND.wrap_unsharded(cls.evaluate)
  cls.predict = _FRONTEND.wrap_unsharded(cls.predict)
  _installed = True


def _refuse_backend(backend):
  """Keras on another backend (JAX, PyTorch, NumPy) ignores TensorFlow's
  strategy scope: its `fit` would train each worker alone, on all the
  data, without a word. It says why instead."""
  def fit(*args, **kwargs):
    del args, kwargs
    raise ValueError(
        f"OscarsStrategy trains Keras models on Keras' TensorFlow backend; "
        f"this process runs Keras on {backend!r} (KERAS_BACKEND or "
        "~/.keras/keras.json). Set KERAS_BACKEND=tensorflow before Keras "
        "is imported.")
  keras.Model.fit = fit
