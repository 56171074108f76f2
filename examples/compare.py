"""Trains the same model with and without OscarsStrategy; prints both.

    python examples/compare.py --num_workers 2 --epochs 5

Runs examples/train.py twice on the same data set, model, per-worker batch
size and optimizer: once as a single process with no strategy, once as
`--num_workers` processes under OscarsStrategy (started by oscars-launch).
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

flags.DEFINE_integer("num_workers", 2, "Workers of the OscarsStrategy run.",
                     lower_bound=1)
flags.DEFINE_integer("epochs", 5, "Training epochs.", lower_bound=1)
flags.DEFINE_enum("dataset", "digits", ["digits", "synthetic", "mnist",
                                        "fashion_mnist", "cifar10"],
                  "Data set.")
flags.DEFINE_enum("model", "mlp", ["mlp", "cnn"], "Model.")
flags.DEFINE_integer("timeout", 900, "Seconds each run may take.",
                     lower_bound=1)
FLAGS = flags.FLAGS

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


def _run(strategy, workers, outdir):
  result = os.path.join(outdir, f"{strategy}.json")
  command = [sys.executable, TRAIN, f"--strategy={strategy}",
             f"--epochs={FLAGS.epochs}", f"--dataset={FLAGS.dataset}",
             f"--model={FLAGS.model}", f"--result_json={result}"]
  if workers > 1:
    command = [sys.executable, "-m", "oscars_tf.cli.launch",
               f"--num_workers={workers}", f"--timeout={FLAGS.timeout}",
               "--"] + command
  proc = subprocess.run(command, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True,
                        timeout=FLAGS.timeout + 30, check=False)
  if proc.returncode:
    sys.exit(f"compare.py: the {strategy} run failed (exit "
             f"{proc.returncode}):\n{proc.stdout[-3000:]}")
  with open(result) as f:
    return json.load(f)


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as outdir:
    rows = [("no strategy, 1 process", _run("default", 1, outdir)),
            (f"OscarsStrategy, {FLAGS.num_workers} workers",
             _run("oscars", FLAGS.num_workers, outdir))]
  print(f"\n{FLAGS.model} on {FLAGS.dataset}, {FLAGS.epochs} epochs, "
        "per-worker batch 32")
  print(f"{'run':32} {'test acc':>9} {'test loss':>10} {'train s':>8} "
        f"{'steps/worker':>13}")
  for name, r in rows:
    steps = "/".join(str(int(w["steps"])) for w in r["per_worker"])
    print(f"{name:32} {r['test_accuracy']:9.4f} {r['test_loss']:10.4f} "
          f"{r['wall_time_s']:8.1f} {steps:>13}")


if __name__ == "__main__":
  app.run(main)
