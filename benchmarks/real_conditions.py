"""Time to accuracy under EMULATED heterogeneity, against the baselines.

    python benchmarks/real_conditions.py --result_json real.json --png real.png
    python benchmarks/real_conditions.py --quick          # under 3 minutes
    python benchmarks/real_conditions.py --repeats 3      # median and range

Nothing here sleeps to look slow: every profile is EMULATED with real
limits that oscars-launch sets (Linux, root):

  even        4 workers, no limits, loopback
  cpu_uneven  CPU quotas 1 : 1 : 0.5 : 0.25, scaled to this machine's cores
              (oscars-launch --cpu_limit: cgroup cpu.cfs_quota_us / cpu.max,
              how Kubernetes enforces CPU limits)
  slow_links  even workers, each on its own --bandwidth (100 Mbit/s) link
              (oscars-launch --network=emulated: network namespaces, veth,
              tc tbf)
  both        the two together
  links_20mbit  like slow_links at 20 Mbit/s (--profiles=links_20mbit: not
              in the default run)

One invocation trains the same model (examples/models.py's wide_cnn, 2.1 M
parameters: 8.5 MB of float32, real compute in every step), data (digits,
8x8 images, offline), per-worker batch, optimizer and epochs under each
strategy, one real multi-process job after another:

  sync_tf      TensorFlow's MultiWorkerMirroredStrategy (custom loop)
  ps           TensorFlow's ParameterServerStrategy (asynchronous; chief,
               one ps task and the workers; ClusterCoordinator loop)
  local_sgd    OscarsStrategy, Fixed(every=P), the best P of --periods
  oscars       OscarsStrategy(): the default, untuned
  oscars_bf16  OscarsStrategy(averaging_dtype="bfloat16")
  oscars_rule_t  Adaptive(min_utilization=None): the period rule's T,
               not lengthened for whole steps' idle (opt-in,
               --strategies only)

By default each profile runs the baselines its goals need: sync_tf, ps and
oscars everywhere, local_sgd in cpu_uneven, oscars_bf16 where links are
slow (--strategies: one list for every profile). CPU quotas apply at each
worker's first training step (--cpu_limit_from=ready), where every
strategy's clock starts, so start-up and tracing under 0.18 CPU do not cost
minutes; everything timed runs under them.

How it measures: see heterogeneous.py (the accuracy curve of the averaged
model after every epoch, training time after the first step, time to
target interpolated between epochs, utilization as compute share); ratios
are taken within a repeat (strategies of one repeat run back to back) and
reported as median and range over --repeats.
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

PROFILES = ("even", "cpu_uneven", "slow_links", "both", "links_20mbit")
# Run by default: the full run's profiles (links_20mbit on request).
DEFAULT_PROFILES = PROFILES[:4]
STRATEGIES = ("sync_tf", "ps", "local_sgd", "oscars", "oscars_bf16",
              "oscars_int8", "oscars_int4", "oscars_rule_t",
              "oscars_overlap", "oscars_overlap_int4")
# Each profile's strategies by default: every baseline the goals
# compare against there (the full run must fit in 20 minutes); --strategies
# runs the same list in every profile.
PROFILE_STRATEGIES = {
    "even": ("sync_tf", "ps", "oscars", "oscars_overlap"),
    "cpu_uneven": ("sync_tf", "ps", "local_sgd", "oscars"),
    "slow_links": ("sync_tf", "ps", "oscars", "oscars_bf16",
                   "oscars_overlap"),
    "both": ("sync_tf", "ps", "oscars", "oscars_bf16"),
    "links_20mbit": ("sync_tf", "oscars", "oscars_bf16", "oscars_int8",
                     "oscars_int4", "oscars_overlap_int4")}
TRAIN_ARGS = {s: accuracy_runs.STRATEGY_ARGS[s] for s in STRATEGIES}

flags.DEFINE_bool("quick", False, "A small run (cpu_uneven; sync_tf, "
                  "local_sgd with one period, oscars; 4 epochs): under 3 "
                  "minutes.")
flags.DEFINE_list("profiles", list(DEFAULT_PROFILES), "EMULATED profiles, "
                  f"of {', '.join(PROFILES)}.")
flags.DEFINE_list("strategies", [], "Strategies to compare in every "
                  "profile; empty: each profile's default (local_sgd in "
                  "cpu_uneven, oscars_bf16 where links are slow; sync_tf, "
                  "ps and oscars everywhere).")
flags.DEFINE_list("periods", ["4", "16"], "local_sgd periods to sweep.")
flags.DEFINE_integer("repeats", 1, "Runs of every job; ratios are reported "
                     "as median and range.", lower_bound=1)
flags.DEFINE_integer("num_workers", 4, "Workers per job.", lower_bound=2)
flags.DEFINE_list("cpu_ratios", ["1", "1", "0.5", "0.25"], "cpu_uneven: the "
                  "workers' relative CPU limits (one per worker), scaled so "
                  "that they add up to at most --cores.")
flags.DEFINE_float("cores", float(os.cpu_count() or 1), "CPUs the workers "
                   "share (cpu_uneven's scale).", lower_bound=0.01)
flags.DEFINE_enum("cpu_limit_from", "ready", ["ready", "start"],
                  "oscars-launch --cpu_limit_from: ready applies the quotas "
                  "once a worker has started (TensorFlow's import would "
                  "take ~40 s under 0.18 CPU); training is throttled "
                  "either way.")
flags.DEFINE_string("bandwidth", "100mbit", "slow_links: each worker's link "
                    "rate (tc syntax).")
flags.DEFINE_string("model", "wide_cnn", "Model of examples/models.py.")
flags.DEFINE_integer("epochs", 6, "Epochs per job.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 0.05, "Learning rate (SGD, Nesterov "
                   "momentum 0.9).", lower_bound=1e-9)
flags.DEFINE_float("target_accuracy", 0.95, "Target test accuracy.",
                   lower_bound=0, upper_bound=1)
flags.DEFINE_float("ps_max_train_seconds", 60.0, "The asynchronous "
                   "baseline stops once it has trained this long (over 100 "
                   "Mbit/s links it would take minutes an epoch); not "
                   "reaching the target by then counts its whole training "
                   "time, a lower bound. 0: no cap.",
                   lower_bound=0)
flags.DEFINE_integer("timeout", 600, "Seconds each job may take.",
                     lower_bound=10)
flags.DEFINE_string("result_json", None, "Write all results here.")
flags.DEFINE_string("png", None, "Write the figure here (needs matplotlib).")
FLAGS = flags.FLAGS


def cpu_limits(n):
  """cpu_uneven's per-worker CPU limits: --cpu_ratios scaled to --cores."""
  ratios = [float(r) for r in FLAGS.cpu_ratios]
  if len(ratios) != n:
    raise app.UsageError(f"--cpu_ratios: need {n} values (one per worker), "
                         f"got {len(ratios)}.")
  return accuracy_runs.scaled_cpu_limits(ratios, FLAGS.cores)


def launcher_args(profile, n):
  """oscars-launch's flags for a profile (every limit EMULATED)."""
  return accuracy_runs.emulated_launcher_args(
      profile, n, cpu_limits(n), FLAGS.cpu_limit_from, FLAGS.bandwidth)


def run(profile, strategy, period, repeat, outdir):
  """One job; its row of numbers."""
  n = FLAGS.num_workers
  name = f"{profile}-{strategy}-{period or 0}-{repeat}"
  launch = launcher_args(profile, n)
  ps = [f"--max_train_seconds={FLAGS.ps_max_train_seconds:g}"]
  if strategy == "ps":
    launch.append("--num_ps=1")
  train = TRAIN_ARGS[strategy] + [
      "--dataset=digits", f"--model={FLAGS.model}",
      f"--epochs={FLAGS.epochs}", f"--batch_size={FLAGS.batch_size}",
      "--optimizer=momentum", f"--learning_rate={FLAGS.learning_rate}"] + (
          [f"--period={period}"] if period else []) + (
              ps if strategy == "ps" else [])
  print(f"running {name} ...", flush=True)
  try:
    result = accuracy_runs.run_job(name, launch, train, outdir, FLAGS.timeout)
  except RuntimeError as e:
    # A baseline that cannot run in a profile (MultiWorkerMirrored's
    # coordination heartbeats time out behind its all-reduce on 20 Mbit/s
    # links) is a result too: reported, not a crash of the whole run.
    print(str(e)[-2000:], flush=True)
    return dict(profile=profile, strategy=strategy, period=period,
                repeat=repeat, launcher=launch, emulated=True,
                failed=accuracy_runs.failure_reason(str(e)))
  curve = result["curve"]
  return dict(
      accuracy_runs.worker_numbers(result), profile=profile,
      strategy=strategy, period=period, repeat=repeat,
      launcher=launch, emulated=True,
      time_to_target_s=accuracy_runs.time_to_target(
          curve, FLAGS.target_accuracy),
      final_accuracy=result["test_accuracy"],
      train_time_s=curve[-1]["train_time_s"] if curve else 0.0,
      job_wall_s=result["job_wall_s"],
      end_spread_s=result["end_spread_s"],
      exit_spread_s=result["exit_spread_s"],
      curve=[(c["train_time_s"], c["test_accuracy"]) for c in curve])


def run_all(outdir):
  rows = []
  for repeat in range(FLAGS.repeats):
    for profile in FLAGS.profiles:
      for strategy in FLAGS.strategies or PROFILE_STRATEGIES[profile]:
        periods = ([int(p) for p in FLAGS.periods]
                   if strategy == "local_sgd" else [None])
        tried = [run(profile, strategy, p, repeat, outdir) for p in periods]
        ran = [r for r in tried if "failed" not in r]
        best = (accuracy_runs.best_local_sgd(ran)
                if strategy == "local_sgd" and ran else
                (ran[0] if ran else None))
        for r in tried:
          r["chosen"] = r is best
        rows.extend(tried)
  return rows


_get = accuracy_runs.row_of


# (profile, what, strategy a, strategy b, threshold): the goals.
GOALS = (
    ("cpu_uneven", "speedup", "oscars", "sync_tf", 2.3),
    ("cpu_uneven", "speedup", "oscars", "local_sgd", 1.3),
    ("slow_links", "speedup", "oscars", "sync_tf", 3.0),
    ("even", "speedup", "oscars", "sync_tf", 1.0),
    # Compressed averaging (links_20mbit, on request).
    ("links_20mbit", "speedup", "oscars_int4", "sync_tf", 10.0),
    ("links_20mbit", "bytes_per_averaging", "oscars_int4", "oscars", 7.0),
    ("links_20mbit", "bytes_per_averaging", "oscars_int8", "oscars", 3.5),
    # Overlapped averaging: the network hidden (within 1.25x of the even
    # profile's time: a "speed-up" of at least 0.8), no cost where it is
    # free.
    ("slow_links", "speedup", "oscars_overlap", "even:oscars", 0.8),
    ("even", "speedup", "oscars_overlap", "oscars", 0.95),
    ("links_20mbit", "speedup", "oscars_overlap_int4", "sync_tf", 10.0),
) + tuple((p, what, "oscars", other, t) for p in PROFILES for what, other, t
          in (("accuracy", "sync_tf", -0.5), ("speedup", "ps", 1.0),
              ("accuracy", "ps", 0.0))) + tuple(
                  ("links_20mbit", "accuracy", s, "oscars", -1.0)
                  for s in ("oscars_int8", "oscars_int4",
                            "oscars_overlap_int4")) + tuple(
                      (p, "accuracy", "oscars_overlap", "oscars", -1.0)
                      for p in ("even", "slow_links"))


def _bytes_per_averaging(row):
  return sum(row["bytes_sent"]) / max(1, sum(row["collectives"]))


def _measure(what, x, y):
  """`what` of row x against row y: how much sooner x reached the target,
  its final accuracy's lead in points, or how many times fewer bytes an
  averaging x sent."""
  if what == "speedup":
    return accuracy_runs.speedup(x, y)
  if what == "bytes_per_averaging":
    return _bytes_per_averaging(y) / _bytes_per_averaging(x)
  return 100 * (x["final_accuracy"] - y["final_accuracy"])


def goals(rows):
  """Every goal with its median and range over the repeats (reported, not
  asserted: a missed goal is printed as missed)."""
  out = []
  for profile, what, a, b, threshold in GOALS:
    values = []
    for repeat in range(FLAGS.repeats):
      x, y = (_get(rows, profile, s, repeat) for s in (a, b))
      if x is None or y is None:
        continue
      values.append(_measure(what, x, y))
    failed = sorted({r["strategy"] for r in rows if "failed" in r and
                     r["profile"] == profile and r["strategy"] in (a, b)})
    if not values and failed:
      out.append({"goal": f"{profile}: {a} vs {b} (goal >= {threshold:g}): "
                          f"not measured, {', '.join(failed)} failed",
                  "median": None, "low": None, "high": None,
                  "threshold": threshold, "met": False})
    if not values:
      continue
    mid, low, high = accuracy_runs.median_and_range(values)
    unit = {"speedup": "x sooner to target",
            "bytes_per_averaging": "x fewer bytes an averaging"}.get(
                what, "points final acc.")
    out.append({"goal": f"{profile}: {a} vs {b}, {unit} (goal >= "
                        f"{threshold:g})",
                "median": mid, "low": low, "high": high,
                "threshold": threshold,
                "met": mid is not None and mid >= threshold})
  return out


def print_table(rows, goal_rows):
  print(f"\nEMULATED heterogeneity (real CPU quotas, real shaped links), "
        f"{FLAGS.num_workers} workers, {FLAGS.model} on digits, batch "
        f"{FLAGS.batch_size}/worker, target {FLAGS.target_accuracy}, "
        f"{FLAGS.repeats} repeat(s); cpu_uneven limits "
        f"{cpu_limits(FLAGS.num_workers)} CPU, links {FLAGS.bandwidth}")
  head = (f"{'profile':11} {'strategy':14} {'rep':>3} {'t->target s':>11} "
          f"{'final acc':>9} {'train s':>7} {'util/worker':>20} "
          f"{'MB sent/w':>9} {'collect.':>8} {'ends s':>10}")
  print(head)
  print("-" * len(head))
  for r in rows:
    name = r["strategy"] + (f"({r['period']})" if r["period"] else "")
    if "failed" in r:
      print(f"{r['profile']:11} {name:14} {r['repeat']:3d} FAILED: "
            f"{r['failed']}")
      continue
    name += "" if r["chosen"] else " *"
    t = r["time_to_target_s"]
    print(f"{r['profile']:11} {name:14} {r['repeat']:3d} "
          f"{'never' if t is None else f'{t:.1f}':>11} "
          f"{r['final_accuracy']:9.3f} {r['train_time_s']:7.1f} "
          f"{' '.join(f'{u:.2f}' for u in r['utilization']):>20} "
          f"{statistics.fmean(r['bytes_sent']) / 1e6:9.1f} "
          f"{statistics.fmean(r['collectives']):8.0f} "
          f"{accuracy_runs.spread_text(r):>10}")
  print("(* local_sgd periods not chosen as best; util = compute share of "
        "training time, estimated alike for every strategy; ends = how far "
        "apart the workers' training returned / their processes exited)")
  accuracy_runs.print_goals(goal_rows)


def plot(rows, path):
  plt = accuracy_runs.pyplot()
  if plt is None:
    return None
  profiles = [p for p in PROFILES if any(r["profile"] == p for r in rows)]
  fig, axes = plt.subplots(3, len(profiles), squeeze=False,
                           figsize=(4.5 * len(profiles), 9))
  for col, profile in enumerate(profiles):
    chosen = [r for r in rows if r["profile"] == profile and r["chosen"]
              and r["repeat"] == 0]
    accuracy_runs.plot_accuracy(axes[0][col], chosen, FLAGS.target_accuracy,
                                f"{profile} (EMULATED)")
    accuracy_runs.plot_per_worker(axes[1][col], chosen, "utilization",
                                  "utilization (est.)")
    accuracy_runs.plot_per_worker(axes[2][col], chosen, "bytes_sent",
                                  "MB sent", scale=1e-6)
  fig.suptitle(f"EMULATED: {FLAGS.num_workers} workers, {FLAGS.model} on "
               f"digits (repeat 0)")
  return accuracy_runs.save_figure(plt, fig, path, dpi=70)


def main(argv):
  del argv
  if FLAGS.quick:
    accuracy_runs.quick_defaults(FLAGS, (
        ("profiles", ["cpu_uneven"]), ("periods", ["8"]),
        ("strategies", ["sync_tf", "local_sgd", "oscars"]), ("epochs", 4)))
  bad = sorted(set(FLAGS.profiles) - set(PROFILES)) + sorted(
      set(FLAGS.strategies) - set(STRATEGIES))
  if bad:
    sys.exit(f"real_conditions.py: unknown --profiles/--strategies {bad}; "
             f"profiles: {PROFILES}, strategies: {STRATEGIES}.")
  cpu_limits(FLAGS.num_workers)  # a bad --cpu_ratios fails before any job
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="oscars_real_") as outdir:
    rows = run_all(outdir)
  goal_rows = goals(rows)
  print_table(rows, goal_rows)
  png = plot(rows, FLAGS.png) if FLAGS.png else None
  total = time.monotonic() - start
  print(f"\nbenchmark wall time {total:.0f} s" +
        (f"; figure {png}" if png else ""))
  if FLAGS.result_json:
    config = {k: FLAGS[k].value for k in (
        "num_workers", "cpu_ratios", "cores", "bandwidth", "model", "epochs",
        "batch_size", "learning_rate", "target_accuracy", "profiles",
        "strategies", "periods", "repeats", "quick", "cpu_limit_from")}
    config["strategies_by_profile"] = {
        p: list(FLAGS.strategies or PROFILE_STRATEGIES[p])
        for p in FLAGS.profiles}
    config["cpu_limits"] = cpu_limits(FLAGS.num_workers)
    with open(FLAGS.result_json, "w") as f:
      json.dump({"emulated": True, "config": config, "rows": rows,
                 "goals": goal_rows, "png": png, "wall_time_s": total}, f,
                indent=1)


if __name__ == "__main__":
  app.run(main)
