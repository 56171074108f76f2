"""The wrappers of a Keras model's `fit`, `evaluate` and `predict`, whatever
the flavour.

Each flavour module (`keras3`, `tf_keras`) says in a `Frontend` what it does
its own way, and wraps its model class's methods with `Frontend.wrap_fit`
and `Frontend.wrap_unsharded`. The wrappers act only for models built under
an OscarsStrategy.

`fit` turns XLA off, gives each worker its share of the input
(`fit_inputs`), adds two callbacks (`fit_hooks`: the agreed epoch end and
log averaging before any other callback, the stop agreement after all of
them) and the flavour's multi-worker callbacks (chief-only writes, each
other worker's own TensorBoard directory, the progress bar of planned
epochs), and runs unsharded inside the flavour's input scope. `evaluate`
and `predict` run on every worker over the whole input with no collective:
after `fit` all workers hold the same averaged model, so they all return
the same numbers.
"""

import dataclasses
import functools
import inspect
import os
from typing import Callable

from absl import logging

from oscars_tf.frontends import fit_hooks
from oscars_tf.frontends import fit_inputs


def _nothing(*args):
  del args


@dataclasses.dataclass(frozen=True)
class Frontend:
  """What a Keras flavour's wrappers do their own way."""
  strategy_attribute: str       # the model's attribute holding its strategy
  inputs: fit_inputs.Flavour
  callback_base: type           # keras.callbacks.Callback
  tensorboard_type: type        # the strategy logs next to its log_dir
  # (model) -> the steps per execution `fit` runs, fixed for the call.
  steps_per_execution: Callable
  # (callbacks, strategy, info) -> callbacks: on a multi-worker cluster,
  # chief-only writes and per-worker log directories.
  worker_callbacks: Callable
  # (verbose) -> the progress bar planned epochs need, or None.
  planned_progbar: Callable
  # (planned) -> the context manager the call's input iterators live in.
  input_scope: Callable
  tf_logs: bool = False         # fit_hooks.with_hooks' `tf_logs`
  # (model): before every wrapped call on a model under an OscarsStrategy.
  before_call: Callable = _nothing
  # (user callbacks, strategy, info): after `fit`, however it ended.
  after_fit: Callable = _nothing
  # (model): before `fit`; raises a clear error for what this flavour
  # cannot train under a tf.distribute strategy.
  check_fit: Callable = _nothing

  def extended_of(self, model):
    """The extended of `model`'s OscarsStrategy, or None under any other."""
    strategy = getattr(model, self.strategy_attribute, None)
    extended = getattr(strategy, "extended", None)
    return extended if hasattr(extended, "unsharded") else None

  def _refuse_outside_scope(self, model):
    """ValueError for `fit` on a model built outside the scope of the
    OscarsStrategy it is trained under (Keras 3 would fail deep inside
    with a bare AssertionError)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    current = tf.distribute.get_strategy()
    if (current is not getattr(model, self.strategy_attribute, None) and
        hasattr(current.extended, "unsharded")):
      raise ValueError(
          "oscars_tf: this model was built outside `strategy.scope()` of the "
          "OscarsStrategy it is trained under: build (and compile) it inside "
          "`with strategy.scope():`, so that its variables are the "
          "strategy's.")

  def wrap_fit(self, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(model, *args, **kwargs):
      extended = self.extended_of(model)
      if extended is None:
        self._refuse_outside_scope(model)
        return original(model, *args, **kwargs)
      bound = signature.bind(model, *args, **kwargs)
      bound.apply_defaults()
      call = dict(bound.arguments)
      call.pop("self")
      self.before_call(model)
      planned = self._prepare_fit(model, extended, call)
      hooks = fit_hooks.FitHooks(extended, call["epochs"])
      user_callbacks = list(call["callbacks"])
      call["callbacks"] = fit_hooks.with_hooks(
          hooks, user_callbacks, self.callback_base, tf_logs=self.tf_logs)
      peer_errors = extended.peer_errors_explained("an averaging point",
                                                   collectives_only=True)
      try:
        with extended.unsharded(), peer_errors, self.input_scope(planned):
          return original(model, **call)
      except StopIteration as e:
        # Keras 3 takes one batch to build before the first step; on an
        # input of unknown length that gave this worker nothing (a filter,
        # a manual shard) the bare StopIteration would say nothing.
        raise ValueError(
            f"oscars_tf: worker {extended.cluster.worker_index}: `fit`'s "
            "training input gave this worker no batch (an empty dataset: a "
            "filter that kept nothing, or a shard of fewer elements than "
            "workers). Every worker needs at least one batch.") from e
      finally:
        extended.epochs.read_in_order(None)  # a read ahead stops waiting
        self.after_fit(user_callbacks, getattr(model, self.strategy_attribute),
                       extended.cluster)
    return fit

  def wrap_unsharded(self, original):
    """`evaluate` or `predict`: the whole input on every worker."""
    @functools.wraps(original)
    def method(model, *args, **kwargs):
      extended = self.extended_of(model)
      if extended is None:
        return original(model, *args, **kwargs)
      self.before_call(model)
      with extended.unsharded(), self.input_scope(False):
        return original(model, *args, **kwargs)
    return method

  def _prepare_fit(self, model, extended, args):
    """Rewrites `fit`'s arguments for this worker, in place; returns whether
    epochs are planned."""
    info = extended.cluster
    self.check_fit(model)
    if model.jit_compile:
      # The train step holds the averaging collective and py_functions,
      # which XLA cannot compile.
      logging.info("oscars_tf: XLA is turned off for the train step, which "
                   "holds the averaging collective.")
      model.jit_compile = False
    extended.track(model, model.optimizer)
    extended.set_steps_per_execution(self.steps_per_execution(model))
    planned = fit_inputs.rewrite_fit_args(extended, args, self.inputs,
                                         self.tensorboard_type)
    if not info.is_multi_worker:
      return False
    args["callbacks"] = self.worker_callbacks(
        args["callbacks"], getattr(model, self.strategy_attribute), info)
    progbar = self.planned_progbar(args["verbose"]) if planned else None
    if progbar is not None:
      args["callbacks"].append(progbar)
    return planned


def worker_log_dir(log_dir, worker_index):
  """A non-chief worker's own TensorBoard directory under `log_dir`;
  `log_dir` itself if it is that already (a callback used in an earlier
  `fit`)."""
  own = f"worker_{worker_index}"
  if os.path.basename(os.path.normpath(log_dir)) == own:
    return log_dir
  return os.path.join(log_dir, own)
