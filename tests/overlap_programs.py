"""A worker program for overlapped averaging: a custom loop whose gradient
is known exactly, so a test can tell whether every local step survives
the averages taken one round late."""

import json
import sys

import worker_programs


def constant_gradient(params):
  """Every weight's gradient is 1 at every step (the loss is the mean of
  `x @ w` with `x` all ones), so with plain SGD each local step moves
  every weight by -lr, and an averaging of models that took the same
  steps moves nothing: after S steps each weight must be w0 - S * lr,
  w0 being the chief's initial weights (broadcast at the start)."""
  strategy = worker_programs._setup(params)  # pylint: disable=protected-access
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  width, steps, lr = 64, params["steps"], params["lr"]
  with strategy.scope():
    model = keras.Sequential([keras.Input((width,)),
                              keras.layers.Dense(1, use_bias=False)])
    optimizer = keras.optimizers.SGD(lr)
  initial = model.weights[0].numpy().ravel().tolist()  # before the broadcast
  x = tf.ones([4, width])

  @tf.function
  def train_step():
    def step():
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return strategy.run(step)

  for _ in range(steps):
    train_step()
  strategy.sync()
  worker_programs._write(params, strategy, {  # pylint: disable=protected-access
      "initial": initial,
      "weights": model.weights[0].numpy().ravel().tolist(),
      "rounds": strategy.round_history, "stats": strategy.stats()})


if __name__ == "__main__":
  constant_gradient(json.loads(sys.argv[1]))
