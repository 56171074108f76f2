"""Randomized faults: kill -9, SIGSTOP and NaN weights, at random moments.

Seeded and bounded: RUNS short jobs of 3 workers (examples/train.py under
oscars-launch, real gRPC on loopback, SIMULATED 40 ms steps), each with one
fault drawn from the seed: its kind, its victim (a worker other than the
chief, whose death is the restart path of test_recovery.py) and its moment
(an epoch E, then a uniform time into it, so it may land in a step, at a
round end, at an epoch end or in validation), early enough that training
goes on for several epochs after it. Set
OSCARS_FAULT_SEED to draw other runs; a failure names its seed and draw.

Every run must end by itself with exit 0; the workers still in the job at
the end hold the same model; and the mean test accuracy of the last five
epochs is within one point of the undisturbed job's (one epoch's accuracy
on the 360 digits test images moves by a point from the next).
"""

import json
import os
import random
import signal
import time

import pytest

import faults

RUNS = 4
WORKERS, EPOCHS = 3, 12
STRAGGLER_S = 3
SEED = int(os.environ.get("OSCARS_FAULT_SEED", "0"))
TRAIN_ARGS = ["--dataset=digits", "--simulate_step_time=60ms",
              f"--epochs={EPOCHS}", f"--straggler_timeout={STRAGGLER_S}",
              "--collective_timeout=60", "--nan_on_sigusr1"]
LAUNCHER_ARGS = ["--timeout=200", "--restarts=1"]


def draws(seed, runs):
  """[(kind, victim, epoch, seconds into it, stop seconds)] of the runs."""
  rng = random.Random(seed)
  kinds = ["kill", "stop", "nan"]
  rng.shuffle(kinds)  # every kind at least once in 3 or more runs
  out = []
  for i in range(runs):
    kind = kinds[i] if i < len(kinds) else rng.choice(kinds)
    out.append((kind, rng.randrange(1, WORKERS), rng.randint(1, EPOCHS - 7),
                round(rng.uniform(0, 1.5), 2), round(rng.uniform(1, 6), 2)))
  return out


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
  result = tmp_path_factory.mktemp("undisturbed") / "result.json"
  job = faults.launch(WORKERS, TRAIN_ARGS + [f"--result_json={result}"],
                      LAUNCHER_ARGS)
  out, err = faults.finish(job, 220)
  assert job.returncode == 0, err[-3000:]
  return json.loads(result.read_text())


def test_the_draws_cover_every_kind_and_depend_on_the_seed():
  kinds = {d[0] for d in draws(SEED, RUNS)}
  assert kinds == {"kill", "stop", "nan"}
  assert draws(1, RUNS) != draws(2, RUNS)


@pytest.mark.parametrize("run", range(RUNS))
def test_a_random_fault_leaves_agreeing_survivors(tmp_path, run,
                                                  undisturbed):
  kind, victim, epoch, after_s, stop_s = draws(SEED, RUNS)[run]
  what = (f"seed {SEED} run {run}: {kind} of worker {victim} {after_s} s "
          f"after epoch {epoch}" + (f" for {stop_s} s" if kind == "stop"
                                    else ""))
  ckpt, result_path = tmp_path / "ckpt", tmp_path / "result.json"
  job = faults.launch(WORKERS, TRAIN_ARGS + [
      f"--checkpoint_dir={ckpt}", f"--result_json={result_path}"],
                      LAUNCHER_ARGS)
  try:
    faults.wait_for(lambda: faults.epoch_of(ckpt) >= epoch, 150,
                    f"epoch {epoch}", job)
    pid = faults.workers_of(str(ckpt)).get(victim)
    assert pid, f"{what}: worker {victim} not found"
    # The fault's moment (a timer, not a wait for anything).
    time.sleep(after_s)
    if kind == "kill":
      os.kill(pid, signal.SIGKILL)
    elif kind == "nan":
      os.kill(pid, signal.SIGUSR1)
    else:
      os.kill(pid, signal.SIGSTOP)
      time.sleep(stop_s)  # the stall itself
      os.kill(pid, signal.SIGCONT)
    out, err = faults.finish(job, 220)
  except BaseException:
    faults.kill(job)
    raise
  assert job.returncode == 0, (what, err[-3000:])
  result = json.loads(result_path.read_text())
  assert [c["epoch"] for c in result["curve"]][-1] == EPOCHS, what
  finals = faults.final_lines(out)
  survivors = sorted(result["final_members"])
  dropped = [e["dropped"] for e in result["membership"] if e["dropped"]]
  restarted = "restart" in err
  # The fault happened, and did what it does.
  if kind == "kill":
    assert dropped == [[victim]] or restarted, (what, dropped, err[-2000:])
  elif kind == "nan":
    assert "weights are now NaN" in out, what
    assert f"worker(s) [{victim}] have non-finite weights" in out + err, what
  elif stop_s > STRAGGLER_S + 0.5:
    assert dropped == [[victim]], (what, dropped)
  if kind != "kill":
    assert survivors == list(range(WORKERS)), (what, result["membership"])
  assert set(survivors) <= set(finals), (what, finals)
  assert len({tuple(finals[w]) for w in survivors}) == 1, (what, finals)
  delta = (faults.settled_accuracy(result, last=5) -
           faults.settled_accuracy(undisturbed, last=5))
  print(f"\n{what}: exit 0, survivors {survivors} agree, accuracy of the "
        f"last 5 epochs {delta * 100:+.2f} points vs undisturbed; "
        f"dropped {dropped}{'; the job restarted' if restarted else ''}")
  assert delta >= -0.01, (what, result["curve"][-5:],
                          undisturbed["curve"][-5:])
