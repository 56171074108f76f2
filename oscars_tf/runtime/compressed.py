"""Compressed averaging: the change since the last global average, in 8 or
4 bits, summed in float32.

Every sound member holds the model of the last global sync, its
`reference` (distribute/compression.py keeps it, and a rejoiner receives
it), so a group's weighted average is

    sum_m w_m * model_m = reference + sum_m w_m * (model_m - reference)

when the weights sum to 1, as a round's do. Only the changes travel, block
quantized (runtime/quantize.py), with error feedback: what rounding lost on
a member is added to what it sends next time. Integers cannot be summed in
an all-reduce without overflowing, so the sum is done in float32 where the
data meets, as a ring's reduce-scatter and all-gather are (the scheme of
INTELLECT-1's int8 all-reduce):

1. each member cuts its change into one shard per member and sends shard r
   to the member of rank r (`CollectiveAllToAllV2`, quantized);
2. each member dequantizes the shards it received and sums its shard in
   float32, then quantizes that sum (keeping what this rounding lost, too);
3. an all-gather (`CollectiveGatherV2`) gives every member every shard's
   quantized sum, which all decode to the same float32 values.

So each member sends 2 (G - 1) / G of its compressed change, as a ring
all-reduce sends of the float32 one, and every member ends with
bit-identical values. Both collectives run on the host's CPU over gRPC,
whatever the devices (NCCL has no all-to-all in TensorFlow 2.21).
"""

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from oscars_tf.runtime import averaging
from oscars_tf.runtime import fault_injection
from oscars_tf.runtime import quantize


class CompressedSum:
  """The group's sum of each member's float32 vector, sent quantized.

  Args:
    bits: 8 or 4.
    device: where the collectives run (this worker's host CPU).
    timeout: seconds a member waits for the others (never 0).
    worker: this worker's index (a row of the all-to-all says whose it is:
      a member learns its rank in the group from them).
    watch: a `collective_watch.PeerWatch` of the round's peers, run while
      the all-to-all is in flight (TensorFlow's does not notice a dead
      peer), or None.

  Example:
    total, lost, sent = CompressedSum(4, "/device:CPU:0", 60.0, 0).sum(
        x, part)  # x: float32 [n]; part: the round's RoundPart
  """

  def __init__(self, bits, device, timeout, worker, watch=None):
    self.bits = bits
    self.device = device
    self.timeout = float(timeout)
    self.worker = worker
    self._watch = watch
    # One graph per vector length, shared by every function that averages
    # (a training step, an epoch's last round, the next model of the same
    # size): its hundred-odd ops are traced once, not once per caller.
    self._sum_function = tf.function(self._sum, autograph=False)

  def sum(self, x, part):
    """(the group's sum of `x` as every member decodes it, what rounding
    lost on this member (to add to `x` next time), the bytes of this
    member's compressed vector); `part.group_size` and `part.group_key`
    name the group."""
    return self._sum_function(x, part.group_size, part.group_key)

  def _sum(self, x, size, group_key):
    length = int(x.shape[0])
    block = quantize.BLOCK
    with tf.device(self.device):
      # Shards of whole blocks: [size, shard].
      shard = -(-length // (size * block)) * block
      padded = tf.pad(x, [[0, size * shard - length]])
      q, scales = quantize.quantize(padded, self.bits)
      lost = padded - quantize.dequantize(q, scales)
      rows = quantize.pack(tf.reshape(q, [size, shard]),
                           tf.reshape(scales, [size, -1]), self.bits)
      rows = tf.concat([rows, tf.fill([size, 1], self.worker)], 1)
    with tf.control_dependencies(fault_injection.before_collective()):
      watching = self._watch_ops("start")
    with tf.control_dependencies(watching):
      received = self._collective(collective_ops.all_to_all_v2, rows, size,
                                  group_key, "compressed_spread", length)
    with tf.control_dependencies([received]):
      watched = self._watch_ops("stop")
    with tf.device(self.device):
      # Row m came from the member of rank m; its last word is its index.
      rank = tf.argmax(tf.cast(tf.equal(received[:, -1], self.worker),
                               tf.int32), output_type=tf.int32)
      q_in, scales_in = quantize.unpack(received[:, :-1], shard, self.bits)
      mine = tf.reduce_sum(tf.reshape(
          quantize.dequantize(q_in, tf.reshape(scales_in, [-1])),
          [size, shard]), 0)
      q_sum, scales_sum = quantize.quantize(mine, self.bits)
      lost_in_sum = mine - quantize.dequantize(q_sum, scales_sum)
      # What rounding the sum lost is this member's to send again.
      lost = lost + tf.pad(lost_in_sum, [[rank * shard,
                                          (size - 1 - rank) * shard]])
      sums = quantize.pack(q_sum[None], scales_sum[None], self.bits)[0]
    with tf.control_dependencies(watched):
      gathered = self._collective(collective_ops.all_gather_v2, sums, size,
                                  group_key, "compressed_gather", length)
    with tf.device(self.device):
      q_all, scales_all = quantize.unpack(tf.reshape(gathered, [size, -1]),
                                          shard, self.bits)
      total = quantize.dequantize(q_all, tf.reshape(scales_all, [-1]))
      sent = tf.cast(size, tf.int64) * 4 * quantize.words_of(
          tf.cast(shard, tf.int64), self.bits)
    return total[:length], lost[:length], sent

  def _watch_ops(self, what):
    """[the py_function starting or stopping the watch], or []."""
    if self._watch is None:
      return []
    with tf.device(self.device):
      return [tf.py_function(getattr(self._watch, what), [], tf.int32)]

  def _collective(self, op, value, size, group_key, role, length):
    with tf.device(self.device):
      return op(value, group_size=size, group_key=group_key,
                # The bits change the rows' shape: in the key too.
                instance_key=averaging.instance_key_of_cut(
                    role, 0, f"int{self.bits}", length, size),
                communication_hint="RING", timeout=self.timeout)


def bytes_of(length, group_size, bits):
  """Bytes of one member's compressed vector of `length` float32 values in
  a group of `group_size` (padding and scales included), as `sum` counts
  them."""
  block = quantize.BLOCK
  shard = -(-length // (group_size * block)) * block
  return group_size * 4 * quantize.words_of(shard, bits)
