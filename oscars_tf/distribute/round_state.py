"""Round states: what a worker holds when a peer is lost mid-round.

A worker killed while the others are inside an averaging collective with it
aborts their collectives for good (TensorFlow 2.21 cannot reset them in a
running process: see docs/reliability.md), so the job must restart. Before
the error leaves a survivor, `Keeper.save` writes its model (weights and
optimizer, Keras `save_weights`) and its position to the checkpoint
directory:

    round-w<index>-step<optimizer step>.weights.h5  (through a temporary file)
    round-w<index>.json                             (names it; renamed last)

so a crash or a power loss while saving leaves the previous state or the
new one, whole (saved_files.py: each file flushed before its rename, the
directory before a deletion). A state naming a file outside the directory
is not a state (`states` leaves it out, saying so).
The values are safe to read: a collective's result is assigned only after
it returns, so a survivor holds the last averaged model plus its own local
steps of the round in flight. `newest` picks what a restart resumes from
(checkpoint.restore), and `remove_superseded` deletes the states an epoch
checkpoint makes older (checkpoint.save), so a later run never resumes
from a state of an earlier epoch.
"""

import contextlib
import json
import os
import re
import time

from absl import logging
import numpy as np

from oscars_tf.distribute import saved_files
from oscars_tf.errors import WorkerLostError
from oscars_tf.runtime import fault_injection

_STATE = re.compile(r"round-w(\d+)\.json$")


def _state_name(worker):
  return f"round-w{worker}.json"


def save(model, directory, position, outer=None):
  """Writes `model` and `position` (a dict with `worker` and
  `optimizer_step`), and the outer optimizer's state `outer` if any (see
  `OscarsStrategy.outer_state`), as the round state of that worker; returns
  the state."""
  worker, step = int(position["worker"]), int(position["optimizer_step"])
  os.makedirs(directory, exist_ok=True)
  name = f"round-w{worker}-step{step}.weights.h5"
  tmp = saved_files.temp_prefix(directory, worker)
  model.save_weights(tmp + ".weights.h5")
  fault_injection.in_round_state_save()  # tests stop a worker here
  saved_files.replace(tmp + ".weights.h5", os.path.join(directory, name))
  state = dict(position, weights=name)
  if outer is not None:
    state["outer"] = f"round-w{worker}-step{step}.outer.npz"
    saved_files.write_outer_npz(
        outer, os.path.join(directory, state["outer"]), tmp + ".npz")
  with open(tmp + ".json", "w") as f:
    json.dump(state, f)
  saved_files.replace(tmp + ".json",
                      os.path.join(directory, _state_name(worker)))
  saved_files.fsync(directory)  # the renames, before any deletion
  prefix = f"round-w{worker}-step"
  for old in os.listdir(directory):  # this worker's superseded weights
    if old.startswith(prefix) and old not in (name, state.get("outer")):
      _remove(directory, old)
  saved_files.remove_temps(directory, worker)  # a killed save's
  return state


def finite_weights(model):
  """Whether every weight of `model` is finite: a non-finite model is never
  saved (a restart would resume from it)."""
  return all(np.all(np.isfinite(np.asarray(w)))
             for w in getattr(model, "weights", ()))


def _remove(directory, name):
  # The chief's epoch checkpoint may be removing the same file.
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(directory, name))


def states(directory):
  """The complete round states in `directory` (any order)."""
  found = []
  for entry in os.listdir(directory) if directory and os.path.isdir(
      directory) else []:
    if not _STATE.match(entry):
      continue
    path = os.path.join(directory, entry)
    try:
      with open(path) as f:
        state = json.load(f)
      int(state["epoch"]), int(state["optimizer_step"]), int(state["worker"])
      saved_files.plain_name(state["weights"], path)  # required here
      saved_files.check_names(state, path)
    except saved_files.SavedStateError as e:
      logging.warning("%s Left out.", e)
      continue
    except (OSError, ValueError, KeyError, TypeError):
      continue
    if os.path.exists(os.path.join(directory, state["weights"])):
      found.append(state)
  return found


def newest(directory, epoch_state):
  """What to resume from: `epoch_state` (the last epoch checkpoint's
  dict, or None) or a round state taken after it, whichever is newer.

  A round state of epoch e (0-based, the epoch in flight) is newer than an
  epoch checkpoint of N completed epochs when e >= N. Among round states
  the latest epoch wins, then the highest optimizer step (the most local
  steps on top of the same average), then the lowest worker index.
  Optimizer steps only grow across restarts (each resumes from one of the
  states), so this order holds over several of them.
  """
  done = int(epoch_state["epoch"]) if epoch_state else 0
  later = [s for s in states(directory) if int(s["epoch"]) >= done]
  if not later:
    return epoch_state
  return max(later, key=lambda s: (int(s["epoch"]), int(s["optimizer_step"]),
                                   -int(s["worker"])))


def remove_superseded(directory, epoch):
  """Deletes the round states taken before `epoch` epochs were complete."""
  for state in states(directory):
    if int(state["epoch"]) < epoch:
      _remove(directory, _state_name(state["worker"]))  # the name first
      _remove(directory, state["weights"])
      if state.get("outer"):
        _remove(directory, state["outer"])


class Keeper:
  """Saves one worker's round state when it loses a peer (see `save`)."""

  def __init__(self, model, directory, worker, rounds, outer_state=None):
    """`outer_state`: () -> the outer optimizer's state, or None."""
    self.model = model
    self.directory = directory
    self.worker = worker
    self._rounds = rounds
    self._outer_state = outer_state or (lambda: None)

  def position(self):
    r = self._rounds.book
    optimizer = getattr(self.model, "optimizer", None)
    local_step = int(self._rounds.local_step.numpy())
    return {
        "worker": self.worker,
        "epoch": r.epoch_index + r.epoch_offset,  # the cluster's, in flight
        "round": r.round + r.rounds_before,
        "optimizer_step": int(optimizer.iterations.numpy())
                          if optimizer is not None else local_step,
        # The Python-side count: the graph's last_sync_step may already be
        # assigned while the failed collective ran (no data dependency).
        "steps_since_average": local_step - r.last_sync_step,
        "attempt": int(os.environ.get("OSCARS_LAUNCH_ATTEMPT", "0") or 0),
        "saved_at": time.time()}

  def save(self):
    """Saves the state; logs, and never raises (the peer's loss is the
    error to report). A model with non-finite weights is not saved."""
    try:
      if not finite_weights(self.model):
        logging.error("oscars_tf: worker %d: a peer is lost, but this "
                      "worker's weights are not finite: no round state "
                      "saved.", self.worker)
        return None
      state = save(self.model, self.directory, self.position(),
                   self._outer_state())
    except Exception as e:  # pylint: disable=broad-except
      logging.error("oscars_tf: worker %d: a peer is lost; could not save "
                    "the round state in %s: %s", self.worker, self.directory,
                    e)
      return None
    logging.warning(
        "oscars_tf: worker %d: a peer is lost; saved this worker's model in "
        "%s (epoch %d in flight, round %d, optimizer step %d, %d local steps "
        "since the last average) for the restart to resume from.",
        self.worker, self.directory, state["epoch"] + 1, state["round"],
        state["optimizer_step"], state["steps_since_average"])
    return state


@contextlib.contextmanager
def saved_when_peer_lost(keeper, explained, peers=None):
  """`explained` (a context raising WorkerLostError on a lost peer), which
  first saves `keeper`'s round state (None: nothing to save). A failed
  collective's error gets `peers()`, the workers of that collective (for
  the worker's exit note: exit_notes.py)."""
  try:
    with explained:
      yield
  except WorkerLostError as e:
    # Contexts nest (fit's around an epoch end's): save once.
    if keeper is not None and not hasattr(e, "round_state"):
      e.round_state = keeper.save()
    if (peers is not None and getattr(e, "in_collective", False) and
        not hasattr(e, "peers")):
      e.peers = peers()
    raise
