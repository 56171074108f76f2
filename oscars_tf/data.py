"""Small data sets for examples and tests, available offline.

`digits` is scikit-learn's bundled copy of the UCI handwritten digits (1,797
8x8 images, 10 classes): it ships inside the scikit-learn wheel, so it needs
no download (`pip install oscars_tf[examples]` brings scikit-learn).
`synthetic` is a generated, linearly separable-ish classification problem of
any size. `mnist`, `fashion_mnist` and `cifar10` come through
`keras.datasets` and need a download on first use (cached in
~/.keras/datasets); offline, they fail with `DatasetUnavailableError` saying
what to use instead. No TensorFlow import at module level.
"""

import importlib.metadata
import os

import numpy as np

from oscars_tf.errors import OscarsError

OFFLINE = ("digits", "synthetic")
ONLINE = ("mnist", "fashion_mnist", "cifar10")
NAMES = OFFLINE + ONLINE


class DatasetUnavailableError(OscarsError):
  """A data set could not be loaded (e.g. no network for its download)."""


def load(name, seed=0, **kwargs):
  """((x_train, y_train), (x_test, y_test)) of data set `name`.

  Image data sets come as float32 in [0, 1] with shape (n, height, width,
  channels); `synthetic` as (n, features). Labels are int32.
  """
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
