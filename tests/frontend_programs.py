"""The worker program of the front-end matrix (tests/test_frontends.py).

    python frontend_programs.py '{"flavour": "keras3", "cases": [...], ...}'

One job runs many cases in a row, as one user's script would: each case
builds a model in the strategy's scope, feeds `fit` one input kind and
records what the test checks (a projection of the final weights, the
batches this worker trained on per epoch, the history). A case that hangs
stalls the job, which the test's timeout ends, naming the last case begun.
Writes <outdir>/worker_<index>.json.
"""

import json
import os
import sys
import threading
import time
import weakref

import numpy as np

N, FEATURES, CLASSES, BATCH = 240, 8, 3, 16
# dataset_sharding_off: each of 3 workers' rows [start, stop).
OWN_ROWS = ((0, 112), (112, 192), (192, 240))


def own_batches(case, worker, workers):
  """Batches per epoch of a worker whose data is its own, or None."""
  if case == "distributed_dataset":
    return -(-len(range(worker, N, workers)) // BATCH)
  if case == "dataset_sharding_off":
    start, stop = OWN_ROWS[worker]
    return -(-(stop - start) // BATCH)
  return None


def _keras(flavour):
  if flavour == "tf_keras":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tf_keras as keras  # pylint: disable=g-import-not-at-top
    return keras
  import keras  # pylint: disable=g-import-not-at-top
  return keras


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, FEATURES)).astype("float32")
  w = rng.normal(size=(FEATURES, CLASSES))
  y = np.argmax(x @ w, axis=1).astype("int64")
  return x, y


class _Cases:
  """Each method feeds `fit` one way; returns the History."""

  def __init__(self, keras, tf, strategy, outdir):
    self.keras, self.tf = keras, tf
    self.strategy, self.outdir = strategy, outdir
    self.x, self.y = _data()
    self.me = strategy.worker_index

  def model(self, steps_per_execution=1, inputs=None, recorder=None,
            hidden=16, policy=None):
    keras = self.keras
    if policy:  # the model's layers and compile's optimizer take it
      keras.mixed_precision.set_global_policy(policy)
    try:
      return self._compiled(steps_per_execution, inputs, recorder, hidden)
    finally:
      keras.mixed_precision.set_global_policy("float32")

  def _compiled(self, steps_per_execution, inputs, recorder, hidden):
    keras = self.keras
    with self.strategy.scope():
      if inputs in ("dict", "list"):
        a = keras.Input((FEATURES // 2,), name="a")
        b = keras.Input((FEATURES // 2,), name="b")
        h = keras.layers.Dense(16, activation="relu")(
            keras.layers.Concatenate()([a, b]))
        model = keras.Model({"a": a, "b": b} if inputs == "dict" else [a, b],
                            keras.layers.Dense(CLASSES)(h))
      else:
        model = keras.Sequential([
            keras.Input((FEATURES,))] + ([recorder] if recorder else []) + [
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(CLASSES)])
      kwargs = {"steps_per_execution": steps_per_execution}
      model.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True),
                    metrics=["accuracy"], **kwargs)
    return model

  def _ds(self):
    return self.tf.data.Dataset.from_tensor_slices((self.x, self.y))

  # -- input kinds ------------------------------------------------------

  def arrays(self, model, cb):
    keras = self.keras
    path = os.path.join(self.outdir, "ckpt.keras" if self._k3() else "ckpt.h5")
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=3,
                     validation_split=0.2, verbose=0, callbacks=cb + [
                         keras.callbacks.EarlyStopping(patience=5),
                         keras.callbacks.ReduceLROnPlateau(patience=1),
                         keras.callbacks.ModelCheckpoint(path)])

  def shuffled_arrays(self, model, cb):
    # The model records the samples of each training step (see _recorder).
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=3, verbose=0,
                     callbacks=cb)

  def another_model_size(self, model, cb):
    # A model of another size than the cases' before it, as a user's second
    # model in one process: TensorFlow fixes a collective's shape per
    # instance key, so its averaging must not reuse the first model's keys.
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb)

  def dict_arrays(self, model, cb):
    half = FEATURES // 2
    x = {"a": self.x[:, :half], "b": self.x[:, half:]}
    return model.fit(x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb, validation_data=(x, self.y))

  def list_arrays(self, model, cb):
    # A multi-input model fed a list of arrays (tf.data would stack a list
    # into one tensor).
    half = FEATURES // 2
    x = [self.x[:, :half], self.x[:, half:]]
    return model.fit(x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb, validation_data=(x, self.y))

  def pandas(self, model, cb):
    import pandas as pd  # pylint: disable=g-import-not-at-top
    return model.fit(pd.DataFrame(self.x), pd.Series(self.y),
                     batch_size=BATCH, epochs=2, verbose=0, callbacks=cb)

  def sample_weight(self, model, cb):
    sw = np.linspace(0.5, 1.5, N).astype("float32")
    return model.fit(self.x, self.y, sample_weight=sw, batch_size=BATCH,
                     epochs=2, verbose=0, callbacks=cb)

  def class_weight(self, model, cb):
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb, class_weight={0: 1.0, 1: 2.0, 2: 0.5})

  def dataset(self, model, cb):
    val = self._ds().batch(BATCH)
    return model.fit(self._ds().shuffle(N, seed=1).batch(BATCH), epochs=2,
                     verbose=0, callbacks=cb, validation_data=val)

  def dataset_unknown_length(self, model, cb):
    ds = self._ds().filter(lambda x, y: x[0] < 1.5).batch(BATCH)
    val = self._ds().filter(lambda x, y: x[1] < 1.0).batch(BATCH)
    return model.fit(ds, epochs=2, verbose=0, callbacks=cb,
                     validation_data=val)

  def dataset_infinite(self, model, cb):
    ds = self._ds().shuffle(N, seed=2).repeat().batch(BATCH)
    return model.fit(ds, steps_per_epoch=N // BATCH // 3, epochs=2,
                     verbose=0, callbacks=cb)

  def distributed_dataset(self, model, cb):
    # Each worker's shard made by the strategy, as TensorFlow's tutorials
    # do: fit reads all of it every epoch and splits nothing again.
    def shard(context):
      return self._ds().shard(context.num_input_pipelines,
                              context.input_pipeline_id).batch(BATCH)
    return model.fit(self.strategy.distribute_datasets_from_function(shard),
                     epochs=2, verbose=0, callbacks=cb)

  def dataset_sharding_off(self, model, cb):
    # The user gives each worker its own rows (uneven: the slow worker the
    # fewest) and turns auto-sharding off: fit reads them all every epoch.
    start, stop = OWN_ROWS[self.me]
    options = self.tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        self.tf.data.experimental.AutoShardPolicy.OFF)
    ds = self._ds().skip(start).take(stop - start).batch(BATCH)
    return model.fit(ds.with_options(options), epochs=2, verbose=0,
                     callbacks=cb)

  def dataset_from_generator(self, model, cb):
    x, y = self.x, self.y

    def gen():
      yield from zip(x, y)
    ds = self.tf.data.Dataset.from_generator(gen, output_signature=(
        self.tf.TensorSpec((FEATURES,), "float32"),
        self.tf.TensorSpec((), "int64"))).batch(BATCH).repeat()
    return model.fit(ds, steps_per_epoch=N // BATCH // 3, epochs=2,
                     verbose=0, callbacks=cb)

  def _py_dataset(self, epoch_ends=None, **kwargs):
    """A PyDataset (tf_keras: a Sequence); `epoch_ends`: a list its
    `on_epoch_end` calls append to."""
    base = (self.keras.utils.PyDataset if self._k3()
            else self.keras.utils.Sequence)
    x, y = self.x, self.y

    class Batches(base):

      def __init__(self):
        if kwargs:
          super().__init__(**kwargs)
        else:
          super().__init__()

      def on_epoch_end(self):  # a user's reshuffle would go here
        if epoch_ends is not None:
          epoch_ends.append(time.time())

      def __len__(self):
        return (len(x) + BATCH - 1) // BATCH

      def __getitem__(self, i):
        return x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
    return Batches()

  def py_dataset(self, model, cb):
    self.epoch_hooks = []  # reported with the case (see run_cases)
    return model.fit(self._py_dataset(self.epoch_hooks), epochs=2,
                     verbose=0, callbacks=cb,
                     validation_data=self._py_dataset())

  def py_dataset_workers(self, model, cb):
    loading = {"workers": 2, "use_multiprocessing": True}
    if self._k3():  # Keras 3: the PyDataset's own settings
      return model.fit(self._py_dataset(**loading), epochs=2, verbose=0,
                       callbacks=cb)
    # tf_keras: a Sequence takes none; fit does.
    return model.fit(self._py_dataset(), epochs=2, verbose=0, callbacks=cb,
                     **loading)

  def generator(self, model, cb):
    x, y = self.x, self.y

    def batches():
      while True:
        for i in range(0, len(x), BATCH):
          yield x[i:i + BATCH], y[i:i + BATCH]
    return model.fit(batches(), steps_per_epoch=N // BATCH // 3, epochs=2,
                     verbose=0, callbacks=cb)

  def progress_bar(self, model, cb):
    # verbose=1: the chief's progress bar (the test reads its counts).
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=3, verbose=1,
                     callbacks=cb)

  def mixed_precision(self, model, cb):
    # mixed_float16: compile wrapped the optimizer for loss scaling (tf_keras
    # allows that only under the strategies it lists).
    if not type(model.optimizer).__name__.startswith("LossScaleOptimizer"):
      raise AssertionError(f"no loss scaling: {type(model.optimizer)}")
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb)

  def moving_average(self, model, cb):
    # use_ema=True: fit ends by copying each worker's moving averages into
    # its weights; they must agree too.
    keras = self.keras
    with self.strategy.scope():
      model.compile(optimizer=keras.optimizers.SGD(0.05, use_ema=True),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb)

  def steps_per_execution(self, model, cb):
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb, validation_data=(self.x, self.y))

  # -- lifecycle --------------------------------------------------------

  def recompile(self, model, cb):
    keras = self.keras
    model.fit(self.x, self.y, batch_size=BATCH, epochs=1, verbose=0)
    model.layers[0].trainable = False  # fine-tuning: freeze, compile again
    with self.strategy.scope():
      model.compile(optimizer=keras.optimizers.Adam(0.01),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True), metrics=["accuracy"])
    return model.fit(self.x, self.y, batch_size=BATCH, epochs=2, verbose=0,
                     callbacks=cb)

  def evaluate_then_fit(self, model, cb):
    model.evaluate(self.x, self.y, verbose=0)
    history = model.fit(self.x, self.y, batch_size=BATCH, epochs=2,
                        verbose=0, callbacks=cb)
    model.predict(self.x[:32], verbose=0)
    return history

  def save_and_load(self, model, cb):
    history = model.fit(self.x, self.y, batch_size=BATCH, epochs=2,
                        verbose=0, callbacks=cb)
    path = os.path.join(self.outdir, f"model_{self.me}." +
                        ("keras" if self._k3() else "h5"))
    model.save(path)
    with self.strategy.scope():
      loaded = self.keras.models.load_model(path)
    loaded.fit(self.x, self.y, batch_size=BATCH, epochs=1, verbose=0,
               callbacks=cb)
    self.final = loaded  # the weights the test compares
    return history

  def text_vectorization(self, model, cb):
    # A model of its own: strings in, a vocabulary lookup among its weights
    # (tf_keras lists the table's handler, not a variable, in
    # non_trainable_weights).
    del model
    keras = self.keras
    words = np.array([[" ".join(f"w{(i * 7 + j) % 11}" for j in range(3))]
                      for i in range(N)])
    with self.strategy.scope():
      vectorize = keras.layers.TextVectorization(max_tokens=16,
                                                 output_sequence_length=3)
      vectorize.adapt(words)
      text = self._bag_of_tokens(keras.Input((1,), dtype="string"),
                                 vectorize, vocabulary=16)
    self.final = text
    data = self.tf.data.Dataset.from_tensor_slices((words, self.y))
    return text.fit(data.batch(BATCH), epochs=2, verbose=0, callbacks=cb)

  def text_files(self, model, cb):
    # A model of its own, as a user's text model reads: records of
    # different lengths in several files of different sizes (tf.data from
    # files: auto-sharded by file), decoded to bytes, padded per batch.
    del model
    keras, tf = self.keras, self.tf
    rng = np.random.default_rng(5)
    folder = os.path.join(self.outdir, f"text_files_{self.me}")
    os.makedirs(folder, exist_ok=True)
    paths, start = [], 0
    for i, count in enumerate((40, 90, 60, 50)):  # N lines in all
      lines = ["".join(chr(97 + (start + k + j) % 26)
                       for j in range(int(rng.integers(3, 40))))
               for k in range(count)]
      start += count
      paths.append(os.path.join(folder, f"part_{i}.txt"))
      with open(paths[-1], "w") as f:
        f.write("\n".join(lines) + "\n")

    def record(line):
      ids = tf.cast(tf.io.decode_raw(line, tf.uint8), tf.int32)
      return ids, tf.cast(tf.size(ids) % CLASSES, tf.int64)
    data = tf.data.TextLineDataset(tf.data.Dataset.from_tensor_slices(
        paths)).map(record).padded_batch(BATCH)
    with self.strategy.scope():
      text = self._bag_of_tokens(keras.Input((None,), dtype="int32"),
                                 vocabulary=128)
    self.final = text
    return text.fit(data, epochs=2, verbose=0, callbacks=cb)

  def _bag_of_tokens(self, *inputs, vocabulary):
    """A compiled text classifier of its own: `inputs` (layers), an
    embedding of `vocabulary` tokens, their average, the classes."""
    keras = self.keras
    text = keras.Sequential(list(inputs) + [
        keras.layers.Embedding(vocabulary, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(CLASSES)])
    text.compile(optimizer=keras.optimizers.SGD(0.05),
                 loss=keras.losses.SparseCategoricalCrossentropy(
                     from_logits=True))
    return text

  def _k3(self):
    return not self.keras.__name__.startswith("tf_keras")


def main(params):
  keras = _keras(params.get("flavour", "keras3"))
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import oscars_tf  # pylint: disable=g-import-not-at-top
  schedule = (oscars_tf.schedules.Fixed(params["every"]) if params.get("every")
              else oscars_tf.schedules.Adaptive())
  strategy = oscars_tf.OscarsStrategy(
      # Generous: beside the other CI stream's jobs on 2 cores the slow
      # worker once reached a round end over 30 s after the chief (a
      # case's first step traces its model), was dropped, and the job
      # failed; a worker that truly hangs still fails within the job's
      # timeout.
      schedule=schedule, collective_timeout=params.get("timeout", 150),
      straggler_timeout=params.get("straggler_timeout", 120),
      compression=params.get("compression"),
      overlap=params.get("overlap") or False)
  me = strategy.worker_index
  frees = _IteratorFrees()
  cases = _Cases(keras, tf, strategy, params["outdir"])
  out = {"cases": {}}
  path = os.path.join(params["outdir"], f"worker_{me}.json")
  for name in params["cases"]:
    keras.utils.set_random_seed(me)  # different starts: equality is earned
    print(f"case {name} begins", flush=True)
    t0 = time.perf_counter()
    spe = 4 if name == "steps_per_execution" else 1
    seen = []
    recorder = (_recorder(keras, tf, seen) if name == "shuffled_arrays"
                else None)
    model = cases.model(spe, inputs={"dict_arrays": "dict",
                                            "list_arrays": "list"}.get(name),
                        recorder=recorder,
                        hidden=24 if name == "another_model_size" else 16,
                        policy=("mixed_float16" if name == "mixed_precision"
                                else None))
    counter = _step_counter(keras, strategy, seen)
    rounds_before = len(strategy.round_history)
    frees.clear()
    history = getattr(cases, name)(model, [counter])
    returned_at = time.time()  # one clock for all workers (one machine)
    freed_here = frees.on_this_thread(since=counter.train_end_at)
    rounds = strategy.round_history[rounds_before:]
    final = cases.__dict__.pop("final", None) or model
    arrays = [np.asarray(v.numpy()) for v in final.weights
              if hasattr(v, "numpy")]  # not tf_keras' lookup table handler
    flat = np.concatenate([np.ravel(a) for a in arrays if a.dtype.kind == "f"])
    out["cases"][name] = {
        "weights": flat.astype(np.float64).tolist(),
        "batches": counter.batches,
        "epoch_ends": counter.epoch_ends,
        "returned_at": returned_at,
        # This case's longest round (compute + wait + communication).
        "round_s": max([r["compute_s"] + r["wait_s"] + r["comm_s"]
                        for r in rounds] or [0.0]),
        "epochs": len(history.history["loss"]),
        "samples": _samples_per_epoch(cases.x, seen, counter.seen_at_end),
        "history": {k: [float(v) for v in vs]
                    for k, vs in history.history.items()},
        "seconds": time.perf_counter() - t0,
        # tf.data iterators deleted on the training thread at the end of a
        # `fit` (deleting one can block for seconds: deferred_release).
        "iterators_freed_on_training_thread": freed_here,
        # The input's own on_epoch_end calls, where the case counts them.
        "epoch_hooks": len(cases.__dict__.pop("epoch_hooks", []))}
    with open(path + ".tmp", "w") as f:
      json.dump(out, f)
    os.replace(path + ".tmp", path)
    print(f"case {name} ends", flush=True)


class _IteratorFrees:
  """Which thread deletes each tf.data iterator, and when: a weak
  reference's callback runs on the thread that frees its object, before
  the iterator resource it holds is deleted."""

  def __init__(self):
    from tensorflow.python.data.ops import iterator_ops  # pylint: disable=g-import-not-at-top
    self._lock = threading.Lock()
    self._refs = set()
    self._frees = []  # (thread name, time.time())
    original = iterator_ops.OwnedIterator.__init__
    watcher = self

    def init(iterator, *args, **kwargs):
      original(iterator, *args, **kwargs)
      if not iterator_ops.context.executing_eagerly():
        return  # a symbolic one, while a tf.function is traced: no resource
      with watcher._lock:  # pylint: disable=protected-access
        watcher._refs.add(weakref.ref(iterator, watcher._freed))  # pylint: disable=protected-access
    iterator_ops.OwnedIterator.__init__ = init

  def _freed(self, ref):
    with self._lock:
      self._refs.discard(ref)
      self._frees.append((threading.current_thread().name, time.time()))

  def clear(self):
    with self._lock:
      self._frees.clear()

  def on_this_thread(self, since):
    """Iterators this thread deleted from `since` (None: never) on."""
    name = threading.current_thread().name
    with self._lock:
      return sum(since is not None and who == name and at >= since
                 for who, at in self._frees)


def _recorder(keras, tf, seen):
  """A layer passing its input on that records, at training steps, each
  row's first feature (which names the sample: the features are random)."""

  class Recorder(keras.layers.Layer):

    def call(self, x, training=None):
      if not training:
        return x

      def record(rows):
        seen.extend(rows.numpy()[:, 0].tolist())
        return rows
      y = tf.py_function(record, [x], x.dtype)
      y.set_shape(x.shape)
      return y
  return Recorder()


def _samples_per_epoch(x, seen, ends):
  """Sample numbers recorded in each epoch (empty: nothing recorded)."""
  if not seen:
    return []
  number = {float(v): i for i, v in enumerate(x[:, 0])}
  assert len(number) == len(x), "first features must name the samples"
  starts = [0] + ends[:-1]
  return [[number[v] for v in seen[a:b]] for a, b in zip(starts, ends)]


def unseen_and_repeated(outs):
  """Per epoch of a `shuffled_arrays` case (outs: every worker's record):
  (samples the cluster never trained on, samples beyond one data set)."""
  per_epoch = zip(*[o["samples"] for o in outs])
  result = []
  for samples in per_epoch:
    taken = [i for worker in samples for i in worker]
    result.append((N - len(set(taken)), len(taken) - len(set(taken))))
  return result


def _step_counter(keras, strategy, seen=()):

  class StepCounter(keras.callbacks.Callback):
    """Training steps this worker took, per epoch (whatever
    steps_per_execution: the strategy counts its updates)."""

    def __init__(self):
      super().__init__()
      self.batches = []
      self.epoch_ends = []
      self.seen_at_end = []  # len(seen) at each epoch end
      self.train_end_at = None
      self._start = 0

    def on_train_end(self, logs=None):
      self.train_end_at = time.time()

    def on_epoch_begin(self, epoch, logs=None):
      self._start = strategy.stats()["local_step"]

    def on_epoch_end(self, epoch, logs=None):
      self.batches.append(strategy.stats()["local_step"] - self._start)
      self.epoch_ends.append(time.time())
      self.seen_at_end.append(len(seen))
  return StepCounter()


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
