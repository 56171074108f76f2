"""The asynchronous baseline: TensorFlow's ParameterServerStrategy.

`examples/train.py --strategy=parameter_server` under
`oscars-launch --num_workers N --num_ps M`: the `worker` and `ps` tasks run a
`tf.distribute.Server` until the launcher stops them (`serve_unless_chief`);
the `chief` builds the model and optimizer in the strategy's scope, so the
variables and the optimizer's slots live on the ps tasks, and a
`ClusterCoordinator` schedules one `tf.function` step at a time on whichever
worker is free: asynchronous SGD, each step pulling the weights and pushing
its update, with no barrier between workers. Keras 3 layers and optimizers
work under the strategy in TF 2.21 with this custom loop (Keras 3 `fit` does
not drive a ClusterCoordinator).

An epoch is a data set's worth of steps (`ceil(examples / batch_size)`, the
batch size per worker) over the whole cluster, as under the other
strategies; each worker draws batches from its own shuffle of the whole
training set, since the workers take unequal numbers of steps. After each
epoch the chief waits for the scheduled steps (`coordinator.join`) and
evaluates the ps's model. The training arrays travel to the workers inside
the data set function, which suits the small offline data sets (digits,
synthetic); a big one would be read from files instead.

SIMULATED per-step delays (oscars_tf.simulate) run on the worker tasks: each
worker's input pipeline sleeps its own delay, by its worker index, before it
hands out a batch, i.e. inside the step (tf.data's sleep; no prefetching).

The per-worker numbers in the result, and what is estimated:
  steps: measured, the steps each worker ran (a step returns its worker's
    index), after the first step of the job (start-up, as elsewhere).
  simulated_s: measured, the delays each worker's pipeline slept.
  compute_s: ESTIMATED as for every strategy: simulated_s plus steps times
    a local step time measured on the chief (a local copy of the model).
  wall_time_s: the chief's training time (every worker's server is up).
  bytes_sent: ESTIMATED, 2 x the trainable weights' bytes per step (the
    pull of the weights and the push of the gradients).
  collectives: the steps (one pull/push round trip with the ps each; there
    is no collective). wait_s and comm_s: 0.0, not measured.
  utilization_second_half: ESTIMATED compute (as above) of the steps that
    started in the second half of the training time, over that half.
The optimizer's `iterations` counts racing updates from all workers, so the
result's optimizer_step is the number of steps the chief scheduled instead.
"""

import math
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from oscars_tf.tools import cpu_limits


def serve_unless_chief():
  """Worker and ps tasks: run this task's server forever. The chief returns.

  The launcher stops the servers once the chief exits (SIGTERM).
  """
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  kind = resolver.task_type
  if kind == "chief":
    return
  # Without a chief no task would ever train or end the job: every one
  # would serve forever.
  if kind not in ("worker", "ps") or not {"chief", "ps"} <= set(
      resolver.cluster_spec().jobs):
    sys.exit("train.py: --strategy=parameter_server needs a cluster with a "
             "chief, workers and ps tasks: oscars-launch --num_ps 1 ... "
             f"(this task is {kind!r})")
  server = tf.distribute.Server(resolver.cluster_spec(), job_name=kind,
                                task_index=resolver.task_id,
                                protocol=resolver.rpc_layer or "grpc",
                                start=True)
  if kind == "worker":  # oscars-launch --cpu_limit_from=ready
    cpu_limits.apply_pending()
  server.join()


def num_workers(strategy):
  """The `worker` tasks of the strategy's cluster."""
  # The strategy's cluster_resolver property is None in TF 2.21.
  resolver = (getattr(strategy, "cluster_resolver", None) or
              tf.distribute.cluster_resolver.TFConfigClusterResolver())
  return resolver.cluster_spec().num_tasks("worker")


def local_copy(model):
  """A copy of `model` with local variables (call it outside the strategy's
  scope), to time a local step without the ps round trips."""
  copy = keras.models.clone_model(model)
  copy.set_weights(model.get_weights())
  return copy


def simulated_delay(profile, worker, step, elapsed):
  """StepTimeProfile.seconds(worker, step, elapsed) as TensorFlow ops (so
  that the worker tasks compute it by their own index)."""
  mults = list(profile.multipliers) + [1.0]  # missing ones are 1
  worker = tf.cast(worker, tf.int64)
  mult = tf.gather(tf.constant(mults, tf.float64),
                   tf.minimum(worker, len(mults) - 1))
  for w, m, unit, at in profile.changes:
    reached = (tf.cast(elapsed, tf.float64) >= at if unit == "s" else
               tf.cast(step, tf.float64) >= at)
    mult = tf.where(tf.equal(worker, w) & reached,
                    tf.constant(m, tf.float64), mult)
  return profile.base * mult


def _sleep_each(ds, seconds_of):
  """Sleeps `seconds_of(*element)` before handing out each element."""
  def one(*element):
    single = tf.data.Dataset.from_tensors(element)
    flat = tf.nest.flatten(single.element_spec)
    micros = tf.cast(tf.round(seconds_of(*element) * 1e6), tf.int64)
    slept = tf.raw_ops.SleepDataset(
        input_dataset=tf.data.experimental.to_variant(single),
        sleep_microseconds=micros, output_types=[s.dtype for s in flat],
        output_shapes=[s.shape for s in flat])
    # take(1): the sleep would come again at the end of the sequence.
    return tf.data.experimental.from_variant(
        slept, single.element_spec).take(1)
  return ds.flat_map(one)


def make_dataset(x, y, batch_size, seed, profile, worker):
  """One worker's stream of ((x, y), delay_s, started_at) batches.

  `started_at` is when the worker's step asked for the batch (time.time()
  on the worker); the SIMULATED delay is slept after it, inside the step.
  """
  worker = tf.cast(worker, tf.int64)
  n = len(x)

  def shuffled(i):
    # Pass i // n over the data: a permutation of its own for this worker
    # (a stateless one: the worker index is a tensor here, which
    # Dataset.shuffle's seed cannot be inside a function).
    return tf.random.experimental.index_shuffle(
        i % n, tf.stack([seed * 65536 + worker, i // n]), n - 1)

  x, y = tf.constant(x), tf.constant(y)
  ds = tf.data.Dataset.counter().map(shuffled).batch(batch_size)
  ds = ds.map(lambda idx: (tf.gather(x, idx), tf.gather(y, idx)))
  ds = ds.enumerate()

  def timed(start, element):
    step, batch = element
    now = tf.timestamp()
    start = tf.where(start < 0, now, start)  # the worker's first step
    delay = (simulated_delay(profile, worker, step, now - start)
             if profile is not None and profile.active else
             tf.constant(0.0, tf.float64))
    return start, (batch, delay, now)

  ds = ds.scan(tf.constant(-1.0, tf.float64), timed)
  if profile is not None and profile.active:
    ds = _sleep_each(ds, lambda batch, delay, now: delay)
  options = tf.data.Options()
  # No batch made ahead of the step: its delay belongs inside the step.
  options.experimental_optimization.inject_prefetch = False
  return ds.with_options(options)


def train(strategy, model, optimizer, x, y, batch_size, epochs, seed=0,
          profile=None, on_epoch_end=None, on_first_step=None,
          should_stop=None):
  """Trains `model` (built in `strategy`'s scope) asynchronously.

  Args:
    strategy: a tf.distribute.ParameterServerStrategy, on the chief.
    x, y: the training arrays (every worker draws from all of them).
    batch_size: per-worker batch size (one step's batch).
    profile: an oscars_tf.simulate.StepTimeProfile, or None.
    on_epoch_end: optional callable(epoch, mean loss), after each epoch's
      steps are done.
    on_first_step: optional callable(), after the job's first step.
    should_stop: optional callable() -> bool, asked before each step is
      scheduled (the chief alone decides: the workers only serve); a stop
      mid-epoch ends that epoch early, with `on_epoch_end` for its steps.

  Returns:
    stats: `steps`, `simulated_s` (lists by worker; after the first step),
    `total_steps` (all scheduled), `started` (worker, start time,
    SIMULATED delay of each step after the first) and `segments` (each
    epoch's training, from the first scheduled step to the join; time.time()).
  """
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  with strategy.scope():
    optimizer.build(model.trainable_variables)  # slots on the ps, now
  per_worker = coordinator.create_per_worker_dataset(
      lambda: make_dataset(
          x, y, batch_size, seed, profile,
          tf.distribute.coordinator.experimental_get_current_worker_index()))
  iterator = iter(per_worker)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none")

  @tf.function
  def step(it):
    (xb, yb), delay, started_at = next(it)

    def replica_step(xb, yb):
      with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(
            loss_fn(yb, model(xb, training=True)))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    loss = strategy.run(replica_step, args=(xb, yb))
    worker = tf.distribute.coordinator.experimental_get_current_worker_index()
    return loss, worker, delay, started_at

  n = num_workers(strategy)
  stats = {"steps": [0] * n, "simulated_s": [0.0] * n, "total_steps": 0,
           "started": [], "segments": []}
  cluster_steps = math.ceil(len(x) / batch_size)
  # Steps queued at once: enough to keep every worker busy, few enough that
  # a stop takes effect within a few steps per worker.
  in_flight = 4 * n
  for epoch in range(epochs):
    losses = []
    if epoch == 0:  # the first step traces: start-up, not training
      losses.append(float(
          coordinator.schedule(step, args=(iterator,)).fetch()[0]))
      if on_first_step is not None:
        on_first_step()
    began = time.time()
    scheduled, stopping = [], False
    for _ in range(cluster_steps - len(losses)):
      stopping = should_stop is not None and should_stop()
      if stopping:  # mid-epoch: this partial epoch is the last
        break
      scheduled.append(coordinator.schedule(step, args=(iterator,)))
      if len(scheduled) > in_flight:  # bounds the overshoot past a stop
        scheduled[-in_flight - 1].fetch()
    coordinator.join()
    stats["segments"].append((began, time.time()))
    for loss, worker, delay, started_at in [r.fetch() for r in scheduled]:
      losses.append(float(loss))
      stats["steps"][worker] += 1
      stats["simulated_s"][worker] += float(delay)
      stats["started"].append((int(worker), float(started_at), float(delay)))
    stats["total_steps"] += len(losses)
    if on_epoch_end is not None and losses:
      on_epoch_end(epoch, float(np.mean(losses)))
    if stopping or (should_stop is not None and should_stop()):
      break
  return stats


def _second_half_start(segments):
  """time.time() at which the training time (the epochs' `segments`, without
  the evaluations between them) passed its half."""
  left = sum(end - start for start, end in segments) / 2
  for start, end in segments:
    if end - start >= left:
      return start + left
    left -= end - start
  return segments[-1][1] if segments else 0.0


def per_worker_rows(stats, model, wall_s, real_step_s):
  """The result's per-worker rows (see the module docstring): `stats` of
  `train`, `wall_s` the training time, `real_step_s` a local step's time."""
  weight_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                     for v in model.trainable_weights)
  late = [0.0] * len(stats["steps"])
  second_half_from = _second_half_start(stats["segments"])
  half = sum(end - start for start, end in stats["segments"]) / 2
  for worker, started_at, delay in stats["started"]:
    if started_at >= second_half_from:
      late[worker] += delay + real_step_s
  rows = []
  for w, steps in enumerate(stats["steps"]):
    simulated = stats["simulated_s"][w]
    rows.append({
        "steps": steps, "wall_time_s": wall_s,
        "compute_s": simulated + steps * real_step_s,
        "simulated_s": simulated, "real_step_s": real_step_s,
        "wait_s": 0.0, "comm_s": 0.0,
        "bytes_sent": 2 * weight_bytes * steps, "collectives": steps,
        "utilization_second_half": late[w] / half if half else 0.0})
  return rows
