"""What a new model costs under OscarsStrategy: each worker compiles and fits
several models of one size in turn (one epoch each), as a tuning loop, a
notebook or a test suite does, and the table gives the seconds of a fit
after the first (which also starts the strategy) against plain Keras in the
same run.

    python benchmarks/model_startup.py --result_json startup.json

A fit's time holds its tracing: the training step with its round end, the
averaging, and for `compression=` the compressed sum (a hundred-odd ops).
Each round end is traced once a model and the compressed sum once a vector
length (see oscars_tf/distribute/round_ends.py). No heterogeneity: equal
workers, real processes over gRPC on loopback.
"""

import json
import os
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags

import accuracy_runs
import job_log
from oscars_tf.cli import launch

# Name -> OscarsStrategy arguments; "plain" is Keras with no strategy.
OPTIONS = {
    "plain": None,
    "float32": {},
    "int8": {"compression": "int8"},
    "int4": {"compression": "int4"},
    "overlap": {"overlap": "always"},
    "int4_overlap": {"compression": "int4", "overlap": "always"},
}

flags.DEFINE_enum("role", "driver", ["driver", "worker"], "Internal.")
flags.DEFINE_string("option", "plain", "Internal: the worker's option.")
flags.DEFINE_string("out", None,
                    "Internal: the directory a worker writes INDEX.json to.")
flags.DEFINE_list("options", list(OPTIONS), "Options to compare.")
flags.DEFINE_integer("workers", 2, "Worker processes per option.")
flags.DEFINE_integer("models", 5, "Models each worker fits in turn.")
flags.DEFINE_integer("steps", 24, "Training steps a fit (one epoch).")
flags.DEFINE_integer("every", 3, "Steps a round (Fixed schedule).")
flags.DEFINE_integer("hidden", 256, "Hidden width of the 3-layer MLP.")
flags.DEFINE_string("result_json", None, "Write the results here.")
FLAGS = flags.FLAGS

_BATCH = 32
_FEATURES = 64


def worker():
  option = OPTIONS[FLAGS.option]
  strategy = None
  if option is not None:
    import oscars_tf  # pylint: disable=g-import-not-at-top
    strategy = oscars_tf.OscarsStrategy(
        schedule=oscars_tf.schedules.Fixed(every=FLAGS.every), **option)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  x = rng.normal(size=(FLAGS.steps * _BATCH, _FEATURES)).astype(np.float32)
  y = rng.integers(0, 10, size=len(x))

  def build():
    model = keras.Sequential([
        keras.Input((_FEATURES,)),
        keras.layers.Dense(FLAGS.hidden, activation="relu"),
        keras.layers.Dense(FLAGS.hidden, activation="relu"),
        keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model

  fits = []
  for k in range(FLAGS.models):
    keras.utils.set_random_seed(k)
    start = time.perf_counter()
    if strategy:
      with strategy.scope():
        model = build()
    else:
      model = build()
    model.fit(x, y, batch_size=_BATCH, epochs=1, shuffle=False, verbose=0)
    fits.append(time.perf_counter() - start)
  index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  with open(os.path.join(FLAGS.out, f"{index}.json"), "w") as f:
    json.dump({"fits_s": fits}, f)


def _run(option):
  """Runs the option's workers at once (the launcher's Job gives each its
  TF_CONFIG, which plain Keras ignores); returns their results."""
  with tempfile.TemporaryDirectory(prefix="oscars_model_startup_") as tmp:
    command = [sys.executable, __file__, "--role=worker", f"--option={option}",
               f"--models={FLAGS.models}", f"--steps={FLAGS.steps}",
               f"--every={FLAGS.every}", f"--hidden={FLAGS.hidden}"]
    log = job_log.JobLog()
    job = launch.Job(command + [f"--out={tmp}"], FLAGS.workers,
                     env=accuracy_runs.job_env(), out=log)
    try:
      codes, failed = job.wait(timeout=900, grace=5)
    finally:
      job.stop(grace=1)
    if failed is not None or any(codes):
      raise RuntimeError(f"benchmark workers failed: {option} ({failed}, "
                         f"codes {codes}):\n{log.text()[-3000:]}")
    return [json.load(open(f"{tmp}/{i}.json")) for i in range(FLAGS.workers)]


def driver():
  unknown = sorted(set(FLAGS.options) - set(OPTIONS))
  if unknown:
    raise app.UsageError(f"--options: unknown {unknown}; known: "
                         f"{', '.join(OPTIONS)}")
  if FLAGS.models < 2:
    raise app.UsageError("--models must be at least 2 (the first fit also "
                         "starts the strategy).")
  rows = []
  for option in FLAGS.options:
    results = _run(option)
    # The slowest worker's fit, model by model (a fit ends at the others').
    fits = [max(r["fits_s"][k] for r in results)
            for k in range(FLAGS.models)]
    rows.append({"option": option, "first_fit_s": fits[0],
                 "later_fit_median_s": statistics.median(fits[1:]),
                 "later_fit_range_s": [min(fits[1:]), max(fits[1:])],
                 "fits_s": fits})
  plain = next((r for r in rows if r["option"] == "plain"), None)
  print(f"{FLAGS.workers} workers, equal speeds (no heterogeneity); "
        f"{FLAGS.steps} steps a fit, Fixed({FLAGS.every}); seconds a fit")
  print(f"{'option':>13} {'first fit':>10} {'later fits (median)':>20} "
        f"{'range':>14} {'vs plain':>9}")
  for r in rows:
    low, high = r["later_fit_range_s"]
    ratio = (r["later_fit_median_s"] / plain["later_fit_median_s"]
             if plain else float("nan"))
    r["vs_plain"] = ratio
    print(f"{r['option']:>13} {r['first_fit_s']:>10.2f} "
          f"{r['later_fit_median_s']:>20.2f} {low:>6.2f} to {high:<4.2f} "
          f"{ratio:>9.2f}")
  if FLAGS.result_json:
    with open(FLAGS.result_json, "w") as f:
      json.dump({"rows": rows, "workers": FLAGS.workers,
                 "steps": FLAGS.steps, "every": FLAGS.every,
                 "models": FLAGS.models, "hidden": FLAGS.hidden}, f, indent=1)


def main(argv):
  del argv
  worker() if FLAGS.role == "worker" else driver()


if __name__ == "__main__":
  app.run(main)
