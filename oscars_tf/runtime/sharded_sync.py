"""A global average over several hosts near the ring all-reduce bound.

HierarchicalAverager (averagers.py) sends the whole model into each host,
across hosts from one leader, and back down: each member sends about
2 x 2(L-1)/L of the model, twice the bound 2(N-1)/N of one flat ring. Here
each host cuts the model into pieces, one a member, and the pieces cross
hosts as segments (policy/shard_layout.py):

1. within the host, an all-to-all: the holder of piece r receives every
   member's piece r and sums them (a reduce-scatter; TensorFlow's CPU
   collectives have none, and its all-to-all sends each piece once);
2. each segment of the piece crosses hosts in a ring of its holders, per
   rack, then (several racks) in a ring of the racks' first hosts, and a
   broadcast back down each rack;
3. within the host, an all-gather of the pieces.

A member of a host of L sends (L-1)/L + about 2(H-1)/(H L) + (L-1)/L of
the model, near 2(N-1)/N whatever the hosts' sizes; every member crosses
the network with 1/L of it, and no ring is longer than the plan's group
bound. (Under an even cut, a host of L > S members sends 2(L-1)/S; its
members past S send zeros and hold nothing.) Members weight their values
with their whole weight (in host x host's share x rack's share) before
sending, so every step is a plain sum and no weight is rounded to the
averaging dtype.
"""

import functools

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from oscars_tf.policy import shard_layout
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

  def weighted_sum(self, values, part):
    """`sum over members of weight * values` (same structure and dtypes):
    the averagers' interface (averagers.py).

    `part`: a RoundPart (protocol/round_parts.py) with tensors as fields:
    host_key, host_size, weight_in_host, host_share, rack_share,
    shard_rank, pieces, cut_denominator, the segment_* vectors,
    host_leads_rack, shard_racks_size.
    """
    p = part
    tensors = [tf.convert_to_tensor(t) for t in values]
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
    """The host's members' places (in worker order) in TensorFlow's rank
    order of the host's group. TensorFlow ranks a group's members in an
    order of its own (a host of tasks 8 to 15 did not follow task order,
    measured on 2.21), while piece r must be held by each host's r-th
    member for the rings across hosts to pair the same segments."""
    return collective_ops.all_gather_v2(
        tf.reshape(tf.cast(p.shard_rank, tf.int32), [1]),
        group_size=p.host_size, group_key=p.host_key,
        instance_key=averaging.instance_key("shard_order", 0, "int32", 1),
        communication_hint=self.intra, timeout=self.timeout)

  def _one_pack(self, flat, p, pack_index, order):
    length = int(flat.shape[0])
    slots = shard_layout.MAX_SEGMENTS
    if pack_index * slots >= averaging.MAX_PACKS:
      raise ValueError(f"too many dtypes to average ({pack_index + 1})")

    def host_key(role):  # the host's rows: [host_size, padded / pieces]
      return averaging.instance_key_of_cut(
          role, pack_index, flat.dtype.name, length,
          tf.cast(p.pieces, tf.int64) * 65537 + p.cut_denominator)

    with tf.device(self.device):
      # The model padded to a multiple of the cut's denominator: every cut
      # point is then a whole position, each piece `width` long (pad and
      # reshape, no copy by index).
      denominator = p.cut_denominator
      padded = (length + denominator - 1) // denominator * denominator
      pieces = tf.cast(p.pieces, tf.int64)
      width = padded // pieces
      # One row a member of the host: piece r for r < pieces; rows past
      # (an even cut's members holding nothing) are zeros.
      rows = tf.pad(
          tf.reshape(tf.pad(flat, [[0, padded - length]]),
                     tf.stack([pieces, width])),
          [[0, p.host_size - p.pieces], [0, 0]])
      # Row t goes to the member of TensorFlow rank t, whose place is
      # order[t]; the rows received, summed: this member's piece of the
      # host's sum.
      piece = tf.reduce_sum(collective_ops.all_to_all_v2(
          tf.gather(rows, order), group_size=p.host_size,
          group_key=p.host_key, instance_key=host_key("shard_in"),
          communication_hint=self.intra, timeout=self.timeout), 0)
      start = tf.cast(p.shard_rank, tf.int64) * width
      cuts = p.segment_cuts * (padded // denominator) - start
      # The piece's segments, each in a slot of its own: not a loop, where
      # TensorFlow would pair a ring's members by iteration (a segment is
      # one member's first and another's second). A member holding
      # nothing has none, and sends zeros.
      mine = tf.concat([
          tf.cond(cuts[k + 1] > cuts[k],
                  functools.partial(self._across, piece, cuts[k],
                                    cuts[k + 1], p, k, pack_index, length),
                  lambda: tf.zeros([0], flat.dtype))
          for k in range(slots)], 0)
      mine = tf.pad(mine, [[0, width - tf.shape(mine, tf.int64)[0]]])
      moved = _moved_dtype(flat.dtype)
      gathered = collective_ops.all_gather_v2(
          tf.bitcast(mine, moved), group_size=p.host_size,
          group_key=p.host_key, instance_key=host_key("shard_out"),
          communication_hint=self.intra, timeout=self.timeout)
      # Gathered in rank order: row t is place order[t]'s piece; the pieces
      # in order, then the model.
      gathered = tf.gather(
          tf.reshape(gathered, tf.stack([tf.cast(p.host_size, tf.int64),
                                         width])),
          tf.math.invert_permutation(order)[:p.pieces])
      return tf.bitcast(tf.reshape(gathered, [-1])[:length], flat.dtype)

  def _across(self, piece, begin, end, p, k, pack_index, length):
    """Segment k of this member's piece ([begin, end) of it), summed over
    every host: its rack's ring, then (several racks) the racks' first
    hosts' ring and a broadcast back down the rack."""
    segment = piece[begin:end]
    # The segment's index tells its rings' collectives apart (a member's
    # segments are consecutive, so distinct modulo the slots), and its
    # cut changes the key when the same ring later carries another shape.
    slot = pack_index * shard_layout.MAX_SEGMENTS + tf.math.floormod(
        p.segment_ids[k], shard_layout.MAX_SEGMENTS)
    cut = tf.cast(tf.math.floormod(
        (p.segment_cuts[k] * 7919 + p.segment_cuts[k + 1]) * 104729 +
        p.cut_denominator, 1 << 17), tf.int32)

    def key(role):
      return averaging.instance_key_of_cut(role, slot, segment.dtype.name,
                                           length, cut)

    def ring(values, role, size, group_key):
      return collective_ops.all_reduce_v2(
          values, group_size=size, group_key=group_key,
          instance_key=key(role), merge_op="Add", final_op="Id",
          communication_hint="RING", timeout=self.timeout)

    rack_key, rack_size = p.segment_keys[k], p.segment_sizes[k]
    segment = ring(segment, "shard_across", rack_size, rack_key)
    several = p.shard_racks_size > 1
    segment = tf.cond(
        several & p.host_leads_rack,
        lambda: ring(segment, "shard_racks", p.shard_racks_size,
                     p.segment_top_keys[k]),
        lambda: tf.identity(segment))
    return tf.cond(
        several,
        lambda: self._back_down(segment, p.host_leads_rack, rack_size,
                                rack_key, key("shard_back")),
        lambda: tf.identity(segment))

  def _back_down(self, segment, leads, size, group_key, instance_key):
    """The racks' sum of the segment, from the rack's first host to the
    rack's other holders of it: a broadcast (a tree: each sends the
    segment about once), not a ring all-reduce of zeros (twice)."""
    moved = _moved_dtype(segment.dtype)

    def send():
      with tf.control_dependencies([collective_ops.broadcast_send_v2(
          tf.bitcast(segment, moved), group_size=size, group_key=group_key,
          instance_key=instance_key, communication_hint="RING",
          timeout=self.timeout)]):
        return tf.identity(segment)

    def receive():
      return tf.bitcast(collective_ops.broadcast_recv_v2(
          tf.shape(segment), moved, group_size=size, group_key=group_key,
          instance_key=instance_key, communication_hint="RING",
          timeout=self.timeout), segment.dtype)
    return tf.cond(leads, send, receive)


def _moved_dtype(dtype):
  """The dtype a copy (gather, broadcast) moves `dtype` as: TensorFlow's
  take no bfloat16, and a copy changes no bit, so its bits go as
  float16."""
  return tf.float16 if dtype == tf.bfloat16 else dtype
