"""After a restore every worker holds the same state, or the job refuses
(checkpoint.restore, distribute/resumed.py): the workers say what they
resumed through the store, and the outer optimizer's state is the chief's.

Workers are threads on an in-memory store; the real store and real
processes: test_multiworker.py (two directories at different epochs).
"""

import contextlib
import shutil
import time
import types

import numpy as np
import pytest

from fake_store import FakeStore
from fake_store import run_threads
from oscars_tf import checkpoint
from oscars_tf.distribute import startup
from oscars_tf.errors import WorkerMismatchError
from oscars_tf.protocol import agreement


def _model(seed):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  model.fit(np.ones((8, 4)), np.ones((8, 3)), epochs=seed + 1, verbose=0)
  return model


class _Strategy:
  """What checkpoint.restore uses of worker `me`'s OscarsStrategy in a
  cluster of `num_workers`: its scope, and its exchange through the store."""

  def __init__(self, store, me, num_workers, timeout=5.0, is_gone=None):
    agreements = agreement.Agreements(store, me, timeout, timeout, is_gone)
    self.extended = types.SimpleNamespace(
        exchange=lambda name, text: agreements.exchange(
            name, text, range(num_workers)))

  def scope(self):
    return contextlib.nullcontext()


def _restore_on_threads(directories, **strategy_args):
  """checkpoint.restore on one thread per worker, worker i from
  directories[i]; (epochs, errors)."""
  store = FakeStore()
  models = [_model(9) for _ in directories]
  strategies = [_Strategy(store, i, len(directories), **strategy_args)
                for i in range(len(directories))]
  return run_threads([
      lambda i=i: checkpoint.restore(models[i], directories[i], strategies[i])
      for i in range(len(directories))])


def _saved(directory, epoch):
  model = _model(epoch)
  checkpoint.save(model, str(directory), epoch)
  return str(directory), int(model.optimizer.iterations.numpy())


def test_workers_that_resumed_different_states_refuse_naming_both(tmp_path):
  (a, a_step), (b, b_step) = (_saved(tmp_path / "a", 3),
                              _saved(tmp_path / "b", 5))
  _, errors = _restore_on_threads([a, b])
  assert all(isinstance(e, WorkerMismatchError) for e in errors), errors
  message = str(errors[0])
  assert str(errors[1]) == message and "\n" not in message
  assert message.startswith(
      f"oscars_tf: worker 1 resumed from {b}/epoch-5.weights.h5 (epoch 5, "
      f"optimizer step {b_step}) but worker 0 from {a}/epoch-3.weights.h5 "
      f"(epoch 3, optimizer step {a_step}): give every worker the same "
      "checkpoint directory"), message
  # A worker that found no saved state is named too.
  empty = str(tmp_path / "empty")
  _, errors = _restore_on_threads([a, a, empty])
  assert f"worker 2 resumed from nothing in {empty} but worker 0 from {a}/" in (
      str(errors[0]))


def test_workers_that_resumed_the_same_state_go_on(tmp_path):
  a, _ = _saved(tmp_path / "a", 3)
  copy = str(tmp_path / "copy")  # a copy on another host: the same state
  shutil.copytree(a, copy)
  epochs, errors = _restore_on_threads([a, a, copy])
  assert errors == [None] * 3 and epochs == [3, 3, 3]
  epochs, errors = _restore_on_threads([None, str(tmp_path / "empty")])
  assert errors == [None] * 2 and epochs == [0, 0]


@pytest.mark.parametrize("gone", [False, True], ids=["late", "gone"])
def test_a_worker_that_never_says_what_it_resumed_is_an_error_in_time(
    tmp_path, gone):
  a, _ = _saved(tmp_path / "a", 3)
  store = FakeStore()
  # Worker 1 never calls restore; its process is gone, or not (0.5 s).
  worker0 = _Strategy(store, 0, 2, timeout=60.0 if gone else 0.5,
                      is_gone=lambda j: gone)
  started = time.monotonic()
  with pytest.raises(WorkerMismatchError, match=(
      "worker 1 did not say which saved state it resumed within")):
    checkpoint.restore(_model(9), a, worker0)
  assert time.monotonic() - started < 10


def _outer_strategy():
  import oscars_tf  # pylint: disable=g-import-not-at-top
  return oscars_tf.OscarsStrategy(
      devices=["CPU:0", "CPU:1"], local_replicas="local_sgd",
      schedule=oscars_tf.schedules.Fixed(every=2),
      outer_optimizer=oscars_tf.schedules.OuterMomentum(momentum=0.9))


def test_the_outer_state_a_worker_restored_is_replaced_by_the_chiefs(
    monkeypatch):
  import keras  # pylint: disable=g-import-not-at-top
  strategy = _outer_strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
  shapes = [tuple(w.shape) for w in model.trainable_weights]

  def state(start, momentum):
    return [([np.full(s, start, np.float32) for s in shapes],
             [np.full(s, momentum, np.float32) for s in shapes])]

  strategy.restore_outer_state(state(1.0, 2.0))  # this worker's directory
  chief = state(3.0, 4.0)  # the chief's

  class _Worker1Handshake:
    """Worker 1's start-up; a broadcast writes the chief's values."""

    def __init__(self, *args):
      del args

    def check_workers_agree(self, variables, settings):
      del variables, settings

    def broadcast_from_chief(self, values, write, role="model"):
      (starts, momenta), = chief
      write(values if role == "model" else starts + momenta)

  monkeypatch.setattr(startup, "Handshake", _Worker1Handshake)
  monkeypatch.setattr(strategy.extended, "_cluster", types.SimpleNamespace(
      is_multi_worker=True, is_chief=False, worker_index=1))
  strategy.extended.track(model, model.optimizer)
  strategy.extended.start()
  (starts, momenta), = strategy.outer_state()
  for got, want in zip(starts + momenta, chief[0][0] + chief[0][1]):
    np.testing.assert_array_equal(got, want)
