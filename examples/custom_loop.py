"""A custom training loop with `strategy.run` under OscarsStrategy.

    oscars-launch --num_workers 2 -- python examples/custom_loop.py

The loop itself is examples/loops.py: a tf.function around `strategy.run`,
datasets from `distribute_datasets_from_function` (each worker its own
stream), and epochs from `strategy.begin_epoch` / `strategy.epoch_over`, so
that under the Adaptive schedule fast workers take more steps per epoch.
Averaging happens inside the step at the planned points; `strategy.sync()`
ends each epoch with one more averaging.
"""

from absl import app
from absl import flags

flags.DEFINE_integer("epochs", 5, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate.",
                   lower_bound=1e-9)
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import oscars_tf  # pylint: disable=g-import-not-at-top
  strategy = oscars_tf.OscarsStrategy()  # first: joins the cluster
  import keras  # pylint: disable=g-import-not-at-top

  import loops  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from oscars_tf import data  # pylint: disable=g-import-not-at-top

  (x, y), (x_test, y_test) = data.load("digits")
  with strategy.scope():
    model = models.build("mlp", x.shape[1:], 10)
    optimizer = keras.optimizers.SGD(FLAGS.learning_rate, momentum=0.9)
  strategy.track(model, optimizer)  # what is averaged (loops.train does too)

  def report(epoch, loss):
    _, accuracy = loops.evaluate(model, x_test, y_test)
    print(f"worker {strategy.worker_index}: epoch {epoch + 1} loss "
          f"{loss:.4f} test accuracy {accuracy:.4f} "
          f"({strategy.stats()['local_step']} local steps)", flush=True)

  loops.train(strategy, model, optimizer, x, y, FLAGS.batch_size,
              FLAGS.epochs, on_epoch_end=report)


if __name__ == "__main__":
  app.run(main)
