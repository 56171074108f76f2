"""One worker's part in a round's averaging, from the round's decision:
its group, key and weights, and across hosts its place in a global sync
(host by host, or shard by shard). No TensorFlow; the graph side
(distribute/rounds.py) takes a RoundPart's fields as tensors.
"""

from typing import NamedTuple

import numpy as np
from absl import logging

from oscars_tf.policy import plan_changes


class RoundPart(NamedTuple):
  """This worker's part in a round's averaging, as the decision fixes it."""
  table: np.ndarray      # every worker's row, flattened (n * ROW)
  weight: float          # this worker's weight in its group's sum
  takes_model: bool      # poisoned or rejoining: sends zeros, takes the sum
  group_key: int
  group_size: int
  nccl: bool             # the group is on one host
  is_global: bool
  rejoining: bool        # someone rejoins: shared state is averaged too
  state_weight: float    # this worker's weight for that shared state
  # A global sync across hosts (see plan_changes.host_part); placeholders on one
  # host.
  host_key: int
  host_size: int
  weight_in_host: float
  is_leader: bool
  leaders_key: int       # the host leaders of this worker's rack
  leaders_size: int
  host_share: float      # the host's share within its rack
  is_rack_leader: bool
  racks_key: int         # the racks' leaders (size 1: a single rack)
  racks_size: int
  rack_share: float
  # A global sync across hosts whose sizes allow goes shard by shard
  # instead (plan_changes.shard_layout); placeholders otherwise.
  sharded: bool
  shard_rank: int        # its place on its host: the shard it holds, if
  shards: int            # below the number of shards
  shard_key: int         # this worker's shard's ring in its rack
  shard_size: int
  host_leads_rack: bool
  shard_racks_key: int   # its shard's ring of the racks' first hosts
  shard_racks_size: int


class NextRound(NamedTuple):
  """Where this worker's next averaging point is, and its update scale."""
  next_sync: int
  scale: float


def multi_host(hosts):
  return len(set(hosts)) > 1


def register_groups(group_keys, plan, hosts, members, max_leaders=None):
  """Keys for every group this round may use, in the same order on every
  member (see group_keys.py): the plan's, and across hosts each host's
  members, the racks of host leaders and the racks' leaders (for a global
  sync; plan_changes.host_part)."""
  group_keys.register(plan.groups)
  if multi_host(hosts):
    by_host = {}
    for i in sorted(members):
      by_host.setdefault(hosts[i], []).append(i)
    by_host = sorted(by_host.values())
    leaders = [h[0] for h in by_host]
    racks = plan_changes.racks_of(leaders, max_leaders or len(leaders))
    group_keys.register(by_host + racks + (
        [[r[0] for r in racks]] if len(racks) > 1 else []))
    layout = plan_changes.shard_layout(hosts, members, max_leaders)
    if layout is not None:
      group_keys.register(layout.rings())


def part_of(me, round_, plan, hosts, members, sound, group_keys, table,
            rejoining, max_leaders=None):
  """Worker `me`'s RoundPart under `plan`; `sound[j]`: worker j adds its
  model (a member, finite weights, not rejoining)."""
  group = plan.group_of(me)
  takes_model = not sound[me]
  if not any(sound[j] for j in group):
    logging.error("oscars_tf: worker %d round %d: every member of group %s "
                  "has non-finite weights: training diverged (try a lower "
                  "learning rate).", me, round_, list(group))
    takes_model = False
  # State sound members share (outer momentum) goes to newcomers: equal
  # weights over the group's sound members, whatever their steps.
  holders = [j for j in group if sound[j]] or list(group)
  return RoundPart(
      table, plan_changes.healthy_weight(plan, me, sound), takes_model,
      group_keys.key(group), len(group),
      len({hosts[i] for i in group}) == 1, plan.global_sync, rejoining,
      1.0 / len(holders) if me in holders else 0.0,
      *_host_part(me, plan, hosts, members, sound, group_keys, max_leaders),
      *_shard_part(me, hosts, members, group_keys, max_leaders))


def _host_part(me, plan, hosts, members, sound, group_keys, max_leaders):
  """Hierarchical-sync fields of worker `me` (used for a global sync across
  hosts; on one host, placeholders)."""
  if not multi_host(hosts):
    return (0, 1, 1.0, True, 0, 1, 1.0, True, 0, 1, 1.0)
  part = plan_changes.host_part(plan, me, hosts, members, sound, max_leaders)
  racks = part.rack_leaders
  return (group_keys.key(part.host), len(part.host), part.weight_in_host,
          me == part.host[0], group_keys.key(part.leaders), len(part.leaders),
          part.host_share, me == part.leaders[0],
          group_keys.key(racks) if len(racks) > 1 else 0, len(racks),
          part.rack_share)


def _shard_part(me, hosts, members, group_keys, max_leaders):
  """Sharded-sync fields of worker `me` (see RoundPart)."""
  layout = (plan_changes.shard_layout(hosts, members, max_leaders)
            if multi_host(hosts) else None)
  if layout is None:
    return (False, 0, 1, 0, 1, True, 0, 1)
  place, rack, leads, _ = layout.place(me)
  if place >= layout.shards:  # holds no shard: within its host only
    return (True, place, layout.shards, 0, 1, leads, 0, 1)
  ring = layout.ring(rack, place)
  several = len(layout.racks) > 1
  return (True, place, layout.shards, group_keys.key(ring), len(ring), leads,
          group_keys.key(layout.top(place)) if several else 0,
          len(layout.racks))
