"""The control plane at scale: one round's protocol for N workers, measured.

    python benchmarks/control_plane.py --workers=16,64,256,1024,4096,10000 \
        --result_json=/tmp/control_plane.json

Everything of a round but the model collective runs for real: the chief's
round book (worker 0: membership decision, planning, history) and a few
sampled workers' round books (each in its own thread, as in a job), over an
in-memory store with the coordination service's semantics. The other
workers are light clients: each posts its row and reads the round's
decision, as a worker does, so every key-value operation and every byte out
of the chief is counted (on several hosts, each host's leader posts the
host's rows with its own: protocol/host_arrivals.py, `--host_arrivals`;
the chief's real code reads the round's keys in directory reads,
protocol/arrival_reads.py, or one key a host with `--read_dir=false`).
Speeds are SIMULATED:
lognormal step rates (seeded), `--workers_per_host` workers per host; a
worker's compute time in a round is
its planned steps over its true rate, so the plan's quality shows as the
simulated cluster utilization (compute / (workers x slowest arrival)).
Every worker reports a SIMULATED sync cost (`--sync_cost_s`), not this
process's timing, so the plans do not depend on the machine.
Injected: `--deaths` workers gone for good at round `--fault_round` (the
chief sees their process gone) and `--stalls` that miss one round (dropped
after the straggler timeout, rejoin the next).

Per N it prints and writes: the chief's control-plane CPU time per round,
a sampled worker's, key-value operations and bytes out of the chief per
round, live keys, plan time, and utilization. No TensorFlow.
"""

import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types

from absl import app
from absl import flags
from absl import logging
import numpy as np

import control_plane_summary
from oscars_tf import schedules
from oscars_tf.policy import planner
from oscars_tf.policy import records
from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import distributions
from oscars_tf.protocol import host_arrivals
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import membership
from oscars_tf.protocol import membership_member
from oscars_tf.protocol import round_book
from oscars_tf.protocol import store_keys
from oscars_tf.protocol import table_deltas

flags.DEFINE_list("workers", ["16", "64", "256", "1024", "4096", "10000"],
                  "Cluster sizes N to measure.")
flags.DEFINE_integer("rounds", 12, "Rounds per N (the first 2 are warm-up).")
flags.DEFINE_integer("workers_per_host", 8, "Simulated workers per host.")
flags.DEFINE_float("sigma", 0.5, "Lognormal sigma of the step rates.")
flags.DEFINE_integer("sampled", 2, "Workers besides the chief that run a "
                     "real round book in their own thread.")
flags.DEFINE_integer("deaths", 1, "Workers that die at --fault_round.")
flags.DEFINE_integer("stalls", 1, "Workers that miss --fault_round.")
flags.DEFINE_integer("fault_round", 5, "The round the faults happen in.")
flags.DEFINE_integer("seed", 0, "Seed of the rates and the faults.")
flags.DEFINE_enum("grouping", "speed", ["speed", "host", "global"],
                  "The Adaptive schedule's grouping.")
flags.DEFINE_enum("distribution", distributions.DISTRIBUTIONS[0],
                 list(distributions.DISTRIBUTIONS),
                 "How members get the round's table: the changes to the "
                 "snapshot they hold (the default), or the whole decision.")
flags.DEFINE_float("noise", 0.0, "Lognormal sigma of the round-to-round "
                   "noise on the light clients' reported rates and losses "
                   "(0: each reports its true rate every round).")
flags.DEFINE_float("sync_cost_s", 0.1, "SIMULATED seconds an averaging "
                   "point costs every worker (its row's sync cost, which the "
                   "planner's cost-aware period reads); not this process's "
                   "own timing, so plans do not depend on the machine.")
flags.DEFINE_float("max_overshoot", None, "The Adaptive schedule's "
                   "max_overshoot (None: its default).")
flags.DEFINE_float("min_utilization",
                   schedules.DEFAULT_MIN_UTILIZATION, "The Adaptive "
                   "schedule's min_utilization (0: off).", lower_bound=0.0,
                   upper_bound=1.0)
flags.DEFINE_integer("bytes_per_member", table_deltas.delta_budget
                     .BYTES_PER_MEMBER, "The most store text a member reads "
                     "of a round's changes (\"deltas\"; the rest wait a "
                     "round, protocol/delta_budget.py); 0: no limit.")
flags.DEFINE_bool("host_relay", True, "Count one read of each round's "
                  "changes per host, by its leader (protocol/host_relay.py;"
                  " the sampled real round books read their own).")
flags.DEFINE_bool("host_arrivals", True, "Each host's leader posts the "
                  "rows of its host with its own and the chief reads one "
                  "key a host (protocol/host_arrivals.py: the chief's real "
                  "code, its host's light clients write real files).")
flags.DEFINE_bool("read_dir", True, "The chief reads each round's arrivals "
                  "with directory reads (protocol/arrival_reads.py); false: "
                  "key by key, as before 2026-12-03.")
flags.DEFINE_string("result_json", None, "Write the results here.")
FLAGS = flags.FLAGS

_LEARNING_RATE = 0.1  # every worker's, light or real
STRAGGLER_S = 0.05  # the stalled worker's round costs this, not its timeout


class CountingStore(kv_store.MemoryStore):
  """The in-memory store, counting operations and the bytes it returns
  (every value read leaves the chief, which hosts the store)."""

  def __init__(self):
    super().__init__()
    self.ops = 0
    self.bytes_out = 0
    self.bytes_in = 0
    self._count = threading.Lock()

  def set(self, key, value):
    with self._count:
      self.ops += 1
      self.bytes_in += len(key) + len(value)
    super().set(key, value)

  def get(self, key, timeout_s):
    value = super().get(key, timeout_s)
    with self._count:
      self.ops += 1
      self.bytes_out += len(value)
    return value

  def read_dir(self, directory, timeout_s):
    values = super().read_dir(directory, timeout_s)
    with self._count:
      self.ops += 1
      self.bytes_out += sum(len(v) for v in values.values())
    return values

  def delete(self, key):
    with self._count:
      self.ops += 1
    super().delete(key)


class _TrueRate:
  """Stands for a round book's rate meter: the worker's true (simulated)
  rate, so that the plan follows the simulated speeds."""

  def __init__(self, rate):
    self.rate = rate

  def add(self, steps, seconds):
    pass

  def reset(self, rate=float("nan")):
    pass


def _info(me, hosts):
  workers = [("worker", j, f"{h}:{1000 + j}") for j, h in enumerate(hosts)]
  return types.SimpleNamespace(worker_index=me, num_workers=len(hosts),
                               workers=workers, is_multi_worker=True)


def _gather_arrivals(posted, round_, members, hosts, books, files, writers):
  """The light clients' side of host_arrivals.py: the chief's host's
  write their rows to files (for the chief's real HostArrivals), every
  other host's leader (the lowest member of the last decision on it)
  posts the host's rows with its own (all there: a leader that is stalled
  posts nothing). The rows so gathered are acknowledged: they are taken
  out of `posted` (their members post nothing). A real round book posts
  its own row alone."""
  chief_relay = books[0].membership.relay
  by_host = {}
  for j in sorted(members):
    by_host.setdefault(hosts[j], []).append(j)
  for host, mates in by_host.items():
    if host == hosts[0]:
      for j in mates:
        if j in posted:
          if j not in writers:  # made once a worker, as a worker holds it
            relay = host_relay.HostRelay(hosts, j, files)
            relay.bind(chief_relay.token)
            writers[j] = host_arrivals.HostArrivals(relay)
          writers[j].write(round_, posted.pop(j))
    elif mates[0] in posted and mates[0] not in books:
      gathered = [j for j in mates if j in posted]
      posted[mates[0]] = host_arrivals.gathered_text(
          {j: posted[j] for j in gathered})
      for j in gathered[1:]:
        del posted[j]


def _row(rate, round_, steps, loss):
  # records.FIELDS, as a round book posts them: rate, round, loss,
  # divergence, learning rate, steps, healthy, exhausted, sync cost
  return [rate, round_, loss, float("nan"), _LEARNING_RATE, steps, 1.0, 0.0,
          FLAGS.sync_cost_s if round_ else float("nan")]


def measure(n, rng):
  """One cluster of `n` workers over FLAGS.rounds rounds: the numbers."""
  hosts = tuple(f"10.0.{i // FLAGS.workers_per_host // 250}."
                f"{i // FLAGS.workers_per_host % 250}" for i in range(n))
  rates = rng.lognormal(0.0, FLAGS.sigma, n) * 10.0
  store = CountingStore()
  if not FLAGS.read_dir:
    store.read_dir = None  # the chief reads key by key
  gone = set()
  schedule = schedules.Adaptive(grouping=FLAGS.grouping,
                                max_overshoot=FLAGS.max_overshoot,
                                min_utilization=FLAGS.min_utilization or None)
  sampled = []
  if n > 1:
    sampled = sorted({1 + int(x) for x in rng.choice(
        max(1, n - 1), min(FLAGS.sampled, n - 1), replace=False)})
  faulty = [j for j in range(1, n) if j not in sampled]
  rng.shuffle(faulty)
  deaths = set(faulty[:FLAGS.deaths])
  stalls = set(faulty[FLAGS.deaths:FLAGS.deaths + FLAGS.stalls])
  books = {}
  gathering = (FLAGS.host_arrivals and FLAGS.distribution == "deltas" and
               host_relay.HostRelay.wanted(hosts))
  files = tempfile.mkdtemp(prefix="control_plane_") if gathering else None
  writers = {}  # the chief's host's light clients' HostArrivals
  for j in [0] + sampled:
    books[j] = round_book.RoundBook(
        _info(j, hosts), schedule, membership=membership.Membership(
            store, j, n, STRAGGLER_S, 30.0, first_round_timeout=30.0,
            is_gone=lambda k: k in gone, distribution=FLAGS.distribution,
            bytes_per_member=FLAGS.bytes_per_member or None,
            relay=(host_relay.HostRelay(hosts, 0, files) if gathering and
                   j == 0 else None)),
        learning_rate_fn=lambda: _LEARNING_RATE)
    books[j].meter = _TrueRate(rates[j])
    books[j].publish = False
  chief = books[0]
  rows = []
  first_round_bytes = None
  members = set(range(n))
  for r in range(FLAGS.rounds):
    plan = chief.plan
    if r == FLAGS.fault_round:
      gone |= deaths
    live = [j for j in range(n) if j not in gone]
    # What the light clients measured this round (SIMULATED noise).
    reported = rates * rng.lognormal(0.0, FLAGS.noise, n) if FLAGS.noise \
        else rates
    losses = (rng.lognormal(0.0, FLAGS.noise, n) if FLAGS.noise
              else np.ones(n)) / (1.0 + 0.01 * r)  # 1 % a round
    # Light clients post their rows (a stalled one misses this round).
    ops0, out0 = store.ops, store.bytes_out
    posted = {}  # light client -> its arrival's text
    for j in live:
      if j in books or (r == FLAGS.fault_round and j in stalls):
        continue
      if j not in members:  # dropped last round: asks to rejoin
        kv_store.put(store, store_keys.rejoin_request(j),
                     decision_codec.encode_row(_row(reported[j], r, 0,
                                                    losses[j])))
        continue
      posted[j] = decision_codec.encode_row(
          _row(reported[j], r, plan.local_steps[j], losses[j]))
    if gathering and r > 0:
      _gather_arrivals(posted, r, members, hosts, books, files, writers)
    for j, text in posted.items():
      store.set(store_keys.arrival(r, j), text)
    # Sampled workers in threads, the chief here: real round books.
    cpu = {}

    def one_round(j, r=r, cpu=cpu):
      b = books[j]
      t0 = time.thread_time()
      step = b.last_sync_step + b.plan.local_steps[j]
      part = b.arrive(step, 1.0, True)
      b.averaged(part.table, 0.0, step, 0)
      b.clock.last_sync_cost = FLAGS.sync_cost_s  # SIMULATED, as the others'
      cpu[j] = time.thread_time() - t0
    threads = [threading.Thread(target=one_round, args=(j,)) for j in sampled]
    for t in threads:
      t.start()
    one_round(0)
    for t in threads:
      t.join(60)
    decision_key = store_keys.decision(r)
    whole_key = store_keys.snapshot(r)
    deltas = FLAGS.distribution == "deltas"
    decision = membership.Decision.decode(
        store.data[whole_key if deltas else decision_key])
    # Light clients read the decision and take their part from it (with
    # deltas a newcomer reads the whole snapshot too).
    t0 = time.thread_time()
    readers = [j for j in decision.members if j not in books]
    if FLAGS.host_relay and deltas:
      # One member per host reads the changes (protocol/host_relay.py: the
      # lowest-numbered member of the host in the last decision; the
      # chief's host has the chief); the host's others read its file, or
      # the chief's when the leader is gone.
      leaders, now = {}, set(decision.members)
      for j in sorted(members):
        leaders.setdefault(hosts[j], j)
      leaders[hosts[0]] = 0
      readers = [j for j in readers if leaders.get(hosts[j], j) == j or
                 leaders[hosts[j]] not in now]
    for _ in readers[:1]:
      text = store.get(decision_key, 1.0)
      if deltas:
        table_deltas.Changes(text)
      else:
        membership.Decision.decode(text)
    light_cpu = time.thread_time() - t0
    for _ in readers[1:]:
      store.get(decision_key, 1.0)
    # The light clients' RPCs while they wait for the decision (SIMULATED
    # waits: from their arrival to the round's latest): a reader's long
    # poll times out and asks again, a relay member checks `latest`.
    arrival = {j: plan.local_steps[j] / rates[j] for j in decision.members
               if j not in decision.newcomers and j not in books}
    last = max(arrival.values(), default=0.0)
    direct = set(readers)
    store.ops += sum(
        2 * control_plane_summary.polls_while_waiting(
            last - t, membership_member.POLL_S,
            membership_member.LONG_POLL_S)
        if j in direct else control_plane_summary.polls_while_waiting(
            last - t, host_relay.POLL_S, host_relay.POLL_MAX_S)
        for j, t in arrival.items())
    for j in decision.newcomers:
      if deltas and j not in books:
        store.get(whole_key, 1.0)
    members = set(decision.members)
    # Simulated utilization of the round just planned and run.
    compute = [plan.local_steps[j] / rates[j] for j in decision.members
               if j not in decision.newcomers]
    util = sum(compute) / (len(compute) * max(compute)) if compute else 1.0
    t0 = time.perf_counter()
    schedule.plan(records.StepRateTable(tuple(
        records.TableEntry(rate=x, round=r) for x in rates), hosts), r + 1,
        chief.plan.state)
    plan_ms = 1e3 * (time.perf_counter() - t0)
    traffic = control_plane_summary.averaging_traffic(
        plan, hosts, decision.members, planner.DEFAULT_MAX_GROUP_SIZE)
    if r == 0:  # every rate is new to every member
      first_round_bytes = store.bytes_out - out0
    rows.append({
        "round": r,
        # Members the next round's plan plans at the median rate: their
        # rate has not reached the members yet (delta_budget.py).
        "imputed_members": len(set(chief.plan.imputed) & members),
        "chief_cpu_ms": 1e3 * cpu[0],
        "worker_cpu_ms": 1e3 * (statistics.median(
            [cpu[j] for j in sampled]) if sampled else 0.0),
        "light_client_decode_ms": 1e3 * light_cpu,
        "kv_ops": store.ops - ops0,
        "bytes_out_of_chief": store.bytes_out - out0,
        "decision_bytes": len(store.data[decision_key]),
        "live_keys": len(store.data), "plan_ms": plan_ms,
        "utilization": util, "members": len(decision.members),
        "global_sync": plan.global_sync,
        "averaging_mean_over_bound": traffic[0],
        "averaging_max_over_bound": traffic[1],
        "median_local_steps": statistics.median(plan.local_steps),
        "time_budget_s": plan.time_budget,
        "dropped": len(decision.dropped),
        "rejoined": len(decision.newcomers),
        "first_round_bytes": first_round_bytes})
  if files:
    shutil.rmtree(files, ignore_errors=True)
  return rows


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)  # drops and rejoins are expected
  rng = np.random.default_rng(FLAGS.seed)
  print("Control plane per round (SIMULATED speeds and sync cost "
        f"{FLAGS.sync_cost_s} s, in-memory store, "
        f"lognormal sigma={FLAGS.sigma}, {FLAGS.workers_per_host} workers "
        f"per host, grouping={FLAGS.grouping}, distribution="
        f"{FLAGS.distribution}, noise={FLAGS.noise}, min_utilization="
        f"{FLAGS.min_utilization or 'off'})")
  head = (f"{'N':>6} {'chief ms':>9} {'worker ms':>9} {'KV ops':>8} "
          f"{'out MB':>8} {'decision KB':>11} {'keys':>6} {'plan ms':>8} "
          f"{'util':>6} {'drop/rejoin':>11} {'max MB':>8} "
          f"{'round 0 MB':>10} {'max MB all':>10} {'table in':>8} "
          f"{'util then':>9} {'avg traffic/bound':>17} {'T s':>6} "
          f"{'median k':>8}")
  print(head)
  print("-" * len(head))
  results = []
  for n in [int(w) for w in FLAGS.workers]:
    s = control_plane_summary.summarize(n, measure(n, rng))
    results.append(s)
    print(f"{n:>6} {s['chief_cpu_ms']:>9.1f} {s['worker_cpu_ms']:>9.1f} "
          f"{s['kv_ops']:>8.0f} {s['bytes_out_of_chief_mb']:>8.2f} "
          f"{s['decision_kb']:>11.1f} {s['live_keys_max']:>6} "
          f"{s['plan_ms']:>8.1f} {s['utilization']:>6.3f} "
          f"{s['dropped']:>5}/{s['rejoined']:<5} "
          f"{s['bytes_out_of_chief_mb_max']:>8.2f} "
          f"{s['first_round_mb']:>10.1f} "
          f"{s['bytes_out_of_chief_mb_max_every_round']:>10.1f} "
          f"{s['first_table_rounds']:>8} "
          f"{s['utilization_until_first_table']:>9.3f} "
          f"{s['averaging_mean_over_bound']:>8.2f}/"
          f"{s['averaging_max_over_bound']:<8.2f} "
          f"{s['time_budget_s']:>6.2f} {s['median_local_steps']:>8.1f}",
          flush=True)
  if FLAGS.result_json:
    with open(FLAGS.result_json, "w", encoding="utf-8") as f:
      json.dump({"heterogeneity": "SIMULATED", "flags": {
          k: getattr(FLAGS, k) for k in ("rounds", "workers_per_host",
                                         "sigma", "sampled", "deaths",
                                         "stalls", "fault_round", "seed",
                                         "grouping", "distribution",
                                         "noise", "sync_cost_s",
                                         "max_overshoot",
                                         "min_utilization",
                                         "bytes_per_member", "host_relay")},
                 "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
