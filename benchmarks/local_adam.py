"""Local Adam against synchronous Adam on the same data, in one process.

    python benchmarks/local_adam.py --result_json local_adam.json  # ~13 min
    python benchmarks/local_adam.py --periods=1,4,8                # ~28 min
    python benchmarks/local_adam.py --quick                        # ~1 min

What is left of the language model's gap at equal samples when there is no
cluster: no network, no speeds, no schedule, the same data. For each seed,
one `transformer_lm` (real_workloads.py's model and text) trains twice
from the same initial weights:

  sync       one Adam on --workers x --batch_size windows a step
  local (P)  --workers replicas, each with its own Adam on --batch_size
             windows a step, their weights set to the mean after every P
             steps (with --optimizer_state=average, Adam's slots too;
             with group_variance, each replica's second moment rescaled
             to the group's batch there, as OscarsStrategy does by default)

Both read one stream of windows (data.stdlib_text's order for the seed): a
sync step takes its next --workers batches, replica i every --workers-th
batch from the i-th, as a worker's shard under OscarsStrategy; every step
of every run therefore sees the same windows. With --data=independent each
replica reads its own stream (seed x 10 + i) instead, and the pairing holds
for the initial weights only. Each run ends with validation bits per byte
on the first --eval_windows held-out windows (lower is better); the table
gives each local run's gap to its seed's sync run, and the median and range
over seeds. The replicas are equal and run one after another: no
heterogeneity, SIMULATED or EMULATED, and no time is compared.
"""

import functools
import json
import pathlib
import statistics
import sys
import time

from absl import app
from absl import flags

import lm_measures  # benchmarks/lm_measures.py

# examples/models.py, as train.py imports it (Bazel: //examples).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] /
                       "examples"))

flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds: each pairs a sync run "
                  "with one local run per period.")
flags.DEFINE_list("periods", ["1"], "Local steps between averagings.")
flags.DEFINE_integer("workers", 4, "Replicas of a local run.", lower_bound=1)
flags.DEFINE_integer("batch_size", 16, "Windows per replica and step.",
                     lower_bound=1)
flags.DEFINE_integer("steps", 180, "Steps per run (real_workloads.py: 3 x "
                     "60).", lower_bound=1)
flags.DEFINE_integer("d_model", 192, "The model's width.", lower_bound=4)
flags.DEFINE_integer("seq_len", 64, "Bytes per window.", lower_bound=2)
flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate.",
                   lower_bound=0.0)
flags.DEFINE_integer("eval_windows", 1024, "Validation windows scored.",
                     lower_bound=1)
flags.DEFINE_enum("data", "shard", ["shard", "independent"], "shard: every "
                  "run reads one stream (paired); independent: a stream per "
                  "replica.")
flags.DEFINE_enum("optimizer_state", "local",
                  ["local", "average", "group_variance"],
                  "average: Adam's slots are averaged with the weights; "
                  "group_variance: OscarsStrategy's default, each "
                  "replica's second moment rescaled to the group's batch "
                  "at every averaging (distribute/second_moments.py).")
flags.DEFINE_bool("quick", False, "A small run (1 seed, a narrow model, 12 "
                  "steps): under a minute, for a smoke test.")
flags.DEFINE_string("result_json", None, "Write the rows here.")
FLAGS = flags.FLAGS


def mean_of(arrays_per_replica):
  """The element-wise mean of each position across replicas' lists."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  return [np.mean(column, axis=0) for column in zip(*arrays_per_replica)]


class _Run:
  """The model, data and evaluation of one seed's runs."""

  def __init__(self, seed):
    # TensorFlow at the first run, not at import (--help stays quick).
    import keras  # pylint: disable=g-import-not-at-top

    import models  # pylint: disable=g-import-not-at-top
    from oscars_tf import data  # pylint: disable=g-import-not-at-top
    self.keras, self.data, self.seed = keras, data, seed
    self.train, validation = data.stdlib_text_files()
    self.validation = data.text_windows(validation, FLAGS.seq_len).take(
        FLAGS.eval_windows).batch(256)
    self._model = functools.partial(models.transformer_lm,
                                    seq_len=FLAGS.seq_len,
                                    d_model=FLAGS.d_model)
    keras.utils.set_random_seed(seed)
    self.initial = self._model().get_weights()
    self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def stream(self, seed, shard=None):
    ds = self.data.text_windows(self.train, FLAGS.seq_len, FLAGS.batch_size,
                                seed=seed, repeat=True)
    return iter(ds if shard is None else ds.shard(FLAGS.workers, shard))

  def replica(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    model = self._model()
    model.set_weights(self.initial)
    optimizer = self.keras.optimizers.Adam(FLAGS.learning_rate)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        loss = self.loss(y, model(x, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model, optimizer, step

  def bits_per_byte(self, model):
    nats = count = 0.0
    for x, y in self.validation:
      nats += float(self.loss(y, model(x, training=False))) * int(x.shape[0])
      count += int(x.shape[0])
    return self.data.bits(nats / count)

  def sync(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    model, _, step = self.replica()
    batches = self.stream(self.seed)
    for _ in range(FLAGS.steps):
      parts = [next(batches) for _ in range(FLAGS.workers)]
      step(tf.concat([x for x, _ in parts], 0),
           tf.concat([y for _, y in parts], 0))
    return self.bits_per_byte(model)

  def local(self, period):
    replicas = [self.replica() for _ in range(FLAGS.workers)]
    streams = [self.stream(self.seed, i) if FLAGS.data == "shard" else
               self.stream(self.seed * 10 + i) for i in range(FLAGS.workers)]
    from oscars_tf.distribute import second_moments  # pylint: disable=g-import-not-at-top
    moments = [second_moments.SecondMoments(o) for _, o, _ in replicas] if (
        FLAGS.optimizer_state == "group_variance") else []
    for t in range(1, FLAGS.steps + 1):
      for (_, _, step), batches in zip(replicas, streams):
        step(*next(batches))
      if t % period == 0 or t == FLAGS.steps:
        self._average(replicas, moments)
    return self.bits_per_byte(replicas[0][0])

  def _average(self, replicas, moments_of_replicas):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    mean = mean_of([m.get_weights() for m, _, _ in replicas])
    for m, _, _ in replicas:
      m.set_weights(mean)
    for moments in moments_of_replicas:  # the product's rule, a group's
      moments.rescale(tf.constant(float(FLAGS.workers)))
    if FLAGS.optimizer_state == "average":
      slots = [[v for v in o.variables if v is not o.iterations]
               for _, o, _ in replicas]
      for values, mean_value in zip(zip(*slots), mean_of(
          [[v.numpy() for v in replica_slots] for replica_slots in slots])):
        for v in values:
          v.assign(mean_value)


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.seeds, FLAGS.periods, FLAGS.steps = ["0"], ["1", "4"], 12
    FLAGS.d_model, FLAGS.eval_windows = 32, 64
  periods = sorted({int(p) for p in FLAGS.periods})
  if not periods or periods[0] < 1:
    sys.exit(f"local_adam.py: --periods must be positive, got "
             f"{FLAGS.periods}.")
  rows, start = [], time.monotonic()
  print(f"local Adam vs sync Adam: transformer_lm (d_model {FLAGS.d_model}) "
        f"on stdlib_text, {FLAGS.workers} x {FLAGS.batch_size} windows a "
        f"step, {FLAGS.steps} steps, Adam {FLAGS.learning_rate:g}, data "
        f"{FLAGS.data}, optimizer state {FLAGS.optimizer_state}; in one "
        "process, equal replicas (no heterogeneity)", flush=True)
  for seed in (int(s) for s in FLAGS.seeds):
    run = _Run(seed)
    for name, period in [("sync", None)] + [("local", p) for p in periods]:
      began = time.monotonic()
      bpb = run.sync() if period is None else run.local(period)
      rows.append({"seed": seed, "run": name, "period": period, "bpb": bpb,
                   "seconds": round(time.monotonic() - began, 1)})
      print(f"  seed {seed} {name:5} {period or '':>3}  {bpb:.4f} bpb",
            flush=True)
  gaps = lm_measures.paired_gaps(rows)
  print("\n| local period | gap to sync, per seed | median (range) |")
  print("| --- | --- | --- |")
  for period, values in sorted(gaps.items()):
    per_seed = " / ".join(f"{100 * g:+.1f} %" for g in values)
    print(f"| {period} | {per_seed} | {100 * statistics.median(values):+.1f} "
          f"% ({100 * min(values):+.1f} to {100 * max(values):+.1f}) |")
  print(f"({time.monotonic() - start:.0f} s)")
  if FLAGS.result_json:
    config = {k: FLAGS[k].value for k in (
        "seeds", "periods", "workers", "batch_size", "steps", "d_model",
        "seq_len", "learning_rate", "eval_windows", "data",
        "optimizer_state")}
    with open(FLAGS.result_json, "w", encoding="utf-8") as f:
      json.dump({"config": config, "rows": rows,
                 "gaps": {str(p): g for p, g in gaps.items()}}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
