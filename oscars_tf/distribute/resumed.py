"""Every worker resumes the same saved state, or the job refuses.

`checkpoint.restore` runs on every worker, each reading its own view of the
checkpoint directory. A directory per host, or one host's stale copy, would
have the workers resume different states at different epochs and train a
split model (Keras would not even run the same epochs). So once it has
chosen its state each worker writes what it chose to the store (the
weights file's name, the epoch, the optimizer step and round) and reads
every other worker's (`agreement.Agreements.exchange`); a difference stops
every worker with one line naming both. Names are compared, not paths:
identical copies of one directory are the same state.

A worker that never says (its program does not restore, or it died) is an
error after the collective timeout, not a hang. And since restore removes
stale temporary files before it says, no worker trains (or saves) before
every worker has removed them (saved_files.remove_temps).
"""

import json
import os

from oscars_tf.errors import WorkerMismatchError


def agree(strategy, directory, state):
  """Returns once every worker of `strategy` resumed the same `state` (the
  saved state's dict, or None: nothing) as this one; else raises
  WorkerMismatchError. Strategies without an `exchange` (TensorFlow's own)
  check nothing."""
  exchange = getattr(getattr(strategy, "extended", None), "exchange", None)
  if exchange is None:
    return
  texts = exchange("resumed", json.dumps(_summary(directory, state)))
  summaries = {j: json.loads(t) for j, t in texts.items() if t is not None}
  missing = sorted(set(texts) - set(summaries))
  if missing:
    raise WorkerMismatchError(
        f"oscars_tf: worker {missing[0]} did not say which saved state it "
        "resumed within the collective timeout (is it gone, or does its "
        "program not call checkpoint.restore?): every worker must restore "
        "from the same checkpoint directory.")
  first = min(summaries)  # the chief
  for j in sorted(summaries):
    if _state_of(summaries[j]) != _state_of(summaries[first]):
      raise WorkerMismatchError(
          f"oscars_tf: worker {j} resumed from {_describe(summaries[j])} but"
          f" worker {first} from {_describe(summaries[first])}: give every "
          "worker the same checkpoint directory (one all of them see).")


def _summary(directory, state):
  state = state or {}
  return {"directory": os.path.abspath(directory) if directory else None,
          "weights": state.get("weights"),
          "epoch": int(state.get("epoch", 0)),
          "optimizer_step": state.get("optimizer_step"),
          "round": state.get("round")}


def _state_of(summary):
  return (summary["weights"], summary["epoch"], summary["optimizer_step"],
          summary["round"])


def _describe(summary):
  directory = summary["directory"]
  if summary["weights"] is None:
    return (f"nothing in {directory}" if directory else
            "nothing (no checkpoint directory)")
  where = (f"epoch {summary['epoch']}, optimizer step "
           f"{summary['optimizer_step']}")
  if summary["round"] is not None:
    where += f", round {summary['round']}"
  return f"{os.path.join(directory, summary['weights'])} ({where})"
