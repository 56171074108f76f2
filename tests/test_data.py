"""The offline data sets: digits read from scikit-learn's wheel without
importing scikit-learn, the same arrays scikit-learn gives; stdlib_text,
Python's standard library as byte windows through tf.data."""

import importlib.metadata
import pathlib
import zlib

import numpy as np
import pytest
import tensorflow as tf

from oscars_tf import data
from oscars_tf import errors


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


def _tree(root, files):
  for relative, content in files.items():
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


def test_stdlib_text_split_is_by_path_hash_disjoint_and_leaves_out_builds(
    tmp_path):
  sources = {f"pkg{i % 7}/mod{i}.py": b"x = 1\n" for i in range(200)}
  other = {"site-packages/numpy/core.py": b"", "dist-packages/a.py": b"",
           "config-3.11-x86_64-linux-gnu/python-config.py": b"",
           "_sysconfigdata__linux_x86_64-linux-gnu.py": b"",
           "README.txt": b"not python"}
  tests = {"test/test_os.py": b"", "idlelib/idle_test/test_a.py": b"",
           "unittest/tests/test_b.py": b""}
  _tree(tmp_path, {**sources, **other, **tests})
  train, validation = data.stdlib_text_files(tmp_path)
  relative = {str(pathlib.Path(p).relative_to(tmp_path).as_posix()): p
              for p in train + validation}
  assert set(relative) == set(sources)  # no build or package files
  assert not set(train) & set(validation)
  assert train == sorted(train) and validation == sorted(validation)
  held_out = {r for r in sources if zlib.crc32(r.encode()) % 100 < 5}
  assert {relative[r] for r in held_out} == set(validation)
  assert 2 <= len(validation) <= 20  # about 5 % of 200
  with_tests, with_tests_validation = data.stdlib_text_files(
      tmp_path, include_tests=True)
  assert len(with_tests) + len(with_tests_validation) == len(sources) + 3
  # Another root, the same relative paths: the same split.
  _tree(tmp_path / "copy", sources)
  again, _ = data.stdlib_text_files(tmp_path / "copy")
  assert [pathlib.Path(p).name for p in again] == [
      pathlib.Path(p).name for p in train]


def test_stdlib_text_of_this_python_has_its_documented_size():
  train, validation = data.stdlib_text_files()
  assert len(train) > 300 and 0.02 < len(validation) / len(train) < 0.1
  assert not any("site-packages" in p for p in train + validation)
  splits = data.stdlib_text(seq_len=64, batch_size=512)
  assert splits.train_windows > 50_000 and splits.validation_windows > 2_000
  assert splits.train_windows == data.count_windows(train, 64)
  # The count (for steps_per_epoch) is what the pipeline gives.
  assert sum(int(x.shape[0]) for x, _ in splits.validation) == (
      splits.validation_windows)


def test_text_windows_are_next_byte_pairs_of_each_file(tmp_path):
  contents = {"a.py": bytes(range(200)), "b.py": bytes(range(255, 90, -1)),
              "short.py": b"abc"}
  _tree(tmp_path, contents)
  paths = [str(tmp_path / name) for name in sorted(contents)]
  seq_len = 16
  pairs = list(data.text_windows(paths, seq_len))
  assert len(pairs) == data.count_windows(paths, seq_len) == (
      199 // 16 + 164 // 16)
  x, y = pairs[0]
  assert x.dtype == tf.int32 and y.dtype == tf.int32
  assert x.shape == y.shape == (seq_len,)
  want = []
  for name in sorted(contents):
    content = np.frombuffer(contents[name], np.uint8).astype(np.int32)
    for start in range(0, len(content) - seq_len, seq_len):
      want.append(content[start:start + seq_len + 1])
  for (x, y), window in zip(pairs, want):
    np.testing.assert_array_equal(x, window[:-1])
    np.testing.assert_array_equal(y, window[1:])  # the next bytes


def test_stdlib_text_training_stream_is_shuffled_batched_and_seeded():
  first = data.stdlib_text(seq_len=32, batch_size=8, seed=3, repeat=True)
  again = data.stdlib_text(seq_len=32, batch_size=8, seed=3)
  other = data.stdlib_text(seq_len=32, batch_size=8, seed=4)
  (x, y), = first.train.take(1)
  assert x.shape == y.shape == (8, 32) and x.dtype == tf.int32
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  (x2, _), = again.train.take(1)
  (x3, _), = other.train.take(1)
  np.testing.assert_array_equal(x, x2)
  assert not np.array_equal(x, x3)
  # Validation comes in file order: a window's last target is the next
  # window's first input (but across a file's end). Training windows are
  # shuffled: they seldom chain.
  (v, vy), = first.validation.take(1)
  assert np.sum(vy[:-1, -1] == v[1:, 0]) >= 6
  (x, y), = first.train.skip(5).take(1)
  assert np.sum(y[:-1, -1] == x[1:, 0]) <= 3


def test_stdlib_text_mistakes_are_clear_errors(tmp_path):
  for bad in ({"seq_len": 0}, {"seq_len": 2.5}, {"batch_size": 0}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      data.stdlib_text(**bad)
  (tmp_path / "only.pyc").write_bytes(b"\0")
  with pytest.raises(data.DatasetUnavailableError, match="no Python sources"):
    data.stdlib_text(root=tmp_path)
  assert issubclass(data.DatasetUnavailableError, errors.OscarsError)
  with pytest.raises(ValueError, match="stdlib_text()"):
    data.load("stdlib_text")
  with pytest.raises(ValueError, match="validation_percent"):
    data.stdlib_text_files(validation_percent=100)
