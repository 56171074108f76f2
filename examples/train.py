"""Trains a Keras model under a flag-chosen strategy: the training binary.

    oscars-launch --num_workers 2 -- python examples/train.py \
        --dataset=digits --model=cnn --epochs=10

--dataset=stdlib_text (Python's standard library as bytes, in tf.data) goes
with --model=transformer_lm, in validation bits per byte (examples/text_lm.py).

Strategy flags (--strategy, --period, --period_rule, ...) come from
`oscars_tf.cli.flags`; run with --helpfull to list them. The batch size is per
worker. With --checkpoint_dir, the chief saves the averaged model, the
optimizer and the outer optimizer's state after every epoch (atomically) and a
later run resumes from the last one (every worker reads it: use a shared file
system across hosts); a worker whose collective fails because a peer died
saves its own model there first, and the restarted job resumes from whichever
is newer (oscars_tf.checkpoint).
--result_json gets the final metrics, the wall time, the accuracy after every
epoch and every worker's step counts.

MultiWorkerMirroredStrategy is trained with a custom loop
(examples/loops.py): Keras 3 `fit` does not work with it in TF 2.21.
--strategy=parameter_server, TensorFlow's asynchronous ParameterServerStrategy,
runs under `oscars-launch --num_ps N` with its own custom loop
(examples/ps_loop.py, which says what its result numbers estimate): the
worker and ps tasks serve, the chief schedules the steps.
"""

import gc
import json
import os
import sys
import time

STARTED_AT = time.time()  # before the imports: to measure a restart's cost

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

import models  # noqa: E402  (imports Keras only when building)
from oscars_tf import checkpoint  # noqa: E402
from oscars_tf import data  # noqa: E402
from oscars_tf.cli import flags as oscars_flags  # noqa: E402
from oscars_tf.tools import cpu_limits  # noqa: E402
import text_lm  # noqa: E402
import train_report  # noqa: E402

flags.DEFINE_enum("dataset", "digits", list(data.NAMES + data.TEXT),
                  f"Data set; offline: {', '.join(data.OFFLINE + data.TEXT)} "
                  "(stdlib_text: text, for --model=transformer_lm); the "
                  "others download through keras.datasets on first use.")
flags.DEFINE_enum("model", "mlp", list(models.MODELS), "Model to train "
                  "(transformer_lm: for --dataset=stdlib_text).")
flags.DEFINE_integer("epochs", 5, "Training epochs (a data set's worth of "
                     "steps over the cluster each).", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.", lower_bound=1)
flags.DEFINE_enum("optimizer", "momentum", ["sgd", "momentum", "adam"],
                  "momentum: SGD with Nesterov momentum 0.9.")
flags.DEFINE_float("learning_rate", 0.05, "Learning rate.", lower_bound=1e-9)
flags.DEFINE_enum("loop", "auto", ["auto", "fit", "custom"],
                  "Keras fit or a custom strategy.run loop (auto: fit, but "
                  "custom for multi_worker_mirrored).")
flags.DEFINE_integer("num_samples", 8192, "Examples of --dataset=synthetic.",
                     lower_bound=2)
flags.DEFINE_integer("steps_per_execution", 1, "Keras fit's steps per "
                     "train-function call (fit only).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of data shuffling and initial weights.")
flags.DEFINE_string("checkpoint_dir", None, "Save after every epoch (and, "
                    "on every worker, when a peer is lost inside a "
                    "collective); resume from the newest state here.")
flags.DEFINE_string("result_json", None, "Write final metrics here (chief).")
flags.DEFINE_boolean("deterministic", False, "Bit-reproducible training, so "
                     "that a run resumed from an epoch checkpoint ends with "
                     "the same weights as one never stopped: TF op "
                     "determinism, "
                     "and each epoch's data order a function of --seed and "
                     "the epoch alone (fit then runs one epoch per call). "
                     "Needs a schedule that does not depend on timing "
                     "(--strategy=local_sgd or sync, or TensorFlow's "
                     "mirrored ones) and, with local_sgd or sync and "
                     "momentum or adam, --optimizer_state=average (the "
                     "checkpoint holds the chief's optimizer state).")
flags.DEFINE_boolean("nan_on_sigusr1", False, "For fault tests (fit only): "
                     "SIGUSR1 turns this worker's weights NaN at its next "
                     "step, as a diverged worker's would be.")
flags.DEFINE_float("max_train_seconds", 0.0, "--strategy=parameter_server "
                   "only (its chief alone decides when training ends): stop "
                   "once training time passes this, mid-epoch (the steps "
                   "already queued finish, a few per worker); 0: train "
                   "every epoch. For benchmarks whose asynchronous "
                   "baseline would take long on slow links.", lower_bound=0)
FLAGS = flags.FLAGS



@flags.multi_flags_validator(
    ["strategy", "simulate_step_time", "loop"],
    message="--simulate_step_time with TensorFlow's own strategies needs "
    "the custom loop (--loop=custom); fit can only slow down OscarsStrategy")
def _simulation_supported(values):
  return (not values["simulate_step_time"] or values["strategy"] in
          ("oscars", "local_sgd", "sync", "parameter_server") or
          values["loop"] == "custom" or
          (values["strategy"] == "multi_worker_mirrored" and
           values["loop"] == "auto"))


@flags.multi_flags_validator(
    ["dataset", "model", "strategy"],
    message="--dataset=stdlib_text goes with --model=transformer_lm, and "
    "that model with it alone (not with --strategy=parameter_server)")
def _text_pairs(values):
  text = values["dataset"] in data.TEXT
  return text == (values["model"] in models.TEXT_MODELS) and not (
      text and values["strategy"] == "parameter_server")


@flags.multi_flags_validator(
    ["strategy", "loop"],
    message="--strategy=multi_worker_mirrored needs --loop=custom (or auto): "
    "Keras 3 fit does not work with it in TF 2.21")
def _mwms_needs_custom_loop(values):
  return not (values["strategy"] == "multi_worker_mirrored" and
              values["loop"] == "fit")


@flags.multi_flags_validator(
    ["strategy", "max_train_seconds"],
    message="--max_train_seconds needs --strategy=parameter_server (only its "
    "chief decides alone when training ends)")
def _time_cap_supported(values):
  return (not values["max_train_seconds"] or
          values["strategy"] == "parameter_server")


@flags.multi_flags_validator(
    ["strategy", "loop", "checkpoint_dir", "deterministic", "nan_on_sigusr1"],
    message="--strategy=parameter_server runs its own custom loop (not "
    "--loop=fit) and has no --checkpoint_dir, --deterministic or "
    "--nan_on_sigusr1")
def _ps_flags(values):
  return values["strategy"] != "parameter_server" or not (
      values["loop"] == "fit" or values["checkpoint_dir"] or
      values["deterministic"] or values["nan_on_sigusr1"])


@flags.multi_flags_validator(
    ["deterministic", "strategy", "optimizer", "optimizer_state"],
    message="--deterministic needs a schedule that does not depend on timing "
    "(--strategy=local_sgd or sync, or TensorFlow's mirrored ones, not "
    "oscars) and, with OscarsStrategy and --optimizer=momentum or adam, "
    "--optimizer_state=average")
def _deterministic_supported(values):
  if not values["deterministic"]:
    return True
  if values["strategy"] == "oscars":
    return False
  return (values["strategy"] not in ("local_sgd", "sync") or
          values["optimizer"] == "sgd" or
          values["optimizer_state"] == "average")


flags.register_validator(
    "checkpoint_dir", lambda d: not d or "://" not in d and (
        not os.path.exists(d) or os.path.isdir(d)),
    message="--checkpoint_dir must be a local or mounted directory (or not "
    "exist yet), not a file or a URL (mount a bucket: checkpoints are made "
    "atomic by renames)")


@flags.multi_flags_validator(
    ["deterministic", "warmup_steps"],
    message="--deterministic: a resumed run would warm up again "
    "(--warmup_steps counts each start's rounds) and not end as an unstopped "
    "one; leave --warmup_steps at 0")
def _deterministic_without_warmup(values):
  return not (values["deterministic"] and values["warmup_steps"])


def _prepare_outputs():
  """Makes --result_json's directory and --checkpoint_dir now, not after
  training or its first epoch (where a missing or unwritable one would
  lose the result or fail the chief)."""
  if FLAGS.checkpoint_dir:
    try:
      checkpoint.check_directory(FLAGS.checkpoint_dir)
    except ValueError as e:
      sys.exit(f"train.py: --checkpoint_dir: {e}")
  if FLAGS.result_json:
    try:
      os.makedirs(os.path.dirname(os.path.abspath(FLAGS.result_json)),
                  exist_ok=True)
    except OSError as e:
      sys.exit(f"train.py: --result_json={FLAGS.result_json}: {e}")


def _uses_custom_loop():
  return FLAGS.loop == "custom" or FLAGS.strategy == "parameter_server" or (
      FLAGS.loop == "auto" and FLAGS.strategy == "multi_worker_mirrored")


def _optimizer(keras):
  if FLAGS.optimizer == "adam":
    return keras.optimizers.Adam(FLAGS.learning_rate)
  momentum = 0.9 if FLAGS.optimizer == "momentum" else 0.0
  return keras.optimizers.SGD(FLAGS.learning_rate, momentum=momentum,
                              nesterov=momentum > 0)


def main(argv):
  del argv
  _prepare_outputs()
  ps = FLAGS.strategy == "parameter_server"
  if ps:
    import ps_loop  # pylint: disable=g-import-not-at-top
    ps_loop.serve_unless_chief()  # worker and ps tasks: never returns
  # The strategy comes first: it joins the cluster before TF runs any op.
  try:
    strategy = oscars_flags.make_strategy()
  except (ValueError, TypeError) as e:
    sys.exit(f"train.py: {e}")
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import loops  # pylint: disable=g-import-not-at-top

  worker, num_workers = ((0, ps_loop.num_workers(strategy)) if ps else
                         loops.worker_of(strategy))
  try:
    kwargs = {"num_samples": FLAGS.num_samples} if (
        FLAGS.dataset == "synthetic") else {}
    # A text data set (text_lm.Text): x, y are one batch, to time a step.
    text, (x, y), (x_test, y_test) = text_lm.load(
        FLAGS.dataset, FLAGS.batch_size, FLAGS.seed, num_workers, **kwargs)
  except (data.DatasetUnavailableError, ImportError) as e:
    sys.exit(f"train.py: --dataset={FLAGS.dataset}: {e}")
  evaluate = text.evaluate if text else (
      lambda m: loops.evaluate(m, x_test, y_test))
  is_chief = worker == 0
  who = "chief" if ps else f"worker {worker}/{num_workers}"
  keras.utils.set_random_seed(FLAGS.seed)
  if FLAGS.deterministic:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.experimental.enable_op_determinism()
  with strategy.scope():
    try:
      model = models.build(FLAGS.model, x.shape[1:], text_lm.NUM_CLASSES
                           if text else int(y.max()) + 1,
                           **(text_lm.model_sizes() if text else {}))
    except ValueError as e:
      sys.exit(f"train.py: {e}")
    model.compile(optimizer=_optimizer(keras),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), metrics=["accuracy"] + (
                          [models.bits_per_byte] if text else []),
                  steps_per_execution=FLAGS.steps_per_execution)
  resumed_from = checkpoint.newest(FLAGS.checkpoint_dir)
  try:
    initial_epoch = checkpoint.restore(model, FLAGS.checkpoint_dir, strategy)
  except ValueError as e:
    sys.exit(f"train.py: --checkpoint_dir={FLAGS.checkpoint_dir}: {e}")
  if resumed_from:
    logging.info("resumed from %s (%s) at epoch %d, optimizer step %d",
                 FLAGS.checkpoint_dir, resumed_from["weights"],
                 initial_epoch, int(model.optimizer.iterations.numpy()))

  # Training time starts after the first step: tracing and the initial
  # broadcast are start-up, the same for every strategy, not training.
  curve, clock = [], {"start": None, "eval_s": 0.0, "steps0": 0}

  def start_clock():
    if clock["start"] is None:
      # oscars-launch --cpu_limit_from=ready: start-up, tracing the step
      # included, is done on this worker; the quota holds from here on, over
      # everything timed (the clock starts now, for every strategy).
      try:
        limit = cpu_limits.apply_pending()
      except cpu_limits.CpuLimitError as e:
        sys.exit(f"train.py: {e}")
      clock["start"] = time.monotonic()
      clock["first_step_at"] = time.time()  # to measure a restart's cost
      clock["steps0"] = int(model.optimizer.iterations.numpy())
      if limit is not None:
        clock["cpu_limit"] = limit
        clock["limited_from_step"] = clock["steps0"]

  def train_time():
    if clock["start"] is None:
      return 0.0
    return time.monotonic() - clock["start"] - clock["eval_s"]

  def after_epoch(epoch, loss):
    """The chief evaluates the averaged model and saves; every worker logs
    one line. Only the chief's curve is reported: another worker's
    evaluation would hold the cluster up at the next collective (the
    slowest's most, under its CPU quota), training time it is not."""
    accuracy = None
    if is_chief:
      t0 = time.monotonic()
      test_loss, accuracy = evaluate(model)
      clock["eval_s"] += time.monotonic() - t0
    clock["end"] = train_time()  # what follows the last epoch is not training
    if is_chief:
      curve.append({"epoch": epoch + 1, "train_time_s": clock["end"],
                    "loss": float(loss), "test_accuracy": accuracy,
                    "test_loss": test_loss,
                    **(text.curve(test_loss) if text else {})})
      if FLAGS.checkpoint_dir:
        checkpoint.save(model, FLAGS.checkpoint_dir, epoch + 1, strategy)
    if not is_chief or _uses_custom_loop():
      tested = "" if accuracy is None else f"test accuracy {accuracy:.4f}, "
      print(f"{who} epoch {epoch + 1}/{FLAGS.epochs}: loss {loss:.4f}, "
            f"{tested}{train_time():.1f} s", flush=True)

  simulate = None
  if FLAGS.simulate_step_time and not hasattr(strategy, "worker_index") and (
      not ps):
    from oscars_tf import simulate as simulate_lib  # pylint: disable=g-import-not-at-top
    profile = simulate_lib.StepTimeProfile.parse(FLAGS.simulate_step_time)
    start = time.monotonic()
    def simulate(w, step):
      return profile.seconds(w, step, time.monotonic() - start)
    logging.warning("SIMULATED heterogeneity: %s", FLAGS.simulate_step_time)

  replicas = 1 if ps else loops.local_replicas(strategy)
  local_step_seconds = loops.local_step_timer(
      ps_loop.local_copy(model) if ps else model, x, y,
      max(FLAGS.batch_size // replicas, 1))
  loop_stats, simulated_spec = {}, FLAGS.simulate_step_time or None
  if initial_epoch >= FLAGS.epochs:
    logging.info("checkpoint is at epoch %d >= --epochs; nothing to train",
                 initial_epoch)
    # This attempt trained no step: its numbers say so (not the steps of
    # the attempts before it, over a wall time of 0).
    clock["steps0"] = int(model.optimizer.iterations.numpy())
  elif ps:
    from oscars_tf import simulate as simulate_lib  # pylint: disable=g-import-not-at-top
    # The launcher's --simulate_step_time comes as the environment's.
    simulated_spec = FLAGS.simulate_step_time or os.environ.get(
        "OSCARS_SIMULATE_STEP_TIME") or None
    if simulated_spec:
      logging.warning("SIMULATED heterogeneity on the worker tasks: %s",
                      simulated_spec)
    loop_stats = ps_loop.train(
        strategy, model, model.optimizer, x, y, FLAGS.batch_size,
        FLAGS.epochs, seed=FLAGS.seed,
        profile=simulate_lib.StepTimeProfile.parse(simulated_spec or ""),
        on_epoch_end=after_epoch, on_first_step=start_clock,
        should_stop=lambda: (FLAGS.max_train_seconds > 0 and
                             train_time() >= FLAGS.max_train_seconds))
  elif _uses_custom_loop():
    _, loop_stats = loops.train(
        strategy, model, model.optimizer, x, y, FLAGS.batch_size,
        FLAGS.epochs, initial_epoch=initial_epoch, simulate=simulate,
        on_epoch_end=after_epoch, seed=FLAGS.seed, on_first_step=start_clock,
        **(text.loop_kwargs() if text else {}))
  else:
    callbacks = [keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: start_clock(),
        on_epoch_end=lambda e, logs: after_epoch(e, logs["loss"]))]
    if FLAGS.logdir:
      callbacks.append(keras.callbacks.TensorBoard(FLAGS.logdir))
    if FLAGS.nan_on_sigusr1:
      callbacks.append(loops.nan_on_signal(model))
    if FLAGS.deterministic:  # epoch e's order: a function of (seed, e)
      for epoch in range(initial_epoch, FLAGS.epochs):
        order = np.random.default_rng((FLAGS.seed, epoch)).permutation(
            len(x))
        inputs = text.fit_kwargs(epoch) if text else dict(
            x=x[order], y=y[order], batch_size=FLAGS.batch_size,
            shuffle=False)
        model.fit(**inputs, epochs=epoch + 1, initial_epoch=epoch,
                  callbacks=callbacks, verbose=1 if is_chief else 0)
    else:
      inputs = text.fit_kwargs() if text else dict(
          x=x, y=y, batch_size=FLAGS.batch_size)
      model.fit(**inputs, epochs=FLAGS.epochs,
                initial_epoch=initial_epoch, callbacks=callbacks,
                verbose=1 if is_chief else 0)
  returned_at = time.time()  # how far apart workers end: a job's tail
  wall = clock.get("end", train_time())
  # Timed after training, under the CPU quota that training ran under.
  real_step_s = local_step_seconds()
  test_loss, accuracy = evaluate(model)
  if ps:  # the optimizer's iterations race: the steps scheduled instead
    steps = loop_stats["total_steps"]
    rows = ps_loop.per_worker_rows(loop_stats, model, wall, real_step_s)
    row, per_worker = rows[0], [v for r in rows for v in r.values()]
  else:
    steps = int(model.optimizer.iterations.numpy())
    simulated = (strategy.stats()["simulated_s"] if hasattr(strategy, "stats")
                 else loop_stats.get("simulated_s", 0.0))
    row = train_report.worker_numbers(
        strategy, model, steps - clock["steps0"], wall, simulated,
        real_step_s)
    # --cpu_limit_from=ready: the quota applied here (0: none pending), from
    # this optimizer step on (-1: none).
    row = dict(row, cpu_limit=clock.get("cpu_limit", 0.0),
               limited_from_step=clock.get("limited_from_step", -1),
               training_returned_at=returned_at)
    per_worker = loops.gather_per_worker(strategy, list(row.values()))
  print(f"{who}: test accuracy {accuracy:.4f}, loss "
        f"{test_loss:.4f}, {steps} optimizer steps, {wall:.1f} s", flush=True)
  if FLAGS.result_json and is_chief:
    result = train_report.result(
        FLAGS, strategy, model, num_workers, initial_epoch, resumed_from,
        started_at=STARTED_AT, clock=clock, accuracy=accuracy,
        test_loss=test_loss, wall=wall, steps=steps, curve=curve,
        simulated_spec=simulated_spec, row=row, per_worker=per_worker,
        extra=text.result(test_loss) if text else {})
    with open(FLAGS.result_json, "w") as f:
      json.dump(result, f, indent=1)
    logging.info("wrote %s", FLAGS.result_json)
  # Python's last collection at exit walks TensorFlow's whole object graph:
  # seconds of CPU, a minute under a small --cpu_limit, and nothing to free
  # that the exit does not free anyway.
  gc.freeze()


if __name__ == "__main__":
  app.run(main)
