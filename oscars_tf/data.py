"""Small data sets for examples and tests, available offline.

`digits` is scikit-learn's bundled copy of the UCI handwritten digits (1,797
8x8 images, 10 classes): it ships inside the scikit-learn wheel, so it needs
no download (`pip install oscars_tf[examples]` brings scikit-learn).
`synthetic` is a generated, linearly separable-ish classification problem of
any size. No TensorFlow import.
"""

import numpy as np


def digits(test_fraction=0.2, seed=0):
  """((x_train, y_train), (x_test, y_test)); x in [0, 1], shape (n, 64)."""
  try:
    from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("the 'digits' data set comes with scikit-learn: "
                      "pip install 'oscars_tf[examples]' (or scikit-learn), "
                      "or use the 'synthetic' data set.") from None
  bunch = load_digits()
  x = (bunch.data / 16.0).astype(np.float32)
  y = bunch.target.astype(np.int32)
  return _split(x, y, test_fraction, seed)


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
