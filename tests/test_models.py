"""examples/models.py's transformer_lm, in both Keras flavours: its shapes,
its causal attention, its bits-per-byte metric; and examples/loops.py's
custom loop on a text stream."""

import math
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

from oscars_tf import data

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] /
                       "examples"))
import loops  # pylint: disable=g-import-not-at-top,wrong-import-position
import models  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(params=["keras", "tf_keras"])
def keras(request):
  """Either Keras flavour's module."""
  if request.param == "tf_keras":
    return pytest.importorskip("tf_keras")
  import keras as keras3  # pylint: disable=g-import-not-at-top
  return keras3


def _bytes(shape, seed=0):
  return np.random.default_rng(seed).integers(0, 256, shape).astype(np.int32)


def test_transformer_lm_gives_next_byte_logits_from_the_past_only(keras):
  keras.utils.set_random_seed(1)
  model = models.transformer_lm(seq_len=24, d_model=32, num_layers=2,
                                num_heads=4, keras_module=keras)
  x = _bytes((3, 24))
  logits = np.asarray(model(x, training=False))
  assert logits.shape == (3, 24, 256)
  later = x.copy()
  later[:, 10:] = (later[:, 10:] + 1) % 256  # bytes from position 10 on
  changed = np.asarray(model(later, training=False))
  np.testing.assert_allclose(changed[:, :10], logits[:, :10], atol=1e-5)
  assert np.abs(changed[:, 10:] - logits[:, 10:]).max() > 1e-3
  with pytest.raises(ValueError, match="num_heads"):
    models.transformer_lm(d_model=30, num_heads=4, keras_module=keras)


def test_bits_per_byte_metric_is_the_loss_over_ln2(keras):
  keras.utils.set_random_seed(2)
  model = models.transformer_lm(seq_len=16, d_model=16, num_layers=1,
                                num_heads=2, keras_module=keras)
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=[models.bits_per_byte])
  x, y = _bytes((32, 16), 3), _bytes((32, 16), 4)
  result = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
  assert result["bits_per_byte"] == pytest.approx(
      result["loss"] / math.log(2), rel=1e-5)
  assert 7.5 < result["bits_per_byte"] < 8.5  # untrained: about log2(256)
  assert data.bits(result["loss"]) == pytest.approx(
      result["bits_per_byte"], rel=1e-5)


def test_build_refuses_a_transformer_for_images():
  with pytest.raises(ValueError, match="stdlib_text"):
    models.build("transformer_lm", (8, 8, 1), 10)
  assert models.build("transformer_lm", (16,), 256).output_shape == (
      None, 16, 256)


def test_the_custom_loop_trains_on_a_text_stream_with_fits_loss():
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = models.transformer_lm(seq_len=16, d_model=16, num_layers=1,
                                num_heads=2)
  optimizer = keras.optimizers.Adam(3e-3)
  text = data.stdlib_text(seq_len=16, batch_size=8, seed=0, repeat=True)
  losses, stats = loops.train(tf.distribute.get_strategy(), model, optimizer,
                              None, None, 8, 2, dataset=text.train,
                              steps_per_epoch=5)
  assert stats["steps"] == 10
  # A mean over the bytes, as fit's loss (not a sum over each window):
  # about ln(256) = 5.5 nats at the start, less after a few steps.
  assert 3 < losses[1] < losses[0] < 6, losses


def test_the_custom_loop_tracks_the_model_and_optimizer_under_oscars():
  # Without `track`, Adam's second moments would go uncorrected at the
  # averagings (optimizer_state's default) and "average" would fail.
  import keras  # pylint: disable=g-import-not-at-top

  import oscars_tf  # pylint: disable=g-import-not-at-top
  strategy = oscars_tf.OscarsStrategy(
      schedule=oscars_tf.schedules.Fixed(every=2))
  x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int64)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(1e-2)
  losses, stats = loops.train(strategy, model, optimizer, x, y, 8, 1)
  averaged = strategy.extended._averaged  # pylint: disable=protected-access
  assert averaged.model is model and averaged.optimizer is optimizer
  assert stats["steps"] == 4 and np.isfinite(losses[0])
