"""A test-only hook that holds a worker at the entrance of a collective.

    OSCARS_FAULT_HOLD_AT_COLLECTIVE=N:W:DIR

    OSCARS_FAULT_HOLD_AT_REJOIN=DIR
    OSCARS_FAULT_HOLD_AT_SAVE=W:DIR
    OSCARS_FAULT_HOLD_AT_ARRIVAL=R:W:DIR

Every worker counts the averaging collectives it enters (each
`GroupAverager.reduce` that runs). At the N-th, each worker writes
`DIR/collective-N-w<index>` right before entering it, and worker W then
stops itself (SIGSTOP). The others are then blocked inside the collective,
waiting for W, which a test can kill with SIGKILL once every marker is
there: a death inside a collective, hit every time. Each marker is written
once, so the restarted job is not held again. Unset (always, outside
tests), the collectives are built without the hook.

The second: a dropped worker that has asked to rejoin writes
`DIR/rejoin-w<index>` (its pid) and kills itself (SIGKILL), once: a death
while waiting to rejoin. Killed by itself, at once, not by a test that
sees the marker later, so the chief almost never reads the request while
the process still lives (it would let it in: a death in the round's
collective; the chief logs whom it lets in, so a test can tell).

The third: worker W, saving its round state, writes `DIR/save-w<W>` and
stops itself once its weights are in a temporary file, before their
rename: a death while saving. The fourth: worker W, at the end of round R
once every worker has reached it (each writes `DIR/arrived-R-w<index>`
there), writes `DIR/arrival-R-w<W>` and stops itself before its row is
posted: a stall the chief surely drops it for (a stall inside a
collective, or while a peer still pulls the last one's data from it, holds
everyone instead); the chief then writes `DIR/dropped-w<W>` as it drops
it.
"""

import json
import os
import signal
import time

ENV = "OSCARS_FAULT_HOLD_AT_COLLECTIVE"
REJOIN_ENV = "OSCARS_FAULT_HOLD_AT_REJOIN"
SAVE_ENV = "OSCARS_FAULT_HOLD_AT_SAVE"
ARRIVAL_ENV = "OSCARS_FAULT_HOLD_AT_ARRIVAL"

_entered = [0]  # collectives this process has entered


def _parse(spec):
  count, worker, directory = spec.split(":", 2)
  return int(count), int(worker), directory


def _worker_index():
  config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  return int(config.get("task", {}).get("index", 0))


def _stop_once(marker, how=signal.SIGSTOP):
  """Writes `marker` (this pid) and stops (or with SIGKILL, kills) this
  process, unless `marker` exists."""
  if os.path.exists(marker):  # held once already: a restarted job goes on
    return
  with open(marker, "w") as f:
    f.write(str(os.getpid()))
  os.kill(os.getpid(), how)


def asked_to_rejoin():
  """Called once a dropped worker's request to rejoin is in the store."""
  directory = os.environ.get(REJOIN_ENV)
  if directory:
    _stop_once(os.path.join(directory, f"rejoin-w{_worker_index()}"),
               signal.SIGKILL)


def in_round_state_save():
  """Called while a round state is saved, its files not yet renamed."""
  spec = os.environ.get(SAVE_ENV)
  if spec:
    worker, directory = spec.split(":", 1)
    if int(worker) == _worker_index():
      _stop_once(os.path.join(directory, f"save-w{worker}"))


def dropped(workers):
  """The chief drops `workers`: with the arrival hold set, it writes
  `DIR/dropped-w<j>` for each, so a test knows the drop has happened."""
  spec = os.environ.get(ARRIVAL_ENV)
  if spec:
    directory = _parse(spec)[2]
    for j in workers:
      with open(os.path.join(directory, f"dropped-w{j}"), "w") as f:
        f.write("1")


def at_arrival(round_):
  """Called at the end of round `round_` (the same number on every
  member), before this worker's row is posted."""
  spec = os.environ.get(ARRIVAL_ENV)
  if not spec:
    return
  held_round, worker, directory = _parse(spec)
  me = _worker_index()
  if round_ != held_round:
    return
  with open(os.path.join(directory, f"arrived-{round_}-w{me}"), "w") as f:
    f.write(str(os.getpid()))
  if me != worker:
    return
  # Not before every other worker is at this round end too: TensorFlow's
  # collectives are pulled, so a peer still reading the last round's
  # collective from this process would wait for it however it is dropped.
  config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  others = [j for j in range(len(config.get("cluster", {}).get("worker", [])))
            if j != me]
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline and not all(
      os.path.exists(os.path.join(directory, f"arrived-{round_}-w{j}"))
      for j in others):
    time.sleep(0.01)
  _stop_once(os.path.join(directory, f"arrival-{round_}-w{worker}"))


def _enter(spec):
  count, victim, directory = _parse(spec)
  _entered[0] += 1
  if _entered[0] != count:
    return
  me = _worker_index()
  marker = os.path.join(directory, f"collective-{count}-w{me}")
  if os.path.exists(marker):  # held once already: a restarted job goes on
    return
  with open(marker, "w") as f:
    f.write(str(os.getpid()))
  if me == victim:
    os.kill(os.getpid(), signal.SIGSTOP)


def before_collective():
  """Ops to run right before a collective: the hook, or none (unset)."""
  spec = os.environ.get(ENV)
  if not spec:
    return []
  _parse(spec)  # a malformed spec fails at trace time, not mid-training
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return [tf.py_function(lambda: _enter(spec) or 0, [], tf.int32)]
