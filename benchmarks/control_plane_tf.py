"""The control plane's round against TensorFlow's REAL coordination service.

    python benchmarks/control_plane_tf.py --clients=4,8,16,32 \
        --result_json=/tmp/control_plane_tf.json

control_plane.py measures one round's protocol in one process over an
in-memory store; this runs it over gRPC on loopback. Per N it starts N
processes, each a task of a `worker` job with the coordination service set
up as a job sets it up (runtime/server.py: worker 0 hosts it, recoverable
jobs). Worker 0, the chief, runs the REAL round book (membership decision,
planning, history) over `kv_store.ContextStore`. The other N-1 are light
clients: each posts its row under the membership's arrival key and reads
the round's decision with a `ContextStore`, as a member does, but plans
nothing. Rates are SIMULATED (lognormal, seeded).

Rounds run on a shared wall-clock schedule (one machine, one clock), so
that each measured operation finds what it needs already there: in round r
the clients post at the slot's start, the chief arrives `--chief_at` into
the slot (all rows are there), the clients read the decision `--read_at`
into it (published by then). A read that still had to wait for the chief
is counted apart, not in the latency percentiles. `--death_round` makes
one client exit before posting that round: the chief drops it as in a job
(its server refuses connections: membership.connection_refused).

Per N: the chief's round CPU time (`time.process_time`: all its threads,
the `--concurrent_reads` readers and the service it hosts among them;
its main thread's alone too) and wall time, the
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
import threading
import time
import traceback
import types

import numpy as np
from absl import app
from absl import flags
from absl import logging

from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import membership
from oscars_tf.protocol import table_deltas

flags.DEFINE_list("clients", ["4", "8", "16", "32"],
                  "Cluster sizes N (the chief and N-1 light clients).")
flags.DEFINE_integer("rounds", 12, "Rounds per N.")
flags.DEFINE_integer("warmup", 2, "First rounds left out of the medians.")
flags.DEFINE_float("slot_s", 1.0, "Seconds per round.")
flags.DEFINE_float("chief_at", 0.3, "When in its slot the chief arrives.")
flags.DEFINE_float("read_at", 0.7, "When in its slot the clients read.")
flags.DEFINE_float("sigma", 0.5, "Lognormal sigma of the SIMULATED rates.")
flags.DEFINE_integer("seed", 0, "Seed of the rates.")
flags.DEFINE_enum("distribution", membership.DISTRIBUTIONS[0],
                  list(membership.DISTRIBUTIONS),
                  "How members get the round's table (membership.py).")
flags.DEFINE_integer("concurrent_reads",
                     kv_store.ContextStore.concurrent_reads,
                     "Reads the chief has in flight at once (1: one by one).")
flags.DEFINE_integer("death_round", -1, "Round in which the last client "
                     "exits before posting its row (-1: none).")
flags.DEFINE_float("start_timeout_s", 600.0, "Seconds for all N processes "
                   "to start and register.")
flags.DEFINE_float("max_memory_share", 0.8, "Skip an N whose processes "
                   "would need more than this share of available memory.")
flags.DEFINE_string("result_json", None, "Write the results here.")
flags.DEFINE_string("log", None, "The processes' output (default: a "
                    "temporary file, named on failure).")
flags.DEFINE_string("task_out", None, "Internal: a task writes its "
                    "measurements to this folder (set in the tasks).")
FLAGS = flags.FLAGS

BENCH = "oscars_tf/bench/"  # the harness's own keys (start barrier)
STRAGGLER_S = 10.0  # late under load is not dead: only a death drops


def _memory_mb():
  """This process's resident memory, MB: (now, peak, private). Most of
  the resident memory is TensorFlow's shared libraries, whose pages all
  the processes share; private pages are each process's own cost."""
  def kb(path, key):
    with open(path, encoding="utf-8") as f:
      return sum(int(line.split()[1]) for line in f
                 if line.split(":")[0] in key) / 1024
  return (kb("/proc/self/status", ("VmRSS",)),
          kb("/proc/self/status", ("VmHWM",)),
          kb("/proc/self/smaps_rollup", ("Private_Clean", "Private_Dirty")))


class CountingStore:
  """A ContextStore that counts its operations, bytes read and each
  operation's wall time, per round (`round` is set by the caller). The
  chief reads from several threads at once (kv_store.values_unless_gone):
  the counts are kept under a lock."""

  def __init__(self, store, concurrent_reads):
    self.store = store
    self.concurrent_reads = concurrent_reads
    self.round = -1
    self._lock = threading.Lock()
    self.ops = {}      # round -> operations
    self.bytes = {}    # round -> bytes of the values read
    self.times = []    # (round, "get"/"set"/"delete", seconds)
    self.published = {}  # round -> time.time() the decision was set

  def _count(self, kind, t0, nbytes=0):
    with self._lock:
      self.times.append((self.round, kind, time.perf_counter() - t0))
      self.ops[self.round] = self.ops.get(self.round, 0) + 1
      self.bytes[self.round] = self.bytes.get(self.round, 0) + nbytes

  def set(self, key, value):
    t0 = time.perf_counter()
    self.store.set(key, value)
    self._count("set", t0)
    if key.startswith(f"{membership.PREFIX}d/"):
      self.published[int(key.rpartition("/")[2])] = time.time()

  def get(self, key, timeout_s):
    t0 = time.perf_counter()
    value = self.store.get(key, timeout_s)
    self._count("get", t0, len(value))
    return value

  def delete(self, key):
    t0 = time.perf_counter()
    self.store.delete(key)
    self._count("delete", t0)


def _sleep_until(t):
  time.sleep(max(0.0, t - time.time()))


def _row(rate, round_, steps, loss):
  # records.FIELDS: rate, round, loss, divergence, lr, steps, healthy,
  # exhausted (sync_cost left out: NaN)
  return [rate, round_, loss, float("nan"), 0.1, steps, 1.0, 0.0]


def _true_rate(rate):
  """The chief's rate meter: its SIMULATED rate, whatever it measures (as
  control_plane.py's `_TrueRate`)."""
  return types.SimpleNamespace(rate=rate, add=lambda steps, seconds: None,
                               reset=lambda rate=None: None)


def run_task():
  """One process of the cluster (TF_CONFIG says which): its rounds."""
  from oscars_tf import cluster  # pylint: disable=g-import-not-at-top
  from oscars_tf.runtime import server  # pylint: disable=g-import-not-at-top
  # Every task ends by itself, even if its peers or the launcher hang.
  limit_s = FLAGS.start_timeout_s + FLAGS.rounds * FLAGS.slot_s + 60
  threading.Timer(limit_s, os._exit, (124,)).start()  # pylint: disable=protected-access
  info = cluster.from_tf_config()
  me, n = info.worker_index, info.num_workers
  server.start(info, heartbeat_timeout_s=FLAGS.start_timeout_s,
               register_timeout_s=FLAGS.start_timeout_s)
  store = CountingStore(kv_store.ContextStore(), FLAGS.concurrent_reads)
  rates = np.random.default_rng(FLAGS.seed).lognormal(0.0, FLAGS.sigma, n)
  rates *= 10.0  # steps per second, SIMULATED
  # Start barrier: the chief sets the schedule once every task is up.
  if me == 0:
    for j in range(1, n):
      store.get(f"{BENCH}ready/{j}", FLAGS.start_timeout_s)
    t0 = time.time() + 1.0
    store.set(f"{BENCH}start", repr(t0))
  else:
    store.set(f"{BENCH}ready/{me}", "1")
    t0 = float(store.get(f"{BENCH}start", FLAGS.start_timeout_s))
  result = {"task": me, "pid": os.getpid(), "t0": t0, "rounds": {}}
  dies = me == n - 1 and n > 1 and FLAGS.death_round >= 0
  if me == 0:
    _chief_rounds(info, store, rates, t0, result)
  else:
    _client_rounds(store, me, rates[me], t0, dies, result)
  result["rss_mb"], result["peak_rss_mb"], result["private_mb"] = (
      _memory_mb())
  result["ops"] = {r: k for r, k in store.ops.items() if r >= 0}
  result["bytes_read"] = {r: k for r, k in store.bytes.items() if r >= 0}
  result["op_s"] = [t for t in store.times if t[0] >= 0]
  result["published"] = store.published
  path = pathlib.Path(FLAGS.task_out) / f"task{me}.json"
  path.write_text(json.dumps(result), encoding="utf-8")
  sys.stdout.flush()
  # TensorFlow's own teardown (the coordination agent's shutdown barrier)
  # is not what is measured, and would wait for the dead client.
  os._exit(0)  # pylint: disable=protected-access


def _chief_rounds(info, store, rates, t0, result):
  from oscars_tf import schedules  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import round_book  # pylint: disable=g-import-not-at-top
  addresses = [a for _, _, a in info.workers]
  member = membership.Membership(
      store, 0, info.num_workers, STRAGGLER_S, 60.0, first_round_timeout=60.0,
      is_gone=lambda j: membership.connection_refused(addresses[j]),
      distribution=FLAGS.distribution)
  book = round_book.RoundBook(info, schedules.Adaptive(grouping="speed"),
                              membership=member)
  book.meter, book.publish = _true_rate(rates[0]), False
  for r in range(FLAGS.rounds):
    _sleep_until(t0 + r * FLAGS.slot_s + FLAGS.chief_at * FLAGS.slot_s)
    store.round = r
    late_s = time.time() - (t0 + (r + FLAGS.chief_at) * FLAGS.slot_s)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    main0 = time.thread_time()
    step = book.last_sync_step + book.plan.local_steps[0]
    part = book.arrive(step, 1.0 / (1.0 + 0.01 * r), True)
    book.averaged(part.table, 0.0, step, 0)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    main_cpu = time.thread_time() - main0
    entry = book.history[-1]
    result["rounds"][r] = {
        "chief_cpu_ms": 1e3 * cpu, "chief_main_cpu_ms": 1e3 * main_cpu,
        "chief_wall_ms": 1e3 * wall,
        "late_ms": 1e3 * late_s, "members": len(entry["members"]),
        "dropped": len(entry["dropped"])}
  store.round = -1
  member.wait_until_done(30.0)


def _client_rounds(store, me, rate, t0, dies, result):
  """A light client: its row posted, the decision read, nothing planned."""
  deltas = FLAGS.distribution == "deltas"
  member = True
  for r in range(FLAGS.rounds):
    if dies and r == FLAGS.death_round:
      result["died_at"] = r
      return
    _sleep_until(t0 + r * FLAGS.slot_s)
    store.round = r
    row = decision_codec.encode_row(_row(rate, r, max(1, round(rate)),
                                         1.0 / (1.0 + 0.01 * r)))
    if member:
      store.set(f"{membership.PREFIX}a/{r}/{me}", row)
    else:  # dropped last round (late): asks to rejoin, as a worker does
      kv_store.put(store, f"{membership.PREFIX}j/{me}", row)
    _sleep_until(t0 + (r + FLAGS.read_at) * FLAGS.slot_s)
    read_at = time.time()
    text = store.get(f"{membership.PREFIX}d/{r}", 60.0)
    cpu0 = time.thread_time()
    if deltas:
      changes = table_deltas.Changes(text)
      if me in changes.newcomers:  # holds no snapshot: reads the whole one
        text = store.get(f"{membership.PREFIX}s/{r}", 60.0)
        membership.Decision.decode(text)
      member = me in changes.newcomers or member and me not in changes.dropped
    else:
      member = me in membership.Decision.decode(text).members
    result["rounds"][r] = {"read_at": read_at,
                           "decode_ms": 1e3 * (time.thread_time() - cpu0)}
  store.round = -1
  # As a member says it at its exit: the chief, which hosts the store,
  # may go.
  kv_store.put(store, f"{membership.PREFIX}done/{me}", "1")


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
  command = [sys.executable, os.path.abspath(__file__), f"--task_out={out}"]
  command += [f"--{k}={getattr(FLAGS, k)}" for k in (
      "rounds", "slot_s", "chief_at", "read_at", "sigma", "seed",
      "distribution", "death_round", "start_timeout_s")]
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
  t0 = time.time()
  with worker_processes.Signals() as signals:
    job = worker_processes.Job(command, n, env=env, out=log)
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
    tasks = [json.loads((pathlib.Path(out) / f"task{j}.json").read_text(
        encoding="utf-8")) for j in range(n)]
  finally:
    shutil.rmtree(out)
  return summarize(n, tasks, tasks[0]["t0"] - t0, pids)


def summarize(n, tasks, start_s, pids):
  """Medians over the measured rounds (warm-up and death round out)."""
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
      "start_s": start_s,
      "chief_cpu_ms": med("chief_cpu_ms"),
      "chief_cpu_ms_max": max(rounds[r]["chief_cpu_ms"] for r in measured),
      "chief_main_cpu_ms": med("chief_main_cpu_ms"),
      "chief_wall_ms": med("chief_wall_ms"),
      "chief_wall_ms_max": max(rounds[r]["chief_wall_ms"] for r in measured),
      "chief_late_ms_max": max(rounds[r]["late_ms"] for r in measured),
      "chief_op_ms_p50": _percentile(chief_op_ms, 50),
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
      "kv_ops": statistics.median(ops), "kv_ops_max": max(ops),
      "bytes_out_of_chief_mb": statistics.median(out_bytes) / 1e6,
      "client_rss_mb": statistics.median(t["rss_mb"] for t in clients),
      "client_peak_rss_mb": max(t["peak_rss_mb"] for t in clients),
      "client_private_mb": statistics.median(
          t["private_mb"] for t in clients),
      "chief_rss_mb": chief["rss_mb"],
      "chief_private_mb": chief["private_mb"],
      "dropped": sum(v["dropped"] for v in rounds.values()),
      "pids": pids}
  if 0 <= FLAGS.death_round < FLAGS.rounds:
    summary["death_round_chief_wall_ms"] = (
        rounds[FLAGS.death_round]["chief_wall_ms"])
  return summary


def main(argv):
  del argv
  if FLAGS.task_out:
    try:
      run_task()
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
        f"{FLAGS.rounds - FLAGS.warmup} measured rounds)")
  head = (f"{'N':>4} {'chief CPU ms all/main':>21} {'chief wall ms':>13} "
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
    need, have = shared_mb + n * own_mb, _available_mb()
    if need > FLAGS.max_memory_share * have:
      stopped = (f"N={n} not run: {n} processes of {own_mb:.0f} MB own "
                 f"memory need {need / 1024:.1f} GiB, more than "
                 f"{FLAGS.max_memory_share:.0%} of the {have / 1024:.1f} "
                 "GiB available")
      print(stopped)
      break
    s = measure(n, log)
    results.append(s)
    own_mb = 1.25 * max(s["client_private_mb"], s["chief_private_mb"])
    shared_mb = s["client_peak_rss_mb"] - s["client_private_mb"]
    print(f"{n:>4} {s['chief_cpu_ms']:>13.1f}/{s['chief_main_cpu_ms']:<7.1f} "
          f"{s['chief_wall_ms']:>13.1f} "
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
                     "concurrent_reads",
                     "death_round")},
                 "stopped": stopped, "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
