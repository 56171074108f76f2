"""Programs the multi-process tests run in each worker process.

    python worker_programs.py SCENARIO '{"param": ...}'

Each writes what the test checks to <outdir>/worker_<index>.json.
"""

import json
import os
import sys
import time

import numpy as np


def _setup(params):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = params.get("local_devices", 1)
  if n > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * n)
  import oscars_tf  # pylint: disable=g-import-not-at-top
  devices = [f"CPU:{i}" for i in range(n)] if n > 1 else None
  resolver = None
  if params.get("resolver"):  # the ClusterResolver path instead of TF_CONFIG
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  strategy = oscars_tf.OscarsStrategy(
      cluster_resolver=resolver,
      schedule=(_adaptive(oscars_tf, params["adaptive"])
                if "adaptive" in params else
                oscars_tf.schedules.Fixed(params.get("every", 4) + (
                    1 if params.get("odd_schedule_worker") ==
                    _task_index() else 0))),
      devices=devices, collective_timeout=params.get("timeout", 60),
      straggler_timeout=params.get("straggler_timeout"),
      # The product's default unless a test names one.
      **({"optimizer_state": params["optimizer_state"]}
         if "optimizer_state" in params else {}),
      simulate_step_time=params.get("simulate", ""),
      outer_optimizer=(oscars_tf.schedules.OuterMomentum(**params["outer"])
                       if "outer" in params else None),
      averaging_dtype=_per_worker(params, "averaging_dtype"),
      compression=_per_worker(params, "compression"),
      overlap=_per_worker(params, "overlap") or False)
  import keras  # pylint: disable=g-import-not-at-top
  # Distinct seeds: workers start from different random weights, so equal
  # weights later prove the initial broadcast and the averaging.
  keras.utils.set_random_seed(params.get("seed", 0) + strategy.worker_index)
  return strategy


def _adaptive(oscars_tf, args):
  """Adaptive(**args); a "period_rule" is named ("Constant")."""
  args = dict(args)
  if "period_rule" in args:
    args["period_rule"] = getattr(oscars_tf.schedules, args["period_rule"])()
  return oscars_tf.schedules.Adaptive(**args)


def _per_worker(params, name):
  """params[name]: one for all workers, or a list by worker."""
  value = params.get(name)
  return value[_task_index()] if isinstance(value, list) else value


def _task_index():
  return json.loads(os.environ.get("TF_CONFIG", "{}") or "{}").get(
      "task", {}).get("index", 0)


def _write(params, strategy, result):
  path = os.path.join(params["outdir"], f"worker_{strategy.worker_index}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(path + ".tmp", path)


def _mlp(params, hidden=64, dtype=None, extra_layer=False):
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([
      keras.Input((64,)),
      keras.layers.Dense(hidden, activation="relu", dtype=dtype)] +
      ([keras.layers.Dense(hidden, activation="relu")] if extra_layer
       else []) + [keras.layers.Dense(10, dtype=dtype)])
  opt = (keras.optimizers.Adam(params.get("lr", 0.01))
         if params.get("optimizer") == "adam"
         else keras.optimizers.SGD(params.get("lr", 0.1)))
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=params.get("steps_per_execution", 1))
  return model


def _flat(model):
  return np.concatenate([np.asarray(v.numpy()).ravel() for v in model.weights])


class _Projector:
  """A fixed random projection of the weights: equal weights, equal vector."""

  def __init__(self, size):
    self.p = np.random.default_rng(123).normal(size=(8, size))

  def __call__(self, model):
    return (self.p @ _flat(model).astype(np.float64)).tolist()


def _die_mid_round(strategy, params):
  """kill -9 of this worker while it computes: between its round's second
  step and its last, so no averaging collective or round decision that
  needs it is in flight (a death inside a collective takes the restart
  path, docs/reliability.md). A file marks the moment for the test."""
  import signal  # pylint: disable=g-import-not-at-top
  history = strategy.round_history
  done = strategy.stats()["local_step"] - (
      history[-1]["end_step"] if history else 0)
  if 2 <= done < strategy.plan.local_steps[strategy.worker_index] - 1:
    path = os.path.join(params["outdir"], f"died_{strategy.worker_index}")
    with open(path, "w") as f:
      f.write(f"{time.time()} {done}")
    os.kill(os.getpid(), signal.SIGKILL)


def _resume(params, strategy, model):
  """Restores `model` from this worker's own directory, where an earlier
  run's chief saved epoch `params["resume_epochs"][index]` (saved here
  first); returns the epoch to resume at."""
  from oscars_tf import checkpoint  # pylint: disable=g-import-not-at-top
  me = strategy.worker_index
  directory = os.path.join(params["outdir"], f"checkpoint-of-worker-{me}")
  with strategy.scope():
    model.optimizer.build(model.trainable_variables)
  checkpoint.save(model, directory, params["resume_epochs"][me])
  return checkpoint.restore(model, directory, strategy)


def fit(params):
  strategy = _setup(params)
  import keras  # pylint: disable=g-import-not-at-top

  from oscars_tf import data  # pylint: disable=g-import-not-at-top
  (x, y), (xt, yt) = data.digits()
  hidden, dtype = params.get("hidden", 64), None
  if strategy.worker_index == params.get("odd_worker", -1):
    hidden = hidden // 2
  if strategy.worker_index == params.get("odd_dtype_worker", -1):
    dtype = "float64"
  if params.get("empty_data"):
    x, y = x[:0], y[:0]
  with strategy.scope():
    model = _mlp(params, hidden, dtype, extra_layer=(
        strategy.worker_index == params.get("extra_layer_worker", -1)))
  me = strategy.worker_index
  records, step_times, gaps, epoch_ends = [], [], [], []
  fit_start = [time.perf_counter()]
  proj = _Projector(_flat(model).size)

  class Recorder(keras.callbacks.Callback):

    def on_epoch_begin(self, epoch, logs=None):
      self._epoch = epoch
      self._epoch_t = time.perf_counter()
      self._first = True
      if params.get("fail_at_epoch") == [me, epoch]:
        raise RuntimeError(f"injected failure on worker {me}")
      if params.get("stop_all_at_epoch") == epoch:
        raise KeyboardInterrupt("planned stop of every worker")
      if params.get("poison_at_epoch") == [me, epoch]:  # inject NaN weights
        kernel = self.model.trainable_weights[0]
        kernel.assign(np.full(kernel.shape, np.nan, np.float32))

    def on_epoch_end(self, epoch, logs=None):
      epoch_ends.append([time.perf_counter() - fit_start[0],
                         float((logs or {}).get("val_accuracy", "nan"))])
      if params.get("stall_at_epoch_end", [None])[:2] == [me, epoch]:
        time.sleep(params["stall_at_epoch_end"][2])  # a slow user callback

    def on_train_batch_begin(self, batch, logs=None):
      self._t = time.perf_counter()
      victim, from_epoch = params.get("die_mid_round", (None, 0))
      if me == victim and self._epoch >= from_epoch:
        _die_mid_round(strategy, params)
      if getattr(self, "_first", False):
        gaps.append(self._t - self._epoch_t)
        self._first = False

    def on_train_batch_end(self, batch, logs=None):
      step_times.append(time.perf_counter() - self._t)
      if params.get("record"):
        stats = strategy.stats()
        records.append({"step": stats["local_step"], "epoch": self._epoch,
                        "t": time.time(), "dt": step_times[-1],
                        "syncs": stats["syncs"], "proj": proj(self.model)})
      if me == params.get("slow_worker", -1):
        time.sleep(params["slow_ms"] / 1000.0)

  callbacks = [Recorder()]
  if params.get("early_stopping"):
    callbacks.append(keras.callbacks.EarlyStopping(
        monitor="loss", min_delta=params["early_stopping"], patience=0))
  ckpt = os.path.join(params["outdir"], "model.keras")
  if params.get("checkpoint"):
    callbacks.append(keras.callbacks.ModelCheckpoint(ckpt))
  if params.get("tensorboard"):
    callbacks.append(keras.callbacks.TensorBoard(
        os.path.join(params["outdir"], "tb")))
  if params.get("backup"):
    callbacks.append(keras.callbacks.BackupAndRestore(
        os.path.join(params["shared_dir"], "backup")))
  history = None
  started = fit_start[0] = time.perf_counter()
  fit_x, fit_y, fit_kwargs = x, y, {"batch_size": params.get("batch_size", 32)}
  if params.get("dataset_steps"):  # an endless tf.data stream
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    fit_x = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        512, seed=me).batch(32).repeat()
    fit_y, fit_kwargs = None, {"steps_per_epoch": params["dataset_steps"]}
  try:
    if params.get("second_strategy"):  # refused: one per cluster process
      _setup(params)
    initial_epoch = (_resume(params, strategy, model)
                     if params.get("resume_epochs") else 0)
    history = model.fit(fit_x, fit_y, epochs=params.get("epochs", 3),
                        initial_epoch=initial_epoch,
                        callbacks=callbacks, **fit_kwargs,
                        validation_data=(xt, yt) if params.get("validate")
                        else None, shuffle=params.get("shuffle", True),
                        validation_split=params.get("validation_split", 0.0),
                        verbose=0)
  except KeyboardInterrupt as e:
    _write(params, strategy, {"interrupted": str(e)})
    return
  except Exception as e:  # pylint: disable=broad-except
    _write(params, strategy, {"error": type(e).__name__, "message": str(e)})
    raise
  wall = time.perf_counter() - started
  loss, acc = model.evaluate(xt, yt, verbose=0)
  _write(params, strategy, {
      "weights": _flat(model).tolist(), "test_accuracy": acc, "wall_s": wall,
      "test_loss": loss, "epochs_run": len(history.history["loss"]),
      "history": {k: [float(v) for v in vs]
                  for k, vs in history.history.items()},
      "stats": strategy.stats(), "records": records,
      "rounds": strategy.round_history,
      "relay": _relay_counts(strategy),
      "table": strategy.step_rate_table(),
      "step_times": step_times, "epoch_start_gaps": gaps,
      "epoch_ends": epoch_ends, "steps_per_epoch": len(step_times) // max(
          1, len(history.history["loss"])),
      "predict_sum": float(np.sum(model.predict(xt[:50], verbose=0))),
      "optimizer_slots": [float(np.sum(np.abs(v.numpy())))
                          for v in model.optimizer.variables
                          if v.dtype == "float32"],
  })


def _relay_counts(strategy):
  """Rounds this worker read from / wrote to its host's decision file
  (protocol/host_relay.py), and the host's rows it gathered as the host's
  leader (protocol/host_arrivals.py); None without a relay."""
  membership = strategy.extended.round_book.membership
  relay = membership.relay if membership is not None else None
  return None if relay is None else {
      "read": relay.files_read, "written": relay.files_written,
      "gathered": membership.arrivals.rows_gathered,
      "saved": membership.arrivals.posts_saved}


def sync_equivalence(params):
  """every=1 with plain SGD must equal one-process SGD on joined batches."""
  strategy = _setup(dict(params, every=1))
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from oscars_tf import data  # pylint: disable=g-import-not-at-top
  (x, y), _ = data.digits()
  x, y = x[:256], y[:256]
  with strategy.scope():
    model = _mlp(params)
  initial = [v.numpy() for v in model.weights]  # before the broadcast
  model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  result = {"weights": _flat(model).tolist()}
  if strategy.is_chief:
    # Reference: one process, no strategy, the workers' batches side by side.
    w = strategy.num_workers
    shards = [(x[i::w], y[i::w]) for i in range(w)]
    with tf.distribute.get_strategy().scope():
      ref = _mlp(params)
    ref.set_weights(initial)
    for _ in range(2):
      for b in range(0, len(shards[0][0]), 16):
        xb = np.concatenate([s[0][b:b + 16] for s in shards])
        yb = np.concatenate([s[1][b:b + 16] for s in shards])
        ref.train_on_batch(xb, yb)
    result["reference"] = _flat(ref).tolist()
  _write(params, strategy, result)


def custom_loop(params):
  """strategy.run in a tf.function, datasets per worker, explicit sync."""
  strategy = _setup(params)
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  seen = [int(v.numpy()[0]) for v in strategy.experimental_distribute_dataset(
      tf.data.Dataset.range(8).batch(1))]
  contexts = []

  def dataset_fn(ctx):
    contexts.append([ctx.num_input_pipelines, ctx.input_pipeline_id])
    rng = np.random.default_rng(ctx.input_pipeline_id)
    xs = rng.normal(size=(64, 4)).astype(np.float32)
    ys = (xs @ np.arange(1, 5, dtype=np.float32))[:, None]
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(8).repeat()

  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05)
  iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

  @tf.function
  def train_step(it):
    def step(xb, yb):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(xb) - yb) ** 2)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return strategy.run(step, args=next(it))

  projections = []
  for _ in range(params.get("steps", 10)):
    train_step(iterator)
    projections.append(_flat(model).tolist())
  strategy.sync()
  _write(params, strategy, {"seen": seen, "contexts": contexts,
                            "per_step": projections,
                            "weights": _flat(model).tolist(),
                            "stats": strategy.stats()})


def soak(params):
  """Thousands of rounds of a tiny model (averaging every step); the chief
  then counts the protocol's keys left in the coordination service."""
  strategy = _setup(dict(params, every=1))
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from oscars_tf.protocol import kv_store  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import membership_chief  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import store_keys  # pylint: disable=g-import-not-at-top
  from oscars_tf.runtime import coordination_store  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
  x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
  ds = tf.data.Dataset.from_tensor_slices((x, x[:, :2])).batch(8).repeat()
  epochs = params["epochs"]
  t0 = time.perf_counter()
  model.fit(ds, steps_per_epoch=params["rounds"] // epochs, epochs=epochs,
            verbose=0)
  wall = time.perf_counter() - t0
  rounds = strategy.round_history[-1]["round"] + 1  # membership rounds
  result = {"rounds": rounds, "wall_s": wall,
            "history": len(strategy.round_history),
            "weights": _flat(model).tolist()}
  if strategy.worker_index == 0:
    store = coordination_store.ContextStore()

    def present(key, timeout_s=0.001):
      try:
        store.get(key, timeout_s)
        return True
      except kv_store.KeyMissing:
        return False
    # Keys that should be there get a generous timeout (a loaded machine's
    # RPC can take over 1 ms); a probe of an absent key waits out a short
    # one, so absent keys are sampled (every 7th round: a leak is every key).
    kept = range(max(0, rounds - membership_chief.KEEP_ROUNDS), rounds)
    missing = [r for r in kept if not present(store_keys.decision(r), 0.5)]
    result["kept_decisions"] = len(kept) - len(missing)
    result["missing_decisions"] = missing[:50]
    result["old_decisions"] = sum(present(store_keys.decision(r))
                                  for r in range(0, kept.start, 7))
    result["arrivals"] = sum(present(store_keys.arrival(r, w))
                             for r in range(0, rounds + 5, 7)
                             for w in range(strategy.num_workers))
  _write(params, strategy, result)


SCENARIOS = {f.__name__: f for f in (fit, sync_equivalence, custom_loop,
                                     soak)}

if __name__ == "__main__":
  SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
