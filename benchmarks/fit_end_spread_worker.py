"""One worker of a fit_end_spread.py job: a plain Keras 3 script with the
strategy line changed (the driver starts it on every worker through
oscars_tf.cli.launch). It writes when fit started, each epoch ended, training
ended and fit returned, by time.time(), to <outdir>/worker_<i>.json.

Models (--model):

  cnn        a 2-conv CNN on MNIST-shaped digits (scikit-learn's, offline).
  slow_mlp   an MLP whose training step sleeps inside the model (a
             numpy_function layer; --model_delay_ms per worker, SIMULATED),
             on NumPy arrays.
  text_lm    a byte-level language model (embedding, two causal
             convolutions) on a shuffled tf.data text pipeline: Python's own
             standard-library sources, which ship with every Python
             (offline). With --cpu_limit_from=ready the worker applies its
             CPU quota once it has joined the cluster.
"""

import json
import os
import time

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import oscars_tf
from oscars_tf.tools import cpu_limits

SCHEDULES = ("adaptive", "fixed1")  # as fit_end_spread.py's
INPUTS = ("arrays", "dataset_noautotune", "text")
MODELS = ("cnn", "slow_mlp", "text_lm")
TEXT_WINDOW = 32  # bytes of context per training sequence

flags.DEFINE_string("outdir", None, "Where each worker writes "
                    "worker_<i>.json.", required=True)
flags.DEFINE_enum("schedule", "adaptive", list(SCHEDULES), "adaptive: "
                  "OscarsStrategy() (the default); fixed1: "
                  "schedules.Fixed(every=1).")
flags.DEFINE_enum("input", "arrays", list(INPUTS), "arrays: NumPy arrays; "
                  "dataset_noautotune: the same batches as a tf.data.Dataset "
                  "with options.autotune.enabled = False; text: the text_lm "
                  "model's shuffled, autotuned tf.data pipeline.")
flags.DEFINE_enum("model", "cnn", list(MODELS), "See the module docstring.")
flags.DEFINE_list("model_delay_ms", ["20", "20", "80"], "slow_mlp: each "
                  "worker's sleep per training step, in ms (SIMULATED; the "
                  "last value for workers past the list).")
flags.DEFINE_integer("text_bytes", 160_000, "text_lm: bytes of text.",
                     lower_bound=TEXT_WINDOW * 64)
flags.DEFINE_integer("epochs", 3, "Epochs.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.",
                     lower_bound=1)
FLAGS = flags.FLAGS


def mnist_like(seed=0):
  """scikit-learn's digits as 28x28x1 float images in [0, 1]: each 8x8
  pixel repeated 3x3, padded by 2. (x_train, y_train, x_val, y_val)."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  bunch = load_digits()
  images = bunch.images.astype("float32") / 16.0
  images = np.kron(images, np.ones((1, 3, 3), "float32"))
  images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None]
  order = np.random.default_rng(seed).permutation(len(images))
  x, y = images[order], bunch.target[order].astype("int32")
  return x[:1500], y[:1500], x[1500:], y[1500:]


def stdlib_text(num_bytes):
  """`num_bytes` of Python's standard-library sources (the same files, in
  name order, on every worker)."""
  folder = os.path.dirname(os.__file__)
  chunks, size = [], 0
  for name in sorted(os.listdir(folder)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(folder, name), "rb") as f:
      chunks.append(f.read())
    size += len(chunks[-1])
    if size >= num_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:num_bytes], np.uint8)


def text_data(num_bytes, batch_size):
  """(train, validation) tf.data pipelines of byte windows: input bytes
  and the next byte at each position. The training one shuffles and maps
  with autotuned parallelism, as a tutorial's text pipeline does."""
  text = stdlib_text(num_bytes).astype("int32")
  count = (len(text) - 1) // TEXT_WINDOW
  windows = text[:count * TEXT_WINDOW + 1]
  starts = np.arange(count) * TEXT_WINDOW
  split = count * 9 // 10

  def pairs(start):
    chunk = tf.gather(windows, tf.range(start, start + TEXT_WINDOW + 1))
    return chunk[:-1], chunk[1:]

  def pipeline(first, last, train):
    ds = tf.data.Dataset.from_tensor_slices(starts[first:last])
    if train:
      ds = ds.shuffle(last - first, seed=0)
    return ds.map(pairs, num_parallel_calls=tf.data.AUTOTUNE).batch(
        batch_size).prefetch(tf.data.AUTOTUNE)
  return pipeline(0, split, True), pipeline(split, count, False)


def build_model(me):
  """The --model, compiled."""
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if FLAGS.model == "text_lm":
    model = keras.Sequential([
        keras.Input((TEXT_WINDOW,), dtype="int32"),
        keras.layers.Embedding(256, 16),
        keras.layers.Conv1D(32, 5, padding="causal", activation="relu"),
        keras.layers.Conv1D(32, 5, padding="causal", activation="relu"),
        keras.layers.Dense(256)])
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=loss)
    return model
  if FLAGS.model == "slow_mlp":
    delays = [float(d) / 1e3 for d in FLAGS.model_delay_ms]
    delay = delays[min(me, len(delays) - 1)]
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
        _SleepLayer(delay), keras.layers.Dense(10)])
  else:
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
  model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss=loss, metrics=["accuracy"])
  return model


class _SleepLayer(keras.layers.Layer):
  """Passes its input on, sleeping `delay` seconds per training step: a
  worker slower inside its model (SIMULATED)."""

  def __init__(self, delay, **kwargs):
    super().__init__(**kwargs)
    self.delay = delay

  def call(self, x, training=None):
    if not training or not self.delay:
      return x

    def sleep(v):
      time.sleep(self.delay)
      return v
    y = tf.numpy_function(sleep, [x], x.dtype)
    y.set_shape(x.shape)
    return y


def fit_data():
  """fit's data arguments for --input and --model."""
  if FLAGS.input == "text":
    train, val = text_data(FLAGS.text_bytes, FLAGS.batch_size)
    return {"x": train, "validation_data": val}
  if FLAGS.model == "slow_mlp":
    from oscars_tf import data  # pylint: disable=g-import-not-at-top
    (x, y), (x_val, y_val) = data.digits()
  else:
    x, y, x_val, y_val = mnist_like()
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
  cpu_limit = cpu_limits.apply_pending()  # --cpu_limit_from=ready, if any
  keras.utils.set_random_seed(me)
  with strategy.scope():
    model = build_model(me)
  epoch_ends, train_end = [], []

  class Times(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      epoch_ends.append(time.time())

    def on_train_end(self, logs=None):
      train_end.append(time.time())

  data = fit_data()
  started = time.time()
  history = model.fit(**data, epochs=FLAGS.epochs, callbacks=[Times()],
                      verbose=0)
  returned = time.time()
  rounds = strategy.round_history
  out = {"worker": me, "fit_start": started, "epoch_ends": epoch_ends,
         "train_end": train_end[0] if train_end else None,
         "fit_return": returned, "cpu_limit": cpu_limit,
         "round_s": [r["compute_s"] + r["wait_s"] + r["comm_s"]
                     for r in rounds],
         "rounds": len(rounds), "local_steps": strategy.stats()["local_step"],
         "val_accuracy": [float(v) for v in
                          history.history.get("val_accuracy", [])],
         "val_loss": [float(v) for v in history.history.get("val_loss", [])]}
  path = os.path.join(FLAGS.outdir, f"worker_{me}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(out, f)
  os.replace(path + ".tmp", path)


def main(argv):
  del argv
  worker_main()


if __name__ == "__main__":
  app.run(main)
