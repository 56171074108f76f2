"""Adam's second moment measured for the group's batch
(`optimizer_state="group_variance"`, the default).

Between averagings each worker's Adam-type optimizer accumulates its second
moment v from its own gradients, on its own batch B. A group of N workers
averages N such updates, as synchronous Adam does on the group's N x B
batch, but synchronous Adam measures v on that batch, whose gradient noise
has 1/N of the variance: local Adam divides by a larger sqrt(v) and the
averaged model moves less (in `benchmarks/local_adam.py`, averaging after
every step still ended 1.2 to 1.8 % behind synchronous Adam).

So at every averaging each worker rescales what v gained since the last
one, from v0 (its value then) over the t - t0 steps since:

    increment = v - beta_2^(t - t0) * v0
    mean part = (1 - beta_2^(t - t0)) * m_hat^2   (m_hat: Adam's bias-
                                                  corrected first moment)
    v = beta_2^(t - t0) * v0 + min(increment, mean part)
        + max(increment - mean part, 0) / n

where n is the group's effective size (`plan_changes.effective_group_size`).
Alone (n = 1) nothing was averaged: v, v0 and t0 stay, so the next
averaging rescales the lone round's increment too (where every worker is
a host of its own, each round between global syncs is alone). The mean
part stays, the noise part shrinks to the group's. Only the round's
increment is rescaled, never v again, and the first moment is left alone.
Raw (not bias-corrected) v accumulates like the corrected one, so the rule
works on Keras' raw slots.

Optimizers with `_momentums`, `_velocities`, `beta_1` and `beta_2` (Keras 3
and tf_keras: Adam, AdamW, Nadam, Lamb) are rescaled; others (SGD,
momentum, RMSprop, Adagrad, legacy tf_keras optimizers) are left as
`optimizer_state="local"` leaves them. AMSGrad keeps the largest v seen,
which a smaller v does not lower.

v0 and t0 are not checkpointed: a checkpoint is written at an epoch's end,
an averaging, so they are v and t then, what a restored worker starts with.
"""

from absl import logging
import tensorflow as tf

from oscars_tf.distribute.replicas import component_variables


def adam_slots(optimizer):
  """(first moments, second moments, beta_1, beta_2, iterations) of an
  Adam-type `optimizer` (unwrapped from loss scaling), or None."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  momentums = getattr(inner, "_momentums", None)
  velocities = getattr(inner, "_velocities", None)
  betas = [getattr(inner, name, None) for name in ("beta_1", "beta_2")]
  if (not momentums or not velocities or
      len(momentums) != len(velocities) or
      not all(isinstance(b, (int, float)) for b in betas)):
    return None
  return momentums, velocities, float(betas[0]), float(betas[1]), (
      inner.iterations)


class SecondMoments:
  """One worker's Adam second moments and their values at the last
  averaging (created eagerly when the round end is first traced).

  Args:
    optimizer: the tracked optimizer.
    local_sgd: whether this worker's devices step on their own batches
      (`local_replicas="local_sgd"`): each device's moments then count as a
      member's.
  """

  def __init__(self, optimizer, local_sgd=False):
    self.optimizer = optimizer
    slots = adam_slots(optimizer)
    self.active = slots is not None
    self._pairs, self._local_replicas = [], 1.0
    if not self.active:
      logging.info("optimizer_state='group_variance': %s has no Adam-type "
                   "second moment; its slots stay local",
                   type(optimizer).__name__)
      return
    momentums, velocities, self._beta_1, self._beta_2, self._t = slots
    if local_sgd:
      self._local_replicas = float(len(component_variables(velocities[0])))
    with tf.init_scope():
      for m, v in zip(momentums, velocities):
        for mc, vc in zip(component_variables(m), component_variables(v)):
          with tf.device(vc.device):
            start = tf.Variable(vc.read_value(), trainable=False,
                                name="oscars_second_moment_start")
          self._pairs.append((mc, vc, start))
      self._t0 = tf.Variable(tf.cast(self._t, tf.float32), trainable=False,
                             name="oscars_second_moment_step")

  def rescale(self, group_size):
    """Op: every second moment's increment since the last averaging
    rescaled to a group of `group_size` (a float32 scalar tensor). A
    member alone (1, and one local replica) averaged nothing: its moments
    and their start stay, so the next averaging rescales the lone round's
    steps too."""
    if not self.active:
      return tf.no_op()
    n = group_size * self._local_replicas
    return tf.cond(n > 1.0, lambda: self._rescaled(n), tf.no_op)

  def _rescaled(self, n):
    t = tf.cast(self._t, tf.float32)
    decay = tf.pow(self._beta_2, tf.maximum(t - self._t0, 0.0))
    first_bias = 1.0 - tf.pow(self._beta_1, tf.maximum(t, 1.0))
    updates = []
    for m, v, start in self._pairs:
      with tf.device(v.device):
        kept = tf.cast(decay, v.dtype) * start
        increment = v - kept
        mean_part = tf.cast(1.0 - decay, v.dtype) * tf.square(
            m / tf.cast(first_bias, m.dtype))
        new = kept + tf.minimum(increment, mean_part) + tf.maximum(
            increment - mean_part, 0.0) / tf.cast(n, v.dtype)
        # A poisoned worker's moments: left as they are (its round end
        # clears what is not finite), and never kept as the start.
        new = tf.where(tf.math.is_finite(new), new, v)
        written = v.assign(new)
        with tf.control_dependencies([written]):
          updates.append(start.assign(tf.where(
              tf.math.is_finite(new), new, tf.zeros_like(new))))
    with tf.control_dependencies(updates):
      return tf.group(self._t0.assign(t))
