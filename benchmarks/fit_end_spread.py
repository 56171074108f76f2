"""How far apart the workers' `fit` calls return, and their epochs end.

    python benchmarks/fit_end_spread.py --result_json spread.json  # ~13 min
    python benchmarks/fit_end_spread.py --quick                    # < 2 min

Issue 16: one worker's `model.fit` used to return seconds after the others
at the end of training (+9.2 s over 100 Mbit/s links, +2.7 s on loopback
with one worker 4x slower). The strategy now agrees every epoch end through
its round protocol, and all workers leave `fit` after the same final
collective. This benchmark measures the spread that is left.

Each job runs a plain Keras 3 script (fit_end_spread_worker.py) on 3 real
worker processes started through oscars_tf.launch: a 2-conv CNN (Conv2D 16,
Conv2D 32, Dense 64) on MNIST-shaped 28x28 images (scikit-learn's digits
upsampled, offline; 1,500 training and 297 validation images), batch 32
per worker, validation every epoch, under the default OscarsStrategy()
(Adaptive) and under schedules.Fixed(every=1). Each worker records the
wall-clock time (time.time(): one clock, one machine) when it calls fit, at
each epoch end and at the end of training (a callback's on_epoch_end and
on_train_end, both after the strategy's own epoch-end and final
collectives) and when fit returns.

Profiles:

  loopback    all workers on loopback in the launcher's private network
              namespace; worker 2 is 4x slower (SIMULATED: a per-step
              sleep, --loopback_step_time).
  slow_links  each worker in a network namespace of its own with its own
              address on a bridge, every link rate-limited to 100 Mbit/s
              with tc tbf (EMULATED; netem is not needed). Needs root; the
              profile is skipped, saying why, where namespaces are not
              allowed.

Inputs: `arrays` (NumPy arrays, as the issue's script) and
`dataset_noautotune` (the same batches as a tf.data.Dataset whose
options.autotune.enabled is False). TensorFlow's tf.data autotuning runs a
model thread per iterator, and destroying the iterator (Keras does when fit
returns) can block until that thread's sleep ends: the second input shows
the spread without it.

Per profile, input and schedule, over --repeats jobs (median and range):
the fit wall time (the longest any worker spent in fit), the end spread
(latest minus earliest fit return), the largest epoch-end spread, the
spread of on_train_end (after the final collective), the longest teardown
(on_train_end to fit's return on one worker) and the chief's median round
(compute + wait + communication), against which the spreads are read.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import job_log

from oscars_tf import launch
from oscars_tf.tools import worker_netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = ("loopback", "slow_links")
LABELS = {"loopback": "SIMULATED", "slow_links": "EMULATED"}
# The worker program's (fit_end_spread_worker.py, run as a process).
SCHEDULES = ("adaptive", "fixed1")
INPUTS = ("arrays", "dataset_noautotune")
NUM_WORKERS = 3
SUBNET = "10.213.79"  # tests/test_netns.py uses 10.213.77 (other
                      # namespaces: no clash either way)
NETNS_ENV = "FIT_END_SPREAD_NETNS"

flags.DEFINE_bool("quick", False, "One repeat of one epoch, arrays input "
                  "and the default schedule only (a job is about 30 s of "
                  "process start-up and exit besides fit): under 2 minutes.")
flags.DEFINE_list("profiles", list(PROFILES), "Profiles to run.")
flags.DEFINE_list("schedules", list(SCHEDULES), "adaptive: OscarsStrategy() "
                  "(the default); fixed1: schedules.Fixed(every=1).")
flags.DEFINE_list("inputs", list(INPUTS), "arrays: fit(x, y, "
                  "validation_data=(x_val, y_val)) on NumPy arrays, the plain "
                  "Keras script; dataset_noautotune: the same batches as "
                  "tf.data.Dataset with options.autotune.enabled = False.")
flags.DEFINE_integer("repeats", 3, "Jobs per profile, input and schedule.",
                     lower_bound=1)
flags.DEFINE_integer("epochs", 3, "Epochs per job.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.",
                     lower_bound=1)
flags.DEFINE_string("loopback_step_time", "20ms*1,1,4", "SIMULATED "
                    "per-step delay of the loopback profile "
                    "(--simulate_step_time of oscars-launch).")
flags.DEFINE_string("slow_links_step_time", "", "SIMULATED per-step delay "
                    "of the slow_links profile (none by default: the links "
                    "are the only emulation).")
flags.DEFINE_string("rate", "100mbit", "tc tbf rate of every link "
                    "(slow_links).")
flags.DEFINE_integer("timeout", 600, "Seconds each job may take.",
                     lower_bound=10)
flags.DEFINE_string("result_json", None, "Write all results here.")
FLAGS = flags.FLAGS


# -- network namespaces (slow_links) -------------------------------------


def make_namespaces(rate):
  """(WorkerNamespaces, None), every worker's link rate-limited by tbf,
  or (None, why not) where this machine refuses."""
  if os.geteuid() != 0:
    return None, "network namespaces need root (CAP_NET_ADMIN)"
  spaces = worker_netns.WorkerNamespaces(NUM_WORKERS, SUBNET,
                                        prefix="oscars_fes")
  try:
    spaces.create()
    why = spaces.shape(["tbf", "rate", rate, "burst", "256kb", "latency",
                        "50ms"])
  except (subprocess.CalledProcessError, OSError,
          subprocess.TimeoutExpired) as e:
    why = (getattr(e, "stderr", None) or str(e)).strip()
  if why is not None:
    spaces.remove()
    return None, f"cannot create network namespaces or tbf here: {why}"
  return spaces, None


# -- the driver ------------------------------------------------------------


def _env():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             TF_NUM_INTRAOP_THREADS="1", PYTHONUNBUFFERED="1",
             GRPC_VERBOSITY="ERROR")
  env.pop("TF_CONFIG", None)
  env.pop("OSCARS_SIMULATE_STEP_TIME", None)
  return env


def _worker_command(schedule, input_kind, outdir):
  return [sys.executable, os.path.join(os.path.dirname(
      os.path.abspath(__file__)), "fit_end_spread_worker.py"),
          f"--schedule={schedule}", f"--input={input_kind}",
          f"--outdir={outdir}", f"--epochs={FLAGS.epochs}",
          f"--batch_size={FLAGS.batch_size}"]


def run_loopback(schedule, input_kind, outdir):
  """A job through `python -m oscars_tf.launch`; (ok, log)."""
  command = [sys.executable, "-m", "oscars_tf.launch",
             f"--num_workers={NUM_WORKERS}", f"--timeout={FLAGS.timeout}"]
  if FLAGS.loopback_step_time:
    command.append(f"--simulate_step_time={FLAGS.loopback_step_time}")
  command += ["--"] + _worker_command(schedule, input_kind, outdir)
  proc = subprocess.run(command, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, env=_env(),
                        timeout=FLAGS.timeout + 60, check=False, cwd=ROOT)
  return proc.returncode == 0, proc.stdout


def run_slow_links(schedule, input_kind, outdir, spaces):
  """A job through oscars_tf.launch.Job, worker i in namespace i; (ok,
  log)."""
  env = _env()
  if FLAGS.slow_links_step_time:
    env["OSCARS_SIMULATE_STEP_TIME"] = FLAGS.slow_links_step_time
  # Every worker runs the same command; `ip netns exec` (which execs in
  # place, keeping launch.Job's process group and parent-death signal)
  # enters the namespace its environment names.
  command = ["sh", "-c", f'exec ip netns exec "${NETNS_ENV}" "$0" "$@"'
             ] + _worker_command(schedule, input_kind, outdir)
  log = job_log.JobLog()
  job = launch.Job(command, NUM_WORKERS, env=env,
                   worker_env={i: {NETNS_ENV: ns}
                               for i, ns in enumerate(spaces.workers)},
                   out=log, hosts=[spaces.address(i)
                                   for i in range(NUM_WORKERS)])
  try:
    codes, failed = job.wait(timeout=FLAGS.timeout, grace=5)
  finally:
    job.stop(grace=1)
  return failed is None and not any(codes), log.text()


def _spread(values):
  return max(values) - min(values)


def measure(outs):
  """The numbers of one job from its workers' records."""
  epochs = list(zip(*[o["epoch_ends"] for o in outs]))
  chief = next(o for o in outs if o["worker"] == 0)
  rounds = chief["round_s"][1:] or chief["round_s"]  # less the first round
  # fit's teardown on each worker: from on_train_end (after the final
  # collective) to fit's return.
  teardown = [o["fit_return"] - (o["train_end"] or o["fit_return"])
              for o in outs]
  return {
      "fit_wall_s": max(o["fit_return"] - o["fit_start"] for o in outs),
      "end_spread_s": _spread([o["fit_return"] for o in outs]),
      "last_worker": max(outs, key=lambda o: o["fit_return"])["worker"],
      "epoch_spreads_s": [_spread(e) for e in epochs],
      "epoch_spread_max_s": max((_spread(e) for e in epochs), default=0.0),
      "train_end_spread_s": (_spread([o["train_end"] for o in outs])
                             if all(o["train_end"] for o in outs) else None),
      "teardown_s": teardown,
      "teardown_max_s": max(teardown),
      "round_median_s": statistics.median(rounds) if rounds else None,
      "rounds": chief["rounds"],
      "local_steps": [o["local_steps"] for o in outs],
      "val_accuracy": (chief["val_accuracy"] or [None])[-1],
      "workers": outs}


def run_job(profile, schedule, input_kind, spaces):
  with tempfile.TemporaryDirectory(prefix="oscars_fes_") as outdir:
    start = time.monotonic()
    if profile == "loopback":
      ok, log = run_loopback(schedule, input_kind, outdir)
    else:
      ok, log = run_slow_links(schedule, input_kind, outdir, spaces)
    wall = time.monotonic() - start
    paths = [os.path.join(outdir, f"worker_{i}.json")
             for i in range(NUM_WORKERS)]
    if not ok or not all(os.path.exists(p) for p in paths):
      raise RuntimeError(f"job {profile}/{input_kind}/{schedule} failed:\n"
                         f"{log[-4000:]}")
    outs = []
    for p in paths:
      with open(p) as f:
        outs.append(json.load(f))
  result = measure(outs)
  result["job_wall_s"] = wall
  return result


def _stat(values):
  values = [v for v in values if v is not None]
  if not values:
    return None
  return {"median": statistics.median(values), "min": min(values),
          "max": max(values), "values": values}


STATS = ("fit_wall_s", "end_spread_s", "epoch_spread_max_s",
         "train_end_spread_s", "teardown_max_s", "round_median_s",
         "job_wall_s")


def summarize(profile, schedule, input_kind, runs):
  row = {"profile": profile, "label": LABELS[profile], "schedule": schedule,
         "input": input_kind, "runs": runs}
  for key in STATS:
    row[key] = _stat([r[key] for r in runs])
  row["end_within_one_round"] = sum(
      r["round_median_s"] is not None and
      r["end_spread_s"] <= r["round_median_s"] for r in runs)
  return row


def _fmt(stat, scale=1.0, digits=0):
  if stat is None:
    return "n/a"
  m, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
  if len(stat["values"]) == 1:
    return f"{m:.{digits}f}"
  return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def print_table(rows, skipped):
  print(f"\n{NUM_WORKERS} workers, 2-conv CNN on 28x28 digits (1,500 train, "
        f"297 validation), {FLAGS.epochs} epoch(s), batch "
        f"{FLAGS.batch_size}/worker; median [min-max] over {FLAGS.repeats} "
        f"run(s); fit wall in s, the rest in ms")
  head = (f"{'profile':11} {'label':9} {'input':18} {'schedule':8} "
          f"{'fit wall':>16} {'end spread':>17} {'epoch-end spread':>16} "
          f"{'train-end spread':>16} {'teardown':>17} {'round':>16} "
          f"{'end<=round':>10}")
  print(head)
  print("-" * len(head))
  for r in rows:
    print(f"{r['profile']:11} {r['label']:9} {r['input']:18} "
          f"{r['schedule']:8} {_fmt(r['fit_wall_s'], 1, 1):>16} "
          f"{_fmt(r['end_spread_s'], 1e3):>17} "
          f"{_fmt(r['epoch_spread_max_s'], 1e3):>16} "
          f"{_fmt(r['train_end_spread_s'], 1e3):>16} "
          f"{_fmt(r['teardown_max_s'], 1e3):>17} "
          f"{_fmt(r['round_median_s'], 1e3):>16} "
          f"{r['end_within_one_round']:>4}/{len(r['runs'])}")
  for profile, why in skipped.items():
    print(f"{profile}: SKIPPED: {why}")
  print("(fit wall: the longest any worker spent in fit; end spread: latest "
        "minus earliest fit return; epoch-end spread: the largest over the "
        "epochs; train-end spread: of on_train_end, after the final "
        "collective; teardown: the longest on_train_end -> fit return of one "
        "worker; round: the chief's median round, compute + wait + "
        "communication; end<=round: runs whose end spread is at most a "
        "round)")


def main(argv):
  del argv
  if FLAGS.quick:
    for name, value in (("repeats", 1), ("epochs", 1), ("inputs", ["arrays"]),
                        ("schedules", ["adaptive"])):
      if not FLAGS[name].present:
        FLAGS[name].value = value
  bad = (sorted(set(FLAGS.profiles) - set(PROFILES)) +
         sorted(set(FLAGS.schedules) - set(SCHEDULES)) +
         sorted(set(FLAGS.inputs) - set(INPUTS)))
  if bad:
    sys.exit(f"fit_end_spread.py: unknown --profiles/--schedules/--inputs "
             f"{bad}; profiles: {PROFILES}, schedules: {SCHEDULES}, inputs: "
             f"{INPUTS}.")
  start = time.monotonic()
  rows, skipped = [], {}
  for profile in FLAGS.profiles:
    spaces = None
    if profile == "slow_links":
      spaces, why = make_namespaces(FLAGS.rate)
      if spaces is None:
        skipped[profile] = why
        print(f"slow_links: SKIPPED: {why}", flush=True)
        continue
    try:
      for input_kind in FLAGS.inputs:
        for schedule in FLAGS.schedules:
          runs = []
          for k in range(FLAGS.repeats):
            print(f"running {profile} ({LABELS[profile]}) {input_kind} "
                  f"{schedule}, run {k + 1} of {FLAGS.repeats} ...",
                  flush=True)
            r = run_job(profile, schedule, input_kind, spaces)
            runs.append(r)
            print(f"  fit {r['fit_wall_s']:.1f} s, end spread "
                  f"{r['end_spread_s'] * 1e3:.0f} ms (last: worker "
                  f"{r['last_worker']}), epoch-end spreads "
                  f"{[round(s * 1e3) for s in r['epoch_spreads_s']]} ms, "
                  f"teardown {[round(t * 1e3) for t in r['teardown_s']]} "
                  f"ms, median round "
                  f"{(r['round_median_s'] or 0) * 1e3:.0f} ms", flush=True)
          rows.append(summarize(profile, schedule, input_kind, runs))
    finally:
      if spaces is not None:
        spaces.remove()
  print_table(rows, skipped)
  total = time.monotonic() - start
  print(f"\nbenchmark wall time {total:.0f} s")
  if FLAGS.result_json:
    config = {k: FLAGS[k].value for k in (
        "profiles", "schedules", "inputs", "repeats", "epochs", "batch_size",
        "loopback_step_time", "slow_links_step_time", "rate", "quick")}
    config["num_workers"] = NUM_WORKERS
    with open(FLAGS.result_json, "w") as f:
      json.dump({"labels": LABELS, "config": config, "rows": rows,
                 "skipped": skipped, "wall_time_s": total,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
