"""A custom training loop (`strategy.run`) that works under any strategy.

Used by examples/custom_loop.py (OscarsStrategy) and by examples/train.py for
TensorFlow's MultiWorkerMirroredStrategy, whose Keras 3 `fit` does not work
in TF 2.21. Under OscarsStrategy the epoch is the strategy's
(`begin_epoch` / `epoch_over`); under TF's strategies each worker takes an
equal share of the data set's steps.
"""

import contextlib
import math
import os
import signal
import threading
import time

import keras
import numpy as np
import tensorflow as tf


def _is_oscars(strategy):
  return hasattr(strategy, "begin_epoch") and hasattr(strategy, "epoch_over")


def _peer_errors(strategy):
  """Under OscarsStrategy, a collective that fails because a peer is lost
  raises WorkerLostError, once the worker saved its round state (as in
  `fit`; see oscars_tf.distribute.round_state)."""
  if not _is_oscars(strategy):
    return contextlib.nullcontext()
  return strategy.extended.peer_errors_explained("an averaging point",
                                                 collectives_only=True)


def worker_of(strategy):
  """(index, count) of this worker under any strategy, chief first."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if _is_oscars(strategy):
    return strategy.worker_index, strategy.num_workers
  if resolver is not None and resolver.cluster_spec().as_dict():
    num = sum(len(v) for k, v in resolver.cluster_spec().as_dict().items()
              if k in ("chief", "worker"))
    index = resolver.task_id + (
        1 if resolver.task_type == "worker" and
        "chief" in resolver.cluster_spec().as_dict() else 0)
    return index, num
  return 0, 1


def local_replicas(strategy):
  """Replicas on this worker (1 for the default strategy)."""
  try:
    return len(strategy.extended.worker_devices)
  except RuntimeError:  # the default strategy has no worker devices
    return 1


def train(strategy, model, optimizer, x, y, batch_size, epochs,
          initial_epoch=0, simulate=None, on_epoch_end=None, seed=0,
          on_first_step=None, dataset=None, steps_per_epoch=None):
  """Trains `model` for `epochs` epochs.

  Args:
    strategy: any tf.distribute strategy; `model` and `optimizer` were built
      in its scope.
    x, y: the full training arrays (each worker draws its own stream).
      Unused with a `dataset`.
    batch_size: per-worker batch size.
    simulate: optional (worker, step) -> seconds, a SIMULATED delay per step
      for TF's own strategies (OscarsStrategy simulates by itself).
    on_epoch_end: optional callable(epoch, loss).
    on_first_step: optional callable(), after the first step (which traces).
    dataset: optional, instead of x and y: an endless, shuffled tf.data of
      (x, y) batches of `batch_size`, the same on every worker (each reads
      its own shard of it), with `steps_per_epoch` steps per worker.

  Returns:
    (per-epoch mean losses, stats): stats has `steps` and `simulated_s`.
  """
  worker, num_workers = worker_of(strategy)
  replicas = local_replicas(strategy)
  if batch_size % replicas:
    raise ValueError(f"batch size {batch_size} does not split evenly over "
                     f"this worker's {replicas} devices.")
  oscars = _is_oscars(strategy)
  if oscars:
    # The model's weights and the optimizer's slots, as fit averages them
    # (Adam's second moments corrected under optimizer_state's default).
    strategy.track(model, optimizer)

  def dataset_fn(ctx):
    if dataset is not None:
      ds = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
      return ds if replicas == 1 else ds.rebatch(batch_size // replicas)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if not (oscars and strategy.extended.epochs.plans()):
      ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    ds = ds.shuffle(len(x), seed=seed + 1000 + ctx.input_pipeline_id)
    return ds.repeat().batch(batch_size // replicas, drop_remainder=True)

  iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none")

  @tf.function
  def train_step(it):
    def step(xb, yb):
      with tf.GradientTape() as tape:
        per_sample = loss_fn(yb, model(xb, training=True))
        if per_sample.shape.rank > 1:  # a sequence's: its mean, as in fit
          per_sample = tf.reduce_mean(
              per_sample, axis=list(range(1, per_sample.shape.rank)))
        loss = tf.nn.compute_average_loss(per_sample)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    # Local results only: a cross-worker reduce here would add a barrier.
    local = strategy.experimental_local_results(
        strategy.run(step, args=next(it)))
    return tf.add_n(local) * strategy.num_replicas_in_sync / len(local)

  cluster_steps = (steps_per_epoch * num_workers if dataset is not None
                   else math.ceil(len(x) / batch_size))
  losses, step = [], 0
  stats = {"simulated_s": 0.0, "steps": 0}
  with _peer_errors(strategy):
    for epoch in range(initial_epoch, epochs):
      total, count = 0.0, 0
      share = math.ceil(cluster_steps / num_workers)
      if oscars:
        strategy.begin_epoch(cluster_steps, epoch)
      while (not strategy.epoch_over) if oscars else count < share:
        if simulate is not None:
          delay = simulate(worker, step)
          if delay > 0:
            time.sleep(delay)
            stats["simulated_s"] += delay
        total += float(train_step(iterator))
        count += 1
        step += 1
        if step == 1 and on_first_step is not None:
          on_first_step()
      if oscars:
        strategy.sync()
      losses.append(total / max(count, 1))
      if on_epoch_end is not None:
        on_epoch_end(epoch, losses[-1])
      if oscars and strategy.cluster_epoch(epoch) >= epochs - 1:
        break  # rejoined after a stall: the cluster is at its last epoch
    if oscars:
      strategy.end_training()
      strategy.write_timeline()  # as fit does at its end (with a logdir)
  stats["steps"] = step
  return losses, stats


def local_step_timer(model, x, y, batch, repeats=20):
  """A function that returns the median seconds of one local forward+backward
  pass (no collective); the pass is traced here, timed when it is called.

  TF's strategies keep no timing and their steps include the wait for the
  all-reduce, so the benchmark estimates every strategy's compute the same
  way: the simulated delay plus steps times this. Under a CPU quota
  (oscars-launch --cpu_limit sets OSCARS_CPU_LIMIT) the mean instead: a
  step often runs whole inside one quota period and the throttling falls
  on a few, so the median would be the unthrottled speed.
  """
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  xb, yb = tf.constant(x[:batch]), tf.constant(y[:batch])

  @tf.function
  def grads():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
    # An embedding's gradient comes sparse (IndexedSlices): made dense, as
    # an averaging would.
    return [tf.convert_to_tensor(g) for g in
            tape.gradient(loss, model.trainable_variables)]

  grads()  # traces (before any --cpu_limit_from=ready quota applies)

  def seconds():
    limited = bool(os.environ.get("OSCARS_CPU_LIMIT"))
    times = []
    # Under a quota of a fraction of a CPU each step takes several quota
    # periods of wall time; half the steps still span dozens of periods.
    for _ in range(repeats // 2 if limited else repeats):
      t0 = time.monotonic()
      tf.nest.map_structure(lambda g: g.numpy(), grads())
      times.append(time.monotonic() - t0)
    return float(np.mean(times) if limited else np.median(times))
  return seconds


def evaluate(model, x, y, batch_size=512):
  """(loss, accuracy) of this worker's `model` on arrays; no collective."""
  logits = np.concatenate([np.asarray(model(x[i:i + batch_size],
                                            training=False))
                           for i in range(0, len(x), batch_size)])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
      y, logits)
  return float(loss), float(np.mean(np.argmax(logits, -1) == y))


def gather_per_worker(strategy, values):
  """Every worker's `values`, concatenated in worker order (a collective:
  all workers call it at the same point; a dropped or stalled worker's are
  zeros)."""
  worker, count = worker_of(strategy)
  k = len(values)
  mine = np.zeros(count * k)
  mine[worker * k:(worker + 1) * k] = values
  if count == 1:
    return mine.tolist()
  if _is_oscars(strategy):
    for j, numbers in strategy.extended.gather_numbers(values).items():
      mine[j * k:(j + 1) * k] = numbers
    return mine.tolist()
  replicas = local_replicas(strategy)

  @tf.function
  def gather():
    per_replica = strategy.run(lambda: tf.constant(mine / replicas))
    return strategy.reduce("SUM", per_replica, axis=None)
  return gather().numpy().tolist()


def nan_on_signal(model, signum=signal.SIGUSR1):
  """A Keras callback for fault tests: after `signum` arrives, this
  worker's first trainable weight turns NaN at its next training step
  (what a diverged or corrupted worker looks like to the others)."""
  requested = threading.Event()
  signal.signal(signum, lambda *_: requested.set())

  class NanOnSignal(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if requested.is_set():
        requested.clear()
        weight = model.trainable_weights[0]
        weight.assign(np.full(weight.shape, np.nan, weight.dtype))
        print("fault injection: this worker's weights are now NaN",
              flush=True)
  return NanOnSignal()
