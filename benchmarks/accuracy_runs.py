"""Time-to-accuracy jobs shared by heterogeneous.py (SIMULATED) and
real_conditions.py (EMULATED): one multi-process training job through
oscars-launch and examples/train.py, and the numbers read from its result.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time

# train.py's flags for each strategy the benchmarks compare.
STRATEGY_ARGS = {
    # A heartbeat timeout of 10 s (TensorFlow's) fails MultiWorkerMirrored
    # behind its all-reduce on 20 Mbit/s links; more changes no speed.
    "sync_tf": ["--strategy=multi_worker_mirrored",
                "--tf_heartbeat_timeout=300"],
    "ps": ["--strategy=parameter_server"],
    "local_sgd": ["--strategy=local_sgd"],
    "oscars": ["--strategy=oscars"],
    "oscars_bf16": ["--strategy=oscars", "--averaging_dtype=bfloat16"],
    "oscars_int8": ["--strategy=oscars", "--compression=int8"],
    "oscars_int4": ["--strategy=oscars", "--compression=int4"],
    "oscars_overlap": ["--strategy=oscars", "--overlap"],
    "oscars_overlap_int4": ["--strategy=oscars", "--overlap",
                            "--compression=int4"],
    "oscars_outer": ["--strategy=oscars", "--outer_momentum=0.5"],
    "oscars_rule_t": ["--strategy=oscars", "--min_utilization=0"]}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


def job_env():
  """The workers' environment: quiet, CPU only, one intra-op thread each
  (several workers share the machine's cores)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             TF_NUM_INTRAOP_THREADS="1", PYTHONUNBUFFERED="1",
             GRPC_VERBOSITY="ERROR")
  env.pop("TF_CONFIG", None)
  return env


def scaled_cpu_limits(ratios, cores):
  """Per-worker CPU limits: `ratios` scaled so that they add up to at most
  `cores` (a quota above the machine's cores limits nothing)."""
  scale = min(1.0, cores / sum(ratios))
  return [round(r * scale, 3) for r in ratios]


# A harsher link than slow_links': every worker's at 20 Mbit/s.
SLOWER_LINK = "20mbit"


def emulated_launcher_args(profile, n, limits, cpu_limit_from, bandwidth):
  """oscars-launch's flags for an EMULATED profile: even, cpu_uneven (CPU
  quotas `limits`, applied from `cpu_limit_from`), slow_links (every
  worker's link at `bandwidth`), both, links_20mbit (every worker's link at
  SLOWER_LINK)."""
  out = [f"--num_workers={n}"]
  if profile in ("cpu_uneven", "both"):
    out.append("--cpu_limit=" + ",".join(f"{c:g}" for c in limits))
    out.append(f"--cpu_limit_from={cpu_limit_from}")
  if profile in ("slow_links", "both"):
    out += ["--network=emulated", f"--bandwidth={bandwidth}"]
  if profile == "links_20mbit":
    out += ["--network=emulated", f"--bandwidth={SLOWER_LINK}"]
  return out


def run_job(name, launcher_args, train_args, outdir, timeout):
  """Runs `oscars-launch launcher_args -- train.py train_args`; returns
  train.py's result (its --result_json) with the job's wall time added."""
  result = os.path.join(outdir, name + ".json")
  command = ([sys.executable, "-m", "oscars_tf.cli.launch",
              f"--timeout={timeout}"] + list(launcher_args) +
             ["--", sys.executable, TRAIN] + list(train_args) +
             [f"--result_json={result}"])
  start = time.monotonic()
  proc = subprocess.run(command, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, env=job_env(),
                        timeout=timeout + 120, check=False)
  if proc.returncode or not os.path.exists(result):
    raise RuntimeError(f"benchmark job {name} failed (exit "
                       f"{proc.returncode}):\n{proc.stdout[-4000:]}")
  with open(result) as f:
    out = json.load(f)
  out["job_wall_s"] = time.monotonic() - start
  out.update(end_spreads(out, proc.stdout))
  return out


def failure_reason(log):
  """Why a job failed, from run_job's message: the log's last error line,
  or else the launcher's last word (e.g. its timeout), or else the first
  line."""
  lines = log.splitlines()
  said = ([line for line in lines if "Error" in line] or
          [line for line in lines if line.startswith("oscars-launch:")] or
          lines[:1] or [""])
  return said[-1][:200]


def end_spreads(result, launcher_output):
  """How far apart the workers ended: `end_spread_s` from the first to the
  last worker's return from training (train.py's per-worker
  training_returned_at; None where it is not reported, e.g. the ps
  strategy), `exit_spread_s` from the first to the last process exit
  (oscars-launch's last line; None without it)."""
  returned = [w.get("training_returned_at", 0.0)
              for w in result.get("per_worker", [])]
  returned = [t for t in returned if t > 0]  # 0: dropped, not reported
  exits = re.findall(r"their exits (\d+\.\d+) s apart", launcher_output)
  return {"end_spread_s": (max(returned) - min(returned)
                           if len(returned) > 1 else None),
          "exit_spread_s": float(exits[-1]) if exits else None}


def spread_text(row):
  """'fit/exit' end spreads of a row in seconds, e.g. '0.01/0.20'."""
  return "/".join("-" if row.get(k) is None else f"{row[k]:.2f}"
                  for k in ("end_spread_s", "exit_spread_s"))


def time_to_target(curve, target):
  """Training time at which the accuracy curve first reaches `target`.

  Accuracy is measured at epoch ends only; between the last point below the
  target and the first at or above it, time is interpolated linearly, so the
  result is not rounded up to a whole epoch (the same rule for every
  strategy; reached at the first point: that point's time). None if the
  target is never reached.
  """
  previous = None
  for point in curve:
    t, a = point["train_time_s"], point["test_accuracy"]
    if a >= target:
      if previous is None:  # reached at the first measurement
        return t
      t0, a0 = previous
      return t0 + (t - t0) * (target - a0) / (a - a0)
    previous = (t, a)
  return None


def worker_numbers(result):
  """Per-worker utilization (compute share of training time), bytes sent
  and collectives, as train.py reports them."""
  workers = result["per_worker"]
  return {
      "utilization": [min(1.0, w["compute_s"] / w["wall_time_s"])
                      if w["wall_time_s"] else 0.0 for w in workers],
      "bytes_sent": [w["bytes_sent"] for w in workers],
      "collectives": [w["collectives"] for w in workers],
      "steps": [w["steps"] for w in workers]}


def best_local_sgd(rows):
  """The local_sgd period that reached the target first (else most
  accurate at the end)."""
  def key(r):
    t = r["time_to_target_s"]
    return (t is None, t if t is not None else -r["final_accuracy"])
  return min(rows, key=key)


def speedup(fast, slow):
  """slow's time to target over fast's; a `slow` that never reached it
  counts its whole training time (a lower bound). None if `fast` never
  reached it."""
  if fast is None or slow is None or fast["time_to_target_s"] is None:
    return None
  return ((slow["time_to_target_s"] or slow["train_time_s"]) /
          fast["time_to_target_s"])


def row_of(rows, profile, strategy, repeat):
  """The chosen row of `strategy` in `profile`'s `repeat`; a strategy
  named "PROFILE:STRATEGY" is that profile's (goals across profiles)."""
  if ":" in strategy:
    profile, strategy = strategy.split(":", 1)
  return next((r for r in rows if (r["profile"], r["strategy"], r["repeat"])
               == (profile, strategy, repeat) and r["chosen"]), None)


def median_and_range(values):
  """(median, low, high) of the values that are not None, else Nones."""
  xs = [v for v in values if v is not None]
  if not xs:
    return None, None, None
  return statistics.median(xs), min(xs), max(xs)


def print_goals(goal_rows):
  """One line per goal: MET or MISSED, its median and range."""
  for g in goal_rows:
    text = ("n/a" if g["median"] is None else
            f"{g['median']:.2f} (range {g['low']:.2f} to {g['high']:.2f})")
    print(f"{'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {text}")


def pyplot():
  """matplotlib's pyplot (Agg), or None with a line saying how to get it."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("no figure: matplotlib is not installed "
          "(pip install 'oscars_tf[benchmarks]')")
    return None
  return plt


# One colour per strategy in every panel (matplotlib's default cycle).
COLOURS = {"sync_tf": "C0", "ps": "C1", "local_sgd": "C2", "oscars": "C3",
           "oscars_bf16": "C4", "async_ps": "C5",
           "oscars_rule_t": "C6"}


def plot_accuracy(ax, rows, target, title):
  """Each row's accuracy curve against training time, the target dotted."""
  for r in rows:
    t, a = zip(*r["curve"]) if r["curve"] else ((), ())
    ax.plot(t, a, marker="o", markersize=3, label=r["strategy"],
            color=COLOURS.get(r["strategy"]))
  ax.axhline(target, color="grey", linestyle=":")
  ax.set_title(title)
  ax.set_xlabel("training time (s)")
  ax.set_ylabel("test accuracy")
  ax.legend(fontsize=7)


def plot_per_worker(ax, rows, key, label, scale=1.0):
  """Bars of each row's per-worker `key` (values times `scale`), grouped by
  worker."""
  width = 0.8 / max(len(rows), 1)
  for i, r in enumerate(rows):
    values = [v * scale for v in r[key]]
    ax.bar([w + i * width for w in range(len(values))], values, width,
           color=COLOURS.get(r["strategy"]),
           label=r["strategy"])
  n = len(rows[0][key]) if rows else 0
  ax.set_xticks([w + 0.4 - width / 2 for w in range(n)])
  ax.set_xticklabels([str(w) for w in range(n)])
  ax.set_xlabel("worker")
  ax.set_ylabel(label)


def save_figure(plt, fig, path, dpi):
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path


def quick_defaults(flag_values, defaults):
  """--quick: `defaults` ((name, value) pairs) for the flags not given."""
  for name, value in defaults:
    if not flag_values[name].present:
      flag_values[name].value = value
