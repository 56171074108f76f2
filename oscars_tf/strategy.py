"""`OscarsStrategy`: local SGD across workers, MirroredStrategy within one.

Glue only: the cluster comes from cluster.py/runtime.py, when to average from
a schedule (policy), how to average from averaging.py. What this file adds is
where those meet TensorFlow's strategy contract:

* Inside a worker, the local devices are replicas of a `MirroredStrategy`
  (gradients summed across them every step). `num_replicas_in_sync`,
  `reduce`, `gather` and replica-context `all_reduce` are worker-local, so
  Keras' per-step loss scaling, gradient all-reduce and metric reduction never
  reach another worker: there is no hidden barrier.
* A step that updates variables is recognised while it is traced (the
  optimizer calls `extended.update`); right after it, the strategy appends
  "count the step; if the schedule says so, average the model with the other
  workers". So `model.fit`, `steps_per_execution` and custom loops with
  `strategy.run` all average at the same planned points.
"""

import os

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values as values_lib

from oscars_tf import averaging
from oscars_tf import cluster as cluster_lib
from oscars_tf import rate_table
from oscars_tf import rounds as rounds_lib
from oscars_tf import runtime
from oscars_tf import schedules as schedules_lib
from oscars_tf import simulate as simulate_lib
from oscars_tf.errors import (PeerTimeoutError, WorkerLostError,
                              WorkerMismatchError)

OPTIMIZER_STATES = ("local", "average")
LOCAL_REPLICAS = ("mirrored", "local_sgd")


def _resolve_devices(devices, info):
  """Full names of this worker's replica devices, validated."""
  local = []
  for d in tf.config.list_logical_devices():
    spec = tf.DeviceSpec.from_string(d.name)
    local.append((spec.device_type, spec.device_index))
  prefix = (info.device_prefix() if info.is_multi_worker
            else "/job:localhost/replica:0/task:0")
  if devices is None:
    chosen = [d for d in local if d[0] == "GPU"] or [("CPU", 0)]
  elif isinstance(devices, str) or not devices:
    raise ValueError("`devices` must be a non-empty list such as "
                     f"['CPU:0', 'CPU:1'], got {devices!r}.")
  else:
    chosen = []
    for d in devices:
      text = d if str(d).startswith("/") else "/device:" + str(d)
      try:
        spec = tf.DeviceSpec.from_string(text)
      except ValueError:
        spec = None
      if spec is None or spec.device_type is None or spec.device_index is None:
        raise ValueError(f"`devices`: {d!r} is not a device name like 'GPU:0'.")
      key = (spec.device_type.upper(), spec.device_index)
      if key not in local:
        raise ValueError(
            f"`devices`: {d!r} is not a device of this worker; its devices "
            f"are {['%s:%d' % k for k in local]}.")
      if key in chosen:
        raise ValueError(f"`devices` lists a device twice: {devices!r}.")
      chosen.append(key)
  return tuple("%s/device:%s:%d" % (prefix, t, i) for t, i in chosen)


def _component_variables(var):
  """The per-device variables behind a (Keras or distributed) variable."""
  var = getattr(var, "_value", var)  # keras.Variable wraps a tf.Variable
  if isinstance(var, values_lib.DistributedVariable):
    return list(var.values)
  return [var]


def _is_float(var):
  return _component_variables(var)[0].dtype.is_floating


class OscarsExtended(mirrored_strategy.MirroredExtended):
  """Implementation of `OscarsStrategy` (see its docstring)."""

  def __init__(self, container, info, devices, schedule, optimizer_state,
               communication, collective_timeout, local_replicas="mirrored",
               simulate=None):
    self._cluster = info
    self._local_sgd = local_replicas == "local_sgd"
    self._schedule = schedule
    self._optimizer_state = optimizer_state
    local_devices = _resolve_devices(devices, info)
    super().__init__(container, devices=local_devices)
    self._host = info.device_prefix() + "/device:CPU:0" if (
        info.is_multi_worker) else "/job:localhost/replica:0/task:0/device:CPU:0"
    device_type = tf.DeviceSpec.from_string(local_devices[0]).device_type
    hosts = [a.rpartition(":")[0] for _, _, a in info.workers]
    self._communication = averaging.choose_communication(
        communication, [device_type] * info.num_workers, hosts)
    averaging_device = (local_devices[0] if self._communication == "NCCL"
                        else self._host)
    self._averager = averaging.GroupAverager(
        group_size=info.num_workers,
        group_key=averaging.group_key_for(range(info.num_workers)),
        device=averaging_device, communication=self._communication,
        timeout=collective_timeout)
    self._rounds = rounds_lib.Rounds(
        info, schedule, self._host, averaging_device, self._communication,
        collective_timeout, learning_rate_fn=self._learning_rate,
        simulate=simulate)
    self._update_log = []         # stack of variables updated per traced call
    self._started_sets = set()    # variable sets already checked+broadcast
    self._tracked = None          # (model, optimizer) registered by Keras/user
    self._last_variables = []
    self._round_starts = {}       # FedNova: round-start copies per variable
    self._sync_functions = {}
    self._suppress_sharding = 0

  @property
  def _local_step(self):
    return self._rounds.local_step

  def _learning_rate(self):
    optimizer = self._tracked[1] if self._tracked else None
    try:
      return float(np.asarray(optimizer.learning_rate))
    except Exception:  # pylint: disable=broad-except
      return float("nan")

  # -- what is averaged ---------------------------------------------------

  def track(self, model, optimizer=None):
    """Average `model`'s weights (and `optimizer`'s slots if asked)."""
    self._tracked = (model, optimizer)

  def _variables_to_average(self, updated):
    if self._tracked is None:
      if self._optimizer_state == "average":
        raise ValueError(
            "optimizer_state='average' needs to know the optimizer: call "
            "strategy.track(model, optimizer) before the training loop (Keras "
            "fit does this by itself).")
      chosen = updated
    else:
      model, optimizer = self._tracked
      chosen = list(model.trainable_weights) + list(model.non_trainable_weights)
      if self._optimizer_state == "average" and optimizer is not None:
        skip = {id(getattr(optimizer, "iterations", None))}
        chosen += [v for v in optimizer.variables if id(v) not in skip]
    out, seen = [], set()
    for v in chosen:
      key = id(_component_variables(v)[0])
      if key not in seen and _is_float(v):
        seen.add(key)
        out.append(v)
    return out

  # -- recognising training steps -----------------------------------------

  def _update(self, var, fn, args, kwargs, group):
    if self._update_log:
      self._update_log[-1].append(var)
    return super()._update(var, fn, args, kwargs, group)

  def _replica_ctx_update(self, var, fn, args, kwargs, group):
    if self._update_log:
      self._update_log[-1].append(var)
    return super()._replica_ctx_update(var, fn, args, kwargs, group)

  def _call_for_each_replica(self, fn, args, kwargs):
    self._update_log.append([])
    try:
      result = super()._call_for_each_replica(fn, args, kwargs)
    finally:
      updated = self._update_log.pop()
    if updated:
      # Count the step only once its update has happened: a step whose input
      # fetch fails (end of data) must not count, and in a graph, ops on
      # unrelated resources are otherwise free to run first.
      done = [tf.identity(_component_variables(v)[0]) for v in updated[:1]]
      with tf.control_dependencies(done):
        self._after_train_step(self._variables_to_average(updated),
                               self._loss_of(result))
    return result

  def _loss_of(self, result):
    """The step's loss if it returned one (Keras: logs["loss"]), else NaN."""
    value = result.get("loss") if isinstance(result, dict) else result
    try:
      parts = [tf.convert_to_tensor(p) for p in self._local_results(value)]
    except (TypeError, ValueError):
      return tf.constant(np.nan, tf.float32)
    if not parts or parts[0].shape.rank != 0 or not parts[0].dtype.is_floating:
      return tf.constant(np.nan, tf.float32)
    return tf.reduce_mean([tf.cast(p, tf.float32) for p in parts])

  def _after_train_step(self, variables, loss):
    self._last_variables = variables
    self._start_once(variables)
    step = self._rounds.step_ops()
    if not (self._cluster.is_multi_worker or self._local_sgd):
      return
    tf.cond(step >= self._rounds.next_sync,
            lambda: self._round_end(variables, step, loss), tf.no_op)

  def _round_end(self, variables, step, loss):
    starts = self._round_starts.get(self._key(variables))
    return self._rounds.round_end_ops(
        step, loss, read_values=lambda: self._read(variables),
        write_values=lambda values: self._write(variables, values, starts),
        start=(lambda: [tf.identity(s) for s in starts]) if starts else None)

  @staticmethod
  def _key(variables):
    return tuple(id(_component_variables(v)[0]) for v in variables)

  # -- averaging ----------------------------------------------------------

  def _read(self, variables):
    """This worker's value of each variable (its replicas' mean)."""
    if self._local_sgd:  # local copies differ: their mean speaks for them
      return [tf.add_n([tf.identity(c) for c in _component_variables(v)]) /
              len(_component_variables(v)) for v in variables]
    return [tf.identity(_component_variables(v)[0]) for v in variables]

  def _write(self, variables, values, starts=None):
    """Assigns `values` to every local copy (and the FedNova start)."""
    ops = [c.assign(a) for v, a in zip(variables, values)
           for c in _component_variables(v)]
    ops += [s.assign(a) for s, a in zip(starts or [], values)]
    return tf.group(ops)

  def _broadcast_from_chief(self, variables):
    weight = 1.0 if self._cluster.is_chief else 0.0
    values = self._averager.weighted_sum(self._read(variables), weight)
    self._write(variables, values)

  def _signature(self, variables):
    """Numbers every worker must agree on (exact in float32)."""
    shapes = repr([(tuple(_component_variables(v)[0].shape),
                    _component_variables(v)[0].dtype.name) for v in variables])
    return [len(variables),
            sum(int(np.prod(_component_variables(v)[0].shape))
                for v in variables),
            averaging.zlib.crc32(shapes.encode()) % (1 << 24),
            self._schedule.fingerprint(),
            OPTIMIZER_STATES.index(self._optimizer_state),
            ("RING", "NCCL").index(self._communication)]

  def _start_once(self, variables):
    """Checks that workers agree, then broadcasts worker 0's model.

    Runs eagerly (lifted out of any function being traced), once per set of
    variables, before the first step executes: every worker starts from the
    chief's initial weights, and a worker with another model fails here with
    a clear error instead of corrupting the others.
    """
    key = self._key(variables)
    if key in self._started_sets or not self._cluster.is_multi_worker:
      self._rounds.mark_round_start()
      return
    self._started_sets.add(key)
    with tf.init_scope():
      names = ["variable count", "element count", "shapes/dtypes",
               "schedule", "optimizer_state", "communication"]
      mine = self._signature(variables)
      low, high = self._collective_or_timeout(
          lambda: self._averager.min_max(mine), "the start of training")
      bad = [n for n, a, b in zip(names, low.numpy(), high.numpy()) if a != b]
      if bad:
        raise WorkerMismatchError(
            f"workers disagree on {', '.join(bad)}: worker "
            f"{self._cluster.worker_index} has {len(variables)} variables, "
            f"{mine[1]} elements, schedule {self._schedule!r}, "
            f"optimizer_state={self._optimizer_state!r}. Every worker must "
            "build the same model and the same OscarsStrategy arguments.")
      self._collective_or_timeout(
          lambda: self._broadcast_from_chief(variables),
          "the initial broadcast")
      if getattr(self._schedule, "weighting", None) == "normalized":
        with tf.device(self._host):
          self._round_starts[key] = [
              tf.Variable(v, trainable=False) for v in self._read(variables)]
      self._rounds.mark_round_start()

  def _collective_or_timeout(self, fn, what):
    try:
      return fn()
    except tf.errors.DeadlineExceededError:
      raise PeerTimeoutError(
          f"worker {self._cluster.worker_index}: not every one of the "
          f"{self._cluster.num_workers} workers reached {what} within "
          f"{self._averager.timeout:.0f} s (collective_timeout). A worker may "
          "have died, stalled, or stopped training earlier than the others."
      ) from None
    except (tf.errors.UnavailableError, tf.errors.CancelledError,
            tf.errors.AbortedError) as e:
      raise WorkerLostError(
          f"worker {self._cluster.worker_index}: a peer is gone at {what} "
          f"({type(e).__name__}); a worker may have died or stopped training "
          "earlier than the others.") from e

  def needs_sync(self):
    """True when a step ran since the last averaging point (eager)."""
    return ((self._cluster.is_multi_worker or self._local_sgd) and
            bool(self._last_variables) and
            int(self._rounds.local_step.numpy()) !=
            int(self._rounds.last_sync_step.numpy()))

  def sync_now(self):
    """Ends the round now (eager). Every worker must call it together."""
    if not self.needs_sync():
      return False
    self.average_now()
    return True

  def average_now(self):
    """Ends the round now, whatever the plan said (eager)."""
    variables = self._last_variables
    key = self._key(variables)
    if key not in self._sync_functions:
      def end_round():
        self._round_end(variables, self._rounds.local_step.read_value(),
                        tf.constant(np.nan, tf.float32))
      self._sync_functions[key] = tf.function(end_round, autograph=False)
    self._collective_or_timeout(self._sync_functions[key], "an averaging point")

  def mark_round_start(self):
    self._rounds.mark_round_start()

  def plans_epochs(self):
    """Whether `fit` epochs are cluster-wide (the Adaptive schedule)."""
    return (self._cluster.is_multi_worker and
            isinstance(self._schedule, schedules_lib.Adaptive))

  def begin_epoch(self):
    """Keras epoch start: plan the epoch's end if it is cluster-wide."""
    self._rounds.begin_epoch(getattr(self, "_epoch_target", None))
    self._rounds.mark_round_start()

  def average_numbers(self, numbers):
    """Mean of a list of floats over all workers (eager, a planned point)."""
    if not self._cluster.is_multi_worker or not numbers:
      return list(numbers)
    vec = tf.constant(numbers, tf.float64)
    out = self._collective_or_timeout(
        lambda: self._averager.weighted_sum(
            [vec], 1.0 / self._cluster.num_workers, role="logs")[0],
        "an epoch end")
    return [float(x) for x in out.numpy()]

  def stats(self):
    r = self._rounds
    return {"local_step": int(r.local_step.numpy()),
            "syncs": int(r.syncs.numpy()),
            "next_sync_step": int(r.next_sync.numpy()),
            "round": r.round, **r.totals}

  # -- local SGD among local replicas --------------------------------------

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    # With local_replicas="local_sgd" the gradient all-reduce Keras and
    # custom loops do in replica context must leave each replica its own
    # gradient: SUM returns the replica's value times the replica count
    # (undoing the 1/num_replicas loss scaling), MEAN returns it unchanged.
    if not self._local_sgd:
      return super()._batch_reduce_to(reduce_op, value_destination_pairs,
                                      options)
    scale = (float(self._num_replicas_in_sync)
             if reduce_op == tf.distribute.ReduceOp.SUM else 1.0)
    out = []
    for value, _ in value_destination_pairs:
      parts = self._local_results(value)
      out.append(values_lib.PerReplica(tuple(
          tf.identity(p) * tf.cast(scale, p.dtype) for p in parts)))
    return out

  def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
    if not self._local_sgd:
      return super()._replica_ctx_all_reduce(reduce_op, value, options)
    scale = (float(self._num_replicas_in_sync)
             if reduce_op == tf.distribute.ReduceOp.SUM else 1.0)
    return tf.nest.map_structure(lambda v: v * tf.cast(scale, v.dtype), value)

  # -- data ---------------------------------------------------------------

  def _single_cpu(self):
    return (len(self._devices) == 1 and
            tf.DeviceSpec.from_string(self._devices[0]).device_type == "CPU")

  def _experimental_distribute_dataset(self, dataset, options):
    off = tf.data.experimental.AutoShardPolicy.OFF
    if (self._cluster.is_multi_worker and not self._suppress_sharding and
        dataset.options().experimental_distribute.auto_shard_policy != off):
      dataset = dataset.shard(self._cluster.num_workers,
                              self._cluster.worker_index)
    if self._single_cpu():
      # One CPU replica: the plain dataset is already "distributed", and
      # skipping TF's multi-device iterator saves ~0.5 ms per step (measured
      # in benchmarks/overhead.py). Elements are plain tensors, which
      # strategy.run and experimental_local_results accept for one replica.
      return dataset.prefetch(tf.data.AUTOTUNE)
    return super()._experimental_distribute_dataset(dataset, options)

  def _distribute_datasets_from_function(self, dataset_fn, options):
    from tensorflow.python.distribute import distribute_lib  # pylint: disable=g-import-not-at-top
    from tensorflow.python.distribute import input_util  # pylint: disable=g-import-not-at-top
    context = distribute_lib.InputContext(
        num_input_pipelines=self._cluster.num_workers,
        input_pipeline_id=self._cluster.worker_index,
        num_replicas_in_sync=self._num_replicas_in_sync)
    if self._single_cpu():
      return dataset_fn(context).prefetch(tf.data.AUTOTUNE)
    return input_util.get_distributed_datasets_from_function(
        dataset_fn, self._input_workers_with_options(options), [context],
        self._container_strategy(), options)

  # -- roles --------------------------------------------------------------

  @property
  def should_checkpoint(self):
    return self._cluster.is_chief

  @property
  def experimental_between_graph(self):
    return True


class OscarsStrategy(tf.distribute.Strategy):
  """Local SGD across workers with periodic, exact model averaging.

  Each worker (one process) trains its own copy of the model; the copies are
  averaged with TF collective ops at the points the `schedule` names. Within a
  worker, its local devices train in lockstep as in `MirroredStrategy`.

  Args:
    schedule: when and with whom to average; default `schedules.Adaptive()`
      (Oscars: per-worker local steps from the step-rate table, adaptive
      period). `schedules.Fixed(every=H)` is plain periodic local SGD;
      `Fixed(every=1)` is synchronous model averaging.
    devices: this worker's replica devices, e.g. `["GPU:0", "GPU:1"]`;
      default all local GPUs, else the CPU.
    cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`;
      default `TF_CONFIG`; with neither, a one-worker cluster (plain local
      training, no server started).
    optimizer_state: "local" (default) keeps optimizer slots per worker;
      "average" averages them with the model.
    local_replicas: "mirrored" (default): the worker's devices sum their
      gradients every step, as in MirroredStrategy. "local_sgd": each device
      steps on its own gradient and the devices' copies are averaged at every
      averaging point too (replica-context `all_reduce` then returns each
      replica's own value, scaled by the replica count for SUM).
    communication: "auto" (default), "ring" (gRPC) or "nccl".
    collective_timeout: seconds to wait for the other workers at an
      averaging point before failing with `PeerTimeoutError` (default 300).
    simulate_step_time: SIMULATED heterogeneity for tests and benchmarks, a
      spec such as "20ms*1,1,2,4" (see `oscars_tf.simulate`); default the
      `OSCARS_SIMULATE_STEP_TIME` environment variable (oscars-launch
      --simulate_step_time sets it), else none.

  Batch size: the batch size given to `fit` or to a dataset is the
  per-worker batch size; it is split across the worker's local devices.

  Example:
    strategy = oscars_tf.OscarsStrategy(schedule=oscars_tf.schedules.Fixed(8))
    with strategy.scope():
      model = keras.Sequential([...])
      model.compile(optimizer="sgd", loss="...", metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=3)
  """

  _collective_key_base = 0

  def __init__(self, schedule=None, devices=None, cluster_resolver=None,
               optimizer_state="local", communication="auto",
               collective_timeout=300.0, local_replicas="mirrored",
               simulate_step_time=None):
    schedule = schedules_lib.Adaptive() if schedule is None else schedule
    if not isinstance(schedule, schedules_lib.Schedule):
      raise TypeError("`schedule` must be an oscars_tf.schedules.Schedule "
                      f"such as Adaptive() or Fixed(every=8), got "
                      f"{schedule!r}.")
    if optimizer_state not in OPTIMIZER_STATES:
      raise ValueError(f"`optimizer_state` must be one of {OPTIMIZER_STATES}, "
                       f"got {optimizer_state!r}.")
    if local_replicas not in LOCAL_REPLICAS:
      raise ValueError(f"`local_replicas` must be one of {LOCAL_REPLICAS}, "
                       f"got {local_replicas!r}.")
    if communication not in averaging.COMMUNICATIONS:
      raise ValueError(f"`communication` must be one of "
                       f"{averaging.COMMUNICATIONS}, got {communication!r}.")
    if (isinstance(collective_timeout, bool) or
        not isinstance(collective_timeout, (int, float)) or
        not collective_timeout > 0):
      raise ValueError("`collective_timeout` must be a number of seconds > 0, "
                       f"got {collective_timeout!r}.")
    if simulate_step_time is None:
      simulate_step_time = os.environ.get("OSCARS_SIMULATE_STEP_TIME", "")
    profile = simulate_lib.StepTimeProfile.parse(simulate_step_time)
    info = (cluster_lib.from_resolver(cluster_resolver) if cluster_resolver
            else cluster_lib.from_tf_config())
    runtime.start(info)
    super().__init__(OscarsExtended(
        self, info, devices, schedule, optimizer_state, communication,
        collective_timeout, local_replicas,
        simulate=profile if profile.active else None))
    if profile.active:
      for line in profile.describe(info.num_workers):
        logging.warning("oscars_tf: %s", line)
    from oscars_tf import keras_integration  # pylint: disable=g-import-not-at-top
    keras_integration.install()
    logging.info("OscarsStrategy: worker %d of %d, devices %s, schedule %r",
                 info.worker_index, info.num_workers,
                 self.extended.worker_devices, schedule)

  @property
  def cluster(self):
    """The `cluster.ClusterInfo` of this process."""
    return self.extended._cluster  # pylint: disable=protected-access

  @property
  def num_workers(self):
    return self.cluster.num_workers

  @property
  def worker_index(self):
    return self.cluster.worker_index

  @property
  def is_chief(self):
    return self.worker_index == 0

  @property
  def schedule(self):
    return self.extended._schedule  # pylint: disable=protected-access

  def track(self, model, optimizer=None):
    """Names what a custom training loop averages (Keras fit does it itself).

    Without it a custom loop averages the variables its optimizer updates.
    With it: `model`'s trainable and non-trainable weights, and with
    `optimizer_state="average"` the optimizer's slot variables.
    """
    self.extended.track(model, optimizer)

  def sync(self):
    """Averages the model now; every worker must call it at the same point.

    Returns True if an averaging ran (False when nothing changed since the
    last one, or for a one-worker cluster).
    """
    return self.extended.sync_now()

  def stats(self):
    """Counters of this worker: local steps, averagings (syncs), round,
    seconds spent computing / waiting / communicating, bytes sent."""
    return self.extended.stats()

  @property
  def plan(self):
    """The `scheduler.Plan` of the round in progress (same on all workers)."""
    return self.extended._rounds.plan  # pylint: disable=protected-access

  @property
  def round_history(self):
    """One dict per finished round of this worker (plan digest, steps,
    compute/wait/communication seconds, rate, divergence, table rates)."""
    return list(self.extended._rounds.history)  # pylint: disable=protected-access

  def step_rate_table(self):
    """Every worker's latest published row (rate, round, loss, ...), read
    from the coordination service; None for a worker that has not yet
    finished a round. One-worker clusters have no table."""
    if not self.cluster.is_multi_worker:
      return []
    return rate_table.read_all(self.num_workers)
