"""A real language model under EMULATED heterogeneity, against the baselines.

    python benchmarks/real_workloads.py --result_json lm.json --png lm.png
    python benchmarks/real_workloads.py --quick        # under 3 minutes
    python benchmarks/real_workloads.py --repeats 3    # median and range

Every job trains examples/models.py's transformer_lm (decoder-only, byte
vocabulary) on stdlib_text (this Python's standard library sources, read
through tf.data from the files; offline everywhere) with Adam, the same
per-worker batch, steps per epoch and epochs under each strategy, one
real multi-process job after another through oscars-launch. Nothing
sleeps to look slow: every profile is EMULATED with the launcher's own
flags (real CPU quotas from each worker's first step, real shaped links):

  even        4 workers, no limits
  cpu_uneven  CPU quotas 1 : 1 : 0.5 : 0.25, scaled to this machine's cores
  slow_links  every worker's link at --bandwidth (100 Mbit/s)
  both        the two together

Strategies:

  sync_tf       TensorFlow's MultiWorkerMirroredStrategy (custom loop)
  local_sgd     OscarsStrategy, Fixed(every=P): the best P of --periods
  oscars        OscarsStrategy(): the default, untuned
  oscars_outer  OscarsStrategy(outer_optimizer=OuterMomentum()), defaults
  oscars_bf16   OscarsStrategy(averaging_dtype="bfloat16")
  oscars_int8, oscars_int4   OscarsStrategy(compression=...) (on request)
  oscars_overlap       OscarsStrategy(overlap=True): averagings beside the
                       next round's steps
  oscars_overlap_int4  both (links_20mbit)

Each job reports validation bits per byte after every epoch (--eval_windows
of the held-out files). Per profile and repeat, the target is sync_tf's
value at --target_fraction (2/3) of its run, and every job's time to it is
interpolated between epoch ends. Also per job: the value at an equal wall
time (the shortest run's training time in that profile) and at an equal
number of samples (the end: every strategy trains --epochs x
--steps_per_epoch x workers x --batch_size windows), the fastest worker's
period in every round (a histogram) and how many rounds an epoch end
ended, bytes sent and utilization per worker, the workers' end spread,
and the realized fraction of the ideal: the speed-up over sync_tf divided
by sum(rate) / (N * min rate) of the CPU limits (1 without them).
"""

import json
import os
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags

import accuracy_runs  # benchmarks/accuracy_runs.py
import lm_measures  # benchmarks/lm_measures.py

PROFILES = ("even", "cpu_uneven", "slow_links", "both", "links_20mbit")
DEFAULT_PROFILES = PROFILES[:4]  # links_20mbit on request
STRATEGIES = ("sync_tf", "local_sgd", "oscars", "oscars_outer",
              "oscars_bf16", "oscars_int8", "oscars_int4", "oscars_overlap",
              "oscars_overlap_int4")
OSCARS = STRATEGIES[2:]
# Each profile's strategies by default: what the goals compare there, in
# a full run of about 25 minutes on 2 cores.
PROFILE_STRATEGIES = {
    "even": ("sync_tf", "oscars", "oscars_overlap"),
    "cpu_uneven": STRATEGIES[:5],  # compressed ones on request
    "slow_links": ("sync_tf", "oscars", "oscars_outer", "oscars_bf16",
                   "oscars_overlap"),
    "both": ("sync_tf", "oscars", "oscars_bf16"),
    "links_20mbit": ("oscars", "oscars_int8", "oscars_int4",
                     "oscars_overlap_int4")}
TRAIN_ARGS = {s: accuracy_runs.STRATEGY_ARGS[s] for s in STRATEGIES}

flags.DEFINE_bool("quick", False, "A small run (cpu_uneven; sync_tf, "
                  "local_sgd with one period, oscars; fewer steps): under 3 "
                  "minutes.")
flags.DEFINE_list("profiles", list(DEFAULT_PROFILES), "EMULATED profiles, "
                  f"of {', '.join(PROFILES)}.")
flags.DEFINE_list("strategies", [], "Strategies in every profile; empty: "
                  "each profile's default.")
flags.DEFINE_list("periods", ["4", "16"], "local_sgd periods to sweep.")
flags.DEFINE_list("oscars_args", [], "More examples/train.py flags for "
                  "every job but sync_tf's (all OscarsStrategy), e.g. "
                  "--oscars_args=--outer_momentum=0.2")
flags.DEFINE_integer("repeats", 1, "Runs of every job.", lower_bound=1)
flags.DEFINE_integer("first_repeat", 0, "Index (and data seed) of the first "
                     "repeat: more repeats of an earlier run.", lower_bound=0)
flags.DEFINE_integer("num_workers", 4, "Workers per job.", lower_bound=2)
flags.DEFINE_list("cpu_ratios", ["1", "1", "0.5", "0.25"], "cpu_uneven: "
                  "relative CPU limits, scaled to --cores.")
flags.DEFINE_float("cores", float(os.cpu_count() or 1), "CPUs the workers "
                   "share.", lower_bound=0.01)
flags.DEFINE_string("bandwidth", "100mbit", "slow_links: each worker's link.")
flags.DEFINE_integer("epochs", 3, "Epochs per job.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 60, "Steps per worker per epoch.",
                     lower_bound=1)
flags.DEFINE_integer("batch_size", 16, "Windows per worker per step.",
                     lower_bound=1)
flags.DEFINE_integer("d_model", 192, "The model's width (2 blocks, 4 heads: "
                     "1.0 M parameters, 4 MB to average at 192).",
                     lower_bound=4)
flags.DEFINE_integer("seq_len", 64, "Bytes per window.", lower_bound=2)
flags.DEFINE_float("learning_rate", 2e-3, "Adam's learning rate.",
                   lower_bound=1e-9)
flags.DEFINE_integer("eval_windows", 1024, "Validation windows evaluated "
                     "after each epoch.", lower_bound=1)
flags.DEFINE_float("target_fraction", 2 / 3, "The target: sync_tf's value "
                   "at this fraction of its run.", lower_bound=0.05,
                   upper_bound=1.0)
flags.DEFINE_integer("timeout", 1800, "Seconds each job may take (sync_tf "
                     "at 20 Mbit/s trains for about 15 minutes).",
                     lower_bound=1)
flags.DEFINE_string("result_json", None, "Write all results here.")
flags.DEFINE_string("png", None, "Write the figure here (needs matplotlib).")
FLAGS = flags.FLAGS


def cpu_limits():
  ratios = [float(r) for r in FLAGS.cpu_ratios]
  if len(ratios) != FLAGS.num_workers:
    raise app.UsageError(f"--cpu_ratios: need {FLAGS.num_workers} values, "
                         f"got {len(ratios)}.")
  return accuracy_runs.scaled_cpu_limits(ratios, FLAGS.cores)


def train_args(strategy, period, repeat):
  """examples/train.py's flags for one job."""
  return TRAIN_ARGS[strategy] + [
      "--dataset=stdlib_text", "--model=transformer_lm",
      f"--d_model={FLAGS.d_model}",
      f"--epochs={FLAGS.epochs}", f"--steps_per_epoch={FLAGS.steps_per_epoch}",
      f"--batch_size={FLAGS.batch_size}", f"--seq_len={FLAGS.seq_len}",
      f"--eval_windows={FLAGS.eval_windows}", "--optimizer=adam",
      f"--learning_rate={FLAGS.learning_rate}", f"--seed={repeat}"] + (
          [f"--period={period}"] if period else []) + (
              FLAGS.oscars_args if strategy != "sync_tf" else [])


def run(profile, strategy, period, repeat, outdir):
  """One job; its row of numbers."""
  name = f"{profile}-{strategy}-{period or 0}-{repeat}"
  launch = accuracy_runs.emulated_launcher_args(
      profile, FLAGS.num_workers, cpu_limits(), "ready", FLAGS.bandwidth)
  train = train_args(strategy, period, repeat)
  print(f"running {name} ...", flush=True)
  try:
    result = accuracy_runs.run_job(name, launch, train, outdir, FLAGS.timeout)
  except RuntimeError as e:  # reported; the other jobs still run
    print(str(e)[-2000:], flush=True)
    return dict(profile=profile, strategy=strategy, period=period,
                repeat=repeat, launcher=launch, emulated=True,
                failed=accuracy_runs.failure_reason(str(e)))
  curve = lm_measures.points(result)
  averagings, at_epoch_end = lm_measures.round_ends(result)
  return dict(
      accuracy_runs.worker_numbers(result), profile=profile,
      strategy=strategy, period=period, repeat=repeat, launcher=launch,
      emulated=True, curve=curve, final_bpb=curve[-1][1],
      train_time_s=curve[-1][0], job_wall_s=result["job_wall_s"],
      end_spread_s=result["end_spread_s"],
      exit_spread_s=result["exit_spread_s"], averagings=averagings,
      epoch_end_rounds=at_epoch_end,
      periods=lm_measures.period_histogram(result),
      rounds=result["rounds"])  # the chief's: steps, waits, costs


def _repeats():
  """The repeats' indices (each its data seed)."""
  return range(FLAGS.first_repeat, FLAGS.first_repeat + FLAGS.repeats)


def run_all(outdir):
  """(measured rows, failed jobs' rows)."""
  rows, failed = [], []
  for repeat in _repeats():
    for profile in FLAGS.profiles:
      tried = []
      for strategy in FLAGS.strategies or PROFILE_STRATEGIES[profile]:
        periods = ([int(p) for p in FLAGS.periods]
                   if strategy == "local_sgd" else [None])
        tried += [run(profile, strategy, p, repeat, outdir) for p in periods]
      failed += [r for r in tried if "failed" in r]
      rows += measure([r for r in tried if "failed" not in r])
  return rows, failed


def measure(rows):
  """One profile's rows of one repeat: times to sync_tf's target, values
  at equal wall time, the best local_sgd period (`chosen`)."""
  if not rows:
    return rows
  sync = next((r for r in rows if r["strategy"] == "sync_tf"), None)
  target = (None if sync is None else lm_measures.target_of(
      sync["curve"], FLAGS.target_fraction))
  equal_time = min(r["train_time_s"] for r in rows)
  for r in rows:
    r["target_bpb"] = target
    r["time_to_target_s"] = (None if target is None else
                             lm_measures.time_to(r["curve"], target))
    r["bpb_at_equal_time"] = lm_measures.at_time(r["curve"], equal_time)
    r["equal_time_s"] = equal_time
    r["chosen"] = True
  local = [r for r in rows if r["strategy"] == "local_sgd"]
  if local:
    best = min(local, key=lambda r: (r["time_to_target_s"] is None,
                                     r["time_to_target_s"] or r["final_bpb"]))
    for r in local:
      r["chosen"] = r is best
  return rows


_get = accuracy_runs.row_of


def _speedup(fast, slow):
  """slow's time to target over fast's; rows of two profiles are timed
  to the same target (slow's)."""
  if (fast is not None and slow is not None and
      fast["target_bpb"] != slow["target_bpb"]):
    fast = dict(fast, time_to_target_s=lm_measures.time_to(
        fast["curve"], slow["target_bpb"]))
  return accuracy_runs.speedup(fast, slow)


def _extra_bpb(a, b):
  return 100 * (a["final_bpb"] - b["final_bpb"]) / b["final_bpb"]


def _rule_share(a, _):
  return (None if not a["averagings"] else
          100 * (1 - a["epoch_end_rounds"] / a["averagings"]))


# (profile, strategy, baseline, measure, unit, goal, at least?)
GOALS = (
    ("cpu_uneven", "oscars", "sync_tf", _speedup, "x to target", 2.5, True),
    ("cpu_uneven", "oscars", "local_sgd", _speedup, "x to target", 1.3, True),
    ("slow_links", "oscars", "sync_tf", _speedup, "x to target", 4.0, True),
    ("even", "oscars", "sync_tf", _speedup, "x to target", 1.0, True),
    # Overlapped averaging: the network hidden (within 1.25x of the even
    # profile's time), no cost where the network is free.
    ("slow_links", "oscars_overlap", "even:oscars", _speedup,
     "x to target (goal: within 1.25x)", 0.8, True),
    ("even", "oscars_overlap", "oscars", _speedup, "x to target", 0.95,
     True),
    ("slow_links", "oscars_overlap", "oscars", _extra_bpb,
     "% final bpb", 1.0, False),
) + tuple((p, "oscars", "sync_tf", _extra_bpb, "% bpb at equal samples",
           1.0, False) for p in PROFILES) + tuple(
               (p, s, None, _rule_share, "% rounds ended by the period rule",
                80.0, True) for p in PROFILES for s in OSCARS)


def goals(rows):
  """Every goal: median and range over the repeats, met or missed."""
  out = []
  for profile, a, b, fn, unit, goal, at_least in GOALS:
    values = []
    for repeat in _repeats():
      x = _get(rows, profile, a, repeat)
      y = _get(rows, profile, b, repeat) if b else x
      if x is not None and y is not None:
        values.append(fn(x, y))
    mid, low, high = accuracy_runs.median_and_range(values)
    if mid is None and not values:
      continue
    met = mid is not None and (mid >= goal if at_least else mid <= goal)
    versus = f" vs {b}" if b else ""
    out.append({"goal": f"{profile}: {a}{versus}, {unit} (goal "
                        f"{'>=' if at_least else '<='} {goal:g})",
                "median": mid, "low": low, "high": high, "met": met})
  return out


def realized(rows):
  """Per profile: oscars' speed-up over sync_tf, the compute ideal, and
  their ratio (medians over the repeats)."""
  out = {}
  for profile in FLAGS.profiles:
    ideal = (lm_measures.compute_ideal(cpu_limits())
             if profile in ("cpu_uneven", "both") else 1.0)
    ups = [_speedup(_get(rows, profile, "oscars", k),
                    _get(rows, profile, "sync_tf", k))
           for k in _repeats()]
    mid = accuracy_runs.median_and_range(ups)[0]
    out[profile] = {"speedup": mid, "ideal": ideal,
                    "fraction": None if mid is None else mid / ideal}
  return out


def print_table(rows, goal_rows, ideal):
  print(f"\nEMULATED heterogeneity (real CPU quotas, real shaped links), "
        f"{FLAGS.num_workers} workers, transformer_lm (d_model "
        f"{FLAGS.d_model}) on stdlib_text, "
        f"batch {FLAGS.batch_size}x{FLAGS.seq_len} bytes/worker, "
        f"{FLAGS.epochs}x{FLAGS.steps_per_epoch} steps/worker, "
        f"{FLAGS.repeats} repeat(s); cpu_uneven limits {cpu_limits()} CPU, "
        f"links {FLAGS.bandwidth}")
  head = (f"{'profile':10} {'strategy':14} {'rep':>3} {'target':>6} "
          f"{'t->tgt s':>8} {'bpb end':>7} {'bpb@t=':>12} {'train s':>7} "
          f"{'avg':>4} {'@ep':>3} {'util/worker':>19} {'MB/w':>6} "
          f"{'ends s':>10}")
  print(head)
  print("-" * len(head))
  for r in rows:
    name = r["strategy"] + (f"({r['period']})" if r["period"] else "")
    name += "" if r["chosen"] else " *"
    t, eq = r["time_to_target_s"], r["bpb_at_equal_time"]
    at = f"{'-' if eq is None else f'{eq:.3f}'}@{r['equal_time_s']:.0f}"
    print(f"{r['profile']:10} {name:14} {r['repeat']:3d} "
          f"{r['target_bpb'] or 0:6.3f} "
          f"{'never' if t is None else f'{t:.1f}':>8} {r['final_bpb']:7.3f} "
          f"{at:>12} {r['train_time_s']:7.1f} {r['averagings']:4d} "
          f"{r['epoch_end_rounds']:3d} "
          f"{' '.join(f'{u:.2f}' for u in r['utilization']):>19} "
          f"{statistics.fmean(r['bytes_sent']) / 1e6:6.1f} "
          f"{accuracy_runs.spread_text(r):>10}")
  print("(bpb: validation bits per byte, lower is better; * local_sgd "
        "periods not chosen; avg: the chief's averagings, @ep: of them "
        "ended by an epoch end; ends: the workers' fit / exit spread)")
  for r in rows:
    if r["periods"]:
      print(f"periods {r['profile']}/{r['strategy']} rep {r['repeat']}: "
            f"{r['periods']}")
  for profile, v in ideal.items():
    if v["speedup"] is not None:
      print(f"{profile}: oscars {v['speedup']:.2f}x over sync_tf; compute "
            f"ideal {v['ideal']:.2f}x; realized {100 * v['fraction']:.0f} %")
  accuracy_runs.print_goals(goal_rows)


def plot(rows, path):
  plt = accuracy_runs.pyplot()
  if plt is None:
    return None
  profiles = [p for p in PROFILES if any(r["profile"] == p for r in rows)]
  fig, axes = plt.subplots(1, len(profiles), squeeze=False,
                           figsize=(4.5 * len(profiles), 3.8))
  for col, profile in enumerate(profiles):
    ax = axes[0][col]
    for r in rows:
      if (r["profile"], r["chosen"], r["repeat"]) == (
          profile, True, FLAGS.first_repeat):
        t, v = zip(*r["curve"])
        ax.plot(t, v, marker="o", markersize=3, label=r["strategy"])
    target = next((r["target_bpb"] for r in rows if r["profile"] == profile
                   and r["target_bpb"]), None)
    if target:
      ax.axhline(target, color="grey", linestyle=":")
    ax.set_title(f"{profile} (EMULATED)")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation bits per byte")
    ax.legend(fontsize=7)
  fig.suptitle(f"EMULATED: {FLAGS.num_workers} workers, transformer_lm on "
               f"stdlib_text (repeat {FLAGS.first_repeat})")
  return accuracy_runs.save_figure(plt, fig, path, dpi=70)


def main(argv):
  del argv
  if FLAGS.quick:
    accuracy_runs.quick_defaults(FLAGS, (
        ("profiles", ["cpu_uneven"]), ("periods", ["16"]),
        ("strategies", ["sync_tf", "local_sgd", "oscars"]), ("epochs", 3),
        ("steps_per_epoch", 30), ("eval_windows", 256), ("d_model", 64)))
  bad = sorted(set(FLAGS.profiles) - set(PROFILES)) + sorted(
      set(FLAGS.strategies) - set(STRATEGIES))
  if bad:
    sys.exit(f"real_workloads.py: unknown --profiles/--strategies {bad}; "
             f"profiles: {PROFILES}, strategies: {STRATEGIES}.")
  not_flags = [a for a in FLAGS.oscars_args if not a.startswith("--")]
  if not_flags:
    sys.exit(f"real_workloads.py: --oscars_args takes train.py flags "
             f"(--name=value), got {not_flags}.")
  cpu_limits()  # a bad --cpu_ratios fails before any job
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="oscars_lm_") as outdir:
    rows, failed = run_all(outdir)
  goal_rows, ideal = goals(rows), realized(rows)
  print_table(rows, goal_rows, ideal)
  for r in failed:
    print(f"FAILED {r['profile']} {r['strategy']} rep {r['repeat']}: "
          f"{r['failed']}")
  png = plot(rows, FLAGS.png) if FLAGS.png else None
  total = time.monotonic() - start
  print(f"\nbenchmark wall time {total:.0f} s" +
        (f"; figure {png}" if png else ""))
  if FLAGS.result_json:
    config = {k: FLAGS[k].value for k in (
        "num_workers", "cpu_ratios", "cores", "bandwidth", "d_model", "epochs",
        "steps_per_epoch", "batch_size", "seq_len", "learning_rate",
        "eval_windows", "target_fraction", "profiles", "strategies",
        "periods", "oscars_args", "repeats", "first_repeat", "quick")}
    config["cpu_limits"] = cpu_limits()
    with open(FLAGS.result_json, "w") as f:
      json.dump({"emulated": True, "config": config, "rows": rows,
                 "failed_jobs": failed, "goals": goal_rows,
                 "realized": ideal, "png": png, "wall_time_s": total},
                f, indent=1)


if __name__ == "__main__":
  app.run(main)
