"""The offline data sets: digits read from scikit-learn's wheel without
importing scikit-learn, the same arrays scikit-learn gives."""

import importlib.metadata

import numpy as np
import pytest

from oscars_tf import data


def test_digits_are_scikit_learns_digits():
  datasets = pytest.importorskip("sklearn.datasets")
  bunch = datasets.load_digits()
  pixels, labels = data._digits_table()  # pylint: disable=protected-access
  np.testing.assert_array_equal(pixels, bunch.data)
  np.testing.assert_array_equal(labels, bunch.target)
  (x, y), (xt, yt) = data.digits(images=True, seed=4)
  (xf, yf), _ = data.digits(images=False, seed=4)
  assert x.shape[1:] == (8, 8, 1) and xf.shape[1:] == (64,)
  np.testing.assert_array_equal(x.reshape(len(x), 64), xf)
  np.testing.assert_array_equal(y, yf)
  everything = np.concatenate([x, xt]).reshape(-1, 64) * 16.0
  assert sorted(map(tuple, everything)) == sorted(map(tuple, bunch.data))
  assert sorted(np.concatenate([y, yt])) == sorted(bunch.target)


def test_digits_without_scikit_learn_says_how_to_get_it(monkeypatch):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  with pytest.raises(ImportError, match=r"oscars_tf\[examples\].*synthetic"):
    data.digits()
