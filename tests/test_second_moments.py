"""optimizer_state="group_variance": Adam's second moment rescaled to the
group's batch at each averaging (distribute/second_moments.py)."""

import numpy as np
import pytest
import tensorflow as tf

import oscars_tf
from oscars_tf.distribute import second_moments


def _flavours():
  import keras  # pylint: disable=g-import-not-at-top
  out = [pytest.param(keras, id="keras3")]
  try:
    import tf_keras  # pylint: disable=g-import-not-at-top
    out.append(pytest.param(tf_keras, id="tf_keras"))
  except ImportError:
    pass
  return out


def _stepped(keras, gradients, beta_1=0.9, beta_2=0.999):
  """An Adam and its variable after one step per gradient."""
  var = tf.Variable(np.zeros(len(gradients[0]), np.float32))
  optimizer = keras.optimizers.Adam(0.01, beta_1=beta_1, beta_2=beta_2)
  optimizer.build([var])
  for g in gradients:
    optimizer.apply_gradients([(tf.constant(g, tf.float32), var)])
  return optimizer, var


def _expected(v, v0, m, t, t0, n, beta_1=0.9, beta_2=0.999):
  decay = beta_2 ** (t - t0)
  kept = decay * v0
  increment = v - kept
  mean_part = (1 - decay) * (m / (1 - beta_1 ** t)) ** 2
  return kept + np.minimum(increment, mean_part) + np.maximum(
      increment - mean_part, 0) / n


@pytest.mark.parametrize("keras", _flavours())
def test_a_rounds_increment_is_rescaled_by_the_group_size(keras):
  rng = np.random.default_rng(0)
  # A mean of 0.3 under noise of 1: the increment holds both parts.
  gradients = 0.3 + rng.normal(size=(20, 5)).astype(np.float32)
  optimizer, var = _stepped(keras, gradients[:1])
  moments = second_moments.SecondMoments(optimizer)
  assert moments.active
  velocity = optimizer._velocities[0]  # pylint: disable=protected-access
  momentum = optimizer._momentums[0]  # pylint: disable=protected-access
  v0 = velocity.numpy().copy()
  for g in gradients[1:]:
    optimizer.apply_gradients([(tf.constant(g), var)])
  v, m = velocity.numpy().copy(), momentum.numpy().copy()
  moments.rescale(tf.constant(4.0))
  want = _expected(v, v0, m, 20, 1, 4.0)
  np.testing.assert_allclose(velocity.numpy(), want, rtol=1e-5)
  assert np.all(velocity.numpy() < v), "the noise part must shrink"
  np.testing.assert_array_equal(momentum.numpy(), m)  # left alone

  # The next round rescales only what it added, from the rescaled value.
  v1 = velocity.numpy().copy()
  for g in gradients[:5]:
    optimizer.apply_gradients([(tf.constant(g), var)])
  v, m = velocity.numpy().copy(), momentum.numpy().copy()
  moments.rescale(tf.constant(2.0))
  np.testing.assert_allclose(velocity.numpy(),
                             _expected(v, v1, m, 25, 20, 2.0), rtol=1e-5)


@pytest.mark.parametrize("keras", _flavours())
def test_a_member_alone_keeps_its_second_moment(keras):
  rng = np.random.default_rng(1)
  optimizer, _ = _stepped(keras, rng.normal(size=(8, 3)))
  moments = second_moments.SecondMoments(optimizer)
  velocity = optimizer._velocities[0]  # pylint: disable=protected-access
  before = velocity.numpy().copy()
  moments.rescale(tf.constant(1.0))
  np.testing.assert_allclose(velocity.numpy(), before, rtol=1e-6)


@pytest.mark.parametrize("keras", _flavours())
def test_a_round_alone_is_not_an_averaging_for_the_next_one(keras):
  """A worker alone in its group averages nothing (each worker of the
  language model's slow_links profile is a host of its own, so alone
  between global syncs): the next real averaging rescales everything v
  gained since the last one, the lone round's steps included."""
  rng = np.random.default_rng(2)
  gradients = 0.3 + rng.normal(size=(20, 5)).astype(np.float32)
  optimizer, var = _stepped(keras, gradients[:1])
  moments = second_moments.SecondMoments(optimizer)
  velocity = optimizer._velocities[0]  # pylint: disable=protected-access
  momentum = optimizer._momentums[0]  # pylint: disable=protected-access
  v0 = velocity.numpy().copy()
  for g in gradients[1:10]:
    optimizer.apply_gradients([(tf.constant(g), var)])
  moments.rescale(tf.constant(1.0))  # the lone round
  for g in gradients[10:]:
    optimizer.apply_gradients([(tf.constant(g), var)])
  v, m = velocity.numpy().copy(), momentum.numpy().copy()
  moments.rescale(tf.constant(4.0))  # the global sync
  np.testing.assert_allclose(velocity.numpy(),
                             _expected(v, v0, m, 20, 1, 4.0), rtol=1e-5)


def test_non_finite_moments_are_left_for_the_poison_guard():
  import keras  # pylint: disable=g-import-not-at-top
  optimizer, _ = _stepped(keras, [[1.0, 2.0]])
  moments = second_moments.SecondMoments(optimizer)
  velocity = optimizer._velocities[0]  # pylint: disable=protected-access
  velocity.assign([np.nan, 0.5])
  moments.rescale(tf.constant(4.0))
  assert np.isnan(velocity.numpy()[0])
  assert np.isfinite(velocity.numpy()[1])


@pytest.mark.parametrize("make", [
    lambda k: k.optimizers.SGD(0.1, momentum=0.9),
    lambda k: k.optimizers.RMSprop(0.01),
    lambda k: k.optimizers.Adagrad(0.1)], ids=["momentum", "rmsprop",
                                               "adagrad"])
def test_optimizers_without_adams_moments_are_left_alone(make):
  import keras  # pylint: disable=g-import-not-at-top
  optimizer = make(keras)
  optimizer.build([tf.Variable([1.0])])
  assert not second_moments.SecondMoments(optimizer).active


def _fit(strategy, keras):
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(512, 8)).astype(np.float32)
  y = (x @ rng.normal(size=(8, 1)) +
       0.5 * rng.normal(size=(512, 1))).astype(np.float32)
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
  model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  return model.get_weights()


def test_local_adam_averaged_every_step_comes_closer_to_synchronous_adam():
  """Two devices stepping on their halves of each batch, averaged after
  every step, against one Adam on the whole batch (synchronous data
  parallelism's update; no MirroredStrategy: its collectives' instance keys
  would meet another test's in this process): with the second moment
  rescaled, the model ends nearer to the synchronous one."""
  import keras  # pylint: disable=g-import-not-at-top
  devices = ["CPU:0", "CPU:1"]
  synchronous = _fit(tf.distribute.get_strategy(), keras)

  def distance(state):
    weights = _fit(oscars_tf.OscarsStrategy(
        devices=devices, local_replicas="local_sgd", optimizer_state=state,
        schedule=oscars_tf.schedules.Fixed(every=1)), keras)
    return np.sqrt(sum(np.sum((a - b) ** 2)
                       for a, b in zip(weights, synchronous)))

  local, rescaled = distance("local"), distance("group_variance")
  assert rescaled < 0.8 * local, (rescaled, local)


def _recompiled_velocity_sum(state):
  """Two local_sgd devices: fit with one Adam, recompile with another, fit
  again; the second Adam's second moments, summed."""
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 4)).astype(np.float32)
  y = rng.normal(size=(256, 1)).astype(np.float32)  # mostly noise
  strategy = oscars_tf.OscarsStrategy(
      devices=["CPU:0", "CPU:1"], local_replicas="local_sgd",
      optimizer_state=state, schedule=oscars_tf.schedules.Fixed(every=2))
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
  model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
  with strategy.scope():
    model.compile(keras.optimizers.Adam(0.01), "mse")
  model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
  return sum(float(np.sum(c.numpy()))
             for v in model.optimizer._velocities  # pylint: disable=protected-access
             for c in second_moments.component_variables(v))


def test_a_recompiled_models_new_adam_is_rescaled_too():
  local = _recompiled_velocity_sum("local")
  rescaled = _recompiled_velocity_sum("group_variance")
  # The noise part of each device's second moment, halved at every
  # averaging: the new optimizer's, not only the first one's.
  assert rescaled < 0.9 * local, (rescaled, local)
