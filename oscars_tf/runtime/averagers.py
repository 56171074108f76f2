"""Averagers: one interface for every way a round averages the model.

    averaged = averager.weighted_sum(values, part)

returns `sum over the members of this worker's collective of weight *
values`, in the structure and dtypes of `values`. `part` is this worker's
`RoundPart` (protocol/round_parts.py) as tensors, the graph receives it at
a round end: who averages with whom, with which weights. What stays fixed
(device, communication, timeout, averaging dtype, the collectives' role) is
given at construction. As in PyTorch's
torch/distributed/algorithms/model_averaging, mechanism apart from policy:
the collectives are averaging.GroupAverager's (one packed all-reduce a
dtype) and sharded_sync.ShardedAverager's; a worker picks its averager once
(distribute/rounds.py) and calls it at every round end:

* `averaging.GroupAverager`: the group's ring (or NCCL) all-reduce;
* `PerGroupAverager`: NCCL for a group on one host, ring across hosts;
* `HierarchicalAverager`: a global sync host by host;
* `sharded_sync.ShardedAverager`: a global sync shard by shard;
* `AcrossHosts`: a global sync across hosts shard by shard or host by
  host, any other round the group's averager;
* `UnlessAlone`: a member alone in its group keeps its values.

Example:
  averager = UnlessAlone(averaging.GroupAverager(
      4, 1, "/device:CPU:0", "RING", timeout=60.0))
  averaged = averager.weighted_sum(values, part)  # in the round's graph
"""

from typing import List
from typing import Protocol

import tensorflow as tf

from oscars_tf.runtime import averaging


class Averager(Protocol):
  """What every averager does (see the module docstring)."""

  def weighted_sum(self, values, part) -> List[tf.Tensor]:
    """`sum over members of weight * values` (same structure and dtypes);
    `part`: this worker's RoundPart, as tensors."""


class PerGroupAverager:
  """Picks NCCL or ring for each group at run time ("auto" on GPUs).

  A plan's groups change from round to round; a group whose members all sit
  on one host averages over NCCL, one that spans hosts over gRPC ring. The
  choice is a tensor (`part.nccl`), so both ops are built and one runs.

  Args:
    group_size, group_key, device, timeout, averaging_dtype, role, exact:
      as `averaging.GroupAverager`'s.

  Example:
    PerGroupAverager(4, 1, "/device:GPU:0", timeout=60.0).weighted_sum(
        values, part)  # part.group_size, group_key, weight and nccl
  """

  def __init__(self, group_size, group_key, device, timeout,
               averaging_dtype=None, role="model", exact=False):
    self.nccl = averaging.GroupAverager(group_size, group_key, device, "NCCL",
                                        timeout, averaging_dtype, role, exact)
    self.ring = averaging.GroupAverager(group_size, group_key, device, "RING",
                                        timeout, averaging_dtype, role, exact)

  def weighted_sum(self, values, part):
    """The sum over `part`'s group, over NCCL where `part.nccl`."""
    return tf.cond(part.nccl,
                   lambda: self.nccl.weighted_sum(values, part),
                   lambda: self.ring.weighted_sum(values, part))


class HierarchicalAverager:
  """A global average over several hosts: within hosts, across, and back.

  Hierarchical all-reduce (Jia et al., "Highly Scalable Deep Learning
  Training System with Mixed-Precision: Training ImageNet in Four
  Minutes", 2018), in up to three levels:
  1. Each host's members sum `weight_in_host * values` (NCCL on GPUs).
  2. One leader per host sums `host_share * host_average` with the other
     leaders of its rack over gRPC ring: only one member per host crosses
     the network, and no ring has more than the schedule's group bound.
  3. With more than one rack, the racks' leaders sum `rack_share *
     rack_average` over gRPC ring, and each sends the result back to its
     rack's leaders.
  4. Each host leader broadcasts the result to its host's members.
  Group keys, sizes and weights are tensors taken from the plan. With an
  averaging dtype all three steps send it: steps 1 and 2 each round (the
  host average is rounded, then the global one), step 3 loses nothing (the
  leader's values came out of step 2, so they are exact in that dtype).

  Args:
    device: this member's averaging device.
    intra_communication: "RING" or "NCCL", within a host.
    timeout: seconds a member waits for the others (never 0).
    averaging_dtype: None, tf.bfloat16 or tf.float16 (averaging.sent_dtype).

  Example:
    HierarchicalAverager("/device:CPU:0", "RING", 60.0).weighted_sum(
        values, part)  # part.host_key, ..., racks_size, rack_share
  """

  def __init__(self, device, intra_communication, timeout,
               averaging_dtype=None):
    self.intra = averaging.GroupAverager(2, 0, device, intra_communication,
                                         timeout, averaging_dtype)
    self.cross = averaging.GroupAverager(2, 0, device, "RING", timeout,
                                         averaging_dtype)

  def weighted_sum(self, values, part):
    """`part`: tensors host_key, host_size, weight_in_host, is_leader,
    leaders_key, leaders_size, host_share, is_rack_leader, racks_key,
    racks_size, rack_share as attributes (a RoundPart of
    protocol/round_parts.py)."""
    p = part

    def within(values, weight, role):
      return tf.cond(
          p.host_size > 1,
          lambda: self.intra.reduce(values, weight, role=role,
                                    group_size=p.host_size,
                                    group_key=p.host_key),
          lambda: [tf.identity(v) for v in values])

    def leaders_ring(values, weight, role, is_in, size, key):
      return tf.cond(
          is_in,
          lambda: self.cross.reduce(values, weight, role=role,
                                    group_size=size, group_key=key),
          lambda: [tf.identity(v) for v in values])

    host_average = within(values, p.weight_in_host, "model")
    crossed = leaders_ring(host_average, p.host_share, "across", p.is_leader,
                           p.leaders_size, p.leaders_key)
    several = p.racks_size > 1
    crossed = leaders_ring(crossed, p.rack_share, "racks",
                           several & p.is_leader & p.is_rack_leader,
                           p.racks_size, p.racks_key)
    crossed = leaders_ring(crossed, tf.where(p.is_rack_leader, 1.0, 0.0),
                           "rack_back", several & p.is_leader,
                           p.leaders_size, p.leaders_key)
    return within(crossed, tf.where(p.is_leader, 1.0, 0.0), "back")


class AcrossHosts:
  """On several hosts: a global sync goes shard by shard where the hosts'
  sizes allow (`part.sharded`; sharded_sync.py), else host by host; any
  other round averages in its group.

  Args:
    in_group: the averager of a group (GroupAverager, PerGroupAverager).
    host_by_host: a HierarchicalAverager.
    shard_by_shard: a sharded_sync.ShardedAverager.

  Example:
    AcrossHosts(in_group, HierarchicalAverager(device, "RING", 60.0),
                sharded_sync.ShardedAverager(device, "RING", 60.0))
  """

  def __init__(self, in_group, host_by_host, shard_by_shard):
    self.in_group = in_group
    self.host_by_host = host_by_host
    self.shard_by_shard = shard_by_shard

  def weighted_sum(self, values, part):
    def global_sync():
      return tf.cond(
          part.sharded,
          lambda: self.shard_by_shard.weighted_sum(values, part),
          lambda: self.host_by_host.weighted_sum(values, part))
    return tf.cond(part.is_global, global_sync,
                   lambda: self.in_group.weighted_sum(values, part))


class UnlessAlone:
  """`averager`'s sum, except for a member alone in its group
  (`part.group_size` 1), which keeps its values and meets no collective.

  Example:
    UnlessAlone(averaging.GroupAverager(4, 1, device, "RING", 60.0))
  """

  def __init__(self, averager):
    self.averager = averager

  def weighted_sum(self, values, part):
    return tf.cond(part.group_size > 1,
                   lambda: self.averager.weighted_sum(values, part),
                   lambda: [tf.identity(v) for v in values])
