"""Keras 3: `model.fit/evaluate/predict` correct under OscarsStrategy.

Every hook into Keras 3's internals is here, each with why; each is guarded
by `tests/test_frontends.py`, which fails loudly when a Keras upgrade moves
one. `install()` wraps the methods of Keras 3's TensorFlow trainer; the
wrappers act only for models built under an OscarsStrategy.

For `fit` they give each worker its share of the input (`fit_inputs`), add
two callbacks (`fit_hooks`: the agreed epoch end, log averaging before any
other callback, the stop agreement after all of them), let only the chief
write checkpoints and backups, and give each other worker its own
TensorBoard directory. `evaluate` and `predict` run on every worker over
the whole input with no collective: after `fit` all workers hold the same
averaged model, so they all return the same numbers.
"""

import functools
import inspect
import os

import keras
from absl import logging

from oscars_tf.frontends import fit_hooks
from oscars_tf.frontends import fit_inputs
from oscars_tf.frontends import keras3_inputs

_installed = False


def _oscars_extended(model):
  strategy = getattr(model, "_distribute_strategy", None)
  extended = getattr(strategy, "extended", None)
  return extended if hasattr(extended, "unsharded") else None


# -- callbacks ----------------------------------------------------------------


class _PlannedProgbar(keras.callbacks.ProgbarLogger):
  """Keras learns an endless input's epoch length from the first epoch and
  then counts past it ("22/21"): a planned epoch's length is this worker's
  own, and differs from epoch to epoch, so it is learnt anew each epoch."""

  def on_epoch_begin(self, epoch, logs=None):
    self.target = None
    super().on_epoch_begin(epoch, logs)


def _worker_callbacks(callbacks, info):
  """Chief-only writes and per-worker log directories."""
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
      own = f"worker_{info.worker_index}"
      if os.path.basename(os.path.normpath(cb.log_dir)) != own:  # once only
        cb.log_dir = os.path.join(cb.log_dir, own)
  return callbacks


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
  extended.track(model, model.optimizer)
  extended.set_steps_per_execution(model.steps_per_execution)
  planned = fit_inputs.rewrite_fit_args(extended, args, keras3_inputs.FLAVOUR,
                                       keras.callbacks.TensorBoard)
  if not info.is_multi_worker:
    return args, False
  args["callbacks"] = _worker_callbacks(args["callbacks"], info)
  if planned and args["verbose"] not in (0, 2):
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
    call, planned = _prepare_fit(self, extended, call)
    hooks = fit_hooks.FitHooks(extended, call["epochs"])
    call["callbacks"] = fit_hooks.with_hooks(hooks, call["callbacks"],
                                             keras.callbacks.Callback)
    peer_errors = extended.peer_errors_explained("an averaging point",
                                                 collectives_only=True)
    try:
      with extended.unsharded(), peer_errors, \
          keras3_inputs.epoch_iterators(planned):
        return original(self, **call)
    finally:
      extended.epochs.read_in_order(None)  # a read ahead stops waiting
  return fit


def _wrap_unsharded(original):
  @functools.wraps(original)
  def method(self, *args, **kwargs):
    extended = _oscars_extended(self)
    if extended is None:
      return original(self, *args, **kwargs)
    with extended.unsharded(), keras3_inputs.epoch_iterators():
      return original(self, *args, **kwargs)
  return method


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
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  cls = trainer.TensorFlowTrainer
  cls.fit = _wrap_fit(cls.fit)
  cls.evaluate = _wrap_unsharded(cls.evaluate)
  cls.predict = _wrap_unsharded(cls.predict)
  _installed = True
