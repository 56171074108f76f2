"""TensorFlow's two multi-worker tutorials, with OscarsStrategy as the strategy.

    python tutorial_programs.py keras OUTDIR   # "Multi-worker training with
                                               #  Keras"
    python tutorial_programs.py ctl OUTDIR     # "Custom training loop with
                                               #  MultiWorkerMirroredStrategy"

Run one process per worker (TF_CONFIG set per worker, e.g. by oscars-launch).
Each program follows its tutorial (tensorflow.org/tutorials/distribute/
multi_worker_with_keras and .../multi_worker_with_ctl) step by step, with the
tutorial's names, calls and file-saving pattern (`_is_chief`, `_get_temp_dir`,
`write_filepath`, saving on every worker and deleting the non-chief's temporary
copy), and with `tf.distribute.MultiWorkerMirroredStrategy()` replaced by
`oscars_tf.OscarsStrategy()`. Every other departure is marked CHANGED with
the reason; what the tests read is marked ADDED. The tutorials' constants
(epochs, steps) are scaled down to keep the tests short.

Each worker writes OUTDIR/report_<task_type>_<task_id>.json and its trained
weights to OUTDIR/trained_<task_type>_<task_id>.npz for the tests.
"""

import json
import os
import sys
import time

import numpy as np

OUTDIR = sys.argv[2] if len(sys.argv) > 2 else "/tmp"
STEPS = int(os.environ.get("TUTORIAL_STEPS", "6"))  # tutorial: 70 per epoch
BARRIER_S = float(os.environ.get("TUTORIAL_BARRIER_S", "120"))


def _schedule():
  """ADDED: TUTORIAL_SCHEDULE=fixed:H runs the CTL tutorial with
  `OscarsStrategy(schedule=schedules.Fixed(every=H))`; unset, the
  strategy line is the tutorial's with only the class changed."""
  import oscars_tf  # pylint: disable=g-import-not-at-top
  spec = os.environ.get("TUTORIAL_SCHEDULE", "")
  if not spec:
    return {}
  kind, _, every = spec.partition(":")
  assert kind == "fixed", spec
  return {"schedule": oscars_tf.schedules.Fixed(every=int(every))}


# -- mnist_setup.py / mnist.py -------------------------------------------------
# CHANGED: `tf.keras.datasets.mnist.load_data()` downloads MNIST, and the
# workers have no network. `load_data` below returns arrays of MNIST's shapes
# and dtypes (28x28 uint8 images, int labels) made from scikit-learn's bundled
# 8x8 digits, scaled up 3x and padded; the rest of the module is unchanged.

def load_data():
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  images = np.kron(digits.images, np.ones((3, 3)))          # 24x24
  images = np.pad(images, ((0, 0), (2, 2), (2, 2)))           # 28x28
  x = np.round(images * (255 / 16)).astype(np.uint8)
  y = digits.target.astype(np.uint8)
  return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def mnist_dataset(batch_size):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  (x_train, y_train), _ = load_data()
  # Scale the uint8 images in [0, 255] to float32 in [0, 1].
  x_train = x_train / np.float32(255)
  y_train = y_train.astype(np.int64)
  return tf.data.Dataset.from_tensor_slices(
      (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)


def build_and_compile_cnn_model():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model = tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(28, 28)),
      tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
      tf.keras.layers.Conv2D(32, 3, activation="relu"),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(128, activation="relu"),
      tf.keras.layers.Dense(10),
  ])
  model.compile(
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
      metrics=["accuracy"])
  return model


def ctl_mnist_dataset(batch_size):
  """The CTL tutorial's `mnist.mnist_dataset`: shuffled, not repeated."""
  del batch_size  # unused there too
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  (x_train, y_train), _ = load_data()
  x_train = x_train / np.float32(255)
  y_train = y_train.astype(np.int64)
  return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000)


def dataset_fn(global_batch_size, input_context):
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  dataset = ctl_mnist_dataset(batch_size)
  dataset = dataset.shard(input_context.num_input_pipelines,
                          input_context.input_pipeline_id)
  return dataset.batch(batch_size)


def build_cnn_model():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  regularizer = tf.keras.regularizers.L2(1e-5)
  return tf.keras.Sequential([
      tf.keras.Input(shape=(28, 28)),
      tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
      tf.keras.layers.Conv2D(32, 3, activation="relu",
                             kernel_regularizer=regularizer),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(128, activation="relu",
                            kernel_regularizer=regularizer),
      tf.keras.layers.Dense(10, kernel_regularizer=regularizer),
  ])


# -- ADDED: what the tests read ----------------------------------------------

def _resolver_facts(strategy):
  r = strategy.cluster_resolver
  e = strategy.extended
  return {
      "resolver_class": type(r).__name__,
      "task_type": r.task_type, "task_id": r.task_id,
      "cluster_spec": r.cluster_spec().as_dict(), "master": r.master(),
      "num_accelerators": dict(r.num_accelerators()),
      "rpc_layer": r.rpc_layer, "environment": r.environment,
      "should_checkpoint": e.should_checkpoint,
      "should_save_summary": e.should_save_summary,
      "experimental_should_init": e.experimental_should_init,
      "in_multi_worker_mode": e._in_multi_worker_mode(),  # pylint: disable=protected-access
      "between_graph": e.experimental_between_graph,
      "worker_index": strategy.worker_index, "is_chief": strategy.is_chief,
  }


def _flat(weights):
  return np.concatenate([np.asarray(w).ravel() for w in weights])


def _report(name, report, **arrays):
  path = os.path.join(OUTDIR, f"{name}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(report, f, default=str)
  os.replace(path + ".tmp", path)
  if arrays:
    np.savez(os.path.join(OUTDIR, name.replace("report", "trained")), **arrays)


def _wait_for_the_chief(name):
  """ADDED: a barrier. The tutorials save and load in one process (their
  multi-worker runs don't reach that part); with two processes, a non-chief
  must not read the chief's file before the chief has finished writing it.
  TensorFlow's coordination service (started with the cluster) has one."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  if context.context().coordination_service is not None:
    context.context().wait_at_barrier(name, int(BARRIER_S * 1000))


def _wait_for_file(path):
  """ADDED: waits (bounded) until the chief has written `path`."""
  deadline = time.monotonic() + BARRIER_S
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(f"{path} did not appear within {BARRIER_S} s")
    time.sleep(0.05)


# -- "Multi-worker training with Keras" --------------------------------------

def keras_tutorial():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import oscars_tf  # pylint: disable=g-import-not-at-top

  # main.py
  per_worker_batch_size = 64
  tf_config = json.loads(os.environ["TF_CONFIG"])
  num_workers = len(tf_config["cluster"]["worker"])

  strategy = oscars_tf.OscarsStrategy()  # tutorial: MultiWorkerMirrored...

  # Under OscarsStrategy the dataset's batch is the per-worker batch: this
  # trains on batches of 64 * num_workers per worker (the tutorial's line is
  # kept; it runs, with bigger batches).
  global_batch_size = per_worker_batch_size * num_workers
  multi_worker_dataset = mnist_dataset(global_batch_size)

  with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_and_compile_cnn_model()

  history = multi_worker_model.fit(multi_worker_dataset, epochs=3,
                                   steps_per_epoch=STEPS)
  trained = _flat(multi_worker_model.get_weights())  # ADDED

  # Model saving and loading.
  # CHANGED: Keras 3 saves whole models to `.keras` files only (the
  # tutorial's '/tmp/keras-model' is a TF1/Keras 2 SavedModel directory).
  model_path = os.path.join(OUTDIR, "keras-model.keras")

  def _is_chief(task_type, task_id):
    # Only `worker` tasks here: worker 0 is the chief. `task_type` None is
    # a one-worker run without TF_CONFIG.
    return (task_type == "worker" and task_id == 0) or task_type is None

  def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir

  def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
      dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)

  task_type, task_id = (strategy.cluster_resolver.task_type,
                        strategy.cluster_resolver.task_id)
  write_model_path = write_filepath(model_path, task_type, task_id)

  multi_worker_model.save(write_model_path)
  if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))

  _wait_for_the_chief("model_saved")  # ADDED (see there)
  # CHANGED: loaded inside the strategy's scope, so the training that
  # continues is multi-worker training again (the tutorial loads outside
  # any scope: in its notebook this part runs on a single worker).
  with strategy.scope():
    loaded_model = tf.keras.models.load_model(model_path)
  loaded = _flat(loaded_model.get_weights())  # ADDED
  # Now that the model is restored, training can continue.
  single_worker_dataset = mnist_dataset(per_worker_batch_size)
  loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=STEPS)

  # Checkpoint saving and restoring.
  checkpoint_dir = os.path.join(OUTDIR, "ckpt")  # tutorial: '/tmp/ckpt'
  checkpoint = tf.train.Checkpoint(model=multi_worker_model)
  write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
  checkpoint_manager = tf.train.CheckpointManager(
      checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
  checkpoint_manager.save()
  if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(write_checkpoint_dir)

  _wait_for_the_chief("checkpoint_saved")  # ADDED (see there)
  latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
  checkpoint.restore(latest_checkpoint)
  restored = _flat(multi_worker_model.get_weights())  # ADDED
  multi_worker_model.fit(multi_worker_dataset, epochs=2,
                         steps_per_epoch=STEPS)

  # The BackupAndRestore callback: the training state is backed up at
  # epoch boundaries (save_freq="epoch", the default).
  backup_dir = os.path.join(OUTDIR, "backup")  # tutorial: '/tmp/backup'
  callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir)]
  with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
  backup_history = multi_worker_model.fit(
      multi_worker_dataset, epochs=3, steps_per_epoch=STEPS,
      callbacks=callbacks)

  # ADDED: the report.
  name = f"report_{task_type}_{task_id}"
  _report(name, dict(
      _resolver_facts(strategy),
      tutorial_is_chief=_is_chief(task_type, task_id),
      write_model_path=write_model_path,
      write_checkpoint_dir=write_checkpoint_dir,
      latest_checkpoint=latest_checkpoint,
      loss=history.history["loss"],
      backup_epochs=len(backup_history.history["loss"]),
      loaded_minus_trained=float(np.max(np.abs(loaded - trained))),
      restored_minus_trained=float(np.max(np.abs(restored - trained))),
      final_sum=float(np.sum(_flat(multi_worker_model.get_weights()),
                             dtype=np.float64))),
      trained=trained)


# -- "Custom training loop with MultiWorkerMirroredStrategy" -----------------

def ctl_tutorial():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import oscars_tf  # pylint: disable=g-import-not-at-top

  # main.py
  per_worker_batch_size = 64
  tf_config = json.loads(os.environ["TF_CONFIG"])
  num_workers = len(tf_config["cluster"]["worker"])
  global_batch_size = per_worker_batch_size * num_workers

  num_epochs = 3
  num_steps_per_epoch = STEPS  # tutorial: 70

  # Checkpoint saving and restoring.
  def _is_chief(task_type, task_id, cluster_spec):
    return (task_type is None
            or task_type == "chief"
            or (task_type == "worker"
                and task_id == 0
                and "chief" not in cluster_spec.as_dict()))

  def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir

  def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
      dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)

  # CHANGED: the tutorial's `multiprocessing.util.get_temp_dir()` is a new
  # directory in every process, so its workers would never share the
  # chief's checkpoint; OUTDIR is the directory they share.
  checkpoint_dir = os.path.join(OUTDIR, "ckpt")

  # Define Strategy (tutorial: tf.distribute.MultiWorkerMirroredStrategy())
  strategy = oscars_tf.OscarsStrategy(**_schedule())

  with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_cnn_model()

    multi_worker_dataset = strategy.distribute_datasets_from_function(
        lambda input_context: dataset_fn(global_batch_size, input_context))
    optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.001)
    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
        name="train_accuracy")

  @tf.function
  def train_step(iterator):
    """Training step function."""

    def step_fn(inputs):
      """Per-Replica step function."""
      x, y = inputs
      with tf.GradientTape() as tape:
        predictions = multi_worker_model(x, training=True)
        per_example_loss = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True,
            reduction=tf.keras.losses.Reduction.NONE)(y, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss)
        model_losses = multi_worker_model.losses
        if model_losses:
          loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))

      grads = tape.gradient(loss, multi_worker_model.trainable_variables)
      optimizer.apply_gradients(
          zip(grads, multi_worker_model.trainable_variables))
      train_accuracy.update_state(y, predictions)
      return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(
        tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

  epoch = tf.Variable(
      initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="epoch")
  step_in_epoch = tf.Variable(
      initial_value=tf.constant(0, dtype=tf.dtypes.int64),
      name="step_in_epoch")

  task_type, task_id, cluster_spec = (
      strategy.cluster_resolver.task_type,
      strategy.cluster_resolver.task_id,
      strategy.cluster_resolver.cluster_spec())

  checkpoint = tf.train.Checkpoint(
      model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)

  write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                        cluster_spec)
  checkpoint_manager = tf.train.CheckpointManager(
      checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

  # Restoring the checkpoint
  latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
  if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)

  # Resume the CTL training
  losses = []  # ADDED
  while epoch.numpy() < num_epochs:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0

    while step_in_epoch.numpy() < num_steps_per_epoch:
      total_loss += train_step(iterator)
      num_batches += 1
      step_in_epoch.assign_add(1)

    train_loss = total_loss / num_batches
    print("Epoch: %d, accuracy: %f, train_loss: %f."  # noqa: UP031
          % (epoch.numpy(), train_accuracy.result(), train_loss))
    losses.append(float(train_loss))  # ADDED

    # CHANGED: Keras 3 metrics have `reset_state()` (`reset_states()` was
    # Keras 2's name).
    train_accuracy.reset_state()

    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
      tf.io.gfile.rmtree(write_checkpoint_dir)

    epoch.assign_add(1)
    step_in_epoch.assign(0)

  # ADDED: the report; every worker restores the chief's last checkpoint
  # into a new model, as a resumed run would.
  trained = _flat(multi_worker_model.get_weights())
  # Not a barrier here: under the Adaptive schedule the workers leave the
  # loop at different times (the strategy ends its rounds together at exit,
  # see epochs.Epochs.finish_at_exit); the chief's last checkpoint is the file.
  _wait_for_file(os.path.join(checkpoint_dir, f"ckpt-{num_epochs}.index"))
  fresh = build_cnn_model()
  fresh_epoch = tf.Variable(tf.constant(0, tf.int64), name="epoch")
  fresh_step = tf.Variable(tf.constant(0, tf.int64), name="step_in_epoch")
  latest = tf.train.latest_checkpoint(checkpoint_dir)
  tf.train.Checkpoint(model=fresh, epoch=fresh_epoch,
                      step_in_epoch=fresh_step).restore(latest).expect_partial()
  _report(f"report_{task_type}_{task_id}", dict(
      _resolver_facts(strategy),
      tutorial_is_chief=_is_chief(task_type, task_id, cluster_spec),
      write_checkpoint_dir=write_checkpoint_dir,
      latest_checkpoint=latest, restored_epoch=int(fresh_epoch.numpy()),
      loss=losses, stats=strategy.stats(),
      round_steps=[h.get("local_steps") for h in strategy.round_history]),
      trained=trained, restored=_flat(fresh.get_weights()))


# -- ADDED: TF's distributed input on a worker with several devices ----------

def several_devices():
  """Not a tutorial: what TF's own distributed iterator does on a worker
  with two devices (as on a GPU worker, unlike one CPU's fast path) now that
  `extended._in_multi_worker_mode()` is True: it counts the replicas that
  still have data with `strategy.reduce(SUM, <plain tensor>)`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

  import oscars_tf  # pylint: disable=g-import-not-at-top
  strategy = oscars_tf.OscarsStrategy(devices=["CPU:0", "CPU:1"])
  dataset = tf.data.Dataset.range(10).batch(4)  # the last batch is partial
  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  batches = []
  while True:
    optional = iterator.get_next_as_optional()
    if not optional.has_value():
      break
    batches.append([t.numpy().tolist() for t in
                    strategy.experimental_local_results(optional.get_value())])
  r = strategy.cluster_resolver
  _report(f"report_{r.task_type}_{r.task_id}",
          dict(_resolver_facts(strategy), batches=batches))


if __name__ == "__main__":
  {"keras": keras_tutorial, "ctl": ctl_tutorial,
   "several_devices": several_devices}[sys.argv[1]]()
