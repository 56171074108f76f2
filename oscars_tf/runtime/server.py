"""Starts this process's part of the TensorFlow cluster (once per process).

The in-process gRPC server, collective ops and the coordination service are
set up the way `MultiWorkerMirroredStrategy` sets them up, with one
difference: the group keys the strategy uses are its own (see averaging.py),
and no collective is launched by the runtime itself between averaging points.
The coordination service runs in the chief's process, or in the cluster's
`coordinator` task where it has one (see coordinator.py).
"""

import copy
import signal

from absl import logging
import tensorflow as tf
from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.eager import context

# The proto's module moved between TensorFlow releases (newest first).
try:
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
except ImportError:  # pragma: no cover (the installed release decides)
  try:
    from tensorflow.tsl.protobuf import coordination_config_pb2
  except ImportError:
    from tensorflow.core.protobuf import coordination_config_pb2

from oscars_tf import cluster as cluster_lib
from oscars_tf.errors import ClusterConfigError
from oscars_tf.runtime import join_watch

_started = None  # the ClusterInfo this process started with


def start(info: cluster_lib.ClusterInfo, heartbeat_timeout_s: float = 30.0,
          register_timeout_s: float = 120.0):
  """Starts the server for `info` (a no-op for a one-worker cluster).
  Every task waits up to `register_timeout_s` for all of them to start."""
  global _started
  if _started is not None:
    if _started != info:
      raise ClusterConfigError(
          "this process already joined a different cluster "
          f"({_started.task_type}:{_started.task_id} of {_started.jobs}); a "
          "TensorFlow process can join one cluster only.")
    return
  if not info.is_multi_worker:
    _started = info
    return
  if context.context()._context_handle is not None:  # pylint: disable=protected-access
    raise ClusterConfigError(
        "OscarsStrategy must be created before TensorFlow runs any op in a "
        "multi-worker process (the cluster is set up when the runtime starts). "
        "Create the strategy first, right after configuring devices.")
  cluster_lib.check_port_free(info)
  spec = tf.train.ClusterSpec({k: list(v) for k, v in info.jobs.items()})
  own = f"/job:{info.task_type}/task:{info.task_id}"
  context.context().configure_collective_ops(
      collective_leader=info.device_prefix(0),  # the chief's
      scoped_allocator_enabled_ops=("CollectiveReduce",),
      device_filters=(own,))
  jobs = [coordination_config_pb2.CoordinatedJob(name=j, num_tasks=len(a))
          for j, a in info.jobs.items()]
  context.context().configure_coordination_service(
      service_type="standalone", service_leader=info.service_leader,
      coordinated_jobs=jobs,
      heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
      cluster_register_timeout_in_ms=int(register_timeout_s * 1000))
  # A worker that dies must not take the others down: the strategy drops it
  # from the rounds (membership.py). Without this, the coordination service
  # aborts every task's collectives once the dead one misses its heartbeats.
  context.context()._coordination_service_config.recoverable_jobs.extend(  # pylint: disable=protected-access
      [j for j in info.jobs if j in cluster_lib.WORKER_JOBS])
  config = copy.deepcopy(context.context().config)
  config.isolate_session_state = True
  port = int(info.address.rpartition(":")[2])
  server_def = tensorflow_server_pb2.ServerDef(
      cluster=spec.as_cluster_def(), default_session_config=config,
      job_name=info.task_type, task_index=info.task_id,
      protocol=info.rpc_layer, port=port)
  if info.is_coordinator:
    logging.info("oscars_tf: starting the coordination service of %d "
                 "workers at %s", info.num_workers, info.address)
  else:
    logging.info("oscars_tf: starting worker %d of %d at %s",
                 info.worker_index, info.num_workers, info.address)
  sigterm = signal.getsignal(signal.SIGTERM)
  _join(info, register_timeout_s, lambda: (
      context.context().enable_collective_ops(server_def),
      context.context().ensure_initialized()))
  _restore_sigterm(sigterm)
  _started = info


def _join(info, timeout_s, join):
  """Runs `join` (the runtime's start, which waits for every task) under a
  join_watch process: it names the tasks not listening yet and ends this
  one past `timeout_s` (TensorFlow holds the GIL while it waits)."""
  own = (info.task_type, info.task_id)
  others = [(job, i, address) for job, addresses in info.jobs.items()
            for i, address in enumerate(addresses) if (job, i) != own]
  watcher = join_watch.Watcher(f"{own[0]}:{own[1]}", others, timeout_s)
  try:
    join()
  finally:
    watcher.stop()


def _restore_sigterm(previous):
  """Undoes TensorFlow's SIGTERM handler (its coordination agent's
  preemption notifier, which the strategy does not use): with it a worker
  ignores the SIGTERM of Slurm, Kubernetes or oscars-launch, and so do the
  processes it forks (a PyDataset's multiprocessing pool then never ends)."""
  try:
    signal.signal(signal.SIGTERM, previous if previous is not None
                  else signal.SIG_DFL)
  except ValueError:  # not the main thread: leave it
    logging.warning("oscars_tf: the strategy was created outside the main "
                    "thread; TensorFlow's SIGTERM handler stays in place.")
