"""Atomic checkpoints of the averaged model and its optimizer, and resume.

    checkpoint.save(model, directory, epoch, strategy)      # the chief
    epoch = checkpoint.restore(model, directory, strategy)  # every worker

Each save writes `epoch-<N>.weights.h5` (through a temporary file, flushed
to disk and renamed), with an outer optimizer its state `epoch-<N>.outer.npz`
(the same way), then `last.json`, which names them (also renamed into
place), flushes the directory, then deletes older files. A crash or a power
loss at any point leaves `last.json` naming complete files: the previous
checkpoint, or the new one (distribute/saved_files.py). Keras'
`save_weights` includes the optimizer's variables, so a resumed run
continues the optimizer's step count and slots; the outer optimizer's start
and momentum (`OscarsStrategy.outer_state`) resume too.

`restore` also tells the strategy to keep round states here: a worker that
loses a peer inside an averaging collective saves its model first
(round_state.py), and a restart resumes from whichever is newer, that or
the epoch checkpoint, losing at most the round in flight. Keras cannot
start mid-epoch: resumed from a round state, training restarts the
interrupted epoch's data with the mid-epoch model. A round state holds the
outer optimizer's state too.

Every worker restores from its own view of `directory`: workers that
resumed different states (directories at different epochs) stop with one
line naming both (distribute/resumed.py), and at the start of training the
outer optimizer's state is the chief's, as the model is (startup.py).
"""

import json
import os

from absl import logging

from oscars_tf.distribute import resumed
from oscars_tf.distribute import round_state
from oscars_tf.distribute import saved_files

STATE = "last.json"


def _weights_name(epoch):
  return f"epoch-{epoch}.weights.h5"


def _outer_name(epoch):
  return f"epoch-{epoch}.outer.npz"


def _outer_state(strategy):
  """The strategy's outer optimizer state, or None (none, or a strategy
  without one: TensorFlow's own)."""
  outer_state = getattr(strategy, "outer_state", None)
  return outer_state() if outer_state is not None else None


def check_directory(directory):
  """Raises ValueError (one line) unless `directory` can hold checkpoints:
  a local or mounted path (their atomicity is the local file system's
  renames and flushes), made here if missing, writable."""
  _refuse_url(directory)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise ValueError(f"cannot make {directory!r}: {e.strerror or e}") from None
  if not os.access(directory, os.W_OK | os.X_OK):
    raise ValueError(f"{directory!r} is not writable")


def _refuse_url(directory):
  if directory and "://" in str(directory):
    raise ValueError(
        f"{directory!r} is a URL: checkpoints need a local or mounted "
        "directory (mount the bucket, e.g. with gcsfuse or s3fs)")


def save(model, directory, epoch, strategy=None):
  """Writes `model` (and its optimizer, and `strategy`'s outer optimizer
  state) as the checkpoint of `epoch`; returns whether it did.

  A model with non-finite weights is not written: it would replace the
  last good checkpoint (an epoch end where every member is poisoned)."""
  if not round_state.finite_weights(model):
    last = latest(directory)
    logging.warning(
        "oscars_tf: the model to save at epoch %d has non-finite weights: "
        "not saved; %s.", epoch,
        f"the last good checkpoint (epoch {last['epoch']}) stays" if last
        else "there is no checkpoint yet")
    return False
  _refuse_url(directory)
  os.makedirs(directory, exist_ok=True)
  name = _weights_name(epoch)
  tmp = saved_files.temp_prefix(directory)
  model.save_weights(tmp + ".weights.h5")
  saved_files.replace(tmp + ".weights.h5", os.path.join(directory, name))
  optimizer = getattr(model, "optimizer", None)
  state = {"epoch": int(epoch), "weights": name,
           "optimizer_step": int(optimizer.iterations.numpy())
                             if optimizer is not None else None}
  book = _round_book(strategy)
  if book is not None:
    state["round"] = book.round + book.rounds_before
  outer = _outer_state(strategy)
  if outer is not None:
    state["outer"] = _outer_name(epoch)
    saved_files.write_outer_npz(
        outer, os.path.join(directory, state["outer"]), tmp + ".npz")
  with open(tmp + ".json", "w") as f:
    json.dump(state, f)
  saved_files.replace(tmp + ".json", os.path.join(directory, STATE))
  saved_files.fsync(directory)  # the renames, before any deletion
  for old in os.listdir(directory):  # superseded checkpoints
    if old.startswith("epoch-") and old not in (name, state.get("outer")) and (
        old.endswith(".weights.h5") or old.endswith(".outer.npz")):
      os.remove(os.path.join(directory, old))
  round_state.remove_superseded(directory, int(epoch))
  saved_files.remove_temps(directory, saved_files.CHECKPOINT)
  return True


def latest(directory):
  """The state dict of the last complete checkpoint, or None."""
  path = os.path.join(directory or "", STATE)
  if not directory or not os.path.exists(path):
    return None
  with open(path) as f:
    return saved_files.check_names(json.load(f), path)


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
  given) so that their saved values load too. The outer optimizer's state
  goes to `strategy` (used when its state is created, at the first step).
  An OscarsStrategy keeps its round states in `directory` from now on (see
  the module docstring), and refuses (WorkerMismatchError) unless every
  worker resumed the same state (distribute/resumed.py). Temporary files
  of saves killed midway are removed.
  """
  _refuse_url(directory)
  if directory:  # nobody saves while the workers restore
    saved_files.remove_temps(directory, saved_files.EVERY_SAVE)
  keep = getattr(getattr(strategy, "extended", None), "keep_round_state",
                 None)
  if directory and keep is not None:
    keep(model, directory)
  state = newest(directory)
  resumed.agree(strategy, directory, state)
  if state is None:
    return 0
  optimizer = getattr(model, "optimizer", None)
  if optimizer is not None:
    if strategy is not None:
      with strategy.scope():
        optimizer.build(model.trainable_variables)
    else:
      optimizer.build(model.trainable_variables)
  path = os.path.join(directory, state["weights"])
  try:
    model.load_weights(path)
  except (ValueError, OSError) as e:  # another model's, or a file gone
    raise ValueError(f"the checkpoint {path} does not load into this model "
                     f"(saved from another model, or damaged): {e}") from e
  _check_optimizer_restored(optimizer, state, path)
  _restore_outer(state, directory, strategy)
  book = _round_book(strategy)
  if book is not None and state.get("round") is not None:
    book.rounds_before = int(state["round"])
  return int(state["epoch"])


def _check_optimizer_restored(optimizer, state, path):
  """Keras loads a model whose optimizer differs from the saved one's (a
  changed --optimizer, another Keras flavour) and only warns that it left
  the optimizer out: its step count restarts at 0, and later choices that
  rank states by optimizer step with it. Said here, naming the file."""
  saved = state.get("optimizer_step")
  if optimizer is None or saved is None:
    return
  now = int(optimizer.iterations.numpy())
  if now != int(saved):
    logging.warning(
        "oscars_tf: %s was saved at optimizer step %d, but the optimizer "
        "restored is at step %d: its state did not load (another optimizer "
        "or Keras flavour than the one saved); it starts afresh.", path,
        int(saved), now)


def _round_book(strategy):
  """An OscarsStrategy's round book, or None (TensorFlow's strategies)."""
  return getattr(getattr(strategy, "extended", None), "round_book", None)


def _restore_outer(state, directory, strategy):
  has_outer = _outer_state(strategy) is not None
  if not state.get("outer"):
    if has_outer:
      logging.warning("oscars_tf: checkpoint %s has no outer optimizer state;"
                      " the outer momentum starts at zero.", directory)
    return
  if not has_outer:
    logging.warning("oscars_tf: checkpoint %s has outer optimizer state, but "
                    "the strategy has no outer optimizer: not used.",
                    directory)
    return
  strategy.restore_outer_state(saved_files.read_outer_npz(
      os.path.join(directory, state["outer"])))
