"""Recovery by restarting the job: oscars-launch, checkpoints, round states.

The chief decides each round's members and hosts TensorFlow's coordination
service, so the others cannot go on without it (a dead non-chief worker is
only dropped: test_faults.py). Its death is recovered by restarting the job:
the launcher sees it, stops the others and starts all workers again, and
examples/train.py resumes from the chief's last averaged checkpoint. A
worker killed while the others are inside an averaging collective with it
aborts their collectives: they save their round state and exit with code
75, and the launcher restarts the job by itself from that state. Real
processes, real gRPC on loopback, every wait bounded.
"""

import json
import os
import signal
import time

import pytest

import faults
from oscars_tf.runtime import fault_injection

TRAIN_ARGS = ["--epochs=10", "--simulate_step_time=20ms*1,1"]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
  """Test accuracy of the same job when nothing is killed."""
  result = tmp_path_factory.mktemp("undisturbed") / "result.json"
  job = faults.launch(2, TRAIN_ARGS + [f"--result_json={result}"],
                      ["--timeout=150"])
  out, err = faults.finish(job, 170)
  assert job.returncode == 0, err[-3000:]
  return json.loads(result.read_text())


# Worker 0: the chief's death always takes this path. Worker 1 with
# --nokeep_going: how a dead worker comes back into the job (a restarted
# process cannot rejoin running collectives; see docs/reliability.md).
@pytest.mark.parametrize("victim, launcher_args", [
    (0, []), (1, ["--nokeep_going"])])
def test_a_death_restarts_the_job_and_training_resumes(tmp_path, victim,
                                                       launcher_args,
                                                       undisturbed):
  ckpt, result = tmp_path / "ckpt", tmp_path / "result.json"
  launcher = faults.launch(
      2, TRAIN_ARGS + [f"--checkpoint_dir={ckpt}", f"--result_json={result}"],
      ["--restarts=1", "--timeout=240"] + launcher_args)
  try:
    faults.wait_for(lambda: faults.epoch_of(ckpt) >= 1, 120,
                    "the first checkpoint", launcher)
    pid = faults.workers_of(str(ckpt)).get(victim)
    assert pid, f"worker {victim} not found"
    killed_at_epoch = faults.epoch_of(ckpt)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out, err = faults.finish(launcher, 240)
    rest_s = time.monotonic() - killed_at
  except BaseException:
    faults.kill(launcher)
    raise
  assert launcher.returncode == 0, (out[-3000:], err[-3000:])
  assert f"worker {victim} was killed by SIGKILL" in err
  assert "restart 1 of 1" in err
  final = json.loads(result.read_text())
  # The second attempt resumed at (or after) the checkpoint seen at the kill.
  assert final["initial_epoch"] >= killed_at_epoch >= 1
  assert [c["epoch"] for c in final["curve"]][-1] == 10
  delta = (faults.settled_accuracy(final) -
           faults.settled_accuracy(undisturbed))
  print(f"\nkill -9 of worker {victim} of 2 {launcher_args}: restart from "
        f"the epoch-{final['initial_epoch']} checkpoint (killed during epoch "
        f"{killed_at_epoch + 1}); {rest_s:.1f} s from the kill to the end of "
        f"the job; final accuracy {final['test_accuracy']:.4f} vs "
        f"{undisturbed['test_accuracy']:.4f} undisturbed, last 3 epochs "
        f"{delta * 100:+.2f} points")
  assert final["test_accuracy"] >= 0.93, final
  assert delta >= -0.01


# With steps_per_execution > 1 Keras runs the steps in a while loop, and the
# round end, collective included, runs inside a tf.py_function (whose errors
# TensorFlow reports as UnknownError: the lost peer must still be seen).
# Compressed averaging dies in its own collectives (an all-to-all, an
# all-gather) and resumes the same way.
# With --overlap_always the held averaging is in flight: worker 0 goes on
# with the next round's steps and meets the failure where it takes the
# average.
_OVERLAP = ["--overlap_always", "--strategy=local_sgd", "--period=4"]


@pytest.mark.parametrize("extra_args, hold", [
    ([], 5), (["--steps_per_execution=4"], 5), (["--compression=int4"], 5),
    (_OVERLAP, 14)], ids=["per_step", "steps_per_execution_4",
                          "compressed_int4", "overlap_in_flight"])
def test_a_death_inside_a_collective_resumes_from_the_survivors_state(
    tmp_path, undisturbed, extra_args, hold):
  # Worker 1 stops itself at the entrance of its `hold`-th averaging
  # collective (in epoch 2 or 3), after worker 0 has entered the same
  # collective; it is killed there. Worker 0's collective fails, it saves
  # its round state and exits 75; the launcher restarts the job by itself
  # (no --restarts).
  ckpt, result = tmp_path / "ckpt", tmp_path / "result.json"
  markers = tmp_path / "markers"
  markers.mkdir()
  launcher = faults.launch(
      2, TRAIN_ARGS + extra_args + [f"--checkpoint_dir={ckpt}",
                                    f"--result_json={result}"],
      ["--timeout=240"], env={fault_injection.ENV: f"{hold}:1:{markers}"})
  entered = [markers / f"collective-{hold}-w{i}" for i in (0, 1)]
  try:
    faults.wait_for(lambda: all(m.exists() and m.read_text()
                                for m in entered), 150,
                    "both workers at the held collective", launcher)
    # Worker 0 is blocked in the collective: no checkpoint moves now.
    at_kill = faults.checkpoint_of(ckpt)
    killed_at = time.time()
    os.kill(int(entered[1].read_text()), signal.SIGKILL)
    out, err = faults.finish(launcher, 240)
  except BaseException:
    faults.kill(launcher)
    raise
  assert launcher.returncode == 0, (out[-3000:], err[-3000:])
  first_attempt = err.split("lost-peer restart")[0]
  # The collective path, not the round protocol's straggler drop:
  assert "a peer is gone at an averaging point (" in first_attempt
  assert "dropped [1]" not in first_attempt
  assert "worker 1 was killed by SIGKILL" in first_attempt
  assert "worker 0: a peer is lost; saved this worker's model" in (
      first_attempt)
  assert "lost-peer restart 1 of 3" in err
  if extra_args == _OVERLAP:
    assert "failed in flight beside the next round's steps" in first_attempt
  assert err.count("restarting all") == 1
  final = json.loads(result.read_text())
  state = final["resumed_from"]
  assert at_kill.get("epoch", 0) >= 1, at_kill
  # Resumed from worker 0's round state, newer than the epoch checkpoint:
  # in the interrupted epoch, with that epoch's steps until the kill.
  assert state["worker"] == 0 and state["attempt"] == 0, state
  assert state["epoch"] == at_kill["epoch"] == final["initial_epoch"]
  assert state["optimizer_step"] > at_kill["optimizer_step"]
  assert [c["epoch"] for c in final["curve"]][-1] == 10
  # The last epoch checkpoint supersedes the round state: a later run
  # resumes from it.
  assert not list(ckpt.glob("round-*")), list(ckpt.iterdir())
  delta = (faults.settled_accuracy(final) -
           faults.settled_accuracy(undisturbed))
  print(f"\nkill -9 of worker 1 of 2 inside an averaging collective (epoch "
        f"{state['epoch'] + 1}, round {state['round']}): restarted from "
        f"worker 0's round state at optimizer step {state['optimizer_step']} "
        f"(the epoch-{at_kill['epoch']} checkpoint: step "
        f"{at_kill['optimizer_step']}; "
        f"{state['optimizer_step'] - at_kill['optimizer_step']} steps kept); "
        f"worker 0 had taken {state['steps_since_average']} local steps since "
        f"the last average (kept), worker 1's of that round are lost; state "
        f"saved {state['saved_at'] - killed_at:.1f} s after the kill, the "
        f"restarted workers started {final['started_at'] - killed_at:.1f} s "
        f"and took their first step {final['first_step_at'] - killed_at:.1f}"
        f" s after it (undisturbed: first step "
        f"{undisturbed['first_step_at'] - undisturbed['started_at']:.1f} s "
        f"after start); {final['optimizer_step']} optimizer steps in all vs "
        f"{undisturbed['optimizer_step']} undisturbed; final accuracy "
        f"{final['test_accuracy']:.4f} vs {undisturbed['test_accuracy']:.4f}"
        f", last 3 epochs {delta * 100:+.2f} points")
  assert final["test_accuracy"] >= 0.93, final
  assert delta >= -0.01


# With an outer optimizer its start and momentum are in the checkpoint too.
@pytest.mark.parametrize("extra_args", [[], ["--outer_momentum=0.5"]],
                         ids=["plain", "outer_momentum"])
def test_a_resumed_deterministic_run_ends_with_the_same_weights(tmp_path,
                                                                extra_args):
  # Stop all workers after epoch 2 and restart them: the weights at epoch 4
  # are bit-identical to those of a run never stopped.
  args = ["--strategy=local_sgd", "--period=4", "--optimizer=momentum",
          "--optimizer_state=average", "--deterministic", "--seed=3"
          ] + extra_args

  def run(name, epochs):
    result = tmp_path / f"{name}_{epochs}.json"
    job = faults.launch(2, args + [f"--epochs={epochs}",
                                   f"--checkpoint_dir={tmp_path / name}",
                                   f"--result_json={result}"],
                        ["--timeout=150"])
    out, err = faults.finish(job, 170)
    assert job.returncode == 0, err[-3000:]
    return json.loads(result.read_text())

  whole = run("whole", 4)
  first_half = run("stopped", 2)
  resumed = run("stopped", 4)
  assert resumed["initial_epoch"] == 2
  assert resumed["optimizer_step"] == whole["optimizer_step"]
  assert first_half["weights_sha256"] != whole["weights_sha256"]
  assert resumed["weights_sha256"] == whole["weights_sha256"]
  assert resumed["test_accuracy"] == whole["test_accuracy"]
