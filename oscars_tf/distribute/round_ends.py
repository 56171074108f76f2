"""The round end a training step appends: "if the plan says so, average the
model with the others" (the extended recognises the step, see extended.py).

Per set of averaged variables it keeps the round end as a function of its
own, which the training step calls (in a `tf.py_function` inside a
tf.while_loop, outside the loop's frame) and so does `average_now`: one
trace serves both. For FedNova's normalized weighting it keeps the round's
start values.
"""

import numpy as np
import tensorflow as tf

from oscars_tf.distribute import averaged_variables
from oscars_tf.distribute import outer as outer_lib
from oscars_tf.distribute import replicas
from oscars_tf.distribute import rounds as rounds_lib
from oscars_tf.distribute import second_moments
from oscars_tf.runtime import py_function_errors


class RoundEnds:
  """The round-end ops of a worker's averaged variable sets.

  Args:
    rounds: the worker's `rounds.Rounds` (step counters, averaging ops).
    averaged: its `averaged_variables.AveragedVariables`.
    outer: its `outer.OuterStates`.
    compression: its `compression.CompressionStates`, or None.
    schedule: the strategy's schedule.
    local_sgd: whether the local replicas step on their own gradients.
    averages_across: whether rounds average anything at all (other workers,
      or local SGD replicas).
  """

  def __init__(self, rounds, averaged, outer, schedule, local_sgd,
               averages_across, compression=None):
    self._rounds = rounds
    self._averaged = averaged
    self._outer = outer
    self._compression = compression
    self._normalized = schedule.weighting == "normalized"
    self._local_sgd = local_sgd
    self._averages_across = averages_across
    self._starts = {}      # FedNova: round-start copies per variable set
    self._moments = {}     # second_moments per tracked optimizer
    self._functions = {}   # the round end of each set, as a tf.function

  def keep_start(self, variables, started):
    """FedNova (normalized weighting): keeps copies of `started`, the
    values `variables` start the first round with (eager, on the device
    in scope)."""
    if self._normalized:
      self._starts[averaged_variables.key_of(variables)] = [
          tf.Variable(v, trainable=False) for v in started]

  def after_step(self, variables, loss):
    """Counts the step; ends the round if the plan says so (traced)."""
    step = self._rounds.step_ops()
    if not self._averages_across:
      return
    if rounds_lib.inside_while_loop():
      # TensorFlow matches a collective's members by instance key *and* by
      # the while-loop iteration it runs in; inside a loop (Keras'
      # steps_per_execution > 1, a custom loop over tf.range) a fast and a
      # slow worker reach the same round end in different iterations and
      # would never meet. The round end then runs as its own function,
      # outside the loop's frame.
      end = py_function_errors.carried(self.function(variables))
      tf.cond(step >= self._rounds.next_sync,
              lambda: tf.py_function(end, [step, loss], tf.bool),
              lambda: tf.constant(False))
      return
    # The round end is a function of its own, called from here and from
    # `average_now` (an epoch's last rounds): its graph, the largest part
    # of a training step's, is traced once for both.
    tf.cond(step >= self._rounds.next_sync,
            # `step` is the step count's update (an unread variable): as a
            # tensor, the argument `average_now` passes too.
            lambda: self.function(variables)(tf.convert_to_tensor(step),
                                             loss),
            lambda: tf.constant(False))

  def function(self, variables):
    """A function (step, loss) ending the round of `variables` (cached);
    it returns True once the round has ended."""
    # A recompiled model's new optimizer needs a round end of its own: the
    # traced one rescales the old optimizer's second moments (each
    # optimizer stays referenced in `_moments`, so its id is not reused).
    key = (averaged_variables.key_of(variables),
           id(self._averaged.optimizer))
    if key not in self._functions:
      def end_round(step, loss):
        with tf.control_dependencies([self.ops(variables, step, loss)]):
          return tf.constant(True)
      self._functions[key] = tf.function(end_round, autograph=False)
    return self._functions[key]

  def _second_moments(self):
    """The tracked optimizer's `SecondMoments` under
    optimizer_state="group_variance", else None (created at the first
    trace, when Keras has built the optimizer's slots)."""
    if (self._averaged.optimizer_state != "group_variance" or
        self._averaged.optimizer is None):
      return None
    optimizer = self._averaged.optimizer
    if id(optimizer) not in self._moments:  # kept: the id is never reused
      self._moments[id(optimizer)] = second_moments.SecondMoments(
          optimizer, self._local_sgd)
    moments = self._moments[id(optimizer)]
    return moments if moments.active else None

  def ops(self, variables, step, loss):
    """The round end of `variables`: average, outer step, round starts."""
    key = averaged_variables.key_of(variables)
    starts = self._starts.get(key)
    outer = self._outer.get(key)
    compressed_state = self._compression.get(key) if self._compression else None
    moments = self._second_moments()

    def write(values, is_global, progress=None):
      # G(avg): at global syncs the averaged update takes an outer step.
      if outer:
        values = tf.cond(is_global, lambda: outer.step(values),
                         lambda: [tf.identity(v) for v in values])
      model = values
      if progress:  # overlap: the local steps taken while it was in flight
        values = with_progress(values, progress, outer_lib.takes_outer_step(
            variables, self._averaged.model))
      written = replicas.write_values(variables, values, starts)
      if compressed_state:  # a global sync's model: the changes' new reference
        with tf.control_dependencies([written]):
          written = tf.cond(is_global, lambda: tf.group(
              compressed_state.take_reference(model)), tf.no_op)
      if moments is not None:  # the group's batch, as Adam sees it
        with tf.control_dependencies([written]):
          size = tf.py_function(lambda: np.float32(
              self._rounds.effective_group_size), [], tf.float32)
          written = moments.rescale(tf.reshape(size, []))
      return written

    shared = (outer.variables if outer else []) + (
        [compressed_state.reference] if compressed_state else [])

    return self._rounds.round_end_ops(
        step, loss,
        read_values=lambda: replicas.read_values(variables, self._local_sgd),
        write_values=write,
        start=(lambda: [tf.identity(s) for s in starts]) if starts else None,
        reset_state=self._averaged.clear_nonfinite_slots,
        shared_state=shared or None, compression=compressed_state, key=key)


def with_progress(averaged, progress, moved_by_sgd):
  """An overlapped round's model: G(avg) + (w_now - w_sent) for the
  weights SGD moves (`moved_by_sgd`), the average alone for the rest.

  A statistic (BatchNorm's moving variance, an averaged optimizer slot)
  moved by the difference of two of its values can leave its range: a
  negative variance, NaN at evaluation. It takes the average, as in a
  blocking round (the outer step leaves it alone too).
  """
  return [a + p if p is not None and moved else a
          for a, p, moved in zip(averaged, progress, moved_by_sgd)]
