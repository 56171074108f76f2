"""When and with whom to average: schedules are pure policy (no TensorFlow).

A schedule turns the step-rate table into the plan of the next round (see
planner.py). The strategy keeps the counters and runs the collectives; a
schedule only does arithmetic, so it is testable without a cluster and gives
the same answer on every worker. Period rules (policy/period_rules.py) are
pure `init` / `update` over a state of their own, composed into
`Adaptive`.
"""

import functools
import hashlib
import json
import warnings

from oscars_tf import arguments
from oscars_tf.policy import period_rules
from oscars_tf.policy import planner


class Schedule:
  """Base class: a deterministic rule for the next round's plan.

  The attributes below are what the planner (policy/planner.py) and the
  round book (protocol/round_book.py) read of any schedule, with the
  defaults a schedule that sets none of them has (`Fixed`); `Adaptive`
  sets each from its arguments.

  Attributes:
    weighting: "work": how members' models are weighted in a group
      (WEIGHTINGS).
    max_group_size: None: the bound on a group's size and on the host
      leaders a global sync's ring holds (None: planner's
      DEFAULT_MAX_GROUP_SIZE).
    max_groupings: None: distinct groupings a run makes (None: planner's
      DEFAULT_MAX_GROUPINGS).
    max_overshoot: None: how far past T a worker's steps may arrive (None:
      half a step).
    min_utilization: None: the planned compute share T grows to reach
      (None: off).
  """

  weighting = "work"
  max_group_size = None
  max_groupings = None
  max_overshoot = None
  min_utilization = None

  def plan(self, table, round_, state=None):
    """The `records.Plan` of round `round_` (state: previous plan's)."""
    raise NotImplementedError

  def config(self) -> dict:
    """A JSON-able description; workers must agree on it."""
    raise NotImplementedError

  def fingerprint(self) -> int:
    """24 bits that differ when `config()` differs (exact in float32)."""
    text = json.dumps(self.config(), sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:3], "big")

  def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in self.config().items()
                     if k != "schedule")
    return f"{type(self).__name__}({args})"


class Fixed(Schedule):
  """Periodic model averaging: every `every` local steps, all workers.

  Local SGD with a constant period (Stich, "Local SGD Converges Fast and
  Communicates Little", ICLR 2019; PyTorch's `PeriodicModelAverager`).
  `every=1` averages after every step: synchronous model averaging, which for
  plain SGD equals synchronous data-parallel SGD — the baseline.

  Args:
    every: positive int, local steps between averaging points.
    warmup_steps: int >= 0 (default 0); the first `warmup_steps` steps are
      each followed by an averaging (as PyTorch's averager's warm-up stage).

  Example:
    strategy = oscars_tf.OscarsStrategy(schedule=oscars_tf.schedules.Fixed(8))
  """

  def __init__(self, every: int = 8, warmup_steps: int = 0):
    self.every = arguments.positive_int("Fixed", "every", every)
    warmup_steps = arguments.int_at_least("Fixed", "warmup_steps",
                                          warmup_steps, 0)
    if every == 1 and warmup_steps:
      warnings.warn("Fixed(every=1) averages every step already; "
                    "`warmup_steps` has no effect.", stacklevel=2)
    self.warmup_steps = warmup_steps

  def plan(self, table, round_, state=None):
    return planner.fixed_plan(table, self.every, self.warmup_steps, round_,
                                state)

  def config(self):
    return {"schedule": "Fixed", "every": self.every,
            "warmup_steps": self.warmup_steps}


# Period rules (policy/period_rules.py), under the names users know them by.
Constant = period_rules.Constant
AdaComm = period_rules.AdaComm
CostAware = period_rules.CostAware
QuadraticSync = period_rules.QuadraticSync
DivergenceBand = period_rules.DivergenceBand


GROUPINGS = ("host", "speed", "global")
WEIGHTINGS = ("work", "equal", "normalized")
# Adaptive's default floor on a round's planned compute share: issue 14's
# 97 % at 1,024 lognormal workers, with a margin for rounds planned on
# imputed rates (benchmarks/control_plane.py: 0.970 to 0.976 over 3 seeds).
DEFAULT_MIN_UTILIZATION = 0.975


class Adaptive(Schedule):
  """Oscars: rounds of equal time, local steps by speed, adaptive period.

  Each round has a time budget T = period / (fastest rate); worker i runs
  k_i = round(rate_i * T) >= 1 local steps, then as many whole steps as end
  by the round's latest planned arrival, so all workers reach the averaging
  point together and none idles a whole step of its own. Groups (same host
  first, then similar speed) average every round; all workers every
  `global_every` rounds (adapted to the measured divergence). See
  planner.plan.

  Args (defaults work without tuning):
    period_rule: CostAware() (default: AdaComm's period, never shorter than
      the measured cost of averaging allows), AdaComm(), QuadraticSync(),
      DivergenceBand() or Constant(): how the period (steps of the fastest
      worker) changes.
    initial_period: 16, the period before the rule has data.
    min_period / max_period: 1 / 256, bounds of the period. (With a rule
      that does not weigh the averaging's cost, a floor of about 8 keeps
      an averaging point's fixed cost small against the round.)
    grouping: "host" (default), "speed" or "global". Groups change only
      when the table really does (a worker whose speed changed moves; rate
      noise moves no one), so a run makes few distinct groups.
    max_group_size: None (default: at most 64 members,
      planner.DEFAULT_MAX_GROUP_SIZE, which keeps a ring all-reduce's
      2(N-1) latencies near 0.1 s) or an int >= 2. A global sync goes
      host by host and keeps every ring within it too (racks of hosts past
      it).
    max_groupings: None (default: 16) or an int >= 1: the most distinct
      groupings a run makes; past them a regroup reuses the best fitting
      one made before, so drifting rates never make new collective groups
      (and NCCL communicators, which TensorFlow keeps) for ever.
    global_every: 4, rounds between global syncs (when groups are smaller
      than the cluster); adapted within [1, max_global_every=64] when
      `adaptive_global`, from the divergence measured at each global sync
      (how far groups drifted apart) against divergence_low / _high. It may
      start above max_global_every (1000: global syncs all but never);
      the first adaptation brings it within.
    weighting: "work" (default: by local steps), "equal", or "normalized"
      (FedNova: each member's update divided by its local steps, so fast
      workers don't bias the model).
    straggler_ratio: 0.25; a worker below this fraction of the median rate
      is flagged a straggler; T never drops below one of its steps.
    max_staleness: 3 rounds; older table rows are ignored with a warning.
    max_overshoot: None (default: k_i is rate_i * T to the nearest step, so
      a worker may arrive up to half of one of its steps past T) or a float
      >= 0: a worker whose nearest step count would arrive more than this
      fraction of T late takes one step fewer (at least 1), so with many
      workers no one but a straggler holds the round much past T (1,024
      lognormal workers: rounds a fifth shorter, the compute share 0.92
      instead of 0.93). Either way every worker then takes as many whole
      steps as end by the round's latest planned arrival.
    min_utilization: 0.975 (default, DEFAULT_MIN_UTILIZATION), a float in
      (0, 1], or None (off: T is the period rule's): T grows by whole
      steps of the slowest worker (up to `max_period` steps of the
      fastest) until the round's planned compute share reaches it. Whole
      steps cost a cluster of widely spread speeds a few percent of its
      time (1,024 lognormal workers, sigma 0.5: 0.945 at the period rule's
      T, 0.970 to 0.976 with T about 2.5x longer); a cluster whose speeds
      are near whole multiples of each other keeps the period rule's T.
      The price of a longer T is fewer averagings.

  Example:
    strategy = oscars_tf.OscarsStrategy(schedule=oscars_tf.schedules.Adaptive())
  """

  def __init__(self, period_rule=None, initial_period=16, min_period=1,
               max_period=256, grouping="host", max_group_size=None,
               max_groupings=None,
               global_every=4, adaptive_global=True, max_global_every=64,
               divergence_low=0.005, divergence_high=0.05, weighting="work",
               straggler_ratio=0.25, max_staleness=3, max_overshoot=None,
               min_utilization=DEFAULT_MIN_UTILIZATION):
    self.period_rule = CostAware() if period_rule is None else period_rule
    if not period_rules.is_rule(self.period_rule):
      raise TypeError("Adaptive: `period_rule` must be CostAware(), "
                      "AdaComm(), QuadraticSync(), DivergenceBand() or "
                      f"Constant(), got {period_rule!r}.")
    count = functools.partial(arguments.positive_int, "Adaptive")
    number = functools.partial(arguments.positive_number, "Adaptive")
    self.initial_period = count("initial_period", initial_period)
    self.min_period = count("min_period", min_period)
    self.max_period = count("max_period", max_period)
    if not self.min_period <= self.initial_period <= self.max_period:
      raise ValueError("Adaptive: need min_period <= initial_period <= "
                       f"max_period, got {min_period}, {initial_period}, "
                       f"{max_period}.")
    self.grouping = arguments.one_of("Adaptive", "grouping", grouping,
                                     GROUPINGS)
    self.max_group_size = _group_size_bound(max_group_size)
    self.max_groupings = (None if max_groupings is None else
                          count("max_groupings", max_groupings))
    self.global_every = count("global_every", global_every)
    self.max_global_every = count("max_global_every", max_global_every)
    self.adaptive_global = arguments.boolean("Adaptive", "adaptive_global",
                                             adaptive_global)
    self.divergence_low = number("divergence_low", divergence_low)
    self.divergence_high = number("divergence_high", divergence_high)
    if self.divergence_low >= self.divergence_high:
      raise ValueError("Adaptive: need divergence_low < divergence_high, "
                       f"got {divergence_low}, {divergence_high}.")
    self.weighting = arguments.one_of("Adaptive", "weighting", weighting,
                                      WEIGHTINGS)
    self.straggler_ratio = number("straggler_ratio", straggler_ratio)
    self.max_staleness = arguments.int_at_least(
        "Adaptive", "max_staleness", max_staleness, 0)
    self.max_overshoot = _overshoot_bound(max_overshoot)
    self.min_utilization = _utilization_target(min_utilization)

  def plan(self, table, round_, state=None):
    return planner.plan(table, self, round_, state)

  def config(self):
    out = {k: v for k, v in vars(self).items() if k != "period_rule"}
    out["period_rule"] = self.period_rule.config()
    out["schedule"] = "Adaptive"
    return out


# Each returns a plain Python int or float (a NumPy scalar given goes into
# the schedule's JSON fingerprint, which the workers compare at start).


def _group_size_bound(value):
  """Adaptive's `max_group_size`: None or an int >= 2."""
  if value is None:
    return None
  if arguments.positive_int("Adaptive", "max_group_size", value) < 2:
    arguments.fail("Adaptive", "max_group_size", "None or >= 2", value)
  return int(value)


def _overshoot_bound(value):
  """Adaptive's `max_overshoot`: None or a number >= 0."""
  if value is None:
    return None
  if not (arguments.is_number(value) and value >= 0):
    arguments.fail("Adaptive", "max_overshoot", "None or a number >= 0",
                   value)
  return float(value)


def _utilization_target(value):
  """Adaptive's `min_utilization`: None or a number in (0, 1]."""
  if value is None:
    return None
  return arguments.number_in("Adaptive", "min_utilization", value, 0, 1,
                             include_low=False, include_high=True)


class OuterMomentum:
  """Outer optimizer on the averaged model at global syncs (SlowMo, DiLoCo).

  At every global sync the change since the previous one, averaged over the
  workers, is treated as a gradient: delta = start - average;
  m = momentum * m + delta; the model becomes
  start - learning_rate * (delta + momentum * m) (Nesterov) or
  start - learning_rate * m. Wang et al., "SlowMo: Improving
  Communication-Efficient Distributed SGD with Slow Momentum", ICLR 2020;
  Douillard et al., "DiLoCo", 2023 (learning_rate=0.7, momentum=0.9).
  `learning_rate=1, momentum=0` is plain averaging.

  Only the model's trainable weights take the outer step; non-trainable
  weights (BatchNorm's moving statistics) and averaged optimizer slots take
  the plain average. A worker that rejoins after it was dropped takes the
  others' start and momentum with the model, and `checkpoint.save(...,
  strategy=)` saves them (see `oscars_tf/distribute/outer.py`).

  Example:
    OscarsStrategy(outer_optimizer=oscars_tf.schedules.OuterMomentum())
  """

  def __init__(self, learning_rate=1.0, momentum=0.5, nesterov=True):
    self.learning_rate = arguments.positive_number(
        "OuterMomentum", "learning_rate", learning_rate)
    self.momentum = arguments.number_in("OuterMomentum", "momentum", momentum,
                                        0, 1)
    self.nesterov = arguments.boolean("OuterMomentum", "nesterov", nesterov)

  def config(self):
    return {"outer": "OuterMomentum", "learning_rate": self.learning_rate,
            "momentum": self.momentum, "nesterov": self.nesterov}

  fingerprint = Schedule.fingerprint

  def __repr__(self):
    return (f"OuterMomentum(learning_rate={self.learning_rate}, "
            f"momentum={self.momentum}, nesterov={self.nesterov})")
