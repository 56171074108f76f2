"""Atomic checkpoints of the averaged model and its optimizer, and resume.

    checkpoint.save(model, directory, epoch)      # the chief, at epoch ends
    epoch = checkpoint.restore(model, directory)  # every worker, at start

Each save writes `epoch-<N>.weights.h5` (through a temporary file and an
atomic rename), then `last.json`, which names it (also renamed into place),
then deletes older weight files. A crash at any point leaves `last.json`
naming a complete weights file: the previous checkpoint, or the new one.
Keras' `save_weights` includes the optimizer's variables, so a resumed run
continues the optimizer's step count and slots.

`restore` also tells the strategy to keep round states here: a worker that
loses a peer inside an averaging collective saves its model first
(round_state.py), and a restart resumes from whichever is newer, that or
the epoch checkpoint, losing at most the round in flight. Keras cannot
start mid-epoch: resumed from a round state, training restarts the
interrupted epoch's data with the mid-epoch model.
"""

import json
import os

from oscars_tf import round_state

STATE = "last.json"


def _weights_name(epoch):
  return f"epoch-{epoch}.weights.h5"


def save(model, directory, epoch):
  """Writes `model` (and its optimizer) as the checkpoint of `epoch`."""
  os.makedirs(directory, exist_ok=True)
  name = _weights_name(epoch)
  tmp = os.path.join(directory, f".tmp-{os.getpid()}")
  model.save_weights(tmp + ".weights.h5")
  os.replace(tmp + ".weights.h5", os.path.join(directory, name))
  optimizer = getattr(model, "optimizer", None)
  state = {"epoch": int(epoch), "weights": name,
           "optimizer_step": int(optimizer.iterations.numpy())
                             if optimizer is not None else None}
  with open(tmp + ".json", "w") as f:
    json.dump(state, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp + ".json", os.path.join(directory, STATE))
  for old in os.listdir(directory):  # superseded checkpoints
    if old.endswith(".weights.h5") and old.startswith("epoch-") and (
        old != name):
      os.remove(os.path.join(directory, old))
  round_state.remove_superseded(directory, int(epoch))


def latest(directory):
  """The state dict of the last complete checkpoint, or None."""
  path = os.path.join(directory or "", STATE)
  if not directory or not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def newest(directory):
  """The state `restore` resumes from, or None: the last epoch checkpoint's
  dict, or a round state taken after it (round_state.newest; it has a
  `worker` key)."""
  return round_state.newest(directory, latest(directory))


def restore(model, directory, strategy=None):
  """Loads the newest saved state into `model`; returns the epoch to
  resume at (0: none). From a round state that is the epoch it
  interrupted.

  The optimizer's slots are built first (under `strategy`'s scope when
  given) so that their saved values load too. An OscarsStrategy keeps its
  round states in `directory` from now on (see the module docstring).
  """
  keep = getattr(getattr(strategy, "extended", None), "keep_round_state",
                 None)
  if directory and keep is not None:
    keep(model, directory)
  state = newest(directory)
  if state is None:
    return 0
  optimizer = getattr(model, "optimizer", None)
  if optimizer is not None:
    if strategy is not None:
      with strategy.scope():
        optimizer.build(model.trainable_variables)
    else:
      optimizer.build(model.trainable_variables)
  model.load_weights(os.path.join(directory, state["weights"]))
  return int(state["epoch"])
