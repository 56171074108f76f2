# -- tf_keras --
# Legacy tf_keras (Keras 2) through oscars_tf/frontends/tf_keras.py: every
# case of frontend_programs.py on 3 workers, one 4x slower (simulated), in
# one job per schedule: Adaptive (planned epochs) and Fixed(every=3)
# (sharded epochs) with compressed averaging (int4) in flight. Names here start
# with _tfk / tf_keras so that the Keras 3 section of this file can sit
# beside this one.

import os
import pathlib
import re

import numpy as np
import pytest

import frontend_programs
import multiworker

_TFK_PROGRAM = pathlib.Path(__file__).with_name("frontend_programs.py")
_TFK_ENV = {"OSCARS_SIMULATE_STEP_TIME": "4ms*1,1,4"}
_TFK_WORKERS = 3
# Cases that train on part of the data set (validation_split=0.2).
_TFK_TRAIN_FRACTION = {"arrays": 0.8}
# Cases the program itself cannot run under tf_keras: name -> the error
# each worker must still raise before `fit` (they run last, under Adaptive
# only). When the program is fixed, the test says to drop the entry.
_TFK_PROGRAM_GAPS = {}


def _tfk_cases():
  """Every case the program defines (the methods of its `_Cases`)."""
  return [name for name, fn in vars(frontend_programs._Cases).items()  # pylint: disable=protected-access
          if callable(fn) and not name.startswith("_") and name != "model"]


# Adaptive: planned epochs, float32 averaging that waits. Fixed(every=3):
# sharded epochs, frequent rounds, int4 averaging in flight beside the next
# round. (A plain Fixed(3) job added 90 s and covered nothing these two do
# not: float32 waiting rounds are Adaptive's, sharded epochs this one's.)
@pytest.fixture(scope="module", params=[
    {"every": 0}, {"every": 3, "compression": "int4", "overlap": "always"}],
                ids=["adaptive", "fixed3_int4_overlap"])
def tf_keras_matrix(request):
  every = request.param["every"]
  cases = [c for c in _tfk_cases() if c not in _TFK_PROGRAM_GAPS]
  gaps = ([c for c in _tfk_cases() if c in _TFK_PROGRAM_GAPS]
          if not every else [])
  result = multiworker.run(
      "tf_keras_matrix", _TFK_WORKERS,
      {"flavour": "tf_keras", "cases": cases + gaps, **request.param},
      timeout=420, program=_TFK_PROGRAM, env=_TFK_ENV, expect_success=False,
      # Each worker exits by itself: a gap case failing on a fast worker
      # must not cut a slower one short in the case before it. A worker that
      # fails mid-case leaves the others at a collective, which times out.
      kill_on_failure=False)
  return cases, gaps, result


def _tfk_outputs(result, case):
  outs = [o and o["cases"].get(case) for o in result.outputs]
  assert all(outs), f"case {case} missing on a worker:\n{result.tail()}"
  return outs


def test_tf_keras_matrix_workers_exit_cleanly(tf_keras_matrix):
  cases, gaps, result = tf_keras_matrix
  assert result.failed is None, f"{result.failed}:\n{result.tail()}"
  for case in cases:
    _tfk_outputs(result, case)
  if not gaps:
    assert result.codes == [0] * _TFK_WORKERS, result.tail()
    return
  # Each gap case fails on every worker, before `fit`, with its error.
  for case in gaps:
    assert f"case {case} begins" in result.log, result.tail()
    fixed = _TFK_PROGRAM_GAPS[case] not in result.log
    assert not fixed, (f"case {case} no longer fails as expected under "
                       "tf_keras: remove it from _TFK_PROGRAM_GAPS.\n"
                       f"{result.tail()}")
  assert all(code != 0 for code in result.codes), result.tail()


@pytest.mark.parametrize("case", _tfk_cases())
def test_tf_keras_matrix_identical_weights_and_epochs(tf_keras_matrix, case):
  cases, _, result = tf_keras_matrix
  if case not in cases:
    pytest.skip(f"{case}: {_TFK_PROGRAM_GAPS[case]}")
  outs = _tfk_outputs(result, case)
  weights = np.array([o["weights"] for o in outs])
  diff = float(np.abs(weights - weights[0]).max())
  assert diff <= 1e-6, f"case {case}: workers differ by {diff}"
  assert len({o["epochs"] for o in outs}) == 1, [o["epochs"] for o in outs]
  assert len({len(o["batches"]) for o in outs}) == 1, [
      o["batches"] for o in outs]


@pytest.mark.parametrize("case", _tfk_cases())
def test_tf_keras_matrix_one_data_set_per_epoch(tf_keras_matrix, case):
  cases, _, result = tf_keras_matrix
  if case not in cases:
    pytest.skip(f"{case}: {_TFK_PROGRAM_GAPS[case]}")
  outs = _tfk_outputs(result, case)
  n = int(frontend_programs.N * _TFK_TRAIN_FRACTION.get(case, 1.0))
  batches = -(-n // frontend_programs.BATCH)
  for epoch, steps in enumerate(zip(*[o["batches"] for o in outs])):
    assert 0.5 * batches <= sum(steps) <= 2.5 * batches, (
        f"case {case} epoch {epoch}: workers took {steps} steps for a "
        f"data set of {batches} batches")


@pytest.mark.parametrize("case", _tfk_cases())
def test_tf_keras_matrix_fit_returns_together(tf_keras_matrix, case):
  """No worker idles after the others at the end of an epoch or of `fit`:
  within one round plus a second (a loaded 2-core machine). tf_keras' `fit`
  frees its epochs' tf.data iterators as it returns, which took 0.3-2.5 s
  on one worker: they are deleted off the training thread now (issue 16)."""
  cases, _, result = tf_keras_matrix
  if case not in cases:
    pytest.skip(f"{case}: {_TFK_PROGRAM_GAPS[case]}")
  outs = _tfk_outputs(result, case)
  if "returned_at" not in outs[0]:
    pytest.skip("the program does not record when fit returns")
  bound = max(o.get("round_s", 0.0) for o in outs) + 1.0  # one round
  returned = [o["returned_at"] for o in outs]
  assert max(returned) - min(returned) < bound, (returned, bound)
  for epoch, ends in enumerate(zip(*[o["epoch_ends"] for o in outs])):
    assert max(ends) - min(ends) < bound, (epoch, ends, bound)


@pytest.mark.parametrize("case", _tfk_cases())
def test_tf_keras_matrix_no_input_iterator_deleted_on_the_training_thread(
    tf_keras_matrix, case):
  """As the Keras 3 test of the same name (test_frontends_keras3.py)."""
  cases, _, result = tf_keras_matrix
  if case not in cases:
    pytest.skip(f"{case}: {_TFK_PROGRAM_GAPS[case]}")
  outs = _tfk_outputs(result, case)
  freed = [o["iterators_freed_on_training_thread"] for o in outs]
  assert freed == [0] * len(outs), (case, freed)


@pytest.mark.parametrize("case", ["distributed_dataset",
                                  "dataset_sharding_off"])
def test_tf_keras_matrix_each_worker_reads_its_own_data_every_epoch(
    tf_keras_matrix, case):
  """As the Keras 3 test of the same name (test_frontends_keras3.py)."""
  _, _, result = tf_keras_matrix
  outs = _tfk_outputs(result, case)
  for w, o in enumerate(outs):
    own = frontend_programs.own_batches(case, w, _TFK_WORKERS)
    assert o["batches"] == [own] * o["epochs"], (case, w, o["batches"])


def test_tf_keras_matrix_shuffled_arrays_every_sample_once_per_epoch(
    tf_keras_matrix):
  """As the Keras 3 test of the same name (test_frontends_keras3.py)."""
  _, _, result = tf_keras_matrix
  outs = _tfk_outputs(result, "shuffled_arrays")
  per_epoch = frontend_programs.unseen_and_repeated(outs)
  assert len(per_epoch) == outs[0]["epochs"] == 3, per_epoch
  assert per_epoch == [(0, 0)] * 3, per_epoch


def test_tf_keras_matrix_progress_bar_never_counts_past_its_end(
    tf_keras_matrix):
  # tf_keras redraws the bar with "\r": lines are split on "\n" only.
  _, _, result = tf_keras_matrix
  chief = "\n".join(line for line in result.log.split("\n")
                    if line.startswith("[0]"))
  bars = re.findall(r"(\d+)/(\d+|Unknown) ", chief)
  if "progress_bar" in _tfk_cases():
    assert bars, "the chief printed no progress bar"
  past = [(a, b) for a, b in bars if b != "Unknown" and int(a) > int(b)]
  assert not past, past[:5]


def test_tf_keras_matrix_a_sequence_hears_the_end_of_every_epoch(
    tf_keras_matrix):
  # Planned epochs stream a Sequence across the whole fit; its own
  # on_epoch_end (where a user reshuffles) still runs at every epoch's end.
  cases, _, result = tf_keras_matrix
  assert "py_dataset" in cases
  outs = _tfk_outputs(result, "py_dataset")
  assert all(o["epoch_hooks"] >= o["epochs"] == 2 for o in outs), [
      (o["epoch_hooks"], o["epochs"]) for o in outs]


def test_tf_keras_matrix_checkpoint_by_chief_only(tf_keras_matrix):
  # `arrays` saves a ModelCheckpoint to <outdir>/ckpt.h5 every epoch.
  _, _, result = tf_keras_matrix
  assert os.path.exists(os.path.join(result.outdir, "ckpt.h5"))
  temp = [d for d, _, _ in os.walk(result.outdir) if "workertemp" in d]
  assert not temp, temp


def test_tf_keras_hooks_present():
  """Fails loudly when a tf_keras upgrade moves an internal the front end
  hooks (oscars_tf/frontends/tf_keras.py, HOOKS)."""
  import tf_keras  # pylint: disable=g-import-not-at-top

  from oscars_tf.frontends import tf_keras as frontend  # pylint: disable=g-import-not-at-top
  missing = frontend.missing_hooks()
  assert not missing, (
      f"tf_keras {tf_keras.__version__} lacks internals that "
      f"oscars_tf/frontends/tf_keras.py hooks: {', '.join(missing)}")


def test_tf_keras_non_chief_writes_nothing(tmp_path):
  """A non-chief's ModelCheckpoint and BackupAndRestore write nothing;
  its TensorBoard writes to its own directory and keeps it."""
  import types  # pylint: disable=g-import-not-at-top

  import tf_keras  # pylint: disable=g-import-not-at-top

  from oscars_tf.frontends import tf_keras as frontend  # pylint: disable=g-import-not-at-top
  info = types.SimpleNamespace(is_chief=False, worker_index=1)
  strategy = object()
  checkpoint = tf_keras.callbacks.ModelCheckpoint(str(tmp_path / "c.h5"))
  backup = tf_keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
  board = tf_keras.callbacks.TensorBoard(str(tmp_path / "tb"))
  frontend._worker_callbacks([checkpoint, backup, board], strategy, info)  # pylint: disable=protected-access
  checkpoint.epochs_since_last_save = 1  # due: tf_keras' own would save
  assert checkpoint._save_model(0, None, {}) is None  # pylint: disable=protected-access
  assert backup._backup(0) is None  # pylint: disable=protected-access
  assert type(strategy) in backup._supported_strategies  # pylint: disable=protected-access
  assert board._get_log_write_dir() == str(tmp_path / "tb" / "worker_1")  # pylint: disable=protected-access
  board._delete_tmp_write_dir()  # pylint: disable=protected-access
  assert list(tmp_path.iterdir()) == []
