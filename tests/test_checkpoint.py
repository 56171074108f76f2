"""Checkpoints and round states are atomic (a crash while writing leaves
the previous one), and a restart resumes from the newest of them."""

import contextlib
import json
import os

import numpy as np
import pytest

from oscars_tf import checkpoint
from oscars_tf import errors
from oscars_tf.distribute import round_state


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


def test_another_models_checkpoint_is_one_clear_error(tmp_path):
  import keras  # pylint: disable=g-import-not-at-top
  checkpoint.save(_model(1), str(tmp_path), epoch=1)
  other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5)])
  other.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
  with pytest.raises(ValueError, match=r"epoch-1.weights.h5 does not load "
                     r"into this model \(saved from another model"):
    checkpoint.restore(other, str(tmp_path))
  os.remove(tmp_path / "epoch-1.weights.h5")  # last.json names it still
  with pytest.raises(ValueError, match="does not load into this model"):
    checkpoint.restore(_model(2), str(tmp_path))


def test_a_non_finite_model_never_replaces_a_good_checkpoint(tmp_path,
                                                             caplog):
  # Issue 43: an epoch end where every member was poisoned overwrote the
  # last good checkpoint with NaN weights.
  good, poisoned = _model(1), _model(2)
  checkpoint.save(good, str(tmp_path), epoch=1)
  kernel = poisoned.layers[0].kernel
  kernel.assign(np.full(kernel.shape, np.nan, np.float32))
  with caplog.at_level("WARNING"):
    checkpoint.save(poisoned, str(tmp_path), epoch=2)
  restored = _model(5)
  assert checkpoint.restore(restored, str(tmp_path)) == 1
  for a, b in zip(_weights(good), _weights(restored)):
    np.testing.assert_array_equal(a, b)
  assert [r.getMessage() for r in caplog.records
          if r.getMessage().startswith("oscars_tf")] == [
      "oscars_tf: the model to save at epoch 2 has non-finite weights: not "
      "saved; the last good checkpoint (epoch 1) stays."]


def _crash_while_saving(monkeypatch, model, crash_at):
  """Makes saving `model` fail at `crash_at` (a write or a rename)."""
  real_replace = os.replace

  def crash(*args, **kwargs):
    raise OSError("simulated crash")

  if crash_at == "weights_write":
    monkeypatch.setattr(model, "save_weights", crash)
  elif crash_at == "weights_rename":
    monkeypatch.setattr(os, "replace", lambda a, b: (
        crash() if b.endswith(".weights.h5") else real_replace(a, b)))
  elif crash_at == "state_write":
    monkeypatch.setattr(json, "dump", crash)
  else:
    monkeypatch.setattr(os, "replace", lambda a, b: (
        crash() if b.endswith(".json") else real_replace(a, b)))


@pytest.mark.parametrize("crash_at", ["weights_write", "weights_rename",
                                      "state_write", "state_rename"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path,
                                                             monkeypatch,
                                                             crash_at):
  old, new = _model(1), _model(2)
  checkpoint.save(old, str(tmp_path), epoch=1)
  _crash_while_saving(monkeypatch, new, crash_at)
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


def _position(worker, epoch, step, **extra):
  return dict(worker=worker, epoch=epoch, round=3, optimizer_step=step,
              **extra)


def test_restore_prefers_a_round_state_taken_after_the_epoch_checkpoint(
    tmp_path):
  epoch_model, round_model = _model(1), _model(2)
  checkpoint.save(epoch_model, str(tmp_path), epoch=2)
  # Worker 0 lost a peer in epoch index 2, the one after the checkpoint.
  round_state.save(round_model, str(tmp_path), _position(0, 2, 40))
  fresh = _model(7)
  assert checkpoint.restore(fresh, str(tmp_path)) == 2
  for a, b in zip(_weights(round_model), _weights(fresh)):
    np.testing.assert_array_equal(a, b)
  assert int(fresh.optimizer.iterations.numpy()) == int(
      round_model.optimizer.iterations.numpy())
  assert checkpoint.newest(str(tmp_path))["weights"] == (
      "round-w0-step40.weights.h5")


def test_the_newest_state_wins_and_ties_go_to_the_lowest_worker(tmp_path):
  model, d = _model(1), str(tmp_path)
  checkpoint.save(model, d, epoch=3)
  for worker, epoch, step in [(1, 2, 90),   # before the checkpoint: stale
                              (2, 3, 70), (3, 3, 75), (4, 3, 75)]:
    round_state.save(model, d, _position(worker, epoch, step))
  assert checkpoint.newest(d)["worker"] == 3
  round_state.save(model, d, _position(5, 4, 1))  # a later epoch wins
  assert checkpoint.newest(d)["worker"] == 5
  # A worker's new state replaces its old one (and its weights file).
  round_state.save(model, d, _position(2, 4, 9))
  assert checkpoint.newest(d)["worker"] == 2
  assert not (tmp_path / "round-w2-step70.weights.h5").exists()
  # With no round state newer than it, the epoch checkpoint.
  assert round_state.newest(d, {"epoch": 5, "weights": "x"})["weights"] == "x"


def test_an_epoch_checkpoint_deletes_the_round_states_it_supersedes(tmp_path):
  model, d = _model(1), str(tmp_path)
  round_state.save(model, d, _position(0, 1, 20))
  round_state.save(model, d, _position(1, 2, 30))
  checkpoint.save(model, d, epoch=2)
  assert [s["worker"] for s in round_state.states(d)] == [1]
  checkpoint.save(model, d, epoch=3)
  assert round_state.states(d) == []
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "epoch-3.weights.h5", "last.json"]


@pytest.mark.parametrize("crash_at", ["weights_write", "weights_rename",
                                      "state_write", "state_rename"])
def test_a_crash_while_saving_a_round_state_leaves_the_previous_one(
    tmp_path, monkeypatch, crash_at):
  old, new, d = _model(1), _model(2), str(tmp_path)
  round_state.save(old, d, _position(0, 1, 10))
  _crash_while_saving(monkeypatch, new, crash_at)
  with pytest.raises(OSError, match="simulated crash"):
    round_state.save(new, d, _position(0, 1, 11))
  monkeypatch.undo()
  assert checkpoint.newest(d)["optimizer_step"] == 10
  restored = _model(5)
  assert checkpoint.restore(restored, d) == 1
  for a, b in zip(_weights(old), _weights(restored)):
    np.testing.assert_array_equal(a, b)


class _Rounds:
  """The parts of rounds.Rounds (and its round book) a Keeper reads."""

  class book:  # noqa: N801 (stands for a round_book.RoundBook)
    epoch_index, epoch_offset, round, last_sync_step = 2, 1, 7, 30
    rounds_before = 0

  class local_step:  # noqa: N801 (stands for a tf.Variable)
    @staticmethod
    def numpy():
      return 36


def test_a_lost_peer_saves_the_round_state_once_and_the_error_goes_on(
    tmp_path):
  model, d = _model(1), str(tmp_path)
  keeper = round_state.Keeper(model, d, 1, _Rounds())

  def lose_a_peer():
    with round_state.saved_when_peer_lost(keeper, contextlib.nullcontext()):
      with round_state.saved_when_peer_lost(keeper, contextlib.nullcontext()):
        raise errors.WorkerLostError("a peer is gone")

  with pytest.raises(errors.WorkerLostError) as raised:
    lose_a_peer()
  state = raised.value.round_state
  assert (state["worker"], state["epoch"], state["round"],
          state["steps_since_average"]) == (1, 3, 7, 6)
  assert state["optimizer_step"] == int(model.optimizer.iterations.numpy())
  assert [s["saved_at"] for s in round_state.states(d)] == [state["saved_at"]]
  # Other errors save nothing.
  with pytest.raises(ValueError):
    with round_state.saved_when_peer_lost(keeper, contextlib.nullcontext()):
      raise ValueError("a bug")
  assert len(round_state.states(d)) == 1


def test_a_round_state_holds_the_outer_optimizer_state(tmp_path):
  # A restart after a lost peer resumes the outer momentum too.
  strategy = _outer_strategy()
  model, d = _bn_model(strategy), str(tmp_path)
  sets = [([np.full((4, 3), 1.5, np.float32), np.arange(3, dtype=np.float32)],
           [np.full((4, 3), -0.5, np.float32), np.ones(3, np.float32)])]
  keeper = round_state.Keeper(model, d, 1, _Rounds(), outer_state=lambda: sets)
  state = keeper.save()
  assert os.path.exists(os.path.join(d, state["outer"]))
  resumed = _outer_strategy()
  checkpoint.restore(_bn_model(resumed), d, resumed)
  got = resumed.outer_state()
  assert len(got) == 1
  for got_arrays, want_arrays in zip(got[0], sets[0]):
    for a, b in zip(got_arrays, want_arrays):
      np.testing.assert_array_equal(a, b)
  # A newer epoch checkpoint removes the round state, its outer file too.
  checkpoint.save(model, d, state["epoch"] + 1, strategy)
  assert not [f for f in os.listdir(d) if f.startswith("round-")]


def test_a_keeper_that_cannot_save_lets_the_peer_error_through(tmp_path,
                                                               monkeypatch):
  model = _model(1)
  keeper = round_state.Keeper(model, str(tmp_path / "a"), 0, _Rounds())
  monkeypatch.setattr(model, "save_weights", lambda path: 1 / 0)
  assert keeper.save() is None
  model.layers[0].kernel.assign(np.full((4, 3), np.nan))
  monkeypatch.undo()
  assert keeper.save() is None  # non-finite weights are not a state
  assert round_state.states(str(tmp_path / "a")) == []


def _steps_written(logdir, tag="oscars/rate"):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  steps = []
  for path in tf.io.gfile.glob(os.path.join(logdir, "worker_0", "events*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      steps += [event.step for v in event.summary.value if v.tag == tag]
  return steps


def test_a_resumed_run_numbers_its_rounds_on_in_tensorboard(tmp_path):
  """A restarted job wrote its round summaries from round 0 again into the
  same log directory: TensorBoard keeps one series per tag, so the second
  attempt's rounds wrote over (or, with other loaders, mixed into) the
  first's. Rounds are numbered on from the restored state's."""
  import oscars_tf  # pylint: disable=g-import-not-at-top
  logdir, ckpt = str(tmp_path / "logs"), str(tmp_path / "ckpt")

  def strategy():
    return oscars_tf.OscarsStrategy(
        devices=["CPU:0", "CPU:1"], local_replicas="local_sgd",
        schedule=oscars_tf.schedules.Fixed(every=2), logdir=logdir)
  first = strategy()
  model = _bn_model(first)
  _fit(model)
  done = first.extended.round_book.round
  assert done >= 2
  checkpoint.save(model, ckpt, epoch=1, strategy=first)
  assert checkpoint.latest(ckpt)["round"] == done
  first.extended.round_logs.finish_logs()

  second = strategy()
  fresh = _bn_model(second)
  assert checkpoint.restore(fresh, ckpt, second) == 1
  _fit(fresh)
  second.extended.round_logs.finish_logs()
  steps = _steps_written(logdir)
  assert sorted(steps) == list(range(2 * done)), steps


def test_a_checkpoint_directory_that_cannot_hold_checkpoints_is_one_line(
    tmp_path):
  """A URL (os paths found nothing there to restore, and the first save
  failed the chief), or a path that cannot be made: refused at start."""
  with pytest.raises(ValueError, match="is a URL: .*mount the bucket"):
    checkpoint.check_directory("gs://bucket/run")
  with pytest.raises(ValueError, match="is a URL"):
    checkpoint.restore(_model(0), "gs://bucket/run")
  with pytest.raises(ValueError, match="is a URL"):
    checkpoint.save(_model(0), "s3://bucket/run", 1)
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError, match="cannot make .*a_file/ckpt"):
    checkpoint.check_directory(str(tmp_path / "a_file" / "ckpt"))
  checkpoint.check_directory(str(tmp_path / "new" / "ckpt"))
  assert (tmp_path / "new" / "ckpt").is_dir()


def test_an_optimizer_state_that_did_not_load_is_said(tmp_path, caplog):
  """Restored into another optimizer (a changed --optimizer): Keras skips
  its state with a warning of its own that names no file; the step count
  restarts at 0. The restore says which checkpoint, at which step."""
  import keras  # pylint: disable=g-import-not-at-top
  saved = _model(2)  # Adam, 3 steps
  checkpoint.save(saved, str(tmp_path), epoch=1)
  other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
  other.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                loss="mse")
  with caplog.at_level("WARNING"):
    checkpoint.restore(other, str(tmp_path))
  said = [r.getMessage() for r in caplog.records
          if "did not load" in r.getMessage()]
  assert len(said) == 1 and "epoch-1.weights.h5 was saved at optimizer " \
      "step 3, but the optimizer restored is at step 0" in said[0], said
  with caplog.at_level("WARNING"):  # the same optimizer: nothing said
    caplog.clear()
    checkpoint.restore(_model(0), str(tmp_path))
  assert not [r for r in caplog.records if "did not load" in r.getMessage()]
