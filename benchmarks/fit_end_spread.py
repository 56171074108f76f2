"""How far apart the workers' `fit` calls return, their processes exit,
and their epochs end.

    python benchmarks/fit_end_spread.py --result_json spread.json  # ~45 min
    python benchmarks/fit_end_spread.py --profiles=slow_model,text_quota \
        --result_json spread.json                                   # ~25 min
    python benchmarks/fit_end_spread.py --quick                     # < 3 min

The user waits for the last worker: a worker whose `fit` returns, or whose
process exits, seconds after the others gives back what the schedule won.
Issue 16 (one worker's `fit` returning up to 9 s late) and issue 42 (4-16 s
late in plain scenarios: the training thread deleted an autotuned tf.data
iterator as `fit` returned) are what this benchmark watches. Goal: every
run under 1 s, for both the `fit` ends and the process exits.

Every job runs a plain Keras 3 script (fit_end_spread_worker.py) on real
worker processes started through oscars_tf.cli.launch, under the default
OscarsStrategy() (Adaptive) and under schedules.Fixed(every=1) (synchronous
training, the baseline). Each worker records the wall-clock time
(time.time(): one clock, one machine) when it calls fit, at each epoch end,
at the end of training (a callback's on_epoch_end and on_train_end, both
after the strategy's own epoch-end and final collectives) and when fit
returns; the launcher records when it sees each worker's process gone (to
its 50 ms poll).

Profiles:

  loopback    3 workers, a 2-conv CNN on MNIST-shaped digits (scikit-learn's
              digits upsampled, offline; 1,500 training and 297 validation
              images), worker 2 4x slower (SIMULATED: the launcher's
              per-step sleep, --loopback_step_time); inputs --inputs.
  slow_links  the same, each worker in a network namespace of its own,
              every link rate-limited to 100 Mbit/s with tc tbf (EMULATED).
              Needs root; skipped, saying why, where namespaces are not
              allowed.
  slow_model  3 workers, an MLP on NumPy arrays (scikit-learn's digits)
              whose training step sleeps inside the model, 20/20/80 ms
              (SIMULATED: a numpy_function layer), 12 epochs: issue 42's
              first scenario.
  text_quota  4 workers, a byte-level language model on a shuffled,
              autotuned tf.data text pipeline (Python's standard-library
              sources), real CPU quotas 0.727/0.727/0.364/0.182 from when
              each worker is ready (EMULATED: oscars-launch --cpu_limit,
              --cpu_limit_from=ready), 6 epochs: issue 42's second
              scenario. Needs root and a writable cgroup cpu controller;
              skipped, saying why, elsewhere.

The CNN profiles' inputs: `arrays` (NumPy arrays) and `dataset_noautotune`
(the same batches as a tf.data.Dataset whose options.autotune.enabled is
False).

Per profile, input and schedule, over --repeats jobs (median and range, and
every run's own line): the fit wall time (the longest any worker spent in
fit), the end spread (latest minus earliest fit return), the exit spread
(latest minus earliest process exit), the largest epoch-end spread, the
spread of on_train_end (after the final collective), the longest teardown
(on_train_end to fit's return on one worker), the chief's median round
(compute + wait + communication), and how many runs ended both spreads
under 1 s.
"""

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

import job_log
from oscars_tf.cli import launch
from oscars_tf.tools import worker_netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("adaptive", "fixed1")
INPUTS = ("arrays", "dataset_noautotune")  # the CNN profiles'
SUBNET = "10.213.79"  # tests/test_netns.py uses 10.213.77 (other
                      # namespaces: no clash either way)
NETNS_ENV = "FIT_END_SPREAD_NETNS"
GOAL_S = 1.0  # every run's fit-end and exit spreads under this


@dataclasses.dataclass(frozen=True)
class Profile:
  label: str          # SIMULATED or EMULATED
  workers: int
  model: str          # fit_end_spread_worker.py --model
  epochs: int         # unless --epochs is given
  repeats: int        # unless --repeats is given
  inputs: tuple = ()  # fixed inputs; () means --inputs
  launcher: tuple = ()  # oscars-launch flags


PROFILES = {
    "loopback": Profile("SIMULATED", 3, "cnn", 3, 3),
    "slow_links": Profile("EMULATED", 3, "cnn", 3, 3),
    "slow_model": Profile("SIMULATED", 3, "slow_mlp", 12, 10, ("arrays",)),
    "text_quota": Profile("EMULATED", 4, "text_lm", 6, 10, ("text",), (
        "--cpu_limit=0.727,0.727,0.364,0.182", "--cpu_limit_from=ready")),
}
LABELS = {name: p.label for name, p in PROFILES.items()}

flags.DEFINE_bool("quick", False, "One repeat of one epoch per profile, "
                  "the default schedule only, loopback and slow_model (a "
                  "job is about 30 s of process start-up and exit besides "
                  "fit): under 3 minutes.")
flags.DEFINE_list("profiles", list(PROFILES), "Profiles to run.")
flags.DEFINE_list("schedules", list(SCHEDULES), "adaptive: OscarsStrategy() "
                  "(the default); fixed1: schedules.Fixed(every=1).")
flags.DEFINE_list("inputs", list(INPUTS), "arrays: fit(x, y, "
                  "validation_data=(x_val, y_val)) on NumPy arrays, the plain "
                  "Keras script; dataset_noautotune: the same batches as "
                  "tf.data.Dataset with options.autotune.enabled = False.")
flags.DEFINE_integer("repeats", None, "Jobs per profile, input and "
                     "schedule (default: 3 for the CNN profiles, 10 for "
                     "slow_model and text_quota).", lower_bound=1)
flags.DEFINE_integer("epochs", None, "Epochs per job (default: the "
                     "profile's; see the module docstring).", lower_bound=1)
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


def make_namespaces(rate, workers):
  """(WorkerNamespaces, None), every worker's link rate-limited by tbf,
  or (None, why not) where this machine refuses."""
  if os.geteuid() != 0:
    return None, "network namespaces need root (CAP_NET_ADMIN)"
  spaces = worker_netns.WorkerNamespaces(workers, SUBNET, prefix="oscars_fes")
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


def quotas_unavailable():
  """Why text_quota's CPU quotas cannot be set here, or None."""
  from oscars_tf.tools import cpu_limits  # pylint: disable=g-import-not-at-top
  try:
    with cpu_limits.CpuLimits([0.5], deferred=True):
      return None
  except (cpu_limits.CpuLimitError, OSError) as e:
    return f"cannot set CPU quotas here: {e}"


# -- the driver ------------------------------------------------------------


def _env():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             TF_NUM_INTRAOP_THREADS="1", PYTHONUNBUFFERED="1",
             GRPC_VERBOSITY="ERROR")
  env.pop("TF_CONFIG", None)
  env.pop("OSCARS_SIMULATE_STEP_TIME", None)
  return env


def _epochs(profile):
  return FLAGS.epochs or PROFILES[profile].epochs


def _repeats(profile):
  return FLAGS.repeats or PROFILES[profile].repeats


def _worker_command(profile, schedule, input_kind, outdir):
  return [sys.executable, os.path.join(os.path.dirname(
      os.path.abspath(__file__)), "fit_end_spread_worker.py"),
          f"--schedule={schedule}", f"--input={input_kind}",
          f"--model={PROFILES[profile].model}", f"--outdir={outdir}",
          f"--epochs={_epochs(profile)}", f"--batch_size={FLAGS.batch_size}"]


# The launcher's last line says how far apart the workers' processes ended.
_EXITS = re.compile(r"their exits (\d+\.\d+) s apart")


def run_launched(profile, schedule, input_kind, outdir):
  """A job through `python -m oscars_tf.cli.launch`; (ok, log, exit spread)."""
  p = PROFILES[profile]
  command = [sys.executable, "-m", "oscars_tf.cli.launch",
             f"--num_workers={p.workers}", f"--timeout={FLAGS.timeout}"]
  command += list(p.launcher)
  if profile == "loopback" and FLAGS.loopback_step_time:
    command.append(f"--simulate_step_time={FLAGS.loopback_step_time}")
  command += ["--"] + _worker_command(profile, schedule, input_kind, outdir)
  proc = subprocess.run(command, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, env=_env(),
                        timeout=FLAGS.timeout + 60, check=False, cwd=ROOT)
  exits = _EXITS.findall(proc.stdout)
  return (proc.returncode == 0, proc.stdout,
          float(exits[-1]) if exits else None)


def run_slow_links(schedule, input_kind, outdir, spaces):
  """A job through oscars_tf.cli.launch.Job, worker i in namespace i; (ok,
  log, exit spread)."""
  env = _env()
  if FLAGS.slow_links_step_time:
    env["OSCARS_SIMULATE_STEP_TIME"] = FLAGS.slow_links_step_time
  # Every worker runs the same command; `ip netns exec` (which execs in
  # place, keeping launch.Job's process group and parent-death signal)
  # enters the namespace its environment names.
  workers = PROFILES["slow_links"].workers
  command = ["sh", "-c", f'exec ip netns exec "${NETNS_ENV}" "$0" "$@"'
             ] + _worker_command("slow_links", schedule, input_kind, outdir)
  log = job_log.JobLog()
  job = launch.Job(command, workers, env=env,
                   worker_env={i: {NETNS_ENV: ns}
                               for i, ns in enumerate(spaces.workers)},
                   out=log, hosts=[spaces.address(i) for i in range(workers)])
  try:
    codes, failed = job.wait(timeout=FLAGS.timeout, grace=5)
  finally:
    job.stop(grace=1)
  return failed is None and not any(codes), log.text(), job.exit_spread()


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
      "val_loss": (chief.get("val_loss") or [None])[-1],
      "workers": outs}


def run_job(profile, schedule, input_kind, spaces):
  workers = PROFILES[profile].workers
  with tempfile.TemporaryDirectory(prefix="oscars_fes_") as outdir:
    start = time.monotonic()
    if profile == "slow_links":
      ok, log, exit_spread = run_slow_links(schedule, input_kind, outdir,
                                            spaces)
    else:
      ok, log, exit_spread = run_launched(profile, schedule, input_kind,
                                          outdir)
    wall = time.monotonic() - start
    paths = [os.path.join(outdir, f"worker_{i}.json") for i in range(workers)]
    if not ok or not all(os.path.exists(p) for p in paths):
      raise RuntimeError(f"job {profile}/{input_kind}/{schedule} failed:\n"
                         f"{log[-4000:]}")
    outs = []
    for p in paths:
      with open(p) as f:
        outs.append(json.load(f))
  result = measure(outs)
  result["job_wall_s"] = wall
  result["exit_spread_s"] = exit_spread
  result["within_goal"] = (result["end_spread_s"] < GOAL_S and
                           exit_spread is not None and exit_spread < GOAL_S)
  return result


def _stat(values):
  values = [v for v in values if v is not None]
  if not values:
    return None
  return {"median": statistics.median(values), "min": min(values),
          "max": max(values), "values": values}


STATS = ("fit_wall_s", "end_spread_s", "exit_spread_s", "epoch_spread_max_s",
         "train_end_spread_s", "teardown_max_s", "round_median_s",
         "job_wall_s", "val_loss")


def summarize(profile, schedule, input_kind, runs):
  p = PROFILES[profile]
  row = {"profile": profile, "label": p.label, "schedule": schedule,
         "input": input_kind, "model": p.model, "workers": p.workers,
         "epochs": _epochs(profile), "runs": runs}
  for key in STATS:
    row[key] = _stat([r[key] for r in runs])
  row["within_goal"] = sum(r["within_goal"] for r in runs)
  return row


def _fmt(stat, scale=1.0, digits=0):
  if stat is None:
    return "n/a"
  m, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
  if len(stat["values"]) == 1:
    return f"{m:.{digits}f}"
  return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def print_table(rows, skipped):
  print(f"\nmedian [min-max] over each row's runs; fit wall in s, the rest "
        f"in ms; batch {FLAGS.batch_size}/worker")
  head = (f"{'profile':11} {'label':9} {'n':>1} {'input':18} {'schedule':8} "
          f"{'ep':>2} {'fit wall':>16} {'end spread':>17} "
          f"{'exit spread':>17} {'epoch-end spread':>16} "
          f"{'teardown':>17} {'round':>16} {'<1s':>6}")
  print(head)
  print("-" * len(head))
  for r in rows:
    print(f"{r['profile']:11} {r['label']:9} {r['workers']:>1} "
          f"{r['input']:18} {r['schedule']:8} {r['epochs']:>2} "
          f"{_fmt(r['fit_wall_s'], 1, 1):>16} "
          f"{_fmt(r['end_spread_s'], 1e3):>17} "
          f"{_fmt(r['exit_spread_s'], 1e3):>17} "
          f"{_fmt(r['epoch_spread_max_s'], 1e3):>16} "
          f"{_fmt(r['teardown_max_s'], 1e3):>17} "
          f"{_fmt(r['round_median_s'], 1e3):>16} "
          f"{r['within_goal']:>3}/{len(r['runs'])}")
  for profile, why in skipped.items():
    print(f"{profile}: SKIPPED: {why}")
  print("(fit wall: the longest any worker spent in fit; end spread: latest "
        "minus earliest fit return; exit spread: latest minus earliest "
        "process exit, as the launcher saw them (50 ms poll); epoch-end "
        "spread: the largest over the epochs; teardown: the longest "
        "on_train_end -> fit return of one worker; round: the chief's median "
        "round, compute + wait + communication; <1s: runs whose end and exit "
        "spreads were both under 1 s)")


def _apply_quick():
  if not FLAGS.quick:
    return
  for name, value in (("repeats", 1), ("epochs", 1), ("inputs", ["arrays"]),
                      ("schedules", ["adaptive"]),
                      ("profiles", ["loopback", "slow_model"])):
    if not FLAGS[name].present:
      FLAGS[name].value = value


def _profile_setup(profile):
  """(network namespaces or None, why the profile is skipped or None)."""
  if profile == "slow_links":
    return make_namespaces(FLAGS.rate, PROFILES[profile].workers)
  if profile == "text_quota":
    return None, quotas_unavailable()
  return None, None


def main(argv):
  del argv
  _apply_quick()
  bad = (sorted(set(FLAGS.profiles) - set(PROFILES)) +
         sorted(set(FLAGS.schedules) - set(SCHEDULES)) +
         sorted(set(FLAGS.inputs) - set(INPUTS)))
  if bad:
    sys.exit(f"fit_end_spread.py: unknown --profiles/--schedules/--inputs "
             f"{bad}; profiles: {tuple(PROFILES)}, schedules: {SCHEDULES}, "
             f"inputs: {INPUTS}.")
  start = time.monotonic()
  rows, skipped = [], {}
  for profile in FLAGS.profiles:
    spaces, why = _profile_setup(profile)
    if why is not None:
      skipped[profile] = why
      print(f"{profile}: SKIPPED: {why}", flush=True)
      continue
    try:
      for input_kind in PROFILES[profile].inputs or FLAGS.inputs:
        for schedule in FLAGS.schedules:
          runs = []
          for k in range(_repeats(profile)):
            print(f"running {profile} ({LABELS[profile]}) {input_kind} "
                  f"{schedule}, run {k + 1} of {_repeats(profile)} ...",
                  flush=True)
            r = run_job(profile, schedule, input_kind, spaces)
            runs.append(r)
            exits = ("n/a" if r["exit_spread_s"] is None else
                     f"{r['exit_spread_s'] * 1e3:.0f} ms")
            print(f"  fit {r['fit_wall_s']:.1f} s, end spread "
                  f"{r['end_spread_s'] * 1e3:.0f} ms (last: worker "
                  f"{r['last_worker']}), exit spread {exits}, epoch-end "
                  f"spreads {[round(s * 1e3) for s in r['epoch_spreads_s']]}"
                  f" ms, teardown {[round(t * 1e3) for t in r['teardown_s']]}"
                  f" ms, median round {(r['round_median_s'] or 0) * 1e3:.0f}"
                  f" ms", flush=True)
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
    config["profile_settings"] = {name: dataclasses.asdict(p)
                                  for name, p in PROFILES.items()}
    with open(FLAGS.result_json, "w") as f:
      json.dump({"labels": LABELS, "goal_s": GOAL_S, "config": config,
                 "rows": rows, "skipped": skipped, "wall_time_s": total,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
