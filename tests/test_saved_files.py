"""Saved states survive a power loss and stay in their directory
(distribute/saved_files.py, through checkpoint.save and round_state.save).

The models are stand-ins whose `save_weights` writes a file: what is
checked is the order of the file operations and the names read back.
"""

import json
import os

import pytest

from oscars_tf import checkpoint
from oscars_tf.distribute import round_state
from oscars_tf.distribute import saved_files


class _Model:
  optimizer = None

  def save_weights(self, path):
    with open(path, "wb") as f:
      f.write(b"weights")


@pytest.fixture
def file_events(monkeypatch):
  """Every fsync, rename and removal, in order, by path."""
  events = []
  real_fsync, real_replace, real_remove = os.fsync, os.replace, os.remove

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    real_fsync(fd)

  def replace(src, dst):
    events.append(("replace", os.path.realpath(src)))
    real_replace(src, dst)

  def remove(path):
    events.append(("remove", os.path.realpath(path)))
    real_remove(path)
  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "replace", replace)
  monkeypatch.setattr(os, "remove", remove)
  return events


def _check_order(events, directory):
  """Each renamed file was flushed before its rename; the directory after
  the last rename and before the first removal."""
  directory = os.path.realpath(directory)
  renames = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
  assert renames, events
  for i in renames:
    flushed = ("fsync", events[i][1])
    assert flushed in events[:i], (events[i], events)
  dir_flush = [i for i, e in enumerate(events) if e == ("fsync", directory)]
  assert dir_flush and dir_flush[-1] > renames[-1], events
  removals = [i for i, (kind, _) in enumerate(events) if kind == "remove"]
  assert removals, events  # the superseded files
  assert min(removals) > dir_flush[-1], events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                    reason="reads file descriptors' paths from /proc")
def test_a_checkpoint_is_on_disk_before_the_previous_one_is_deleted(
    tmp_path, file_events):
  checkpoint.save(_Model(), str(tmp_path), 1)
  file_events.clear()
  checkpoint.save(_Model(), str(tmp_path), 2)
  _check_order(file_events, tmp_path)
  assert sorted(os.listdir(tmp_path)) == ["epoch-2.weights.h5", "last.json"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                    reason="reads file descriptors' paths from /proc")
def test_a_round_state_is_on_disk_before_the_previous_one_is_deleted(
    tmp_path, file_events):
  position = {"worker": 1, "epoch": 0, "optimizer_step": 5}
  round_state.save(_Model(), str(tmp_path), position)
  file_events.clear()
  round_state.save(_Model(), str(tmp_path), dict(position, optimizer_step=9))
  _check_order(file_events, tmp_path)
  assert sorted(os.listdir(tmp_path)) == ["round-w1-step9.weights.h5",
                                          "round-w1.json"]


@pytest.mark.parametrize("name", ["VICTIM", "../victim", "sub/../../victim",
                                  ".", ""])
def test_a_round_state_naming_a_file_elsewhere_is_left_out_and_never_deleted(
    tmp_path, name):
  directory = tmp_path / "ckpt"
  directory.mkdir()
  victim = tmp_path / "victim"
  victim.write_text("not the job's")
  name = str(victim) if name == "VICTIM" else name
  (directory / "round-w0.json").write_text(json.dumps(
      {"worker": 0, "epoch": 0, "optimizer_step": 3, "weights": name}))
  assert round_state.states(str(directory)) == []
  round_state.remove_superseded(str(directory), 5)  # as the next save does
  assert victim.read_text() == "not the job's"


def test_a_checkpoint_naming_a_file_elsewhere_is_a_clear_error(tmp_path):
  (tmp_path / checkpoint.STATE).write_text(json.dumps(
      {"epoch": 2, "weights": "../elsewhere.weights.h5"}))
  with pytest.raises(saved_files.SavedStateError, match="not a file name"):
    checkpoint.newest(str(tmp_path))


@pytest.mark.parametrize("name", ["epoch-3.weights.h5", "round-w1.json"])
def test_plain_names_are_kept(name):
  assert saved_files.plain_name(name, "x.json") == name


# Temporary files of a save killed midway (a survivor killed while saving
# its round state, the chief while saving a checkpoint), and files that are
# not the job's temporary files and must stay.
_ROUND_W1_TEMPS = {".tmp-round-w1-4242.weights.h5", ".tmp-round-w1-4242.npz",
                   ".tmp-round-w1-4242.json"}
_ROUND_W2_TEMP = ".tmp-round-w2-4244.weights.h5"
_CHECKPOINT_TEMPS = {".tmp-4243.weights.h5", ".tmp-4243.npz",
                     ".tmp-4243.json"}
_NOT_TEMPS = {"notes.txt", ".tmp-mine", ".tmp-round-w1-x.json",
              "a.tmp-4243.json", ".tmp-4243.weights.h5.bak"}


def _write_files(directory, names):
  for name in names:
    (directory / name).write_text("left by a killed save")


def test_a_save_removes_its_own_kind_of_temporary_files_left_by_a_killed_one(
    tmp_path):
  _write_files(tmp_path, _ROUND_W1_TEMPS | _CHECKPOINT_TEMPS | _NOT_TEMPS |
               {_ROUND_W2_TEMP})
  round_state.save(_Model(), str(tmp_path),
                   {"worker": 1, "epoch": 0, "optimizer_step": 5})
  # Worker 1's own; not worker 2's nor the chief's, which may be saving now.
  assert set(os.listdir(tmp_path)) == (
      _CHECKPOINT_TEMPS | _NOT_TEMPS | {_ROUND_W2_TEMP, "round-w1.json",
                                        "round-w1-step5.weights.h5"})
  checkpoint.save(_Model(), str(tmp_path), 1)
  assert set(os.listdir(tmp_path)) == _NOT_TEMPS | {
      _ROUND_W2_TEMP, "epoch-1.weights.h5", "last.json"}


def test_a_restore_removes_every_temporary_file_of_the_job(tmp_path):
  # Nobody saves while the workers restore: every temporary file is stale.
  _write_files(tmp_path, _ROUND_W1_TEMPS | _CHECKPOINT_TEMPS | _NOT_TEMPS |
               {_ROUND_W2_TEMP})
  assert checkpoint.restore(_Model(), str(tmp_path)) == 0
  assert set(os.listdir(tmp_path)) == _NOT_TEMPS
