"""Keras front ends: `model.fit/evaluate/predict` unchanged under the strategy.

One module per Keras flavour holds every hook into that flavour's internals
(`keras3` for Keras 3, `tf_keras` for legacy Keras 2); what a hook does is
flavour-agnostic and lives in `fit_hooks` (epoch ends, log averaging, stop
agreement) and `fit_inputs` (each worker's share of the training input).
"""


def install():
  """Installs the wrappers of every Keras flavour that imports (idempotent)."""
  from oscars_tf.frontends import keras3  # pylint: disable=g-import-not-at-top
  keras3.install()
  try:
    from oscars_tf.frontends import tf_keras  # pylint: disable=g-import-not-at-top
  except ImportError:  # tf_keras is optional
    return
  tf_keras.install()
