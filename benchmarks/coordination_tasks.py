"""One process of control_plane_tf.py's cluster: the chief's round book or
a process of light clients, over TensorFlow's real coordination service.

control_plane_tf.py starts these (its `--task_out` says a process is one);
TF_CONFIG says which task it is. Task 0 is the chief: the REAL round book
(membership decision, planning, history) over
`coordination_store.ContextStore`, for
N logical workers. Every other task runs `--clients_per_process` light
clients, each in its own thread over the process's one service client: a
light client posts its row under the membership's arrival key and reads
the round's decision, as a member does, but plans nothing; the k_i it
posts as its steps are the chief's plan's, passed in a file (a worker
plans its own, at no cost to the service). Rates are SIMULATED.
"""

import json
import os
import pathlib
import signal
import sys
import threading
import time
import types

from absl import flags
import numpy as np

from oscars_tf import cluster
from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import distributions
from oscars_tf.protocol import host_arrivals
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import membership
from oscars_tf.protocol import store_keys
from oscars_tf.protocol import table_deltas
from oscars_tf.runtime import coordination_store
import task_measures

flags.DEFINE_integer("clients_per_process", 1,
                     "Light clients per client process, each in its own "
                     "thread over the process's one coordination-service "
                     "client (1: a process per worker, as in a job). More "
                     "reach N in the thousands on one machine.")
flags.DEFINE_integer("rounds", 12, "Rounds per N.")
flags.DEFINE_float("slot_s", 1.0, "Seconds per round.")
flags.DEFINE_float("chief_at", 0.3, "When in its slot the chief arrives.")
flags.DEFINE_float("read_at", 0.7, "When in its slot the clients read.")
flags.DEFINE_float("sigma", 0.5, "Lognormal sigma of the SIMULATED rates.")
flags.DEFINE_integer("seed", 0, "Seed of the rates.")
flags.DEFINE_enum("distribution", distributions.DISTRIBUTIONS[0],
                  list(distributions.DISTRIBUTIONS),
                  "How members get the round's table (membership.py).")
flags.DEFINE_integer("concurrent_reads",
                     coordination_store.ContextStore.concurrent_reads,
                     "Reads the chief has in flight at once (1: one by one).")
flags.DEFINE_integer("death_round", -1, "Round in which the last client "
                     "exits before posting its row (-1: none).")
flags.DEFINE_float("start_timeout_s", 600.0, "Seconds for all N processes "
                   "to start and register.")
flags.DEFINE_string("task_out", None, "Internal: a task writes its "
                    "measurements to this folder (set in the tasks).")
flags.DEFINE_integer("workers_per_host", 0, "Logical workers per logical "
                     "host (0: one host, as on this machine): each host's "
                     "leader gathers its host's rows through files and the "
                     "chief reads one key a host (protocol/host_arrivals.py"
                     "); the leader passes the decision on in a file "
                     "(protocol/host_relay.py).")
flags.DEFINE_boolean("dedicated_service", False, "Host the coordination "
                     "service in a task of its own (the cluster's "
                     "`coordinator`, as oscars-launch --coordinator does) "
                     "instead of the chief's process.")
flags.DEFINE_boolean("read_dir", True, "The chief reads each round's "
                     "arrivals with directory reads (the service's "
                     "GetKeyValueDir, protocol/arrival_reads.py); false: key "
                     "by key, as before 2026-12-03.")
flags.DEFINE_integer("workers_total", 0, "Internal: N, the logical workers "
                     "of the tasks' cluster (set in the tasks).")
FLAGS = flags.FLAGS

BENCH = "oscars_tf/bench/"  # the harness's own keys (start barrier)
STRAGGLER_S = 10.0  # late under load is not dead: only a death drops


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


def logical_workers(task, n, per_process):
  """The logical workers task `task` runs: the chief (0) for task 0, else
  its `per_process` light clients, in order."""
  if task == 0:
    return [0]
  first = 1 + (task - 1) * per_process
  return list(range(first, min(n, first + per_process)))


def processes_for(n, per_process):
  """How many processes N logical workers take: the chief's, and one per
  `per_process` light clients."""
  return 1 + -(-(n - 1) // per_process)


def run_task():
  """One process of the cluster (TF_CONFIG says which): its rounds."""
  from oscars_tf import cluster  # pylint: disable=g-import-not-at-top
  from oscars_tf.runtime import server  # pylint: disable=g-import-not-at-top
  # Every task ends by itself, even if its peers or the launcher hang.
  limit_s = FLAGS.start_timeout_s + FLAGS.rounds * FLAGS.slot_s + 60
  threading.Timer(limit_s, os._exit, (124,)).start()  # pylint: disable=protected-access
  info = cluster.from_tf_config()
  if info.is_coordinator:
    _service_task(info)
  task, tasks = info.worker_index, info.num_workers
  n = FLAGS.workers_total or tasks
  server.start(info, heartbeat_timeout_s=FLAGS.start_timeout_s,
               register_timeout_s=FLAGS.start_timeout_s)
  shared = coordination_store.ContextStore(
      info.service_address if FLAGS.read_dir else None)
  rates = np.random.default_rng(FLAGS.seed).lognormal(0.0, FLAGS.sigma, n)
  rates *= 10.0  # steps per second, SIMULATED
  mine = logical_workers(task, n, FLAGS.clients_per_process)
  stores = {j: task_measures.CountingStore(shared, FLAGS.concurrent_reads)
            for j in mine}
  # Start barrier: the chief sets the schedule once every worker is up.
  if task == 0:
    for j in range(1, n):
      stores[0].get(f"{BENCH}ready/{j}", FLAGS.start_timeout_s)
    t0 = time.time() + 1.0
    stores[0].set(f"{BENCH}start", repr(t0))
  else:
    for j in mine:
      stores[j].set(f"{BENCH}ready/{j}", "1")
    t0 = float(stores[mine[0]].get(f"{BENCH}start", FLAGS.start_timeout_s))
  results = {j: {"task": task, "pid": os.getpid(), "t0": t0, "rounds": {}}
             for j in mine}
  # The last process dies (all its clients at once, as a host would).
  dies = task == tasks - 1 and tasks > 1 and FLAGS.death_round >= 0
  if task == 0:
    _chief_rounds(info, n, stores[0], rates, t0, results[0])
  else:
    errors = []

    def client(j):
      try:
        _client_rounds(stores[j], j, n, rates[j], t0, dies, results[j])
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)
    threads = [threading.Thread(target=client, args=(j,), daemon=True)
               for j in mine]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    if errors:
      raise errors[0]
  memory = task_measures.memory_mb()
  for j in mine:
    store, result = stores[j], results[j]
    result["rss_mb"], result["peak_rss_mb"], result["private_mb"] = memory
    result["ops"] = {r: k for r, k in store.ops.items() if r >= 0}
    result["bytes_read"] = {r: k for r, k in store.bytes.items() if r >= 0}
    result["op_s"] = [t for t in store.times if t[0] >= 0]
    result["published"] = store.published
    path = pathlib.Path(FLAGS.task_out) / f"worker{j}.json"
    path.write_text(json.dumps(result), encoding="utf-8")
  sys.stdout.flush()
  # TensorFlow's own teardown (the coordination agent's shutdown barrier)
  # is not what is measured, and would wait for the dead client.
  os._exit(0)  # pylint: disable=protected-access


def _service_task(info):
  """The `coordinator` task (--dedicated_service): hosts the service and
  measures its process's CPU per slot, all of it serving the others."""
  from oscars_tf.runtime import server  # pylint: disable=g-import-not-at-top
  server.start(info, heartbeat_timeout_s=FLAGS.start_timeout_s,
               register_timeout_s=FLAGS.start_timeout_s)
  # The launcher stops a server task once the workers are done: this one
  # still has its measurements to write (within the launcher's grace).
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  store = coordination_store.ContextStore()
  t0 = float(store.get(f"{BENCH}start", FLAGS.start_timeout_s))
  slots = {}
  _sleep_until(t0)
  cpu0 = time.process_time()
  for r in range(FLAGS.rounds):
    _sleep_until(t0 + (r + 1) * FLAGS.slot_s)
    cpu = time.process_time()
    slots[r] = 1e3 * (cpu - cpu0)
    cpu0 = cpu
  store.get(f"{BENCH}chief_done", 120.0)  # the last client is done too
  path = pathlib.Path(FLAGS.task_out) / "service.json"
  path.write_text(json.dumps({"slot_cpu_ms": slots, "pid": os.getpid(),
                              "rss_mb": task_measures.memory_mb()[0]}),
                  encoding="utf-8")
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


def _chief_rounds(info, n, store, rates, t0, result):
  """The chief's real round book over the N logical workers; a light
  client's address is its process's (gone when that process is)."""
  from oscars_tf import schedules  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import round_book  # pylint: disable=g-import-not-at-top
  task_addresses = [a for _, _, a in info.workers]
  per = FLAGS.clients_per_process
  addresses = [task_addresses[0]] + [
      task_addresses[1 + (j - 1) // per] for j in range(1, n)]
  info = types.SimpleNamespace(
      worker_index=0, num_workers=n, is_multi_worker=True,
      workers=[("worker", j, a) for j, a in enumerate(addresses)])
  member = membership.Membership(
      store, 0, n, STRAGGLER_S, 60.0, first_round_timeout=60.0,
      is_gone=lambda j: cluster.connection_refused(addresses[j]),
      distribution=FLAGS.distribution, relay=_relay(0, n))
  book = round_book.RoundBook(info, schedules.Adaptive(grouping="speed"),
                              membership=member)
  book.meter, book.publish = _true_rate(rates[0]), False
  _write_planned_steps(0, book.plan.local_steps)
  slot_cpu0 = time.process_time()
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
        "late_ms": 1e3 * late_s, "members": len(entry.members),
        "dropped": len(entry.dropped)}
    # The whole process over a slot (the end of the last round's work to
    # the end of this one's): the service it hosts serving every client's
    # post of this round and read of the last, and its own round.
    result["rounds"][r]["slot_cpu_ms"] = 1e3 * (
        time.process_time() - slot_cpu0)
    slot_cpu0 = time.process_time()
    _write_planned_steps(r + 1, book.plan.local_steps)
  store.round = -1
  member.wait_until_done(30.0)
  if FLAGS.dedicated_service:  # the service's task may go
    store.store.set(f"{BENCH}chief_done", "1")


def _write_planned_steps(round_, local_steps):
  """The plan's k_i for `round_`, in a file the light clients read (not
  through the service): a worker plans its own k_i, and posts it as its
  steps; the snapshot expects just that (table_deltas.next_snapshot)."""
  path = pathlib.Path(FLAGS.task_out) / f"steps{round_}.npy"
  np.save(path.with_suffix(".tmp.npy"), np.asarray(local_steps, np.int32))
  os.replace(path.with_suffix(".tmp.npy"), path)


_STEPS = {"lock": threading.Lock(), "round": -1, "steps": None}


def _planned_steps(round_, me, default):
  """This light client's planned k for `round_` (read once a process)."""
  with _STEPS["lock"]:
    if _STEPS["round"] != round_:
      try:
        _STEPS["steps"] = np.load(
            pathlib.Path(FLAGS.task_out) / f"steps{round_}.npy")
        _STEPS["round"] = round_
      except (OSError, ValueError):  # late: last round's k
        pass
    steps = _STEPS["steps"]
    return int(steps[me]) if steps is not None else default


def _relay(me, n):
  """Worker `me`'s host relay on the logical hosts (--workers_per_host),
  its files in the tasks' folder; None on one host."""
  if not FLAGS.workers_per_host:
    return None
  hosts = [f"host{j // FLAGS.workers_per_host}" for j in range(n)]
  return host_relay.HostRelay(hosts, me, FLAGS.task_out)


def _decision_text(store, relay, round_, member, members):
  """Round `round_`'s changes as a member reads them: with
  --workers_per_host through its host's leader's file (host_relay.py;
  the leader reads the service's and writes it), else from the
  service."""
  if relay is not None and member and not relay.leads(members):
    text = relay.wait(round_, time.monotonic() + 60.0, lambda: int(
        store.get(store_keys.latest(), 1.0)) >= round_)
    if text is not None:
      return text, True
  text = store.get(store_keys.decision(round_), 60.0)
  if relay is not None and member and relay.leads(members):
    relay.write(round_, text)
  return text, False


def _client_rounds(store, me, n, rate, t0, dies, result):
  """A light client: its row posted (a host's leader: the host's rows,
  with --workers_per_host), the decision read, nothing planned."""
  deltas = FLAGS.distribution == "deltas"
  member = True
  relay = _relay(me, n)
  arrivals = (host_arrivals.HostArrivals.for_member(relay, STRAGGLER_S)
              if relay else None)
  members = set(range(n))  # as the last decision's changes say
  for r in range(FLAGS.rounds):
    if dies and r == FLAGS.death_round:
      result["died_at"] = r
      return
    _sleep_until(t0 + r * FLAGS.slot_s)
    store.round = r
    steps = _planned_steps(r, me, max(1, round(rate)))
    row = decision_codec.encode_row(_row(rate, r, steps,
                                         1.0 / (1.0 + 0.01 * r)))
    if arrivals is not None and r == 1:  # the job's token, once
      relay.bind(store.get(store_keys.job(), 60.0))
    saved = arrivals.posts_saved if arrivals is not None else 0
    if member and arrivals is not None:  # acknowledged rows: no post
      arrivals.post(store, store_keys.arrival(r, me), r, row,
                    sorted(members))
    elif member:
      store.set(store_keys.arrival(r, me), row)
    else:  # dropped last round (late): asks to rejoin, as a worker does
      kv_store.put(store, store_keys.rejoin_request(me), row)
    _sleep_until(t0 + (r + FLAGS.read_at) * FLAGS.slot_s)
    read_at = time.time()
    text, from_file = _decision_text(store, relay, r, member, members)
    posted = arrivals is None or arrivals.posts_saved == saved
    cpu0 = time.thread_time()
    if deltas:
      changes = table_deltas.Changes(text)
      if me in changes.newcomers:  # holds no snapshot: reads the whole one
        text = store.get(store_keys.snapshot(r), 60.0)
        membership.Decision.decode(text)
      member = me in changes.newcomers or member and me not in changes.dropped
      members = (members - set(changes.dropped)) | set(changes.newcomers)
    else:
      member = me in membership.Decision.decode(text).members
    result["rounds"][r] = {"read_at": read_at,
                           "decode_ms": 1e3 * (time.thread_time() - cpu0),
                           "posted": posted, "from_file": from_file}
  store.round = -1
  # As a member says it at its exit: the chief (and the service) may go.
  kv_store.put(store, store_keys.done(me), "1")
