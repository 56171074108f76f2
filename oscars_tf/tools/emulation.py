"""EMULATED heterogeneity for one launcher job, as a Job's arguments.

Real limits, not sleeps: a CPU quota per worker (cpu_limits: cgroups, as
Kubernetes enforces CPU limits) and a network namespace per task on a
shaped link (worker_netns: veth, bridge, tc tbf). Both outlive the
launcher's restarts (every Job joins the same cgroups and namespaces) and
are removed however the job ends. Imports no TensorFlow.
"""

import contextlib
import sys

from oscars_tf.tools import cpu_limits
from oscars_tf.tools import worker_netns
from oscars_tf.tools.job_layout import cluster_tasks
from oscars_tf.tools.worker_processes import compose

BANDWIDTH_ENV = "OSCARS_BANDWIDTH"  # a worker's link rate, as given


class FlagError(ValueError):
  """A flag value that cannot work; the message names the flag."""


def _say(line):
  print(f"oscars-launch: {line}", file=sys.stderr)


@contextlib.contextmanager
def cpu_quotas(cpu_limit, num_workers, from_ready=False):
  """--cpu_limit's cgroups while the jobs run; None without the flag.
  `from_ready` (--cpu_limit_from=ready): each worker applies its quota once
  ready (cpu_limits.apply_pending).

  Raises FlagError for a bad value, cpu_limits.CpuLimitError where the
  machine allows no quotas.
  """
  if not cpu_limit:
    if from_ready:
      raise FlagError("--cpu_limit_from=ready: needs --cpu_limit")
    yield None
    return
  try:
    values = cpu_limits.parse(cpu_limit, num_workers)
  except ValueError as e:
    raise FlagError(f"--cpu_limit: {e}") from None
  limits = cpu_limits.CpuLimits(values, deferred=from_ready).create()
  try:
    for line in limits.describe():
      _say(line)
    yield limits
  finally:
    for i in limits.unapplied():
      _say(f"WARNING: worker {i} never applied its CPU limit (it ran "
           "unlimited): --cpu_limit_from=ready needs the program to call "
           "oscars_tf.tools.cpu_limits.apply_pending() once ready")
    for path in limits.remove():
      _say(f"WARNING: could not remove cgroup {path}")


def _rates(bandwidth, num_workers, num_tasks):
  """One tc rate per task (workers first as in the flag; the chief and ps
  tasks of a parameter-server job get the fastest worker's), or None."""
  if not bandwidth:
    return None
  try:
    rates = worker_netns.parse_bandwidth(bandwidth, num_workers)
  except ValueError as e:
    raise FlagError(f"--bandwidth: {e}") from None
  if num_tasks == num_workers:
    return rates
  fastest = max(rates, key=worker_netns.parse_rate)
  return [fastest] + rates + [fastest] * (num_tasks - num_workers - 1)


@contextlib.contextmanager
def network(mode, bandwidth, num_workers, num_ps=0, host_given=False):
  """--network=emulated's namespaces while the jobs run: {"hosts": one
  address per task (cluster_tasks' order), "task_preexec": entering each
  task's namespace}, or {} for another mode.

  Raises FlagError for bad flags, worker_netns.Unavailable where the
  machine refuses; a launcher killed by SIGKILL takes the namespaces with
  it (WorkerNamespaces.detach).
  """
  if mode != "emulated":
    if bandwidth:
      raise FlagError("--bandwidth needs --network=emulated")
    yield {}
    return
  if host_given:
    raise FlagError("--host does not apply to --network=emulated: each "
                    "worker gets an address of its own")
  tasks = cluster_tasks(num_workers, num_ps)
  if len(tasks) > worker_netns.MAX_WORKERS:
    raise FlagError(f"--network=emulated: at most "
                    f"{worker_netns.MAX_WORKERS} "
                    f"{'tasks (workers, chief, ps)' if num_ps else 'workers'}")
  rates = _rates(bandwidth, num_workers, len(tasks))
  spaces = worker_netns.emulate(len(tasks), rates)
  try:
    shaped = (", links not shaped" if rates is None else
              f", link shaped with tbf rate {rates[0]} (both directions)")
    if rates is None or len(set(rates)) == 1:
      who = "task" if num_ps else "worker"  # tasks: cluster_tasks' order
      _say(f"EMULATED network: {who} i at {spaces.subnet}.(i+1){shaped}")
    else:
      for i, ((kind, index), rate) in enumerate(zip(tasks, rates)):
        _say(f"EMULATED network: {kind} {index} at {spaces.address(i)}, "
             f"link shaped with tbf rate {rate} (both directions)")
    by_worker = {index: rates[i] for i, (kind, index) in enumerate(tasks)
                 if kind == "worker"} if rates else {}
    yield {"hosts": [spaces.address(i) for i in range(len(tasks))],
           "task_preexec": {i: spaces.enter(i) for i in range(len(tasks))},
           "bandwidth": by_worker}
  finally:
    spaces.remove()


def job_arguments(num_workers, num_ps, spaces, limits, first_worker=0):
  """Job's keyword arguments for the namespaces (`network`'s value) and
  CPU quotas (`cpu_quotas`' value): task addresses, the workers'
  environments, and each process's pre-exec steps (its cgroup first, then
  its namespace). Quotas apply to worker tasks only. `first_worker`: the
  global index of this node's first worker (a job on several nodes: the
  flags' lists are this node's workers, the environments keyed globally).
  """
  tasks = cluster_tasks(num_workers, num_ps)
  if limits:
    limits.rearm()  # a restarted job's workers start unlimited again
  env = {first_worker + i: {} for i in range(num_workers)}
  for i, rate in spaces.get("bandwidth", {}).items():
    env[first_worker + i][BANDWIDTH_ENV] = rate
  for i, values in (limits.worker_env() if limits else {}).items():
    env[first_worker + i].update(values)
  steps = {}
  for position, (kind, index) in enumerate(tasks):
    steps[position] = compose(
        limits.preexec(index) if limits and kind == "worker" else None,
        spaces.get("task_preexec", {}).get(position))
  return {"hosts": spaces.get("hosts"), "worker_env": env,
          "task_preexec": {p: s for p, s in steps.items() if s}}
