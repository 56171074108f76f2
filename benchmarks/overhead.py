"""Per-step overhead of OscarsStrategy between averaging points, and the time
of one averaging of the model — measured against plain Keras `fit` with no
strategy, side by side in one run.

    python benchmarks/overhead.py --result_json overhead.json

Pairs compared under the same CPU load:
  1 process:   plain Keras fit           vs  OscarsStrategy, one worker
  2 processes: two plain fits at once    vs  OscarsStrategy, two workers
In the OscarsStrategy runs the period is longer than the run, so every
measured step is a step between averaging points (the first epoch, which
holds tracing and the start-of-training broadcast, is not measured).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

flags.DEFINE_enum("role", "driver", ["driver", "worker"], "Internal.")
flags.DEFINE_enum("mode", "plain", ["plain", "oscars", "every8", "every8_log"],
                  "Internal.")
flags.DEFINE_string("out", None, "Internal: where a worker writes its JSON.")
flags.DEFINE_integer("epochs", 4, "Epochs per run (the first is warm-up).")
flags.DEFINE_integer("samples", 8192, "Synthetic samples per worker.")
flags.DEFINE_integer("hidden", 512, "Hidden width of the 3-layer MLP.")
flags.DEFINE_integer("batch_size", 64, "Per-worker batch size.")
flags.DEFINE_integer("averagings", 20, "Timed averagings of the model.")
flags.DEFINE_list("processes", ["1", "2"], "Process counts to compare.")
flags.DEFINE_bool("summaries", True, "Also measure the summaries' cost.")
flags.DEFINE_string("result_json", None, "Write the results here.")
FLAGS = flags.FLAGS


def worker():
  strategy = None
  if FLAGS.mode != "plain":
    import oscars_tf  # pylint: disable=g-import-not-at-top
    every = 10**9 if FLAGS.mode == "oscars" else 8
    strategy = oscars_tf.OscarsStrategy(
        schedule=oscars_tf.schedules.Fixed(every=every),
        # Beside the worker's result: removed with the run's directory.
        logdir=f"{FLAGS.out}.logs" if FLAGS.mode == "every8_log" else None)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from oscars_tf import data  # pylint: disable=g-import-not-at-top
  workers = strategy.num_workers if strategy else 1
  (x, y), _ = data.synthetic(num_samples=FLAGS.samples * workers,
                             num_features=256, test_fraction=0.01)
  keras.utils.set_random_seed(0)

  def build():
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(FLAGS.hidden, activation="relu"),
        keras.layers.Dense(FLAGS.hidden, activation="relu"),
        keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model

  if strategy:
    with strategy.scope():
      model = build()
  else:
    model = build()
  times = []

  class Timer(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      times.append((self.epoch, batch, time.perf_counter() - self.t))

    def on_epoch_begin(self, epoch, logs=None):
      self.epoch = epoch

  model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
            callbacks=[Timer()], verbose=0)
  # Not measured: epoch 0 (tracing, broadcast) and each epoch's first step
  # (iterator start-up, the same with or without a strategy).
  steps = [t for e, b, t in times if e > 0 and b > 0]
  if FLAGS.mode.startswith("every8"):  # the cost lands at averaging points:
    steps = [sum(steps) / len(steps)]  # compare the mean over all steps
  result = {"median_step_s": statistics.median(steps),
            "mean_step_s": statistics.fmean(steps), "steps": len(steps),
            "params": int(sum(np.prod(w.shape) for w in model.weights))}
  if strategy and strategy.num_workers > 1:
    ext = strategy.extended
    ext.average_now()  # trace once
    costs = []
    sent = strategy.stats()["bytes_sent"]
    for _ in range(FLAGS.averagings):
      start = time.perf_counter()
      ext.average_now()
      costs.append(time.perf_counter() - start)
    result["averaging_median_s"] = statistics.median(costs)
    # As the strategy counts them (in the dtype the weights are sent in).
    result["averaging_bytes"] = (strategy.stats()["bytes_sent"] -
                                 sent) // FLAGS.averagings
  with open(FLAGS.out, "w") as f:
    json.dump(result, f)


def _run(mode, processes, cluster):
  """Runs `processes` workers at once; returns their results."""
  from oscars_tf.cli import launch  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix="oscars_overhead_") as tmp:
    configs = launch.tf_configs(processes) if cluster else [None] * processes
    procs = []
    for i, config in enumerate(configs):
      # Each process gets an equal share of the cores, so the pairs compared
      # run under the same load and no process oversubscribes the machine.
      threads = str(max(1, (os.cpu_count() or 1) // processes))
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                 TF_NUM_INTRAOP_THREADS=threads, TF_NUM_INTEROP_THREADS=threads)
      env.pop("TF_CONFIG", None)
      if config:
        env["TF_CONFIG"] = config
      cmd = [sys.executable, __file__, "--role=worker", f"--mode={mode}",
             f"--out={tmp}/{i}.json", f"--epochs={FLAGS.epochs}",
             f"--samples={FLAGS.samples}", f"--hidden={FLAGS.hidden}",
             f"--batch_size={FLAGS.batch_size}",
             f"--averagings={FLAGS.averagings}"]
      procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
      if p.wait(timeout=900) != 0:
        raise RuntimeError(f"benchmark worker failed: {mode} x{processes}")
    return [json.load(open(f"{tmp}/{i}.json")) for i in range(processes)]


def _summaries_cost():
  # Summaries are written at averaging points only; their cost per step is
  # the mean step time (averaging steps included) with and without them.
  no_log = _run("every8", 2, cluster=True)
  with_log = _run("every8_log", 2, cluster=True)
  base = statistics.fmean(r["median_step_s"] for r in no_log)
  logged = statistics.fmean(r["median_step_s"] for r in with_log)
  return {"mean_step_ms_without": base * 1e3,
          "mean_step_ms_with": logged * 1e3,
          "summaries_cost_ratio": logged / base}


def driver():
  rows = []
  for processes in map(int, FLAGS.processes):
    plain = _run("plain", processes, cluster=False)
    ours = _run("oscars", processes, cluster=processes > 1)
    base = statistics.fmean(r["median_step_s"] for r in plain)
    step = statistics.fmean(r["median_step_s"] for r in ours)
    row = {"processes": processes, "plain_step_ms": base * 1e3,
           "oscars_step_ms": step * 1e3, "overhead_ratio": step / base,
           "params": ours[0]["params"]}
    if "averaging_median_s" in ours[0]:
      row["averaging_ms"] = statistics.fmean(
          r["averaging_median_s"] for r in ours) * 1e3
      row["averaging_bytes"] = ours[0]["averaging_bytes"]
    rows.append(row)
  summaries = _summaries_cost() if FLAGS.summaries else {}
  print(f"{'workers':>7} {'plain ms/step':>14} {'oscars ms/step':>15} "
        f"{'ratio':>7} {'averaging ms':>13} {'model bytes':>12}")
  for r in rows:
    print(f"{r['processes']:>7} {r['plain_step_ms']:>14.3f} "
          f"{r['oscars_step_ms']:>15.3f} {r['overhead_ratio']:>7.3f} "
          f"{r.get('averaging_ms', float('nan')):>13.2f} "
          f"{r.get('averaging_bytes', 0):>12}")
  if summaries:
    print(f"summaries (2 workers, Fixed(8), mean over all steps): "
          f"{summaries['mean_step_ms_without']:.3f} ms/step without, "
          f"{summaries['mean_step_ms_with']:.3f} with, ratio "
          f"{summaries['summaries_cost_ratio']:.3f}")
  if FLAGS.result_json:
    with open(FLAGS.result_json, "w") as f:
      json.dump({"rows": rows, "summaries": summaries,
                 "epochs": FLAGS.epochs, "batch_size": FLAGS.batch_size}, f,
                indent=1)


def main(argv):
  del argv
  worker() if FLAGS.role == "worker" else driver()


if __name__ == "__main__":
  app.run(main)
