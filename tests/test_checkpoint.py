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


def _outer_strategy():
  import oscars_tf  # pylint: disable=g-import-not-at-top
  return oscars_tf.OscarsStrategy(
      devices=["CPU:0", "CPU:1"], local_replicas="local_sgd",
      schedule=oscars_tf.schedules.Fixed(every=2),
      outer_optimizer=oscars_tf.schedules.OuterMomentum(momentum=0.9))


def _bn_model(strategy, units=3):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units),
                              keras.layers.BatchNormalization()])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
  return model


def _fit(model, steps=6):
  rng = np.random.default_rng(0)
  model.fit(rng.normal(size=(8 * steps, 4)), rng.normal(size=(8 * steps, 3)),
            batch_size=8, epochs=1, shuffle=False, verbose=0)


def test_the_outer_optimizer_state_is_saved_and_restored(tmp_path):
  strategy = _outer_strategy()
  model = _bn_model(strategy)
  _fit(model)
  saved = strategy.outer_state()
  # One averaged set: the model's trainable weights only (not BatchNorm's
  # moving statistics, not Adam's slots), momentum moved by the syncs.
  (starts, momenta), = saved
  assert [s.shape for s in starts] == [
      tuple(w.shape) for w in model.trainable_weights]
  assert any(np.any(m != 0) for m in momenta)
  checkpoint.save(model, str(tmp_path), epoch=1, strategy=strategy)
  assert checkpoint.latest(str(tmp_path))["outer"] == "epoch-1.outer.npz"

  # A new run restores it before its state exists (created at fit's start):
  # the state it then creates is the saved one, not start = weights and
  # zero momentum.
  resumed = _outer_strategy()
  fresh = _bn_model(resumed)
  assert checkpoint.restore(fresh, str(tmp_path), resumed) == 1
  resumed.extended.track(fresh, fresh.optimizer)
  resumed.extended.start()
  created = resumed.extended._outer.arrays()  # pylint: disable=protected-access
  for got, want in zip(created[0], saved[0]):
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)

  # Restored into an existing state (a run already started): assigned now.
  _fit(fresh, steps=2)
  checkpoint.restore(fresh, str(tmp_path), resumed)
  for got, want in zip(resumed.outer_state()[0], saved[0]):
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)

  # Superseded outer files go with their weights.
  _fit(model, steps=2)
  checkpoint.save(model, str(tmp_path), epoch=2, strategy=strategy)
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "epoch-2.outer.npz", "epoch-2.weights.h5", "last.json"]


def test_outer_state_of_another_shape_is_a_clear_error(tmp_path):
  strategy = _outer_strategy()
  model = _bn_model(strategy)
  _fit(model, steps=2)
  (starts, momenta), = strategy.outer_state()
  other = _outer_strategy()
  other_model = _bn_model(other, units=5)
  other.restore_outer_state([(starts, momenta)])  # waits for its state
  other.extended.track(other_model, other_model.optimizer)
  with pytest.raises(ValueError, match="another model"):
    other.extended.start()
  with pytest.raises(ValueError, match="another model"):
    strategy.restore_outer_state([(starts[:1], momenta[:1])])


def test_a_crash_while_saving_the_outer_state_leaves_the_previous_one(
    tmp_path, monkeypatch):
  strategy = _outer_strategy()
  model = _bn_model(strategy)
  _fit(model, steps=2)
  checkpoint.save(model, str(tmp_path), epoch=1, strategy=strategy)
  before = strategy.outer_state()
  _fit(model, steps=2)
  real_replace = os.replace

  def crash(a, b):
    if b.endswith(".outer.npz"):
      raise OSError("simulated crash")
    real_replace(a, b)

  monkeypatch.setattr(os, "replace", crash)
  with pytest.raises(OSError, match="simulated crash"):
    checkpoint.save(model, str(tmp_path), epoch=2, strategy=strategy)
  monkeypatch.undo()
  state = checkpoint.latest(str(tmp_path))
  assert state["epoch"] == 1 and state["outer"] == "epoch-1.outer.npz"
  resumed = _outer_strategy()
  fresh = _bn_model(resumed)
  checkpoint.restore(fresh, str(tmp_path), resumed)
  for got, want in zip(resumed.outer_state()[0], before[0]):
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
