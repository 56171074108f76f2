"""Changes to a round's plan from what happened in the round, the same on
every member: workers dropped or rejoining (`with_members`), a group left
with no sound member (`with_sound_groups`), who arrived with how many steps
and whose data ran out (`with_arrivals`), the epoch's end
(`fit_to_epoch`), whole multiples of Keras' steps per call (`quantized`),
each worker's weights when some are unsound (`healthy_weight`,
`host_part`), and how many members' noise a group's average holds
(`effective_group_size`). Pure Python.
"""

import dataclasses
import math
from typing import Tuple

from oscars_tf.policy.planner import weights_and_scales
from oscars_tf.policy.records import Plan


def healthy_weight(plan: Plan, me: int, healthy) -> float:
  """`me`'s averaging weight with unhealthy (non-finite) members left out.

  A poisoned member contributes nothing, and the healthy members of its
  group share its weight in proportion to their own, so the group's
  average is the average of its healthy models. A group with no healthy
  member keeps its weights (there is nothing sound to average).
  """
  total = sum(plan.weights[j] for j in plan.group_of(me) if healthy[j])
  if total <= 0:
    return plan.weights[me]
  return plan.weights[me] / total if healthy[me] else 0.0


@dataclasses.dataclass(frozen=True)
class HostPart:
  """One worker's part in a global sync done host by host: a weighted sum
  inside its host; the host leaders' weighted sum inside their rack (at
  most `max_leaders` host leaders); the rack leaders' weighted sum when
  there is more than one rack; then each result sent back down."""
  host: Tuple[int, ...]      # the members on this worker's host
  weight_in_host: float      # this worker's weight in its host's average
  leaders: Tuple[int, ...]   # the host leaders of this worker's rack
  host_share: float          # this host's weight within its rack
  rack_leaders: Tuple[int, ...]  # the first host leader of every rack
  rack_share: float          # this rack's weight among the racks


def racks_of(leaders, max_leaders):
  """`leaders` (sorted) in ceil(L / max_leaders) racks of near-equal size,
  in order: no ring of the sync has more than `max_leaders` members."""
  count = -(-len(leaders) // max_leaders)
  return [tuple(leaders[i * len(leaders) // count:
                        (i + 1) * len(leaders) // count])
          for i in range(count)]


def host_part(p: Plan, me: int, hosts, members, sound,
              max_leaders=None) -> HostPart:
  """`me`'s part in a hierarchical global sync of `members`.

  Only sound members (finite weights, not rejoining) carry weight, as in
  `healthy_weight`: a host's share is its sound weight over its rack's
  sound weight, a rack's over all of it, so the composed weights are the
  flat healthy weights and the model keeps its scale when a member is
  poisoned or rejoining. `max_leaders`: None, one rack of every host.
  """
  members = sorted(members)
  host = tuple(i for i in members if hosts[i] == hosts[me])
  first_on_host = {}  # O(workers): the lowest member of each host leads it
  for i in members:
    first_on_host.setdefault(hosts[i], i)
  all_leaders = sorted(first_on_host.values())
  racks = racks_of(all_leaders, max_leaders or len(all_leaders))
  rack = next(r for r in racks if first_on_host[hosts[me]] in r)
  in_rack_hosts = {hosts[i] for i in rack}
  w = [p.weights[i] if sound[i] else 0.0 for i in range(len(p.weights))]
  total = sum(w[i] for i in members)
  if total <= 0:  # nothing sound anywhere: a plain mean keeps the weights
    w = [1.0] * len(p.weights)
    total = float(len(members))
  in_host = sum(w[i] for i in host)
  in_rack = sum(w[i] for i in members if hosts[i] in in_rack_hosts)
  return HostPart(host, w[me] / in_host if in_host > 0 else 0.0, rack,
                  in_host / in_rack if in_rack > 0 else 0.0,
                  tuple(r[0] for r in racks), in_rack / total)


def with_members(p: Plan, members, newcomers=(), weighting="work") -> Plan:
  """`p` restricted to the workers of `members` (a round's membership).

  Workers outside `members` (dropped: dead, stalled, cut off) are taken out
  of every group and left alone in singleton groups, so no collective waits
  for them; the members' weights are renormalized within their groups. With
  newcomers, the round is a sync of all members, so a newcomer takes the
  current model whatever group it would have been in.
  """
  n = len(p.local_steps)
  members = set(members)
  if len(members) == n and not newcomers:
    return p
  if newcomers:
    return _members_together(p, members, weighting)
  kept = tuple(g2 for g2 in (tuple(i for i in g if i in members)
                             for g in p.groups) if g2)
  groups = kept + tuple((i,) for i in range(n) if i not in members)
  weights, scales = weights_and_scales(groups, p.local_steps, weighting)
  return dataclasses.replace(p, groups=groups, weights=weights,
                             update_scales=scales)


def with_sound_groups(p: Plan, members, sound, weighting="work") -> Plan:
  """`p` with no group of members left without a sound one (`sound[j]`:
  worker j adds its model, see `healthy_weight`).

  A group whose members are all poisoned (non-finite weights) has no model
  to take: a poisoned worker alone in its group kept its NaN weights and
  slots. While any member is sound, such a round becomes a sync of all
  members, as a round with newcomers does, so the poisoned take the sound
  members' model in this round (its group is the one global syncs use:
  nothing new to set up). With no sound member at all, `p` is returned.
  """
  members = set(members)
  with_sound = [any(sound[i] for i in g) for g in p.groups if g[0] in members]
  if all(with_sound) or not any(with_sound):
    return p
  return _members_together(p, members, weighting)


def _members_together(p: Plan, members, weighting) -> Plan:
  """`p` as a sync of all `members` (a set); the others alone."""
  n = len(p.local_steps)
  groups = (tuple(sorted(members)),) + tuple(
      (i,) for i in range(n) if i not in members)
  weights, scales = weights_and_scales(groups, p.local_steps, weighting)
  return dataclasses.replace(p, groups=groups, weights=weights,
                             update_scales=scales, global_sync=True)


def with_arrivals(p: Plan, members, steps, exhausted,
                  weighting="work") -> Tuple[Plan, bool]:
  """`p` as the members really arrived: (plan, epoch over?).

  A member whose data for the epoch ran out (`exhausted`) arrives with the
  steps it took (maybe 0: it idles through the rounds until every member's
  data has run out). In a round with such a member, weights follow the
  steps really taken, so a member that took none adds nothing and takes its
  group's model. When every member is exhausted the epoch is over on all of
  them at once, and the round averages all members together. Without an
  exhausted member `p` is returned unchanged.
  """
  members = tuple(sorted(members))
  if not any(exhausted[i] for i in members):
    return p, False
  over = all(exhausted[i] for i in members)
  n = len(p.local_steps)
  if over:
    groups = (members,) + tuple((i,) for i in range(n) if i not in members)
  else:
    groups = p.groups
  taken = [max(0, int(steps[i])) for i in range(n)]
  weights, scales = [0.0] * n, [1.0] * n
  for g in groups:
    work = sum(taken[i] for i in g)
    for i in g:
      if work == 0:  # nothing new anywhere in the group: a plain mean
        weights[i] = 1.0 / len(g)
      elif weighting == "work":
        weights[i] = taken[i] / work
      else:  # "equal", "normalized": equal among those that took steps
        weights[i] = (1.0 / sum(1 for j in g if taken[j]) if taken[i]
                      else 0.0)
  return dataclasses.replace(
      p, groups=groups, weights=tuple(weights), update_scales=tuple(scales),
      global_sync=p.global_sync or over, epoch_end=p.epoch_end or over), over


def quantized(p: Plan, quantum: int, weighting="work") -> Plan:
  """`p` with every k_i rounded up to a whole number of `quantum` steps.

  Keras runs `steps_per_execution` steps per call; with k_i a multiple of
  it (and rounds starting at a call's start) every round, the epoch's last
  included, ends with a call, and no step runs past an epoch's end.
  """
  if quantum <= 1:
    return p
  steps = tuple(-(-k // quantum) * quantum for k in p.local_steps)
  if steps == p.local_steps:
    return p
  weights, scales = weights_and_scales(p.groups, steps, weighting)
  return dataclasses.replace(p, local_steps=steps, weights=weights,
                             update_scales=scales)


def _split_exactly(rates, total):
  """Integers >= 1, each within one of total * rate / sum(rates), that add
  up to `total` (largest remainders; `total` >= len(rates))."""
  ideal = [total * r / sum(rates) for r in rates]
  steps = [max(1, int(math.floor(x))) for x in ideal]
  order = sorted(range(len(steps)), key=lambda i: ideal[i] - steps[i])
  while sum(steps) < total:  # most under their share first
    i = order.pop()
    steps[i] += 1
  for i in order:  # the 1-step floor overshot: most over their share first
    if sum(steps) == total:
      break
    if steps[i] > 1:
      steps[i] -= 1
  return tuple(steps)


def fit_to_epoch(p: Plan, remaining_steps: int, weighting="work") -> Plan:
  """Shrinks `p` so the cluster's steps end the epoch with this round.

  An epoch is a data set's worth of steps over the whole cluster (fast
  workers take more of them). When this round's planned steps reach the
  remaining ones, every worker's k_i is scaled down in proportion (at least
  1), the round becomes global, and `epoch_end` is set: all workers end the
  epoch at the same round boundary.
  """
  planned = sum(p.local_steps)
  # Less than half a round would be left after this one: rather than end
  # the epoch with a runt round, this round takes those steps too.
  if remaining_steps >= 1.5 * planned + len(p.local_steps):
    return p
  # Shrink (or stretch) the time budget, not the arrival order: k_i is
  # rate_i * T' split so the cluster's steps add up to exactly what is left
  # (an epoch is one pass over the data), each worker within one of its
  # steps of T' (and at least 1 step).
  budget = max(remaining_steps, len(p.rates)) / sum(p.rates)
  steps = _split_exactly(p.rates, max(remaining_steps, len(p.rates)))
  groups = (tuple(range(len(steps))),)
  weights, scales = weights_and_scales(groups, steps, weighting)
  return dataclasses.replace(
      p, time_budget=budget, local_steps=steps, groups=groups,
      weights=weights, update_scales=scales, global_sync=True, epoch_end=True)


def effective_group_size(plan: Plan, me: int) -> float:
  """How many members' worth of independent gradient noise the weighted
  average of `me`'s group holds: (sum w)^2 / sum w^2 over the group's
  weights (its size for equal weights, 1 alone, less when some weigh more).
  Adam's second moment is rescaled by it (`optimizer_state=
  "group_variance"`)."""
  weights = [plan.weights[j] for j in plan.group_of(me)]
  squares = sum(w * w for w in weights)
  if squares <= 0:
    return 1.0
  return max(1.0, sum(weights) ** 2 / squares)
