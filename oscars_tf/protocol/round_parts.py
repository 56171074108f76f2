"""One worker's part in a round's averaging, from the round's decision:
its group, key and weights, and across hosts its place in a global sync
(host by host, or shard by shard). No TensorFlow; the graph side
(distribute/rounds.py) takes a RoundPart's fields as tensors.
"""

from typing import NamedTuple

from absl import logging
import numpy as np

from oscars_tf.policy import plan_changes
from oscars_tf.policy import shard_layout


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
  # instead (policy/shard_layout.py); placeholders otherwise.
  sharded: bool
  shard_rank: int        # its place on its host: the piece it holds, if
  pieces: int            # below the pieces its host cuts
  cut_denominator: int
  # Its piece's segments, MAX_SEGMENTS slots: segment k is
  # [segment_cuts[k], segment_cuts[k+1]) / cut_denominator of the model,
  # empty past the last; each crosses hosts in a ring of its rack, then
  # (several racks) a ring of the racks' first hosts.
  segment_cuts: tuple
  segment_ids: tuple     # their indices in the layout (for instance keys)
  segment_keys: tuple    # their rings in the rack
  segment_sizes: tuple
  segment_top_keys: tuple
  host_leads_rack: bool
  shard_racks_size: int  # the racks of the layout


# The length of each vector field but the table (n * ROW).
VECTOR_LENGTHS = {"segment_cuts": shard_layout.MAX_SEGMENTS + 1,
                  **dict.fromkeys(("segment_ids", "segment_keys",
                                   "segment_sizes", "segment_top_keys"),
                                  shard_layout.MAX_SEGMENTS)}


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
  sync; plan_changes.host_part), and the rings of a sharded one. Returns
  that ShardLayout (or None), for `part_of`."""
  group_keys.register(plan.groups)
  if not multi_host(hosts):
    return None
  by_host = {}
  for i in sorted(members):
    by_host.setdefault(hosts[i], []).append(i)
  by_host = sorted(by_host.values())
  leaders = [h[0] for h in by_host]
  racks = plan_changes.racks_of(leaders, max_leaders or len(leaders))
  group_keys.register(by_host + racks + (
      [[r[0] for r in racks]] if len(racks) > 1 else []))
  layout = shard_layout.shard_layout(hosts, members, max_leaders)
  if layout is not None:
    group_keys.register(layout.rings())
  return layout


def sound_workers(healthy, newcomers):
  """sound[j]: worker j adds its model this round: a member with finite
  weights (`healthy[j]`) that is not rejoining. When no member is, the
  finite newcomers are: their models are the only finite ones, so they keep
  them and the poisoned take them, instead of all taking a NaN average."""
  newcomers = set(newcomers)
  sound = [ok and j not in newcomers for j, ok in enumerate(healthy)]
  return sound if any(sound) else list(healthy)


def part_of(me, round_, plan, hosts, members, sound, group_keys, table,
            rejoining, max_leaders, layout):
  """Worker `me`'s RoundPart under `plan`; `sound[j]`: worker j adds its
  model (a member, finite weights, not rejoining); `layout`: what
  `register_groups` returned this round."""
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
      *_shard_part(me, layout, group_keys))


class MetCollectives:
  """The collectives (a group key and the cut it carries) a worker's
  averagings ran. TensorFlow resolves a group and an instance the first
  time it meets them, a round trip through the group's leader that on a
  loaded machine costs several averagings: such a round's row reports no
  averaging cost, and CostAware counts no cost of a round in which any
  member's row has none (a global sync waits for every member's setup)."""

  LIMIT = 4096  # regrouping reuses groupings; this only bounds memory

  def __init__(self):
    self._met = set()

  def first_meeting(self, part):
    """Whether the averaging under `part` runs one not met before."""
    used = collectives_of(part)
    new = not used <= self._met
    if len(self._met) + len(used) > self.LIMIT:
      self._met.clear()
    self._met |= used
    return new


def collectives_of(part):
  """The collectives of one worker's averaging under `part`, as
  distribute/rounds.py and runtime/ launch them."""
  shared = {(part.group_key, "shared")} if (
      part.rejoining and part.group_size > 1) else set()
  if not part.is_global or part.host_key == 0:  # a group, or one host
    return shared | ({(part.group_key,)} if part.group_size > 1 else set())
  if part.sharded:
    cut = (part.pieces, part.cut_denominator, tuple(part.segment_cuts))
    return shared | {(key, cut) for key in (part.host_key,) + tuple(
        part.segment_keys) + tuple(part.segment_top_keys) if key}
  keys = {(part.host_key,)} if part.host_size > 1 else set()
  if part.is_leader:  # its leaders' ring runs even with one member
    keys.add((part.leaders_key,))
    if part.is_rack_leader and part.racks_size > 1:
      keys.add((part.racks_key,))
  return shared | keys


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


def _shard_part(me, layout, group_keys):
  """Sharded-sync fields of worker `me` (see RoundPart)."""
  slots = shard_layout.MAX_SEGMENTS
  if layout is None:
    return (False, 0, 1, 1, (0,) * (slots + 1)) + ((0,) * slots,) * 4 + (
        True, 1)
  place, rack, leads, h = layout.place(me)
  segments = list(layout.segments_of(h, place))
  cuts = [layout.cuts[s] for s in segments]
  cuts.append(layout.cuts[segments[-1] + 1] if segments else 0)
  several = len(layout.racks) > 1
  rings = [layout.ring(rack, s) for s in segments]

  def slotted(values, fill=0, length=slots):
    return tuple(values) + (fill,) * (length - len(values))
  return (True, place, layout.pieces[h], layout.denominator,
          slotted(cuts, cuts[-1], slots + 1), slotted(segments),
          slotted([group_keys.key(r) for r in rings]),
          slotted([len(r) for r in rings]),
          slotted([group_keys.key(layout.top(s)) if several else 0
                   for s in segments]),
          leads, len(layout.racks))
