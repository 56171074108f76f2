"""Cluster description: who the workers are and which one this process is.

Parsed from `TF_CONFIG` or a `tf.distribute.cluster_resolver.ClusterResolver`
and validated up front, so that a user mistake becomes one clear error here
instead of a hang or a traceback from inside TensorFlow's runtime.

Workers are the tasks of the `chief` and `worker` jobs, chief first (the same
numbering as `MultiWorkerMirroredStrategy`); worker 0 is the chief. An
optional `coordinator` job of one task hosts TensorFlow's coordination
service instead of the chief (`python -m oscars_tf.cli.coordinator`), so that
at hundreds of workers the chief's process does not serve every worker's
requests.
`connection_refused` tells whether a worker's process is gone.
"""

import dataclasses
import json
import os
import socket
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

from oscars_tf.errors import ClusterConfigError

WORKER_JOBS = ("chief", "worker")
COORDINATOR_JOB = "coordinator"
COORDINATOR_TASK_TRAINS_NOT = (
    "this task is the cluster's 'coordinator': it hosts TensorFlow's "
    "coordination service and trains nothing. Run `python -m "
    "oscars_tf.cli.coordinator` there instead of the training script "
    "(oscars-launch --coordinator does).")


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
  """A validated cluster and this process's place in it."""

  jobs: Dict[str, Tuple[str, ...]]
  task_type: str
  task_id: int
  rpc_layer: str = "grpc"
  # TF_CONFIG's "environment", as resolvers report it (TF's own
  # TFConfigClusterResolver reports none): not part of the cluster's identity.
  environment: str = dataclasses.field(default="", compare=False)

  @property
  def workers(self) -> List[Tuple[str, int, str]]:
    """(job, task, address) of every worker, chief first."""
    out = []
    for job in WORKER_JOBS:
      out.extend((job, i, a) for i, a in enumerate(self.jobs.get(job, ())))
    return out

  @property
  def num_workers(self) -> int:
    return len(self.workers)

  @property
  def is_coordinator(self) -> bool:
    """Whether this task hosts the coordination service and trains not."""
    return self.task_type == COORDINATOR_JOB

  @property
  def service_leader(self) -> str:
    """The task hosting the coordination service: the coordinator task if
    the cluster has one, else the chief."""
    if COORDINATOR_JOB in self.jobs:
      return f"/job:{COORDINATOR_JOB}/replica:0/task:0"
    return self.device_prefix(0)

  @property
  def service_address(self) -> str:
    """"host:port" of the task hosting the coordination service."""
    if COORDINATOR_JOB in self.jobs:
      return self.jobs[COORDINATOR_JOB][0]
    return self.workers[0][2]

  @property
  def worker_index(self) -> int:
    if self.is_coordinator:
      raise ClusterConfigError(COORDINATOR_TASK_TRAINS_NOT)
    for i, (job, task, _) in enumerate(self.workers):
      if (job, task) == (self.task_type, self.task_id):
        return i
    raise AssertionError("validated cluster lost its own task")

  @property
  def is_chief(self) -> bool:
    return self.worker_index == 0

  @property
  def address(self) -> str:
    return self.jobs[self.task_type][self.task_id]

  @property
  def is_multi_worker(self) -> bool:
    return self.num_workers > 1

  def device_prefix(self, index: Optional[int] = None) -> str:
    job, task, _ = self.workers[self.worker_index if index is None else index]
    return "/job:%s/replica:0/task:%d" % (job, task)


def local_cluster() -> ClusterInfo:
  """The one-worker cluster used when nothing is configured."""
  return ClusterInfo(jobs={"worker": ("localhost:0",)}, task_type="worker",
                     task_id=0)


def _check_address(job, i, address):
  if not isinstance(address, str) or address.count(":") < 1:
    raise ClusterConfigError(
        f"cluster address {job}[{i}]={address!r} is not 'host:port'.")
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ClusterConfigError(
        f"cluster address {job}[{i}]={address!r} is not 'host:port' with a "
        "port in 1..65535.")


def from_dict(cluster: dict, task_type, task_id, rpc_layer="grpc",
              source="TF_CONFIG", environment="") -> ClusterInfo:
  """Validates a cluster spec dict and this task's place in it."""
  if not isinstance(cluster, dict) or not cluster:
    raise ClusterConfigError(f"{source}: 'cluster' must be a non-empty dict "
                             f"of job name to address list, got {cluster!r}.")
  jobs = {}
  for job, addresses in cluster.items():
    if isinstance(addresses, dict):  # sparse form {index: address}
      addresses = [addresses[k] for k in sorted(addresses, key=int)]
    if not isinstance(addresses, (list, tuple)) or not addresses:
      raise ClusterConfigError(f"{source}: job {job!r} must list at least one "
                               f"address, got {addresses!r}.")
    for i, a in enumerate(addresses):
      _check_address(job, i, a)
    jobs[job] = tuple(addresses)
  other = sorted(set(jobs) - set(WORKER_JOBS) - {COORDINATOR_JOB})
  if other:
    raise ClusterConfigError(
        f"{source}: OscarsStrategy trains with 'chief' and 'worker' jobs "
        f"(and an optional '{COORDINATOR_JOB}' task) only; got job(s) "
        f"{other} (parameter servers and evaluators are not used).")
  if len(jobs.get(COORDINATOR_JOB, ())) > 1:
    raise ClusterConfigError(
        f"{source}: at most one '{COORDINATOR_JOB}' task is allowed (it "
        f"hosts the coordination service), got "
        f"{len(jobs[COORDINATOR_JOB])}.")
  if COORDINATOR_JOB in jobs and sum(
      len(jobs.get(j, ())) for j in WORKER_JOBS) < 2:
    raise ClusterConfigError(
        f"{source}: a '{COORDINATOR_JOB}' task serves a cluster of two or "
        "more workers; this one has fewer.")
  if len(jobs.get("chief", ())) > 1:
    raise ClusterConfigError(f"{source}: at most one 'chief' task is allowed, "
                             f"got {len(jobs['chief'])}.")
  every = [a for job in WORKER_JOBS + (COORDINATOR_JOB,)
           for a in jobs.get(job, ())]
  dupes = sorted({a for a in every if every.count(a) > 1})
  if dupes:
    raise ClusterConfigError(f"{source}: address(es) {dupes} appear more than "
                             "once; every task needs its own host:port.")
  if task_type not in jobs:
    raise ClusterConfigError(
        f"{source}: task type {task_type!r} is not a job of the cluster "
        f"(jobs: {sorted(jobs)}).")
  try:
    task_id = int(task_id)
  except (TypeError, ValueError):
    raise ClusterConfigError(
        f"{source}: task index {task_id!r} is not an integer.") from None
  if not 0 <= task_id < len(jobs[task_type]):
    raise ClusterConfigError(
        f"{source}: task index {task_id} is out of range for job "
        f"{task_type!r}, which has {len(jobs[task_type])} task(s) "
        f"(valid: 0..{len(jobs[task_type]) - 1}).")
  return ClusterInfo(jobs=jobs, task_type=task_type, task_id=task_id,
                     rpc_layer=rpc_layer or "grpc",
                     environment=environment or "")


def from_tf_config(text: Optional[str] = None) -> ClusterInfo:
  """Parses `TF_CONFIG` (the environment variable, or `text`)."""
  text = os.environ.get("TF_CONFIG", "") if text is None else text
  if not text.strip():
    return local_cluster()
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise ClusterConfigError(f"TF_CONFIG is not valid JSON ({e}): "
                             f"{text[:200]!r}") from None
  if not isinstance(config, dict):
    raise ClusterConfigError(f"TF_CONFIG must be a JSON object, got {text!r}.")
  cluster, task = config.get("cluster"), config.get("task")
  if not cluster:
    return local_cluster()
  if not isinstance(task, dict) or "type" not in task or "index" not in task:
    raise ClusterConfigError(
        "TF_CONFIG has a 'cluster' but no 'task' with 'type' and 'index': "
        f"{text[:200]!r}")
  return from_dict(cluster, task["type"], task["index"],
                   config.get("rpc_layer", "grpc"),
                   environment=config.get("environment", ""))


def from_resolver(resolver) -> ClusterInfo:
  """Reads a `tf.distribute.cluster_resolver.ClusterResolver`."""
  spec = resolver.cluster_spec().as_dict()
  if not spec:
    return local_cluster()
  return from_dict(spec, resolver.task_type, resolver.task_id,
                   getattr(resolver, "rpc_layer", None) or "grpc",
                   source=type(resolver).__name__,
                   environment=getattr(resolver, "environment", "") or "")


def resolver_for(info: ClusterInfo, devices=()):
  """The `tf.distribute.cluster_resolver.SimpleClusterResolver` of `info`.

  What `OscarsStrategy.cluster_resolver` returns when the user gave none,
  with TensorFlow's conventions (as `TFConfigClusterResolver` reads
  TF_CONFIG): `task_type`/`task_id` as configured, so with a 'chief' job the
  chief is ('chief', 0) and otherwise ('worker', 0); `master()` is this
  task's address. With nothing configured (the one-worker cluster) it is
  what `MultiWorkerMirroredStrategy` returns then: an empty `cluster_spec()`
  and `task_type`/`task_id` None, which code written for that strategy
  (TensorFlow's tutorials included) takes for a lone chief.
  `num_accelerators()` counts the GPUs/TPUs among this worker's `devices`.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  accelerators = {}
  for device in devices:
    kind = tf.DeviceSpec.from_string(device).device_type
    if kind in ("GPU", "TPU"):
      accelerators[kind] = accelerators.get(kind, 0) + 1
  simple = tf.distribute.cluster_resolver.SimpleClusterResolver
  if info == local_cluster():
    return simple(tf.train.ClusterSpec({}), num_accelerators=accelerators)
  # The coordinator task trains nothing, and TensorFlow's multi-worker
  # helpers (multi_worker_util, which Keras' callbacks call) reject a job
  # of that name: the resolver's cluster is the training cluster.
  spec = tf.train.ClusterSpec({job: list(addresses)
                               for job, addresses in info.jobs.items()
                               if job != COORDINATOR_JOB})
  return simple(spec, master=info.address, task_type=info.task_type,
                task_id=info.task_id, environment=info.environment,
                num_accelerators=accelerators, rpc_layer=info.rpc_layer)


_SLURM_STEP_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
                    "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


def slurm_resolver(port_base: int = 8888):
  """A checked `SlurmClusterResolver` for the `srun` step this task runs in.

  Every task of the step is a worker (job 'worker', task = SLURM_PROCID,
  worker 0 the chief); the tasks of a node listen on port_base, port_base+1,
  ... TensorFlow's resolver reads SLURM_PROCID, SLURM_STEP_NUM_TASKS,
  SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE (it runs no command).

  GPUs stay as Slurm bound them (`auto_set_gpu=False`): by default the
  resolver rewrites CUDA_VISIBLE_DEVICES and counts GPUs with nvidia-smi
  (failing on CPU nodes), and it lists a node's tasks only up to
  gpus_per_node / gpus_per_task (failing for gpus_per_node=0), so it gets
  values that list every task. Each worker uses the GPUs it can see, and
  `num_accelerators()` (which MultiWorkerMirroredStrategy reads) reports them.

  The resolver sorts node names as strings (node10 before node9) and puts
  rank r at the r-th address; where Slurm placed rank r elsewhere
  (SLURMD_NODENAME, SLURM_LOCALID) this fails here instead of leaving the
  workers waiting for each other at the wrong addresses.
  """
  missing = [v for v in _SLURM_STEP_VARS if v not in os.environ]
  if missing:
    raise ClusterConfigError(
        f"Slurm: {', '.join(missing)} not set; start each worker with srun "
        "(a job step), not directly from the batch script.")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = len(tf.config.list_physical_devices("GPU"))  # starts no runtime

  class SlurmResolver(tf.distribute.cluster_resolver.SlurmClusterResolver):

    def num_accelerators(self, task_type=None, task_id=None,
                         config_proto=None):
      del task_type, task_id, config_proto
      return {"GPU": gpus}

  try:
    num_tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
    resolver = SlurmResolver(
        jobs={"worker": num_tasks}, port_base=port_base,
        gpus_per_node=num_tasks, gpus_per_task=1, auto_set_gpu=False)
    resolver.cluster_spec()
  except (RuntimeError, ValueError) as e:
    raise ClusterConfigError(f"SlurmClusterResolver: {e}") from None
  info = from_resolver(resolver)
  node = os.environ.get("SLURMD_NODENAME")
  local_id = os.environ.get("SLURM_LOCALID")
  if node and local_id is not None:
    expected = f"{node}:{port_base + int(local_id)}"
    if info.address != expected:
      raise ClusterConfigError(
          f"SlurmClusterResolver gives rank {info.task_id} the address "
          f"{info.address}, but Slurm runs it on {node} as local task "
          f"{local_id} ({expected}): the resolver assumes ranks fill the "
          "nodes in name order sorted as strings, a block at a time. Use "
          "srun --distribution=block, and node names that sort that way "
          "(zero-padded numbers), or set TF_CONFIG per task instead "
          "(examples/cluster/slurm_tf_config.py).")
  return resolver


def check_port_free(info: ClusterInfo) -> None:
  """Fails clearly when this task's port is taken, before TF binds it.

  TensorFlow's server reports a busy port deep inside its C++ runtime (or
  aborts the process); checking here turns that into a readable error.
  """
  _, _, port = info.address.rpartition(":")
  for family, host in ((socket.AF_INET, "0.0.0.0"),):
    with socket.socket(family, socket.SOCK_STREAM) as s:
      # As a server does: a port whose last connections linger in TIME_WAIT
      # (a worker just restarted) is free; one with a listener is not.
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind((host, int(port)))
      except OSError as e:
        raise ClusterConfigError(
            f"port {port} of this task ({info.task_type}:{info.task_id} at "
            f"{info.address}) is already in use ({e.strerror}); pick a free "
            "port or stop the process holding it.") from None


def connection_refused(address, timeout_s=0.5):
  """Whether nothing listens at `address` ("host:port") any more: the
  process behind it is gone. A stopped process still accepts connections
  (the kernel does), and an unreachable host is not "refused": both are
  left to the straggler timeout."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout_s):
      return False
  except ConnectionRefusedError:
    return True
  except (OSError, ValueError):
    return False
