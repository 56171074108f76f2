"""`OscarsStrategy`: local SGD across workers, MirroredStrategy within one.

The public class: validates arguments, joins the cluster, and hands the work
to `extended.OscarsExtended`.
"""


from absl import logging
import tensorflow as tf

from oscars_tf import arguments
from oscars_tf import cluster as cluster_lib
from oscars_tf.distribute import replicas
from oscars_tf.distribute import strategy_arguments
from oscars_tf.distribute.extended import OscarsExtended
from oscars_tf.errors import ClusterConfigError
from oscars_tf.protocol import rate_table
from oscars_tf.runtime import coordination_store
from oscars_tf.runtime import server

LOCAL_REPLICAS = replicas.LOCAL_REPLICAS
OWNER = strategy_arguments.OWNER


# Called, without arguments, whenever a strategy is created or its scope
# entered: the package registers the Keras front ends' `install` here (they
# sit above this layer, so the strategy cannot import them).
CREATION_HOOKS = []


_made_in_cluster = []  # an OscarsStrategy this process made in a cluster


def _one_per_cluster_process():
  """A worker process joins its cluster once; a second strategy would
  start its rounds again from 0 in the coordination service, where the
  first one's keys are (AlreadyExistsError at its first round end)."""
  if _made_in_cluster:
    raise ValueError(
        f"{OWNER}: this worker process already made an OscarsStrategy in "
        "its cluster; make one per process and train every model under it "
        "(a Keras Tuner or a loop of trials: create the strategy before "
        "the loop).")
  _made_in_cluster.append(True)


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
    optimizer_state: "group_variance" (default): slots per worker, Adam's
      second moment rescaled to the group's batch at each averaging
      (second_moments.py); "local": left alone; "average": averaged.
    local_replicas: "mirrored" (default): the worker's devices sum their
      gradients every step, as in MirroredStrategy. "local_sgd": each device
      steps on its own gradient and the devices' copies are averaged at every
      averaging point too (replica-context `all_reduce` then returns each
      replica's own value, scaled by the replica count for SUM).
    communication: "auto" (default), "ring" (gRPC) or "nccl".
    collective_timeout: seconds to wait for the other workers at an
      averaging point before failing with `PeerTimeoutError` (default 300).
    straggler_timeout: seconds the chief waits at a round end for a worker
      that has not arrived before it drops it from the round (default 60,
      or `collective_timeout` if shorter): the others go on without a
      dead, stopped or cut-off worker, and a stalled one rejoins with the
      current model when it is back. The chief itself is never dropped:
      if it dies, the job stops with `PeerTimeoutError` and `oscars-launch
      --restarts` resumes it.
    logdir: where each worker writes its round summaries for TensorBoard
      (`<logdir>/worker_<i>`, the chief's global view in `<logdir>/cluster`)
      and its timeline; default: the log_dir of a Keras TensorBoard callback
      given to `fit`, else none.
    outer_optimizer: None (default: the average is the new model) or
      `schedules.OuterMomentum(...)`: SlowMo/DiLoCo momentum on the averaged
      update at every global sync, for the trainable weights only (the
      others take the plain average). A rejoining worker takes the others'
      outer state; `checkpoint.save(..., strategy=)` saves it (see
      `outer_state`).
    averaging_dtype: None or "float32" (default: each variable is averaged
      in its own dtype), "bfloat16" or "float16" (or the `tf.DType`):
      float32 and float64 weights are sent in it, halving the bytes of
      every averaging. Each worker weights its values in float32, casts
      them down, the collective sums them in the averaging dtype, and the
      sum is cast back to the variable's dtype; every member still gets
      bit-identical values. The price is precision: each contribution and
      each partial sum is rounded to bfloat16's 8 significant bits
      (relative error 2**-9, about 0.2%, per rounding; float16: 11 bits,
      2**-12, but values beyond 65504 overflow), so a weight's change
      smaller than that between two averagings can be lost. The full
      weights are sent, not their change since the last average (members
      need not share the last average: groups, rejoins).
      16-bit variables, integer variables, the initial broadcast and the
      outer optimizer's state are sent as they are. On GPUs (NCCL)
      TensorFlow 2.21 cannot reduce bfloat16: float16 is used instead,
      with a warning.
    compression: None (default), "int8" or "int4": each averaging sends
      the trainable float32 weights' change since the last global sync,
      quantized in blocks of 64 values with a float32 scale each (int8:
      1/3.8 of float32's bytes, int4: 1/7.1), with error feedback, summed
      in float32 (an all-to-all, then an all-gather, on the host's CPU), so
      every member still gets bit-identical values. Rounds that end an
      epoch or let a worker rejoin are exact. Not with `averaging_dtype`.
      See docs/reference.md#compression.
    overlap: False (default), True or "always": averagings run beside the
      next round's steps, taken at its end as `G(avg) + (w_now - w_sent)`.
      Epoch ends, rejoins, poisoned members, `sync()` and (True, not
      "always") averagings that cost at most a tenth of a round's compute
      wait. See docs/reference.md#overlap.
    join_timeout: seconds each worker waits at its start for every task of
      the cluster to start (default 120). Meanwhile it names the tasks not
      listening yet every 15 s; past it the process is ended (SIGKILL:
      TensorFlow holds its main thread while it waits) with an error naming
      them, not waiting forever for a mistyped address or a lost worker.
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
               optimizer_state="group_variance", communication="auto",
               collective_timeout=300.0, local_replicas="mirrored",
               simulate_step_time=None, outer_optimizer=None, logdir=None,
               straggler_timeout=None, averaging_dtype=None,
               join_timeout=120.0, compression=None, overlap=False):
    args, join_timeout = strategy_arguments.checked(
        schedule, optimizer_state, communication, collective_timeout,
        local_replicas, simulate_step_time, outer_optimizer,
        straggler_timeout, averaging_dtype, join_timeout, compression,
        overlap, logdir)
    info = (cluster_lib.from_resolver(cluster_resolver) if cluster_resolver
            else cluster_lib.from_tf_config())
    if info.is_coordinator:
      raise ClusterConfigError(cluster_lib.COORDINATOR_TASK_TRAINS_NOT)
    if info.is_multi_worker:
      _one_per_cluster_process()
    # The coordination service's heartbeats only catch what the straggler
    # timeout catches sooner, and a task they time out can never come back:
    # long ones let a stalled worker rejoin (stalls up to this long).
    server.start(info,
                 heartbeat_timeout_s=max(30.0, 2 * args.collective_timeout),
                 register_timeout_s=float(join_timeout))
    super().__init__(OscarsExtended(self, info, devices, args))
    # Handed back as given, as MWMS does; but not one with a coordinator
    # job, which TensorFlow's multi-worker helpers reject (resolver_for
    # leaves it out).
    if (cluster_resolver is not None and
        cluster_lib.COORDINATOR_JOB not in info.jobs):
      self.extended.cluster_resolver = cluster_resolver
    if logdir:
      self.extended.round_logs.set_logdir(logdir)
    if args.simulate is not None:
      for line in args.simulate.describe(info.num_workers):
        logging.warning("oscars_tf: %s", line)
      try:  # a spec for another job (oscars-launch refuses one)
        args.simulate.check_workers(info.num_workers)
      except ValueError as e:
        logging.warning("oscars_tf: %s", e)
    for hook in CREATION_HOOKS:
      hook()
    logging.info("OscarsStrategy: worker %d of %d, devices %s, schedule %r, "
                 "averaging in %s", info.worker_index, info.num_workers,
                 self.extended.worker_devices, args.schedule,
                 self.compression or self.averaging_dtype)
    if self.compression and info.num_workers == 1:
      logging.warning("oscars_tf: compression=%r does nothing on one worker: "
                      "it compresses what workers send each other; local "
                      "replicas average exactly.", self.compression)

  def scope(self):
    # The creation hooks again (idempotent): a Keras imported after the
    # strategy was made (TF_USE_LEGACY_KERAS=1 skips importing Keras 3 for
    # its wrappers) is wrapped before a model is built in the scope.
    for hook in CREATION_HOOKS:
      hook()
    return super().scope()

  @property
  def cluster(self):
    """The `cluster.ClusterInfo` of this process."""
    return self.extended.cluster

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
  def cluster_resolver(self):
    """This worker's `tf.distribute.cluster_resolver.ClusterResolver`.

    The one passed to the constructor, else a `SimpleClusterResolver` of the
    cluster with TensorFlow's conventions, as `MultiWorkerMirroredStrategy`
    reports them: `task_type`/`task_id` as in TF_CONFIG (with a 'chief' job
    the chief is ('chief', 0), otherwise ('worker', 0)), `cluster_spec()`,
    `master()`, `num_accelerators()`, `rpc_layer`, `environment`. With no
    cluster configured: an empty `cluster_spec()` and `task_type` and
    `task_id` None, as under `MultiWorkerMirroredStrategy`. So the checks
    TensorFlow's tutorials teach (`_is_chief(task_type, task_id)` and
    `extended.should_checkpoint`) pick the same chief as `is_chief`.
    """
    return self.extended.cluster_resolver

  @property
  def schedule(self):
    return self.extended.schedule

  @property
  def averaging_dtype(self):
    """The dtype float32 weights are averaged in, as a name: "float32"
    (their own), "bfloat16" or "float16" (also after the GPU fallback)."""
    dtype = self.extended.averaging_dtype
    return "float32" if dtype is None else dtype.name

  @property
  def compression(self):
    """"int8" or "int4" when averagings send the weights' changes
    compressed, else None."""
    return self.extended.compression

  @property
  def overlap(self):
    """False, True or "always": the `overlap` it was built with."""
    return self.extended.overlap

  def track(self, model, optimizer=None):
    """Names what a custom training loop averages (Keras fit does it itself).

    Without it a custom loop averages the variables its optimizer updates.
    With it: `model`'s weights, and the optimizer's slots (averaged, or by
    default its Adam second moments rescaled: see `optimizer_state`).
    """
    self.extended.track(model, optimizer)

  def outer_state(self):
    """The outer optimizer's state, for a checkpoint: per averaged variable
    set (a Keras model has one), its trainable variables' (starts, momenta)
    as NumPy arrays. None without an `outer_optimizer`. The chief's is every
    member's (see `outer.py`); `checkpoint.save(..., strategy=)` saves it."""
    outer = self.extended.outer
    return outer.arrays() if outer.optimizer is not None else None

  def restore_outer_state(self, sets):
    """Loads what `outer_state()` returned, now or, before the first step
    (the state does not exist yet), when it is created. Shapes that do not
    match the model's trainable variables raise ValueError."""
    self.extended.outer.load(sets)

  def sync(self):
    """Averages the model now; every worker must call it at the same point.

    Returns True if an averaging ran (False when nothing changed since the
    last one, or for a one-worker cluster).
    """
    return self.extended.sync_now()

  def begin_epoch(self, cluster_steps, epoch=None):
    """Custom training loops: starts an epoch of `cluster_steps` steps.

    `cluster_steps` counts the steps of all workers together (a data set's
    worth: examples // per-worker batch size). Under the Adaptive schedule
    fast workers take more of them, and the epoch ends at the same round on
    every worker; under `Fixed` each worker takes an equal share. Loop

        strategy.begin_epoch(steps)
        while not strategy.epoch_over:
          train_step(iterator)
        strategy.sync()

    `cluster_steps` must be an int >= 1 (a NumPy integer too; a float or a
    tensor is refused: give `int(...)` of it). Give `epoch` (0-based) to let a
    worker that was dropped and rejoined find where the cluster is: see
    `cluster_epoch` and `end_training`.
    """
    cluster_steps = arguments.positive_int("begin_epoch", "cluster_steps",
                                           cluster_steps)
    self.extended.epochs.begin_custom(cluster_steps, epoch)

  def cluster_epoch(self, epoch):
    """The cluster's number for this worker's `epoch`: the same, unless the
    worker was dropped (a stall) and rejoined, missing epochs. A custom loop
    of E epochs stops when `cluster_epoch(epoch) >= E - 1`; `fit` does."""
    return self.extended.epochs.cluster_epoch(epoch)

  def end_training(self):
    """The chief marks the end of training, so a worker still dropped stops
    waiting to rejoin (with an error saying so). `fit` calls it; a custom
    loop calls it after its last epoch."""
    self.extended.epochs.end_training()

  @property
  def epoch_over(self):
    """True once the epoch `begin_epoch` started is done on this worker."""
    return self.extended.epochs.custom_over()

  def write_timeline(self):
    """Flushes summaries and writes `<logdir>/timeline_worker_<i>.json`
    (done by `fit` at its end; a custom loop calls it when done)."""
    self.extended.round_logs.finish_logs()

  def stats(self):
    """Counters of this worker: `local_step`, `syncs` (averaging points it
    took part in; each exchanges table rows through the coordination service
    and runs one packed model collective per dtype), `round`,
    `next_sync_step`, seconds spent
    computing / waiting / communicating, and model bytes sent."""
    return self.extended.stats()

  @property
  def plan(self):
    """The `records.Plan` of the round in progress (same on all workers)."""
    return self.extended.round_book.plan

  @property
  def members(self):
    """The workers of the latest round: all of them, less those dropped
    (dead, stalled or cut off) and not back yet."""
    return self.extended.round_book.members

  @property
  def round_history(self):
    """One dict per finished round of this worker (plan digest, steps,
    compute/wait/communication seconds, rate, divergence, table rates): the
    last `round_history.HISTORY_KEEP` (10,000) rounds. The lists over the
    whole cluster (`round_history.CLUSTER_FIELDS`: every worker's rate and
    planned steps, the groups, the members) are in the newest rounds only,
    at least 100, all 10,000 up to 25 workers: the history stays bounded at
    10,000 workers too."""
    return [r.as_dict() for r in self.extended.round_book.history]

  def step_rate_table(self):
    """Every worker's latest published row (rate, round, loss, ...), read
    from the coordination service; None for a worker that has not yet
    finished a round. One-worker clusters have no table."""
    if not self.cluster.is_multi_worker:
      return []
    return rate_table.read_all(coordination_store.ContextStore(),
                               self.num_workers)
