"""Recovery from a dead chief: oscars-launch --restarts and checkpoints.

The chief decides each round's members and hosts TensorFlow's coordination
service, so the others cannot go on without it (a dead non-chief worker is
only dropped: test_faults.py). Its death is recovered by restarting the job:
the launcher sees it, stops the others and starts all workers again, and
examples/train.py resumes from the chief's last averaged checkpoint. Real
processes, real gRPC on loopback, every wait bounded.
"""

import json
import os
import signal
import time

import pytest

import faults


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
# process cannot rejoin running collectives; see README, Reliability).
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
