"""The planner: step-rate table in, plan for the next round out.

Pure Python (no TensorFlow): every member runs `plan()` on the same table
snapshot (the chief's round decision carries it, see membership.py) and the
same config, and so gets the same plan, byte for byte: the chief decides who
is in a round, never what the plan is. `Plan.digest()` is the short hash
workers log every round to show it. The table and plan are in records.py;
how a round's events change its plan, in plan_changes.py.

Words (docs/DESIGN.md): a *round* ends at an averaging point; worker i runs
`local_steps[i] ≈ rate_i · T` steps in it, so fast and slow workers arrive
together; the time budget `T` comes from a period rule; *groups* average
together every round and all workers every `global_every` rounds.
"""

import dataclasses
import math
import statistics
from typing import Optional
from typing import Sequence

import numpy as np

from oscars_tf.policy import period_rules
from oscars_tf.policy.planner_state import PlannerState
from oscars_tf.policy.records import Plan
from oscars_tf.policy.records import StepRateTable

PROBE_STEPS = 2  # steps per worker in rounds planned before any rate is known
# Groups are at most this large unless the schedule says otherwise: a ring
# all-reduce takes 2(N-1) steps one after another, each paying a message's
# latency (about a millisecond over gRPC), so a ring of 64 costs ~0.1 s
# whatever the model's size, one of 1,024 two seconds; and a bigger group
# is likelier to hold a late member that all wait for. A global sync is
# no such group: it goes host by host (plan_changes.host_part).
DEFAULT_MAX_GROUP_SIZE = 64
# Distinct non-global groupings a run makes unless the schedule says
# otherwise; then the best-fitting one already made is reused (see
# stable_groups).
DEFAULT_MAX_GROUPINGS = 16


def usable_rates(table: StepRateTable, round_: int, max_staleness: int):
  """Rates to plan with: bad or stale entries replaced by the median.

  A missing, non-finite, non-positive or stale (measured more than
  `max_staleness` rounds ago) rate is ignored, and the worker is planned at
  the median of the good rates (1.0 if there are none), so one bad row never
  crashes or skews the plan. The plan names those workers (`imputed`); the
  caller logs when that set changes, not every round.
  """
  entries = table.entries
  # Column by column (10,000 workers: a Python test per row took 10 ms).
  rates = np.array([e.rate if isinstance(e.rate, float) else math.nan
                    for e in entries], np.float64)
  rounds = np.array([e.round for e in entries], np.float64)
  with np.errstate(invalid="ignore"):
    ok = (np.isfinite(rates) & (rates > 0) & (rounds >= 0) &
          (round_ - rounds <= max_staleness))
  good = rates[ok].tolist()
  fill = statistics.median(good) if good else 1.0
  return (tuple(np.where(ok, rates, fill).tolist()),
          tuple(np.flatnonzero(~ok).tolist()))


def make_groups(rates: Sequence[float], hosts: Sequence[str], grouping: str,
                max_group_size: Optional[int]):
  """Groups for a non-global round; every worker in exactly one group.

  "host": workers of one host together (their averaging can use NCCL),
  split by speed when a host has more than `max_group_size`.
  "speed": workers of similar rate together, `max_group_size` at most.
  "global": everyone together.
  `max_group_size` None means DEFAULT_MAX_GROUP_SIZE.
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
    size = max_group_size or DEFAULT_MAX_GROUP_SIZE
    chunks = [ordered[j:j + size] for j in range(0, len(ordered), size)]
    if len(chunks) > 1 and len(chunks[-1]) == 1:  # no one averages alone
      chunks[-2].extend(chunks.pop())
    groups.extend(tuple(sorted(c)) for c in chunks)
  return tuple(sorted(groups))


REGROUP_SPREAD = 1.25  # groups whose rates are this close are kept as is
REGROUP_GAIN = 1.25    # else kept unless a regroup narrows them this much


def _spread(groups, rates):
  """The widest ratio of fastest to slowest rate inside one group (numpy:
  this runs over every known grouping at 10,000 workers)."""
  order = np.fromiter((i for g in groups for i in g), np.int64)
  starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
  r = np.asarray(rates, np.float64)[order]
  return float(np.max(np.maximum.reduceat(r, starts) /
                      np.minimum.reduceat(r, starts)))


def stable_groups(previous, fresh, rates, known=(), max_groupings=None):
  """(groups for this round, every grouping made so far).

  `previous` groups stay unless the table really changed, else `fresh`.
  Regrouping on every wobble of the rates makes a new group almost every
  round (each a new group resolution, and on GPUs a new NCCL communicator).
  The previous groups stay while their rates are close, or while a regroup
  would not narrow them by REGROUP_GAIN: a worker that became 4x slower
  moves, 5 % noise moves no one.

  Rates that drift for ever would still make new groups for ever, and
  TensorFlow keeps every group it resolved (and its communicator) for the
  process's life. So once `max_groupings` distinct groupings (`known`) were
  made, a regroup takes the known one that fits the rates best (and only
  if it is narrower than `previous`): a run's groups stay within
  max_groupings x (workers / group size), plus those its membership changes
  make.
  """
  previous = tuple(tuple(g) for g in previous)
  known = tuple(tuple(tuple(g) for g in gs) for gs in known)
  limit = max_groupings or DEFAULT_MAX_GROUPINGS
  n = len(rates)
  if any(r <= 0 or not math.isfinite(r) for r in rates):
    return fresh, known
  if (not previous or sorted(i for g in previous for i in g)
      != list(range(n))):
    return _made(fresh, known, limit, rates)
  kept = _spread(previous, rates)
  if kept <= REGROUP_SPREAD or kept <= REGROUP_GAIN * _spread(fresh, rates):
    return previous, known
  return _made(fresh, known, limit, rates, previous, kept)


def _made(fresh, known, limit, rates, previous=None, kept=math.inf):
  """`fresh` if known or the budget allows one more grouping, else the best
  known grouping that is narrower than `previous` (or `previous`)."""
  if fresh in known:
    return fresh, known
  if len(known) < limit:
    return fresh, known + (fresh,)
  usable = [gs for gs in known if sum(map(len, gs)) == len(rates)]
  best = min(usable, key=lambda gs: _spread(gs, rates), default=None)
  if best is not None and _spread(best, rates) < kept:
    return best, known
  return (previous if previous is not None else best or fresh), known


def plan(table: StepRateTable, config, round_: int,
         state: Optional[PlannerState] = None) -> Plan:
  """The plan for round `round_` (see module docstring).

  Args:
    table: the step-rate table snapshot every worker holds.
    config: an `oscars_tf.schedules.Adaptive` (or any object with its
      attributes: the `schedules.Schedule` interface and Adaptive's own);
      only read.
    round_: the round to plan, 0 for the first.
    state: the previous plan's `state`, or None for the first round.
  """
  n = table.size
  if n < 1:
    raise ValueError("plan: the table has no workers.")
  rates, bad = usable_rates(table, round_, config.max_staleness)
  if state is None:
    state = PlannerState(
        config.period_rule.init(float(config.initial_period)),
        global_every=config.global_every)
  asked = config.period_rule.update(state.rule, table, config)
  period = min(max(asked.period, config.min_period), config.max_period)
  fastest, slowest = max(rates), min(rates)
  median = statistics.median(rates)
  stragglers = tuple(i for i, r in enumerate(rates)
                     if r < config.straggler_ratio * median)
  # T is about the fastest worker's `period` steps, rounded to a whole number
  # of the slowest worker's steps; every worker takes k_i = rate_i * T to the
  # nearest step and so arrives within half of one of its own steps of T (the
  # slowest, at T), then as many more as end by the latest of those
  # arrivals. T never drops below one step of the slowest worker: a
  # straggler takes one step and is waited for no longer than that.
  time_budget = _whole_slow_steps(max(period / fastest, 1.0 / slowest),
                                  slowest)
  overshoot = config.max_overshoot
  target = config.min_utilization
  if target is not None:
    time_budget = _budget_for_utilization(
        rates, time_budget, slowest, target, overshoot,
        config.max_period / fastest)
  local_steps = _all_steps_in(rates, time_budget, overshoot)
  if len(bad) == n:  # nothing measured yet: short, equal probe rounds
    local_steps = (max(1, min(PROBE_STEPS, int(period))),) * n
    time_budget = local_steps[0] / slowest  # all planned at the same rate

  since = state.rounds_since_global + 1
  global_sync = since >= state.global_every or config.grouping == "global"
  kept, groupings = state.groups, state.groupings
  if global_sync:
    groups = (tuple(range(n)),)
  else:
    groups, groupings = stable_groups(
        kept, make_groups(rates, table.hosts, config.grouping,
                          config.max_group_size), rates, state.groupings,
        config.max_groupings)
    kept = groups
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
      state, rule=dataclasses.replace(asked, period=period),
      global_every=global_every,
      rounds_since_global=0 if global_sync else since,
      previous_global=round_ > 0 and state.rounds_since_global == 0,
      groups=tuple(tuple(g) for g in kept), groupings=groupings)
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
  state = state or PlannerState(period_rules.ConstantState(float(every)),
                                global_every=1)
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


def _all_steps_in(rates, budget, overshoot=None):
  """k_i = rate_i * T to the nearest step (>= 1) for every worker: each
  arrives within half a step of T, early or late; then the steps that fit
  before the latest arrival (`_steps_array`). (Flooring would make
  measured rates a hair under nominal cost the fast workers a whole step of
  idling every round.) Vectorized: 10,000 workers in a millisecond."""
  return tuple(_steps_array(np.asarray(rates, float), budget,
                            overshoot).astype(np.int64).tolist())


def _steps_array(rates, budget, overshoot=None):
  """`_all_steps_in` as a float array. With `overshoot`, one step fewer
  (>= 1) for every worker whose k_i would arrive more than `overshoot` x T
  late: with many workers, one whose rate x T is just under 1.5 rounds up
  to 2 steps and arrives a third of T late; the round waits for the latest
  arrival, so that rounding costs everyone.

  The round ends at its latest planned arrival, not at T: every worker then
  takes as many whole steps as end by it (never later), so none waits a
  whole step of its own or more (1,024 lognormal workers, sigma 0.5: the
  planned compute share 0.80 -> 0.93 at the same round length)."""
  k = np.maximum(1.0, np.floor(rates * budget + 0.5))
  if overshoot is not None:
    k = np.where((k > 1) & (k / rates > budget * (1.0 + overshoot)), k - 1, k)
  return np.maximum(k, np.floor(rates * (k / rates).max()))


def planned_utilization(local_steps, rates):
  """The round's compute share if every worker runs at its rate: the
  members' compute over n times the latest arrival (the round ends there)."""
  return _compute_share(np.asarray(local_steps, float) /
                        np.asarray(rates, float))


def _compute_share(compute):
  return float(compute.sum() / (len(compute) * compute.max()))


def _budget_for_utilization(rates, budget, slowest, target, overshoot,
                            longest):
  """The shortest T of whole slowest steps from `budget` up to `longest`
  whose planned utilization reaches `target` (else the best of them).

  Whole steps waste up to a step per worker and round, and the round waits
  for the latest arrival: with lognormal rates (sigma 0.5) over 1,024
  workers the median worker takes about 5 steps in one slowest step, and
  a round of that length is 75 % compute. Vectorized: at 10,000 workers
  each candidate costs well under a millisecond."""
  r = np.asarray(rates, float)
  first = max(1, round(budget * slowest))
  best_u, best_b = -1.0, budget
  for count in range(first, max(first, int(longest * slowest)) + 1):
    b = count / slowest
    u = _compute_share(_steps_array(r, b, overshoot) / r)
    if u > best_u:
      best_u, best_b = u, b
    if u >= target:
      break
  return best_b


def _whole_slow_steps(budget, slowest):
  """T rounded to a whole number of the slowest worker's steps (>= 1).

  The slowest worker's k is small, so flooring rate * T would leave it idle
  for up to one of its (long) steps every round; a budget it fills exactly
  costs the fast workers less than one of their (short) steps instead.
  """
  return max(1, round(budget * slowest)) / slowest


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
