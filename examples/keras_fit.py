"""Train a small Keras model with OscarsStrategy: the whole user surface.

    oscars-launch --num_workers 2 -- python examples/keras_fit.py --epochs 5

Run directly (no launcher, no TF_CONFIG) it trains on one worker. The data
set is scikit-learn's bundled handwritten digits, so no download is needed.
The batch size is per worker.
"""

import json
import time

from absl import app
from absl import flags
from absl import logging

flags.DEFINE_enum("dataset", "digits", ["digits", "synthetic"],
                  "Offline data set to train on.")
flags.DEFINE_integer("epochs", 5, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.1, "SGD learning rate.", lower_bound=0)
flags.DEFINE_enum("schedule", "adaptive", ["adaptive", "fixed"],
                  "adaptive: Oscars (local steps by measured speed); fixed: "
                  "average every --every steps.")
flags.DEFINE_integer("every", 8, "With --schedule=fixed: average the workers' "
                     "models every this many local steps (1 = synchronous "
                     "model averaging).", lower_bound=1)
flags.DEFINE_string("simulate_step_time", None, "SIMULATED heterogeneity, "
                    "e.g. '20ms*1,1,2,4' (default: $OSCARS_SIMULATE_STEP_TIME, "
                    "which oscars-launch --simulate_step_time sets).")
flags.DEFINE_enum("optimizer_state", "group_variance",
                  ["group_variance", "local", "average"],
                  "Optimizer slots per worker (group_variance: Adam's second "
                  "moment rescaled to the group's batch at each averaging), "
                  "or averaged too.")
flags.DEFINE_string("result_json", None, "Write final metrics here (chief).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import oscars_tf  # pylint: disable=g-import-not-at-top
  # The strategy comes first: it joins the cluster before TF runs any op.
  schedule = (oscars_tf.schedules.Adaptive() if FLAGS.schedule == "adaptive"
              else oscars_tf.schedules.Fixed(every=FLAGS.every))
  strategy = oscars_tf.OscarsStrategy(
      schedule=schedule, optimizer_state=FLAGS.optimizer_state,
      simulate_step_time=FLAGS.simulate_step_time)
  import keras  # pylint: disable=g-import-not-at-top

  from oscars_tf import data  # pylint: disable=g-import-not-at-top

  (x, y), (x_test, y_test) = getattr(data, FLAGS.dataset)()
  with strategy.scope():
    model = keras.Sequential([
        keras.Input(x.shape[1:]),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(int(y.max()) + 1)])
    model.compile(
        optimizer=keras.optimizers.SGD(FLAGS.learning_rate, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
  start = time.time()
  model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
            validation_data=(x_test, y_test))
  wall = time.time() - start
  loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
  stats = strategy.stats()
  print(f"worker {strategy.worker_index}/{strategy.num_workers}: test accuracy "
        f"{accuracy:.4f}, loss {loss:.4f}, {stats['local_step']} local steps, "
        f"{stats['syncs']} averagings, {wall:.1f} s")
  if FLAGS.result_json and strategy.is_chief:
    with open(FLAGS.result_json, "w") as f:
      json.dump({"test_accuracy": accuracy, "test_loss": loss,
                 "wall_time_s": wall, "workers": strategy.num_workers,
                 **stats}, f, indent=1)
    logging.info("wrote %s", FLAGS.result_json)


if __name__ == "__main__":
  app.run(main)
