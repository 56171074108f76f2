"""Small data sets for examples and tests, available offline.

`digits` is scikit-learn's bundled copy of the UCI handwritten digits (1,797
8x8 images, 10 classes): it ships inside the scikit-learn wheel, so it needs
no download (`pip install oscars_tf[examples]` brings scikit-learn).
`synthetic` is a generated, linearly separable-ish classification problem of
any size. `mnist`, `fashion_mnist` and `cifar10` come through
`keras.datasets` and need a download on first use (cached in
~/.keras/datasets); offline, they fail with `DatasetUnavailableError` saying
what to use instead.

`stdlib_text` is text: the running Python's standard library sources, read
as bytes through a `tf.data` pipeline from the file list, for byte-level
language models (`stdlib_text()`, not `load`; see its docstring for what it
holds and how it is split). No TensorFlow import at module level.
"""

import collections
import importlib.metadata
import math
import os
import pathlib
import sysconfig
import zlib

import numpy as np

from oscars_tf.errors import OscarsError

OFFLINE = ("digits", "synthetic")
ONLINE = ("mnist", "fashion_mnist", "cifar10")
NAMES = OFFLINE + ONLINE  # what `load` gives: arrays
TEXT = ("stdlib_text",)  # offline text, as tf.data (stdlib_text())


class DatasetUnavailableError(OscarsError):
  """A data set could not be loaded (e.g. no network for its download)."""


def load(name, seed=0, **kwargs):
  """((x_train, y_train), (x_test, y_test)) of data set `name`.

  Image data sets come as float32 in [0, 1] with shape (n, height, width,
  channels); `synthetic` as (n, features). Labels are int32.
  """
  if name in TEXT:
    raise ValueError(f"{name!r} is text, read as tf.data: use "
                     f"oscars_tf.data.{name}(), not load().")
  if name not in NAMES:
    raise ValueError(f"unknown data set {name!r}; choose one of {NAMES} "
                     f"(offline: {OFFLINE}).")
  if name in ONLINE:
    return _keras_dataset(name)
  if name == "digits":
    return digits(seed=seed, images=True, **kwargs)
  return synthetic(seed=seed, **kwargs)


def digits(test_fraction=0.2, seed=0, images=False):
  """((x_train, y_train), (x_test, y_test)); x in [0, 1].

  x has shape (n, 64), or (n, 8, 8, 1) with `images`.
  """
  data, target = _digits_table()
  x = data.reshape(-1, 8, 8, 1) if images else data
  x = (x / 16.0).astype(np.float32)
  y = target.astype(np.int32)
  return _split(x, y, test_fraction, seed)


def _digits_table():
  """(pixels (n, 64), labels (n,)) of scikit-learn's bundled digits.

  Read straight from the CSV inside the installed wheel: importing
  scikit-learn costs a second or more of CPU in every worker process.
  """
  try:
    wheel = importlib.metadata.distribution("scikit-learn")
  except importlib.metadata.PackageNotFoundError:
    raise ImportError("the 'digits' data set comes with scikit-learn: "
                      "pip install 'oscars_tf[examples]' (or scikit-learn), "
                      "or use the 'synthetic' data set.") from None
  path = wheel.locate_file("sklearn/datasets/data/digits.csv.gz")
  if not os.path.exists(path):  # a layout we do not know: ask scikit-learn
    from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
    bunch = load_digits()
    return bunch.data, bunch.target
  table = np.loadtxt(path, delimiter=",")
  return table[:, :-1], table[:, -1]


def synthetic(num_samples=4096, num_features=32, num_classes=10, seed=0,
              test_fraction=0.2, noise=0.5):
  """A Gaussian-cluster classification problem; deterministic for a seed."""
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(num_classes, num_features)).astype(np.float32)
  y = rng.integers(0, num_classes, size=num_samples).astype(np.int32)
  x = centers[y] + noise * rng.normal(size=(num_samples, num_features))
  return _split(x.astype(np.float32), y, test_fraction, seed)


def _split(x, y, test_fraction, seed):
  if not 0 < test_fraction < 1:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
  order = np.random.default_rng(seed).permutation(len(x))
  cut = int(round(len(x) * (1 - test_fraction)))
  tr, te = order[:cut], order[cut:]
  return (x[tr], y[tr]), (x[te], y[te])


def _keras_dataset(name):
  import keras  # pylint: disable=g-import-not-at-top
  module = getattr(keras.datasets, name)
  try:
    (x, y), (x_test, y_test) = module.load_data()
  except Exception as e:  # pylint: disable=broad-except
    # keras reports a failed download as a bare URL/socket error.
    raise DatasetUnavailableError(
        f"could not load {name!r} through keras.datasets (it downloads on "
        f"first use; {type(e).__name__}: {str(e)[:160]}). Offline, use "
        "--dataset=digits (bundled with scikit-learn) or --dataset=synthetic, "
        f"or copy the {name} archive into ~/.keras/datasets/.") from None

  def prepare(images, labels):
    images = images.astype(np.float32) / 255.0
    if images.ndim == 3:
      images = images[..., None]
    return images, labels.reshape(-1).astype(np.int32)

  return prepare(x, y), prepare(x_test, y_test)


# Directories under the stdlib that are not the standard library's own
# sources, or differ between installs of one Python version: installed
# packages, the build's configuration (machine paths), and, unless asked
# for, the test suites (distributions often ship them apart or not at all).
_NOT_STDLIB = ("site-packages", "dist-packages")
_TEST_DIRS = ("test", "tests", "idle_test")

TextSplits = collections.namedtuple(
    "TextSplits", ["train", "validation", "train_windows",
                   "validation_windows"])


def stdlib_text_files(root=None, include_tests=False, validation_percent=5):
  """(train paths, validation paths): the stdlib's *.py files, split.

  A file is in validation when zlib.crc32 of its POSIX path relative to
  `root` (the running Python's stdlib, sysconfig's "stdlib" path, unless
  given) is below `validation_percent` modulo 100: the same split on every
  machine with the same Python version, and a file never in both. Left out:
  site-packages and dist-packages, the build's `config-*` directory and
  `_sysconfigdata*` modules (they hold the build machine's paths), and
  unless `include_tests` the `test`, `tests` and `idle_test` directories.
  Both lists are sorted.
  """
  if not 0 <= validation_percent < 100:
    raise ValueError("validation_percent must be in [0, 100), got "
                     f"{validation_percent!r}")
  root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  train, validation = [], []
  for path in sorted(root.rglob("*.py")):
    relative = path.relative_to(root).as_posix()
    parts = relative.split("/")
    if (parts[0] in _NOT_STDLIB or parts[0].startswith("config-") or
        parts[-1].startswith("_sysconfigdata") or
        (not include_tests and set(parts[:-1]) & set(_TEST_DIRS)) or
        not path.is_file()):
      continue
    held_out = zlib.crc32(relative.encode()) % 100 < validation_percent
    (validation if held_out else train).append(str(path))
  if not train or (validation_percent and not validation):
    raise DatasetUnavailableError(
        f"no Python sources (*.py) under {root} to make 'stdlib_text' of "
        f"({len(train)} for training, {len(validation)} for validation): "
        "this Python's standard library ships compiled files only. Use "
        "another Python, or a data set from oscars_tf.data.NAMES.")
  return train, validation


def count_windows(paths, seq_len):
  """How many windows `text_windows` cuts from `paths`: (size - 1) //
  seq_len per file (a file shorter than seq_len + 1 bytes gives none)."""
  return sum(max(0, (os.path.getsize(p) - 1) // seq_len) for p in paths)


def text_windows(paths, seq_len, batch_size=None, seed=None, repeat=False,
                 shuffle_buffer=16384):
  """A tf.data of (inputs, targets) windows of the byte files `paths`.

  Each file is read whole (tf.io.read_file), decoded to uint8 and cut into
  windows of seq_len + 1 bytes that start seq_len bytes apart (a window's
  last byte is the next one's first, so every byte but a file's first is a
  target once); the tail shorter than a window is dropped. inputs are a
  window's first seq_len bytes, targets its last seq_len (the next byte of
  each input), both int32 of shape (seq_len,) (batched: (batch,
  seq_len)).

  With a `seed` the files are shuffled, and the windows through a buffer of
  `shuffle_buffer` (a new order every pass); without, they come in file
  order. `batch_size`: batches (the last, short one dropped when
  shuffling, for training); None: single windows.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  _check_positive(seq_len=seq_len, batch_size=batch_size or 1)
  if not paths:
    raise ValueError("text_windows needs at least one file.")
  ds = tf.data.Dataset.from_tensor_slices([str(p) for p in paths])
  if seed is not None:
    ds = ds.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)

  def windows(path):
    data = tf.io.decode_raw(tf.io.read_file(path), tf.uint8)
    # Per file, in one op: no per-byte dataset elements.
    return tf.data.Dataset.from_tensor_slices(tf.signal.frame(
        data, seq_len + 1, seq_len, pad_end=False))

  ds = ds.flat_map(windows)
  if seed is not None:
    ds = ds.shuffle(shuffle_buffer, seed=seed + 1,
                    reshuffle_each_iteration=True)
  if repeat:
    ds = ds.repeat()
  if batch_size:
    ds = ds.batch(batch_size, drop_remainder=seed is not None)

  def pair(window):
    window = tf.cast(window, tf.int32)  # Keras' embeddings and losses
    return window[..., :-1], window[..., 1:]
  return ds.map(pair, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
      tf.data.AUTOTUNE)


def stdlib_text(seq_len=64, batch_size=32, seed=0, repeat=False,
                include_tests=False, validation_percent=5, root=None):
  """The Python standard library's sources as a byte-level text corpus.

  The files are those of `stdlib_text_files`. On CPython 3.11.7 (Linux),
  without the test directories: 677 training files of 11,222,368 bytes and
  55 validation files of 857,368 bytes; with them (`include_tests`) 1,691
  files of 30,073,582 bytes and 97 of 1,412,737. Nothing is downloaded and
  nothing is held in memory whole: `text_windows` reads the files as a
  training pipeline would read a user's own.

  Returns:
    TextSplits(train, validation, train_windows, validation_windows): the
    training set shuffled with `seed` (files and windows; endless with
    `repeat`, for `fit(steps_per_epoch=...)`), batched with `batch_size`,
    the validation set in file order (the last batch short), and their
    sizes in windows (for steps_per_epoch: train_windows // batch_size).
    seq_len 64: 175,000 and 13,369 windows (469,065 and 22,023 with
    the tests).
  """
  _check_positive(seq_len=seq_len, batch_size=batch_size)
  train, validation = stdlib_text_files(root, include_tests,
                                        validation_percent)
  return TextSplits(
      text_windows(train, seq_len, batch_size, seed=seed, repeat=repeat),
      text_windows(validation, seq_len, batch_size) if validation else None,
      count_windows(train, seq_len), count_windows(validation, seq_len))


def _check_positive(**values):
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}")


def bits(nats):
  """Cross-entropy in nats as bits (per byte, for a byte-level model)."""
  return nats / math.log(2)
