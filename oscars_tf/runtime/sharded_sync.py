"""A global average over several hosts near the ring all-reduce bound.

HierarchicalAverager (averaging.py) sends the whole model into each host,
across hosts from one leader, and back down: each member sends about
2 x 2(L-1)/L of the model, twice the bound 2(N-1)/N of one flat ring. Here
the model is cut into S shards (S: the fewest members a host has;
plan_changes.shard_layout) and each host's first S members hold one each:

1. within the host, an all-to-all: the holder of shard r receives every
   member's shard r and sums them (a reduce-scatter; TensorFlow's CPU
   collectives have none, and its all-to-all sends each shard once);
2. shard r crosses hosts in a ring of the hosts' holders of shard r, per
   rack, then (several racks) in a ring of the racks' first hosts, and a
   broadcast back down each rack;
3. within the host, an all-gather of the shards.

For H hosts of L (S = L, one rack) each member sends (L-1)/L +
2(H-1)/(H L) + (L-1)/L = 2(N-1)/N of the model, every member crosses the
network with 1/L of it, and no ring is longer than the plan's group
bound. A host of L > S members sends 2(L-1)/S within the host (its members
past S send zeros and hold no shard). Members weight their values with
their whole weight (in host x host's share x rack's share) before sending,
so every step is a plain sum and no weight is rounded to the averaging
dtype.
"""

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from oscars_tf.runtime import averaging
from oscars_tf.runtime import fault_injection


class ShardedAverager:
  """Weighted sum of tensors over every member of a sharded global sync.

  Args:
    device: this member's averaging device.
    intra_communication: "RING" or "NCCL", within a host.
    timeout: seconds a member waits for the others (never 0).
    averaging_dtype: None, tf.bfloat16 or tf.float16 (averaging.sent_dtype).
  """

  def __init__(self, device, intra_communication, timeout,
               averaging_dtype=None):
    if timeout <= 0:
      raise ValueError(f"collective timeout must be > 0 s, got {timeout!r}.")
    self.device = device
    self.intra = intra_communication
    self.timeout = float(timeout)
    self.averaging_dtype = averaging_dtype

  def weighted_sum(self, tensors, p):
    """`sum over members of weight * tensors` (same structure and dtypes).

    `p`: a RoundPart (protocol/round_parts.py) with tensors as fields:
    host_key, host_size, weight_in_host, host_share, rack_share,
    shard_rank, shards, shard_key, shard_size, host_leads_rack,
    shard_racks_key, shard_racks_size.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = list(tensors)
    previous = fault_injection.before_collective()  # [] outside tests
    weight = p.weight_in_host * p.host_share * p.rack_share
    with tf.control_dependencies(previous), tf.device(self.device):
      order = self._rank_order(p)
    previous = [order]
    packs = averaging.packs_by_dtype(tensors, self.averaging_dtype)
    for pack_index, (dtype, indices) in enumerate(packs):
      with tf.device(self.device):
        flat = averaging.weighted_pack(tensors, indices, weight, dtype)
      with tf.control_dependencies(previous):
        flat = self._one_pack(flat, p, pack_index, order)
      previous = [flat]
      with tf.device(self.device):
        averaging.unpack(flat, tensors, indices, out)
    return out

  def _rank_order(self, p):
    """The host's members' shard numbers (their places in worker order) in
    TensorFlow's rank order of the host's group. TensorFlow ranks a group's
    members in an order of its own (a host of tasks 8 to 15 did not follow
    task order, measured on 2.21), while shard r must be held by each
    host's r-th member for the rings across hosts to pair the same
    shards."""
    return collective_ops.all_gather_v2(
        tf.reshape(tf.cast(p.shard_rank, tf.int32), [1]),
        group_size=p.host_size, group_key=p.host_key,
        instance_key=averaging.instance_key("shard_order", 0, "int32", 1),
        communication_hint=self.intra, timeout=self.timeout)

  def _one_pack(self, flat, p, pack_index, order):
    length = int(flat.shape[0])

    def key(role):
      return averaging.instance_key_of_cut(role, pack_index, flat.dtype.name,
                                           length, p.shards)

    def ring(values, role, size, group_key):
      return collective_ops.all_reduce_v2(
          values, group_size=size, group_key=group_key,
          instance_key=key(role), merge_op="Add", final_op="Id",
          communication_hint="RING", timeout=self.timeout)

    with tf.device(self.device):
      # S shards of `width`; rows S to L-1 (members holding no shard, on a
      # host larger than the smallest) are zeros.
      width = (length + p.shards - 1) // p.shards
      chunks = tf.pad(
          tf.reshape(tf.pad(flat, [[0, width * p.shards - length]]),
                     [p.shards, width]),
          [[0, p.host_size - p.shards], [0, 0]])
      # Row t goes to the member of TensorFlow rank t, which holds shard
      # order[t]; the rows received, summed: this member's shard of the
      # host's sum.
      shard = tf.reduce_sum(collective_ops.all_to_all_v2(
          tf.gather(chunks, order), group_size=p.host_size,
          group_key=p.host_key,
          instance_key=key("shard_in"), communication_hint=self.intra,
          timeout=self.timeout), 0)
      holds = p.shard_rank < p.shards
      shard = tf.cond(
          holds,
          lambda: ring(shard, "shard_across", p.shard_size, p.shard_key),
          lambda: tf.identity(shard))
      several = holds & (p.shard_racks_size > 1)
      shard = tf.cond(
          several & p.host_leads_rack,
          lambda: ring(shard, "shard_racks", p.shard_racks_size,
                       p.shard_racks_key),
          lambda: tf.identity(shard))
      shard = tf.cond(several, lambda: self._back_down(shard, p, key),
                      lambda: tf.identity(shard))
      moved = _moved_dtype(flat.dtype)
      whole = collective_ops.all_gather_v2(
          tf.bitcast(shard, moved), group_size=p.host_size,
          group_key=p.host_key, instance_key=key("shard_out"),
          communication_hint=self.intra, timeout=self.timeout)
      # Gathered in rank order: row t is shard order[t]; the shards in
      # order, then the model.
      whole = tf.gather(tf.reshape(whole, [p.host_size, width]),
                        tf.math.invert_permutation(order))[:p.shards]
      return tf.bitcast(tf.reshape(whole, [-1])[:length], flat.dtype)

  def _back_down(self, shard, p, key):
    """The racks' sum of the shard, from the rack's first host to the
    rack's other holders of the shard: a broadcast (a tree: each sends the
    shard about once), not a ring all-reduce of zeros (twice)."""
    moved = _moved_dtype(shard.dtype)

    def send():
      with tf.control_dependencies([collective_ops.broadcast_send_v2(
          tf.bitcast(shard, moved), group_size=p.shard_size,
          group_key=p.shard_key, instance_key=key("shard_back"),
          communication_hint="RING", timeout=self.timeout)]):
        return tf.identity(shard)

    def receive():
      return tf.bitcast(collective_ops.broadcast_recv_v2(
          tf.shape(shard), moved, group_size=p.shard_size,
          group_key=p.shard_key, instance_key=key("shard_back"),
          communication_hint="RING", timeout=self.timeout), shard.dtype)
    return tf.cond(p.host_leads_rack, send, receive)


def _moved_dtype(dtype):
  """The dtype a copy (gather, broadcast) moves `dtype` as: TensorFlow's
  take no bfloat16, and a copy changes no bit, so its bits go as
  float16."""
  return tf.float16 if dtype == tf.bfloat16 else dtype
