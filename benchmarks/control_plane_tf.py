"""The control plane's round against TensorFlow's REAL coordination service.

    python benchmarks/control_plane_tf.py --clients=4,8,16,32 \
        --result_json=/tmp/control_plane_tf.json

control_plane.py measures one round's protocol in one process over an
in-memory store; this runs it over gRPC on loopback. Per N it starts the
chief's process and one process per `--clients_per_process` light clients
(coordination_tasks.py), each a task of a `worker` job with the
coordination service set up as a job sets it up (runtime/server.py: worker
0 hosts it, recoverable jobs). Worker 0, the chief, runs the REAL round
book (membership decision, planning, history) over
`coordination_store.ContextStore`. The other N-1 are light clients: each
posts its
row under the membership's arrival key and reads the round's decision with
a `ContextStore`, as a member does, but plans nothing. Rates are SIMULATED
(lognormal, seeded). With one client per process (the default) every
worker is its own process, as in a job; with more, N reaches the
thousands on one machine, each process's clients sharing its one service
client (every key, RPC and byte of theirs still their own).

Rounds run on a shared wall-clock schedule (one machine, one clock), so
that each measured operation finds what it needs already there: in round r
the clients post at the slot's start, the chief arrives `--chief_at` into
the slot (all rows are there), the clients read the decision `--read_at`
into it (published by then). A read that still had to wait for the chief
is counted apart, not in the latency percentiles. `--death_round` makes
the last client process exit before posting that round: the chief drops
its clients as in a job (its server refuses connections:
cluster.connection_refused).

`--workers_per_host=K` puts the workers on logical hosts of K: each
host's leader posts the host's rows, gathered through files, under its own
arrival key and the chief reads one key a host, the members it
acknowledged post nothing (protocol/host_arrivals.py), and the leader
reads the round's changes and passes them to the host's others in a file
(protocol/host_relay.py): the real code on both sides.

`--dedicated_service` hosts the service in one more process, the
cluster's `coordinator` task (oscars_tf/cli/coordinator.py), instead of in the
chief's: its CPU per slot is then reported apart ("service ms").
The chief reads each round's arrivals in directory reads of the service
(GetKeyValueDir over gRPC: runtime/service_dir.py, arrival_reads.py);
`--read_dir=false` reads them key by key, as before 2026-12-03.

Per N: the chief's round CPU time (`time.process_time`: all its threads,
the `--concurrent_reads` readers and the service it hosts among them;
its main thread's alone too) and wall time; the chief process's CPU over
a whole slot (the service serving every client's post and read too); the
clients' set and get latencies, key-value operations and bytes the clients
read out of the chief per round, and each process's resident memory. The
first `--warmup` rounds and the death round are not in the medians.
"""

import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import traceback

from absl import app
from absl import flags
from absl import logging
import numpy as np

import coordination_tasks

flags.DEFINE_list("clients", ["4", "8", "16", "32"],
                  "Cluster sizes N (the chief and N-1 light clients).")
flags.DEFINE_integer("warmup", 2, "First rounds left out of the medians.")
flags.DEFINE_float("max_memory_share", 0.8, "Skip an N whose processes "
                   "would need more than this share of available memory.")
flags.DEFINE_string("result_json", None, "Write the results here.")
flags.DEFINE_string("log", None, "The processes' output (default: a "
                    "temporary file, named on failure).")
FLAGS = flags.FLAGS


# -- the launcher --------------------------------------------------------


def _available_mb():
  with open("/proc/meminfo", encoding="utf-8") as f:
    return next(int(line.split()[1]) / 1024 for line in f
                if line.startswith("MemAvailable:"))


def _percentile(values, q):
  return float(np.percentile(values, q)) if values else float("nan")


def measure(n, log):
  """Starts N tasks, waits for them; their measurements summed up."""
  from oscars_tf.tools import worker_processes  # pylint: disable=g-import-not-at-top
  out = tempfile.mkdtemp(prefix="control_plane_tf_")
  command = [sys.executable, os.path.abspath(__file__), f"--task_out={out}",
             f"--workers_total={n}"]
  command += [f"--{k}={getattr(FLAGS, k)}" for k in (
      "rounds", "slot_s", "chief_at", "read_at", "sigma", "seed",
      "distribution", "death_round", "start_timeout_s",
      "clients_per_process", "concurrent_reads", "workers_per_host",
      "dedicated_service", "read_dir")]
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
  t0 = time.time()
  with worker_processes.Signals() as signals:
    job = worker_processes.Job(
        command, coordination_tasks.processes_for(
            n, FLAGS.clients_per_process), env=env, out=log,
        coordinator_command=command if FLAGS.dedicated_service else None)
    pids = [p.pid for p in job.procs]
    try:
      codes, failed = job.wait(
          timeout=FLAGS.start_timeout_s + FLAGS.rounds * FLAGS.slot_s + 60,
          grace=5.0, interrupt=signals)
    finally:  # any error here: no task outlives the launcher
      job.stop(grace=1.0)
  try:
    if failed is not None:
      what = (f"task {failed} failed" if isinstance(failed, int) else
              {"timeout": "timed out", "signal": "stopped by a signal"}.get(
                  failed, failed))
      raise RuntimeError(f"N={n}: {what} (exit codes {codes}); the tasks' "
                         f"output is in {log.name}")
    workers = [json.loads((pathlib.Path(out) / f"worker{j}.json").read_text(
        encoding="utf-8")) for j in range(n)]
    service = (json.loads((pathlib.Path(out) / "service.json").read_text(
        encoding="utf-8")) if FLAGS.dedicated_service else None)
  finally:
    shutil.rmtree(out)
  return summarize(n, workers, workers[0]["t0"] - t0, pids, service)


def _median_count(clients, measured, flag):
  return statistics.median(
      sum(bool(t["rounds"].get(str(r), {}).get(flag)) for t in clients)
      for r in measured)


def summarize(n, tasks, start_s, pids, service=None):
  """Medians over the measured rounds (warm-up and death round out);
  `tasks`: each logical worker's measurements, the chief's first;
  `service`: the coordinator task's (--dedicated_service), or None."""
  chief, clients = tasks[0], tasks[1:]
  measured = [r for r in range(FLAGS.warmup, FLAGS.rounds)
              if r != FLAGS.death_round]
  rounds = {int(r): v for r, v in chief["rounds"].items()}
  ops, out_bytes, waited = [], [], 0
  lat = {"get": [], "set": []}
  for r in measured:
    key = str(r)
    ops.append(sum(t["ops"].get(key, 0) for t in tasks))
    out_bytes.append(sum(t["bytes_read"].get(key, 0) for t in clients))
    published = chief["published"].get(key, float("inf"))
    for t in clients:
      read = t["rounds"].get(key)
      late = read is not None and read["read_at"] < published
      waited += late
      for round_, kind, s in t["op_s"]:
        if round_ == r and kind in lat and not (kind == "get" and late):
          lat[kind].append(1e3 * s)
  chief_op_ms = [1e3 * s for r, k, s in chief["op_s"] if r in measured]

  def med(key):
    return statistics.median(rounds[r][key] for r in measured)
  summary = {
      "workers": n, "light_clients": n - 1, "rounds": len(measured),
      "processes": len(pids),
      "clients_per_process": FLAGS.clients_per_process,
      "start_s": start_s,
      "chief_slot_cpu_ms": med("slot_cpu_ms"),
      "chief_cpu_ms": med("chief_cpu_ms"),
      "chief_cpu_ms_max": max(rounds[r]["chief_cpu_ms"] for r in measured),
      "chief_main_cpu_ms": med("chief_main_cpu_ms"),
      "chief_wall_ms": med("chief_wall_ms"),
      "chief_wall_ms_max": max(rounds[r]["chief_wall_ms"] for r in measured),
      "chief_late_ms_max": max(rounds[r]["late_ms"] for r in measured),
      "chief_op_ms_p50": _percentile(chief_op_ms, 50),
      "chief_op_ms_p99": _percentile(chief_op_ms, 99),
      "chief_op_ms_max": max(chief_op_ms, default=float("nan")),
      "chief_ops_per_round": statistics.median(
          chief["ops"].get(str(r), 0) for r in measured),
      "client_get_ms_p50": _percentile(lat["get"], 50),
      "client_get_ms_p99": _percentile(lat["get"], 99),
      "client_set_ms_p50": _percentile(lat["set"], 50),
      "client_set_ms_p99": _percentile(lat["set"], 99),
      "client_reads_waited": waited,
      "client_decode_ms": statistics.median(
          v["decode_ms"] for t in clients for r, v in t["rounds"].items()
          if int(r) in measured),
      # Rows posted and decisions read from a host's file (the rest from
      # the service), by the light clients, a round.
      "client_posts": _median_count(clients, measured, "posted"),
      "client_file_reads": _median_count(clients, measured, "from_file"),
      "kv_ops": statistics.median(ops), "kv_ops_max": max(ops),
      "bytes_out_of_chief_mb": statistics.median(out_bytes) / 1e6,
      "client_rss_mb": statistics.median(t["rss_mb"] for t in clients),
      "client_peak_rss_mb": max(t["peak_rss_mb"] for t in clients),
      "client_private_mb": statistics.median(
          t["private_mb"] for t in clients),
      "chief_rss_mb": chief["rss_mb"],
      "chief_private_mb": chief["private_mb"],
      "dropped": sum(v["dropped"] for v in rounds.values()),
      "dedicated_service": service is not None,
      "service_slot_cpu_ms": (statistics.median(
          service["slot_cpu_ms"][str(r)] for r in measured)
                              if service else None),
      "pids": pids}
  if 0 <= FLAGS.death_round < FLAGS.rounds:
    summary["death_round_chief_wall_ms"] = (
        rounds[FLAGS.death_round]["chief_wall_ms"])
  return summary


def service_ms(summary):
  """The coordinator task's CPU per slot, or where the service ran."""
  if summary["service_slot_cpu_ms"] is None:
    return "in chief"
  return f"{summary['service_slot_cpu_ms']:.1f}"


def main(argv):
  del argv
  if FLAGS.task_out:
    try:
      coordination_tasks.run_task()
    except BaseException:  # pylint: disable=broad-except
      # Out at once: TensorFlow's teardown could hang on the others.
      traceback.print_exc()
      sys.stderr.flush()
      os._exit(1)  # pylint: disable=protected-access
  logging.set_verbosity(logging.ERROR)
  print("Control plane per round against TensorFlow's coordination service "
        "(real gRPC on loopback; SIMULATED lognormal rates, sigma="
        f"{FLAGS.sigma}; distribution={FLAGS.distribution}; "
        f"concurrent_reads={FLAGS.concurrent_reads}; "
        f"{FLAGS.clients_per_process} light client(s) per process; "
        f"{FLAGS.workers_per_host or 'all'} workers per host; "
        f"{FLAGS.rounds - FLAGS.warmup} measured rounds)")
  head = (f"{'N':>5} {'procs':>5} {'chief CPU ms all/main':>21} "
          f"{'slot CPU ms':>11} {'service ms':>10} {'chief wall ms':>13} "
          f"{'get ms p50/p99':>15} {'set ms p50/p99':>15} {'KV ops':>7} "
          f"{'out KB':>7} {'client MB RSS/own':>17} {'start s':>7}")
  print(head)
  print("-" * len(head), flush=True)
  log = (open(FLAGS.log, "w", encoding="utf-8") if FLAGS.log else
         tempfile.NamedTemporaryFile("w", prefix="control_plane_tf_",
                                     suffix=".log", delete=False))
  results, stopped = [], None
  # Memory an N needs: the shared libraries once, each process's own pages
  # N times (a guess until the first N is measured).
  shared_mb, own_mb = 500.0, 400.0
  for n in [int(c) for c in FLAGS.clients]:
    procs = coordination_tasks.processes_for(n, FLAGS.clients_per_process)
    need, have = shared_mb + procs * own_mb, _available_mb()
    if need > FLAGS.max_memory_share * have:
      stopped = (f"N={n} not run: {procs} processes of {own_mb:.0f} MB own "
                 f"memory need {need / 1024:.1f} GiB, more than "
                 f"{FLAGS.max_memory_share:.0%} of the {have / 1024:.1f} "
                 "GiB available")
      print(stopped)
      break
    s = measure(n, log)
    results.append(s)
    own_mb = 1.25 * max(s["client_private_mb"], s["chief_private_mb"])
    shared_mb = s["client_peak_rss_mb"] - s["client_private_mb"]
    print(f"{n:>5} {s['processes']:>5} "
          f"{s['chief_cpu_ms']:>13.1f}/{s['chief_main_cpu_ms']:<7.1f} "
          f"{s['chief_slot_cpu_ms']:>11.1f} "
          f"{service_ms(s):>10} {s['chief_wall_ms']:>13.1f} "
          f"{s['client_get_ms_p50']:>7.2f}/{s['client_get_ms_p99']:<7.2f} "
          f"{s['client_set_ms_p50']:>7.2f}/{s['client_set_ms_p99']:<7.2f} "
          f"{s['kv_ops']:>7.0f} {1e3 * s['bytes_out_of_chief_mb']:>7.1f} "
          f"{s['client_rss_mb']:>11.0f}/{s['client_private_mb']:<5.0f} "
          f"{s['start_s']:>7.0f}", flush=True)
  log.close()
  if not FLAGS.log:  # all went well: the tasks' output is not needed
    os.remove(log.name)
  if FLAGS.result_json:
    with open(FLAGS.result_json, "w", encoding="utf-8") as f:
      json.dump({"heterogeneity": "SIMULATED",
                 "store": "tensorflow coordination service",
                 "flags": {k: getattr(FLAGS, k) for k in (
                     "clients", "rounds", "warmup", "slot_s", "chief_at",
                     "read_at", "sigma", "seed", "distribution",
                     "concurrent_reads", "clients_per_process",
                     "workers_per_host", "dedicated_service",
                     "death_round", "read_dir")},
                 "stopped": stopped, "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
