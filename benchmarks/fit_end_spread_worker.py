"""One worker of a fit_end_spread.py job: a plain Keras 3 script with the
strategy line changed (the driver starts it on every worker through
oscars_tf.launch). It writes when fit started, each epoch ended, training
ended and fit returned, by time.time(), to <outdir>/worker_<i>.json.
"""

import json
import os
import time

import keras
import numpy as np
import tensorflow as tf
from absl import app
from absl import flags
from sklearn.datasets import load_digits

import oscars_tf

SCHEDULES = ("adaptive", "fixed1")  # as fit_end_spread.py's
INPUTS = ("arrays", "dataset_noautotune")

flags.DEFINE_string("outdir", None, "Where each worker writes "
                    "worker_<i>.json.", required=True)
flags.DEFINE_enum("schedule", "adaptive", list(SCHEDULES), "adaptive: "
                  "OscarsStrategy() (the default); fixed1: "
                  "schedules.Fixed(every=1).")
flags.DEFINE_enum("input", "arrays", list(INPUTS), "arrays: NumPy arrays; "
                  "dataset_noautotune: the same batches as a tf.data.Dataset "
                  "with options.autotune.enabled = False.")
flags.DEFINE_integer("epochs", 3, "Epochs.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.",
                     lower_bound=1)
FLAGS = flags.FLAGS


def mnist_like(seed=0):
  """scikit-learn's digits as 28x28x1 float images in [0, 1]: each 8x8
  pixel repeated 3x3, padded by 2. (x_train, y_train, x_val, y_val)."""
  bunch = load_digits()
  images = bunch.images.astype("float32") / 16.0
  images = np.kron(images, np.ones((1, 3, 3), "float32"))
  images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None]
  order = np.random.default_rng(seed).permutation(len(images))
  x, y = images[order], bunch.target[order].astype("int32")
  return x[:1500], y[:1500], x[1500:], y[1500:]


def fit_data(x, y, x_val, y_val):
  """fit's data arguments for --input."""
  if FLAGS.input == "arrays":
    return {"x": x, "y": y, "batch_size": FLAGS.batch_size,
            "validation_data": (x_val, y_val)}
  options = tf.data.Options()
  options.autotune.enabled = False

  def batches(*arrays):
    return tf.data.Dataset.from_tensor_slices(arrays).batch(
        FLAGS.batch_size).with_options(options)
  return {"x": batches(x, y), "validation_data": batches(x_val, y_val)}


def worker_main():
  """One worker: a plain Keras 3 script with the strategy line changed."""
  if FLAGS.schedule == "fixed1":
    strategy = oscars_tf.OscarsStrategy(
        schedule=oscars_tf.schedules.Fixed(every=1))
  else:
    strategy = oscars_tf.OscarsStrategy()
  me = strategy.worker_index
  x, y, x_val, y_val = mnist_like()
  keras.utils.set_random_seed(me)
  with strategy.scope():
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), metrics=["accuracy"])
  epoch_ends, train_end = [], []

  class Times(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      epoch_ends.append(time.time())

    def on_train_end(self, logs=None):
      train_end.append(time.time())

  data = fit_data(x, y, x_val, y_val)
  started = time.time()
  history = model.fit(**data, epochs=FLAGS.epochs, callbacks=[Times()],
                      verbose=0)
  returned = time.time()
  rounds = strategy.round_history
  out = {"worker": me, "fit_start": started, "epoch_ends": epoch_ends,
         "train_end": train_end[0] if train_end else None,
         "fit_return": returned,
         "round_s": [r["compute_s"] + r["wait_s"] + r["comm_s"]
                     for r in rounds],
         "rounds": len(rounds), "local_steps": strategy.stats()["local_step"],
         "val_accuracy": [float(v) for v in
                          history.history.get("val_accuracy", [])]}
  path = os.path.join(FLAGS.outdir, f"worker_{me}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(out, f)
  os.replace(path + ".tmp", path)


def main(argv):
  del argv
  worker_main()


if __name__ == "__main__":
  app.run(main)
