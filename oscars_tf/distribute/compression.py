"""Compressed averaging's state and its round: what a worker sends is its
change since the last global sync (runtime/compressed.py).

Per averaged variable set, two flat float32 vectors of its trainable
float32 variables:

* `reference`: the model the last global sync wrote (after the outer step,
  if any). Every sound member holds the same one, so a group's members
  agree on what their changes are changes from. It is state sound members
  share: a rejoining worker takes it at its round (rounds.py's `_share`),
  and that round averages exactly, since the newcomer's own reference is
  stale until then. A member alone keeps its model and meets no one. A
  round that ends an epoch is exact too: the model evaluated, saved and
  returned at an epoch's end is the true average of the models the
  workers hold (the residuals stay with them, for the next compressed
  round).
* `residual`: what rounding lost on this worker, sent again next time
  (error feedback). It is this worker's own; a poisoned worker sends
  nothing and keeps nothing; a sound one at weight 0 (no steps this
  round) still sends it.

The rest is averaged exactly beside them: variables of other dtypes
(float16, float64, integers), and statistics and optimizer slots, which
must stay non-negative (BatchNormalization's moving variance, Adam's second
moment): a rounding error on a value near 0 would make it negative.
Neither vector is saved: a restored job starts them again from the model
every worker starts with (the chief's, broadcast).
"""

import numpy as np
import tensorflow as tf

from oscars_tf.runtime import averaging
from oscars_tf.runtime import compressed
from oscars_tf.runtime import quantize

COMPRESSIONS = tuple(quantize.BITS)  # ("int8", "int4")


class CompressionState:
  """The reference and residual of one averaged set (eager, at its start).

  Args:
    values: the set's values now, the same on every worker (the first
      reference).
    trainable: per value, whether it is a trainable weight (only those are
      compressed); default all.
  """

  def __init__(self, values, trainable=None):
    trainable = [True] * len(values) if trainable is None else trainable
    self.indices = [i for i, (v, t) in enumerate(zip(values, trainable))
                    if t and v.dtype == tf.float32]
    self._shapes = [values[i].shape for i in self.indices]
    flat = self.flat(values)
    self.reference = tf.Variable(flat, trainable=False,
                                 name="oscars_compression_reference")
    self.residual = tf.Variable(tf.zeros_like(flat), trainable=False,
                                name="oscars_compression_residual")

  def flat(self, values):
    """The compressed ones of `values` as one float32 vector."""
    if not self.indices:
      return tf.zeros([0], tf.float32)
    return tf.concat([tf.reshape(values[i], [-1]) for i in self.indices], 0)

  def take_reference(self, values):
    """Op: `values` (those a global sync wrote) become the reference."""
    return self.reference.assign(self.flat(values))

  def put(self, flat, out):
    """Writes `flat` back into the list `out` at the compressed indices."""
    sizes = [int(np.prod(s)) for s in self._shapes]
    for i, shape, part in zip(self.indices, self._shapes,
                              tf.split(flat, sizes)):
      out[i] = tf.reshape(part, shape)


class CompressionStates:
  """Each averaged set's `CompressionState`, keyed as the sets are;
  `compression` None: compressed averaging is off and none is made."""

  def __init__(self, compression):
    self.compression = compression
    self._states = {}

  def create(self, key, values, trainable=None):
    self._states[key] = CompressionState(values, trainable)
    return self._states[key]

  def get(self, key):
    return self._states.get(key)


class CompressedRound:
  """A round's weighted sum of the model with the changes sent compressed.

  Args:
    compression: "int8" or "int4".
    exact: the averager of every other round and of the variables not
      compressed (`averagers.UnlessAlone(...)`): a member alone keeps its
      values; a round with a rejoining worker is exact, and so is a round
      that ends an epoch (its model is evaluated, checkpointed, and the
      last one is what `fit` returns: a true average).
    device, timeout, worker, watch: `compressed.CompressedSum`'s.
    averaging_dtype: the exact averager's, for its byte count.
  """

  def __init__(self, compression, exact, device, timeout, worker,
               averaging_dtype=None, watch=None):
    self._sum = compressed.CompressedSum(quantize.BITS[compression], device,
                                         timeout, worker, watch)
    self._exact = exact
    self._averaging_dtype = averaging_dtype

  def weighted_sum(self, values, part, state, exact=False):
    """(`sum over the group of weight * values` in `values`' structure,
    the bytes this member sent) as tensors; `exact` (a bool tensor, the
    same on every member): this round is averaged exactly."""
    def exact_round():
      return (self._exact.weighted_sum(values, part),
              averaging.sent_bytes(values, part.group_size,
                                   self._averaging_dtype))

    if not state.indices:  # no float32 variable: nothing to compress
      return exact_round()

    def compressed_round():
      return self._compressed(values, part, state)

    return tf.cond(part.rejoining | (part.group_size <= 1) | exact,
                   exact_round, compressed_round)

  def _compressed(self, values, part, state):
    reference = tf.identity(state.reference)
    # A poisoned member sends nothing and keeps no error (it takes the
    # model). A sound one sends its error even at weight 0 (no steps this
    # round), and keeps what rounding lost, its shard's sum's included:
    # that error is the group's.
    sound = tf.logical_not(part.takes_model)
    change = tf.where(sound, part.weight * (state.flat(values) - reference) +
                      state.residual, tf.zeros_like(reference))
    total, lost, sent = self._sum.sum(change, part)
    keep = state.residual.assign(tf.where(sound, lost, tf.zeros_like(lost)))
    out = list(values)
    with tf.control_dependencies([keep]):
      state.put(reference + total, out)
    rest = [i for i in range(len(values)) if i not in state.indices]
    if rest:
      # After the compressed collectives: every member in the same order.
      with tf.control_dependencies([total]):
        summed = self._exact.weighted_sum([values[i] for i in rest], part)
      for i, v in zip(rest, summed):
        out[i] = v
      sent += averaging.packed_bytes([values[i] for i in rest],
                                     self._averaging_dtype)
    return out, sent
