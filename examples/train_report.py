"""What examples/train.py reports: each worker's counters and the chief's
result JSON (--result_json). Apart from train.py so the binary reads as the
run it is; the numbers are the benchmarks' inputs (benchmarks/*.py read
these keys)."""

import hashlib
import time

import numpy as np


def worker_numbers(strategy, model, steps, train_time, simulated_s,
                   real_step_s):
  """This worker's counters for the result (same keys on every worker).

  compute_s is estimated the same way under every strategy: the SIMULATED
  delay plus the steps times a measured local step (loops.local_step_timer).
  Under OscarsStrategy bytes and collectives are its own counts; under TF's
  strategies one gradient all-reduce per step of the trainable weights.
  """
  row = {"steps": steps, "wall_time_s": train_time,
         "compute_s": simulated_s + steps * real_step_s,
         "simulated_s": simulated_s, "real_step_s": real_step_s}
  if hasattr(strategy, "stats"):
    s = strategy.stats()
    late = [r for r in strategy.round_history
            if r["arrived_at"] >= time.time() - train_time / 2]
    busy = sum(r["compute_s"] for r in late)
    spent = busy + sum(r["wait_s"] + r["comm_s"] for r in late)
    return dict(row, wait_s=s["wait_s"], comm_s=s["comm_s"],
                bytes_sent=s["bytes_sent"], collectives=s["syncs"],
                utilization_second_half=busy / spent if spent else 1.0)
  weight_bytes = sum(int(v.numpy().nbytes) for v in model.trainable_weights)
  compute = row["compute_s"]
  return dict(row, wait_s=0.0, comm_s=0.0, bytes_sent=weight_bytes * steps,
              collectives=steps,
              # No rounds to split: the whole run's share.
              utilization_second_half=compute / train_time if train_time
              else 0.0)


def result(flag_values, strategy, model, num_workers, initial_epoch,
           resumed_from, *, started_at, clock, accuracy, test_loss, wall,
           steps, curve, simulated_spec, row, per_worker, extra):
  """The chief's --result_json: the run's flags, its final metrics, its
  curve, the rounds as the chief saw them and every worker's `row`
  (`per_worker`: every worker's values of `row`, gathered, flat)."""
  rounds = getattr(strategy, "round_history", [])
  return {
      "strategy": flag_values.strategy, "dataset": flag_values.dataset,
      "model": flag_values.model, "workers": num_workers,
      # What the averagings sent (bytes_sent in per_worker counts it).
      "averaging_dtype": getattr(strategy, "averaging_dtype", "float32"),
      "compression": getattr(strategy, "compression", None),
      "batch_size_per_worker": flag_values.batch_size,
      "epochs": flag_values.epochs, "initial_epoch": initial_epoch,
      # The saved state this run started from (checkpoint.newest), if any.
      "resumed_from": resumed_from,
      "started_at": started_at, "first_step_at": clock.get("first_step_at"),
      "test_accuracy": accuracy, "test_loss": test_loss,
      # Equal digests: bit-identical final weights (see --deterministic).
      "weights_sha256": hashlib.sha256(b"".join(
          np.ascontiguousarray(v.numpy()).tobytes()
          for v in model.weights)).hexdigest(),
      "wall_time_s": wall, "eval_time_s": clock["eval_s"],
      "optimizer_step": steps, "curve": curve,
      "simulated_step_time": simulated_spec,
      # The chief's view of each round's plan: steps per worker.
      "round_plans": [r["planned_all"] for r in rounds],
      # Each round's groups (worker indices): by host, by speed, or all.
      "round_groups": [r.get("groups") for r in rounds],
      # Workers dropped (dead, stalled, cut off) or back, by round.
      "membership": [{k: r[k] for k in ("round", "arrived_at", "wait_s",
                                        "members", "dropped", "rejoined")}
                     for r in rounds if r.get("dropped") or r.get("rejoined")],
      "final_members": list(getattr(strategy, "members",
                                    range(num_workers))),
      # The chief's rounds: when it arrived, its steps, its waits (for the
      # decision; in the collective), its averaging beside compute.
      "rounds": [{k: r[k] for k in ("round", "arrived_at", "local_steps",
                                    "planned_steps", "epoch_end", "wait_s",
                                    "comm_s", "overlap_s", "take_wait_s",
                                    "members")}
                 for r in rounds],
      "per_worker": [dict(zip(row, map(float, values))) for values in
                     np.reshape(per_worker, (num_workers, -1))],
      **extra}
