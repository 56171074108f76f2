"""The planner: step-rate table in, plan for the next round out.

Pure Python (no TensorFlow): every member runs `plan()` on the same table
snapshot (the chief's round decision carries it, see membership.py) and the
same config, and so gets the same plan, byte for byte: the chief decides who
is in a round, never what the plan is. `Plan.digest()` is the short hash
workers log every round to show it. `with_members` takes the workers dropped
from a round out of its groups.

Words (DESIGN.md): a *round* ends at an averaging point; worker i runs
`local_steps[i] ≈ rate_i · T` steps in it, so fast and slow workers arrive
together; the time budget `T` comes from a period rule; *groups* average
together every round and all workers every `global_every` rounds.
"""

import dataclasses
import hashlib
import json
import math
import statistics
from typing import Optional, Sequence, Tuple


PROBE_STEPS = 2  # steps per worker in rounds planned before any rate is known
FIELDS = ("rate", "round", "loss", "divergence", "learning_rate", "steps",
          "healthy", "exhausted")


@dataclasses.dataclass(frozen=True)
class TableEntry:
  """One worker's row: what it measured, and in which round."""
  rate: float = math.nan           # compute steps/s (EMA), waits excluded
  round: int = -1                  # round the row was measured in
  loss: float = math.nan           # training loss at that round's end
  divergence: float = math.nan     # distance from the group mean / its norm
  learning_rate: float = math.nan  # the optimizer's learning rate then
  steps: int = 0                   # local steps it ran in that round
  healthy: bool = True             # its weights were all finite then
  exhausted: bool = False          # its data for the epoch had run out


@dataclasses.dataclass(frozen=True)
class StepRateTable:
  """The global view: a row per worker, and the host of each worker."""
  entries: Tuple[TableEntry, ...]
  hosts: Tuple[str, ...]

  def __post_init__(self):
    if len(self.entries) != len(self.hosts):
      raise ValueError("StepRateTable: one host per entry is required.")

  @classmethod
  def from_rows(cls, rows, hosts):
    """From a sequence of per-worker sequences in FIELDS order."""
    entries = []
    for row in rows:
      values = [float(x) for x in row] + [0.0] * (len(FIELDS) - len(row))
      rate, rnd, loss, div, lr, steps, healthy, exhausted = values
      entries.append(TableEntry(rate, int(rnd) if math.isfinite(rnd) else -1,
                                loss, div, lr,
                                int(steps) if math.isfinite(steps) else 0,
                                healthy > 0.5, exhausted > 0.5))
    return cls(tuple(entries), tuple(hosts))

  @property
  def size(self):
    return len(self.entries)


@dataclasses.dataclass(frozen=True)
class PlannerState:
  """What the planner carries from round to round (identical on all)."""
  period: float              # local steps of the fastest worker per round
  global_every: int          # rounds between global syncs
  rounds_since_global: int = 0
  initial_loss: float = math.nan
  groups: Tuple[Tuple[int, ...], ...] = ()  # the last non-global grouping
  previous_global: bool = False  # the round before the last was global


@dataclasses.dataclass(frozen=True)
class Plan:
  """The next round, for every worker."""
  round: int
  time_budget: float                 # T, seconds
  local_steps: Tuple[int, ...]       # k_i >= 1
  groups: Tuple[Tuple[int, ...], ...]
  weights: Tuple[float, ...]         # within each group they sum to 1
  update_scales: Tuple[float, ...]   # FedNova: tau_eff / k_i; else 1
  global_sync: bool
  stragglers: Tuple[int, ...]
  rates: Tuple[float, ...]           # the rates planned with (imputed)
  state: PlannerState
  epoch_end: bool = False            # the epoch ends with this round
  imputed: Tuple[int, ...] = ()      # planned at the median: no usable rate

  def group_of(self, worker: int) -> Tuple[int, ...]:
    for g in self.groups:
      if worker in g:
        return g
    raise KeyError(f"worker {worker} is in no group of plan {self.round}")

  def to_json(self) -> str:
    """Canonical JSON (floats to 12 significant digits) for the digest."""
    body = _map_floats(dataclasses.asdict(self),
                       lambda x: float(f"{x:.12g}") if isinstance(x, float)
                       else x)
    return json.dumps(body, sort_keys=True, separators=(",", ":"))

  def digest(self) -> str:
    """8 hex digits; equal plans have equal digests on every worker."""
    return hashlib.sha256(self.to_json().encode()).hexdigest()[:8]


def _map_floats(x, fn):
  if isinstance(x, dict):
    return {k: _map_floats(v, fn) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_map_floats(v, fn) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return repr(x)
  return fn(x)


def usable_rates(table: StepRateTable, round_: int, max_staleness: int):
  """Rates to plan with: bad or stale entries replaced by the median.

  A missing, non-finite, non-positive or stale (measured more than
  `max_staleness` rounds ago) rate is ignored, and the worker is planned at
  the median of the good rates (1.0 if there are none), so one bad row never
  crashes or skews the plan. The plan names those workers (`imputed`); the
  caller logs when that set changes, not every round.
  """
  good, bad = {}, []
  for i, e in enumerate(table.entries):
    ok = (isinstance(e.rate, float) and math.isfinite(e.rate) and e.rate > 0
          and e.round >= 0 and round_ - e.round <= max_staleness)
    if ok:
      good[i] = e.rate
    else:
      bad.append(i)
  fill = statistics.median(good.values()) if good else 1.0
  return tuple(good.get(i, fill) for i in range(table.size)), tuple(bad)


def make_groups(rates: Sequence[float], hosts: Sequence[str], grouping: str,
                max_group_size: Optional[int]):
  """Groups for a non-global round; every worker in exactly one group.

  "host": workers of one host together (their averaging can use NCCL),
  split by speed when a host has more than `max_group_size`.
  "speed": workers of similar rate together, `max_group_size` at most.
  "global": everyone together.
  """
  n = len(rates)
  if grouping == "global":
    return (tuple(range(n)),)
  if grouping == "host":
    by_host = {}
    for i, h in enumerate(hosts):
      by_host.setdefault(h, []).append(i)
    buckets = [by_host[h] for h in sorted(by_host)]
  else:
    buckets = [list(range(n))]
  groups = []
  for bucket in buckets:
    ordered = sorted(bucket, key=lambda i: (-rates[i], i))
    size = max_group_size or len(ordered)
    chunks = [ordered[j:j + size] for j in range(0, len(ordered), size)]
    if len(chunks) > 1 and len(chunks[-1]) == 1:  # no one averages alone
      chunks[-2].extend(chunks.pop())
    groups.extend(tuple(sorted(c)) for c in chunks)
  return tuple(sorted(groups))


REGROUP_SPREAD = 1.25  # groups whose rates are this close are kept as is
REGROUP_GAIN = 1.25    # else kept unless a regroup narrows them this much


def _spread(groups, rates):
  """The widest ratio of fastest to slowest rate inside one group."""
  return max(max(rates[i] for i in g) / min(rates[i] for i in g)
             for g in groups)


def stable_groups(previous, fresh, rates):
  """`previous` groups unless the table really changed, else `fresh`.

  Regrouping on every wobble of the rates makes a new group almost every
  round (each a new group resolution, and on GPUs a new NCCL communicator).
  The previous groups stay while their rates are close, or while a regroup
  would not narrow them by REGROUP_GAIN: a worker that became 4x slower
  moves, 5 % noise moves no one.
  """
  previous = tuple(tuple(g) for g in previous)
  n = len(rates)
  if (not previous or sorted(i for g in previous for i in g) != list(range(n))
      or any(r <= 0 or not math.isfinite(r) for r in rates)):
    return fresh
  kept = _spread(previous, rates)
  if kept <= REGROUP_SPREAD or kept <= REGROUP_GAIN * _spread(fresh, rates):
    return previous
  return fresh


def plan(table: StepRateTable, config, round_: int,
         state: Optional[PlannerState] = None) -> Plan:
  """The plan for round `round_` (see module docstring).

  Args:
    table: the step-rate table snapshot every worker holds.
    config: an `oscars_tf.schedules.Adaptive` (or any object with its
      fields); only read.
    round_: the round to plan, 0 for the first.
    state: the previous plan's `state`, or None for the first round.
  """
  n = table.size
  if n < 1:
    raise ValueError("plan: the table has no workers.")
  rates, bad = usable_rates(table, round_, config.max_staleness)
  if state is None:
    state = PlannerState(period=float(config.initial_period),
                         global_every=config.global_every)
  state = config.period_rule.update(state, table, config)
  period = min(max(state.period, config.min_period), config.max_period)
  fastest, slowest = max(rates), min(rates)
  median = statistics.median(rates)
  stragglers = tuple(i for i, r in enumerate(rates)
                     if r < config.straggler_ratio * median)
  # T is about the fastest worker's `period` steps, rounded to a whole number
  # of the slowest worker's steps; every worker takes k_i = rate_i * T to the
  # nearest step and so arrives within half of one of its own steps of T (the
  # slowest, at T). T never drops below one step of the slowest worker: a
  # straggler takes one step and is waited for no longer than that.
  time_budget = _whole_slow_steps(max(period / fastest, 1.0 / slowest),
                                  slowest)
  local_steps = tuple(_steps_in(r, time_budget) for r in rates)
  if len(bad) == n:  # nothing measured yet: short, equal probe rounds
    local_steps = (max(1, min(PROBE_STEPS, int(period))),) * n
    time_budget = local_steps[0] / slowest  # all planned at the same rate

  since = state.rounds_since_global + 1
  global_sync = since >= state.global_every or config.grouping == "global"
  kept = state.groups
  if global_sync:
    groups = (tuple(range(n)),)
  else:
    groups = kept = stable_groups(
        kept, make_groups(rates, table.hosts, config.grouping,
                          config.max_group_size), rates)
  if len(groups) == 1:
    global_sync = True
  weights, scales = weights_and_scales(groups, local_steps, config.weighting)
  global_every = state.global_every
  # The table's divergences were measured two rounds back (a row carries
  # the divergence of the round before it). Only one measured at a global
  # sync says how far the groups drifted apart.
  if state.previous_global and config.adaptive_global:
    global_every = _adapt_global_every(global_every, table, config)
  new_state = dataclasses.replace(
      state, period=period, global_every=global_every,
      rounds_since_global=0 if global_sync else since,
      previous_global=round_ > 0 and state.rounds_since_global == 0,
      groups=tuple(tuple(g) for g in kept))
  return Plan(round=round_, time_budget=time_budget, local_steps=local_steps,
              groups=groups, weights=weights,
              update_scales=scales, global_sync=global_sync,
              stragglers=stragglers, rates=rates, state=new_state,
              imputed=bad)


def fixed_plan(table: StepRateTable, every: int, warmup_steps: int,
               round_: int, state: Optional[PlannerState] = None,
               straggler_ratio: float = 0.25) -> Plan:
  """Periodic averaging: `every` steps for everyone, all workers together."""
  n = table.size
  rates, _ = usable_rates(table, round_, max_staleness=3)
  k = 1 if round_ < warmup_steps else every
  median = statistics.median(rates)
  state = state or PlannerState(period=float(every), global_every=1)
  return Plan(round=round_, time_budget=k / median, local_steps=(k,) * n,
              groups=(tuple(range(n)),), weights=(1.0 / n,) * n,
              update_scales=(1.0,) * n, global_sync=True,
              stragglers=tuple(i for i, r in enumerate(rates)
                               if r < straggler_ratio * median),
              rates=rates, state=state)


def weights_and_scales(groups, local_steps, weighting):
  """Averaging weights and FedNova update scales for each worker."""
  n = len(local_steps)
  weights, scales = [0.0] * n, [1.0] * n
  for g in groups:
    work = sum(local_steps[i] for i in g)
    for i in g:
      weights[i] = (local_steps[i] / work if weighting == "work"
                    else 1.0 / len(g))  # "equal", "normalized"
    if weighting == "normalized":  # FedNova: scale updates by tau_eff / k_i
      tau = sum(weights[i] * local_steps[i] for i in g)
      for i in g:
        scales[i] = tau / local_steps[i]
  return tuple(weights), tuple(scales)


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
  inside its host, then the host leaders' weighted sum, sent back down."""
  host: Tuple[int, ...]      # the members on this worker's host
  weight_in_host: float      # this worker's weight in its host's average
  leaders: Tuple[int, ...]   # the lowest member of each host
  host_share: float          # this host's weight among the hosts


def host_part(p: Plan, me: int, hosts, members, sound) -> HostPart:
  """`me`'s part in a hierarchical global sync of `members`.

  Only sound members (finite weights, not rejoining) carry weight, as in
  `healthy_weight`: a host's share is its sound weight over all the sound
  weight, so the composed weights are the flat healthy weights and the
  model keeps its scale when a member is poisoned or rejoining.
  """
  members = sorted(members)
  host = tuple(i for i in members if hosts[i] == hosts[me])
  leaders = tuple(sorted({min(i for i in members if hosts[i] == hosts[j])
                          for j in members}))
  w = [p.weights[i] if sound[i] else 0.0 for i in range(len(p.weights))]
  total = sum(w[i] for i in members)
  in_host = sum(w[i] for i in host)
  if total <= 0:  # nothing sound anywhere: a plain mean keeps the weights
    return HostPart(host, 1.0 / len(host), leaders, len(host) / len(members))
  return HostPart(host, w[me] / in_host if in_host > 0 else 0.0, leaders,
                  in_host / total)


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
    kept = (tuple(sorted(members)),)
  else:
    kept = tuple(g2 for g2 in (tuple(i for i in g if i in members)
                               for g in p.groups) if g2)
  groups = kept + tuple((i,) for i in range(n) if i not in members)
  weights, scales = weights_and_scales(groups, p.local_steps, weighting)
  return dataclasses.replace(p, groups=groups, weights=weights,
                             update_scales=scales,
                             global_sync=p.global_sync or bool(newcomers))


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


def _steps_in(rate, budget):
  """k = rate * T to the nearest step (>= 1): a worker arrives within half a
  step of T, early or late. (Flooring would make measured rates a hair under
  nominal cost the fast workers a whole step of idling every round.)"""
  return max(1, int(math.floor(rate * budget + 0.5)))


def _whole_slow_steps(budget, slowest):
  """T rounded to a whole number of the slowest worker's steps (>= 1).

  The slowest worker's k is small, so flooring rate * T would leave it idle
  for up to one of its (long) steps every round; a budget it fills exactly
  costs the fast workers less than one of their (short) steps instead.
  """
  return max(1, round(budget * slowest)) / slowest


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


def _adapt_global_every(current, table, config):
  """Fewer global syncs while groups stay close, more when they drift
  (`table`'s divergences measured at a global sync)."""
  divs = [e.divergence for e in table.entries if math.isfinite(e.divergence)]
  if not divs:
    return current
  d = max(divs)
  if d > config.divergence_high:
    return max(1, current // 2)
  if d < config.divergence_low:
    return min(config.max_global_every, current * 2)
  return current
