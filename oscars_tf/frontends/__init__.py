"""Keras front ends: `model.fit/evaluate/predict` unchanged under the strategy.

One module per Keras flavour holds every hook into that flavour's internals
(`keras3` for Keras 3, `tf_keras` for legacy Keras 2); what a hook does is
flavour-agnostic and lives in `method_wrappers` (the wrapped `fit`,
`evaluate` and `predict`), `fit_hooks` (epoch ends, log averaging, stop
agreement) and `fit_inputs` (each worker's share of the training input).
"""

import functools
import importlib.util
import os
import sys


@functools.cache
def _has_tf_keras():
  # Asked at every scope entry (strategy.run enters it): the search of
  # sys.path once.
  return importlib.util.find_spec("tf_keras") is not None


def install():
  """Installs the wrappers of every Keras flavour this process may use
  (idempotent).

  Keras 3 unless the process asked TensorFlow for legacy Keras
  (TF_USE_LEGACY_KERAS, read as TensorFlow reads it) and has not imported
  Keras 3 itself: importing it only to wrap it costs a tf_keras worker
  seconds. tf_keras whenever it is installed (it imports in about a second).
  """
  legacy = os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")
  if not legacy or "keras" in sys.modules:
    from oscars_tf.frontends import keras3  # pylint: disable=g-import-not-at-top
    keras3.install()
  if not _has_tf_keras():  # tf_keras is optional
    return
  # Installed: an ImportError here means tf_keras moved an internal the
  # front end hooks, which must not pass silently.
  from oscars_tf.frontends import tf_keras  # pylint: disable=g-import-not-at-top
  tf_keras.install()
