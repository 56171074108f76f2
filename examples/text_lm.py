"""Text data sets in examples/train.py: --dataset=stdlib_text, a byte-level
corpus read as tf.data from its files (oscars_tf.data.stdlib_text), for
--model=transformer_lm, reported in bits per byte on its validation split.

Every worker builds the same shuffled, endless stream of training windows
(same --seed); Keras `fit` under OscarsStrategy gives each worker its own
shard of it (docs/keras.md, "Input kinds"), and the custom loop
(loops.train) shards it the same way. An epoch is --steps_per_epoch steps
per worker, by default the training windows' worth over the cluster.
"""

from absl import flags
import numpy as np

from oscars_tf import data

flags.DEFINE_integer("seq_len", 64, "Text data sets: bytes a window holds "
                     "(the model's context).", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 0, "Text data sets: steps per "
                     "worker per epoch; 0: the training windows' worth over "
                     "the cluster.", lower_bound=0)
flags.DEFINE_integer("eval_windows", 0, "Text data sets: validation "
                     "windows evaluated (the first, in file order); 0: "
                     "all.", lower_bound=0)
flags.DEFINE_integer("d_model", 64, "--model=transformer_lm: width.",
                     lower_bound=1)
flags.DEFINE_integer("num_layers", 2, "--model=transformer_lm: blocks.",
                     lower_bound=1)
flags.DEFINE_integer("num_heads", 4, "--model=transformer_lm: attention "
                     "heads (a divisor of --d_model).", lower_bound=1)
FLAGS = flags.FLAGS


def model_sizes():
  """models.build's sizes for a text model."""
  return {"d_model": FLAGS.d_model, "num_layers": FLAGS.num_layers,
          "num_heads": FLAGS.num_heads}

NUM_CLASSES = 256  # bytes
_EVAL_BATCH = 256


def load(name, batch_size, seed, num_workers, **kwargs):
  """(text, (x, y), (x_test, y_test)) of data set `name`: for a text data
  set a `Text`, one batch of it (to time a step) and no test arrays; for
  the others None and `data.load`'s arrays."""
  if name not in data.TEXT:
    return (None, *data.load(name, seed=seed, **kwargs))
  text = Text(name, batch_size, seed, num_workers)
  return text, text.sample(), (None, None)


class Text:
  """A text data set as train.py uses one: its inputs, its evaluation."""

  def __init__(self, name, batch_size, seed, num_workers):
    if name not in data.TEXT:
      raise ValueError(f"{name!r} is not a text data set {data.TEXT}.")
    self._batch_size, self._seed = batch_size, seed
    self.splits = self._load(seed)
    self.steps_per_epoch = FLAGS.steps_per_epoch or max(
        1, self.splits.train_windows // (batch_size * num_workers))
    self._forward = None

  def _load(self, seed):
    return data.stdlib_text(FLAGS.seq_len, self._batch_size, seed=seed,
                            repeat=True)

  def sample(self):
    """(inputs, targets) of one batch, as NumPy arrays (for step timing)."""
    x, y = next(iter(self.splits.validation))
    return x.numpy(), y.numpy()

  def fit_kwargs(self, epoch=None):
    """Keras fit's input arguments; with an `epoch` (--deterministic) a
    stream whose order is a function of (seed, epoch) alone."""
    splits = self.splits if epoch is None else self._load(
        self._seed * 100003 + epoch)
    return {"x": splits.train, "steps_per_epoch": self.steps_per_epoch,
            "shuffle": False}

  def loop_kwargs(self):
    """loops.train's input arguments."""
    return {"dataset": self.splits.train,
            "steps_per_epoch": self.steps_per_epoch}

  def evaluate(self, model):
    """(loss in nats, next-byte accuracy) on the validation windows; this
    worker alone, no collective."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if self._forward is None:
      self._forward = tf.function(lambda x: model(x, training=False))
    ds = self.splits.validation.unbatch()
    if FLAGS.eval_windows:
      ds = ds.take(FLAGS.eval_windows)
    nats, correct, count = 0.0, 0, 0
    for x, y in ds.batch(_EVAL_BATCH):
      logits = self._forward(x)
      nats += float(tf.reduce_sum(
          tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)))
      correct += int(tf.reduce_sum(tf.cast(
          tf.argmax(logits, -1, output_type=tf.int32) == y, tf.int32)))
      count += int(np.prod(y.shape))
    return nats / count, correct / count

  def curve(self, loss):
    """What an epoch's point of the curve adds."""
    return {"val_bits_per_byte": data.bits(loss)}

  def result(self, loss):
    """What a run's result JSON adds for a text data set."""
    return {"val_bits_per_byte": data.bits(loss), "seq_len": FLAGS.seq_len,
            "steps_per_epoch": self.steps_per_epoch,
            "train_windows": self.splits.train_windows,
            "validation_windows": self.splits.validation_windows}
