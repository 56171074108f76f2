"""Checkpoints are atomic: a crash while writing leaves the previous one."""

import json
import os

import numpy as np
import pytest

from oscars_tf import checkpoint


def _model(seed):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
  model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
  model.fit(np.ones((8, 4)), np.ones((8, 3)), epochs=seed + 1, verbose=0)
  return model


def _weights(model):
  return [np.array(w) for w in model.get_weights()]


def test_save_then_restore_brings_back_weights_and_optimizer(tmp_path):
  first = _model(1)
  checkpoint.save(first, str(tmp_path), epoch=3)
  fresh = _model(7)
  assert checkpoint.restore(fresh, str(tmp_path)) == 3
  for a, b in zip(_weights(first), _weights(fresh)):
    np.testing.assert_array_equal(a, b)
  assert int(fresh.optimizer.iterations.numpy()) == int(
      first.optimizer.iterations.numpy())
  assert checkpoint.restore(_model(2), str(tmp_path / "none")) == 0


@pytest.mark.parametrize("crash_at", ["weights_write", "weights_rename",
                                      "state_write", "state_rename"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path,
                                                             monkeypatch,
                                                             crash_at):
  old, new = _model(1), _model(2)
  checkpoint.save(old, str(tmp_path), epoch=1)
  real_replace = os.replace

  def crash(*args, **kwargs):
    raise OSError("simulated crash")

  if crash_at == "weights_write":
    monkeypatch.setattr(new, "save_weights", crash)
  elif crash_at == "weights_rename":
    monkeypatch.setattr(os, "replace", lambda a, b: (
        crash() if b.endswith(".weights.h5") else real_replace(a, b)))
  elif crash_at == "state_write":
    monkeypatch.setattr(json, "dump", crash)
  else:
    monkeypatch.setattr(os, "replace", lambda a, b: (
        crash() if b.endswith(".json") else real_replace(a, b)))
  with pytest.raises(OSError, match="simulated crash"):
    checkpoint.save(new, str(tmp_path), epoch=2)
  monkeypatch.undo()
  restored = _model(5)
  assert checkpoint.restore(restored, str(tmp_path)) == 1
  for a, b in zip(_weights(old), _weights(restored)):
    np.testing.assert_array_equal(a, b)
  # The next successful save replaces it and removes the superseded file.
  checkpoint.save(new, str(tmp_path), epoch=2)
  assert checkpoint.latest(str(tmp_path))["epoch"] == 2
  assert not (tmp_path / "epoch-1.weights.h5").exists()
