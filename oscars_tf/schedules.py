"""When and with whom to average: schedules are pure policy (no TensorFlow).

A schedule turns the step-rate table into the plan of the next round (see
planner.py). The strategy keeps the counters and runs the collectives; a
schedule only does arithmetic, so it is testable without a cluster and gives
the same answer on every worker. Period rules are small objects with state
passed in and out, composed into `Adaptive`.
"""

import dataclasses
import hashlib
import json
import math
import warnings

from oscars_tf.policy import planner


def _positive_int(name, value, owner):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{owner}: `{name}` must be a positive int, got "
                     f"{value!r}.")
  return value


def _positive_float(name, value, owner):
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or
      not math.isfinite(value) or value <= 0):
    raise ValueError(f"{owner}: `{name}` must be a finite number > 0, got "
                     f"{value!r}.")
  return float(value)


class Schedule:
  """Base class: a deterministic rule for the next round's plan."""

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
    self.every = _positive_int("every", every, "Fixed")
    if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
        or warmup_steps < 0):
      raise ValueError("Fixed: `warmup_steps` must be an int >= 0, got "
                       f"{warmup_steps!r}.")
    if every == 1 and warmup_steps:
      warnings.warn("Fixed(every=1) averages every step already; "
                    "`warmup_steps` has no effect.")
    self.warmup_steps = warmup_steps

  def plan(self, table, round_, state=None):
    return planner.fixed_plan(table, self.every, self.warmup_steps, round_,
                                state)

  def config(self):
    return {"schedule": "Fixed", "every": self.every,
            "warmup_steps": self.warmup_steps}


# -- period rules: how many steps the fastest worker runs per round ---------

class Constant:
  """Keeps the period at `Adaptive.initial_period`."""

  def update(self, state, table, config):
    del table, config
    return state

  def config(self):
    return {"rule": "Constant"}


class AdaComm:
  """Period shrinks as the loss falls: H_r = H_0 * sqrt(loss_r / loss_0).

  Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best
  Error-Runtime Trade-off in Local-Update SGD", SysML 2019: long periods
  early (fast progress per second), short ones as the loss flattens (low
  error floor). loss_r is the mean of the workers' reported losses.
  """

  def update(self, state, table, config):
    losses = [e.loss for e in table.entries
              if math.isfinite(e.loss) and e.loss > 0]
    if not losses:
      return state
    loss = sum(losses) / len(losses)
    if not math.isfinite(state.initial_loss):
      return dataclasses.replace(state, initial_loss=loss)
    period = config.initial_period * math.sqrt(loss / state.initial_loss)
    return dataclasses.replace(state, period=float(math.ceil(period)))

  def config(self):
    return {"rule": "AdaComm"}


class CostAware:
  """Never averages more often than the averaging's measured cost allows.

  The period is the larger of two: what a `base` rule asks for the
  model's sake (AdaComm() by default: long early, shorter as the loss
  falls), and the shortest round whose averaging point takes at most
  `max_overhead` of it: c / (T + c) <= max_overhead, so
  T = c * (1 - max_overhead) / max_overhead, times the fastest worker's
  rate. c is what the last worker to arrive at the previous averaging
  point spent there (it waited for no one: the exchange and the collective
  only), smoothed over rounds. Cheap averaging (an even cluster on a fast
  network) leaves the base rule free, down to every step with base=None;
  expensive averaging (slow links, a large model) stretches the rounds so
  the links do not set the pace. The period is bounded by
  `Adaptive.min_period` / `max_period` like every rule's.

  Local SGD's error-runtime trade-off (Wang & Joshi, SysML 2019): the
  period weighs what a step and an averaging cost, as measured each round,
  instead of a constant tuned for one cluster.

  Args:
    max_overhead: 0.1, the share of each round averaging may take, in
      (0, 1).
    smoothing: 0.5, weight of the newest measurement in the running cost,
      in (0, 1].
    base: AdaComm() (default), another rule, or None (the cost alone).
  """

  def __init__(self, max_overhead: float = 0.1, smoothing: float = 0.5,
               base="AdaComm"):
    self.max_overhead = _positive_float("max_overhead", max_overhead,
                                        "CostAware")
    self.smoothing = _positive_float("smoothing", smoothing, "CostAware")
    if self.max_overhead >= 1 or self.smoothing > 1:
      raise ValueError("CostAware: need 0 < max_overhead < 1 and 0 < "
                       f"smoothing <= 1, got max_overhead={max_overhead!r}, "
                       f"smoothing={smoothing!r}.")
    self.base = AdaComm() if base == "AdaComm" else base
    if self.base is not None and (not hasattr(self.base, "update") or
                                  isinstance(self.base, CostAware)):
      raise TypeError("CostAware: `base` must be None or a period rule "
                      "(AdaComm(), QuadraticSync(), DivergenceBand(), "
                      f"Constant()), got {base!r}.")

  def update(self, state, table, config):
    if self.base is not None:
      # The base rule runs on its own period, not on the cost-raised one
      # (a rule that scales the last period would otherwise ratchet up).
      own = state.base_period if math.isfinite(state.base_period) else (
          state.period)
      state = self.base.update(dataclasses.replace(state, period=own),
                               table, config)
      state = dataclasses.replace(state, base_period=state.period)
    floor, cost = self.cost_floor(state, table)
    if floor is None:
      return state
    return dataclasses.replace(
        state, period=float(max(state.period if self.base else 1, floor)),
        sync_cost=cost)

  def cost_floor(self, state, table):
    """(the shortest period the cost allows, the smoothed cost), or
    (None, None) before both a cost and a rate are measured."""
    costs = [e.sync_cost for e in table.entries
             if math.isfinite(e.sync_cost) and e.sync_cost > 0]
    rates = [e.rate for e in table.entries
             if math.isfinite(e.rate) and e.rate > 0]
    if not costs or not rates:
      return None, None
    cost = min(costs)  # the last to arrive: no wait for others in it
    if math.isfinite(state.sync_cost):
      cost = self.smoothing * cost + (1 - self.smoothing) * state.sync_cost
    budget = cost * (1 - self.max_overhead) / self.max_overhead
    return max(1.0, math.ceil(budget * max(rates))), cost

  def config(self):
    return {"rule": "CostAware", "max_overhead": self.max_overhead,
            "smoothing": self.smoothing,
            "base": None if self.base is None else self.base.config()}


class QuadraticSync:
  """Quadratic synchronization rule: H = max(H_base, floor((beta / lr)^2)).

  Gu, Lyu, Arora, Huang, "Why (and When) does Local SGD Generalize Better
  than SGD?", ICLR 2023: as the learning rate decays, average less often.
  lr is the median of the learning rates the workers report.
  """

  def __init__(self, beta: float = 0.1, base_period: int = 2):
    self.beta = _positive_float("beta", beta, "QuadraticSync")
    self.base_period = _positive_int("base_period", base_period,
                                     "QuadraticSync")

  def update(self, state, table, config):
    del config
    lrs = sorted(e.learning_rate for e in table.entries
                 if math.isfinite(e.learning_rate) and e.learning_rate > 0)
    if not lrs:
      return state
    lr = lrs[len(lrs) // 2]
    period = max(self.base_period, math.floor((self.beta / lr) ** 2))
    return dataclasses.replace(state, period=float(period))

  def config(self):
    return {"rule": "QuadraticSync", "beta": self.beta,
            "base_period": self.base_period}


class DivergenceBand:
  """Keeps the replicas' measured divergence inside [low, high].

  Divergence is |w_i - mean| / |mean| just before an averaging. Above
  `high` the period is divided by `factor`; below `low` multiplied by it.
  """

  def __init__(self, low: float = 0.005, high: float = 0.05,
               factor: float = 2.0):
    self.low = _positive_float("low", low, "DivergenceBand")
    self.high = _positive_float("high", high, "DivergenceBand")
    self.factor = _positive_float("factor", factor, "DivergenceBand")
    if self.low >= self.high or self.factor <= 1:
      raise ValueError("DivergenceBand: need low < high and factor > 1, got "
                       f"low={low!r}, high={high!r}, factor={factor!r}.")

  def update(self, state, table, config):
    del config
    divs = [e.divergence for e in table.entries
            if math.isfinite(e.divergence)]
    if not divs:
      return state
    d = max(divs)
    if d > self.high:
      return dataclasses.replace(state, period=state.period / self.factor)
    if d < self.low:
      return dataclasses.replace(state, period=state.period * self.factor)
    return state

  def config(self):
    return {"rule": "DivergenceBand", "low": self.low, "high": self.high,
            "factor": self.factor}


GROUPINGS = ("host", "speed", "global")
WEIGHTINGS = ("work", "equal", "normalized")


class Adaptive(Schedule):
  """Oscars: rounds of equal time, local steps by speed, adaptive period.

  Each round has a time budget T = period / (fastest rate); worker i runs
  k_i = floor(rate_i * T) >= 1 local steps, so all workers reach the
  averaging point together and no one idles. Groups (same host first, then
  similar speed) average every round; all workers every `global_every`
  rounds (adapted to the measured divergence). See planner.plan.

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
      2(N-1) latencies near 0.1 s) or an int >= 2. A global sync is not
      bound by it: it goes host by host.
    max_groupings: None (default: 16) or an int >= 1: the most distinct
      groupings a run makes; past them a regroup reuses the best fitting
      one made before, so drifting rates never make new collective groups
      (and NCCL communicators, which TensorFlow keeps) for ever.
    global_every: 4, rounds between global syncs (when groups are smaller
      than the cluster); adapted within [1, max_global_every=64] when
      `adaptive_global`, from the divergence measured at each global sync
      (how far groups drifted apart) against divergence_low / _high.
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
      lognormal workers: the round's compute share 0.75 -> about 0.9).
    min_utilization: None (default) or a float in (0, 1]: T grows by whole
      steps of the slowest worker (up to `max_period` steps of the
      fastest) until the round's planned compute share reaches it. Whole
      steps and the wait for the latest arrival cost a cluster of widely
      spread speeds a quarter of its time when T is one slowest step; the
      price of a longer T is fewer averagings.

  Example:
    strategy = oscars_tf.OscarsStrategy(schedule=oscars_tf.schedules.Adaptive())
  """

  def __init__(self, period_rule=None, initial_period=16, min_period=1,
               max_period=256, grouping="host", max_group_size=None,
               max_groupings=None,
               global_every=4, adaptive_global=True, max_global_every=64,
               divergence_low=0.005, divergence_high=0.05, weighting="work",
               straggler_ratio=0.25, max_staleness=3, max_overshoot=None,
               min_utilization=None):
    self.period_rule = CostAware() if period_rule is None else period_rule
    if not hasattr(self.period_rule, "update"):
      raise TypeError("Adaptive: `period_rule` must be CostAware(), "
                      "AdaComm(), QuadraticSync(), DivergenceBand() or "
                      "Constant(), got "
                      f"{period_rule!r}.")
    self.initial_period = _positive_int("initial_period", initial_period,
                                        "Adaptive")
    self.min_period = _positive_int("min_period", min_period, "Adaptive")
    self.max_period = _positive_int("max_period", max_period, "Adaptive")
    if not self.min_period <= self.initial_period <= self.max_period:
      raise ValueError("Adaptive: need min_period <= initial_period <= "
                       f"max_period, got {min_period}, {initial_period}, "
                       f"{max_period}.")
    if grouping not in GROUPINGS:
      raise ValueError(f"Adaptive: `grouping` must be one of {GROUPINGS}, "
                       f"got {grouping!r}.")
    if max_group_size is not None and (
        _positive_int("max_group_size", max_group_size, "Adaptive") < 2):
      raise ValueError("Adaptive: `max_group_size` must be None or >= 2, got "
                       f"{max_group_size!r}.")
    if weighting not in WEIGHTINGS:
      raise ValueError(f"Adaptive: `weighting` must be one of {WEIGHTINGS}, "
                       f"got {weighting!r}.")
    self.grouping, self.max_group_size = grouping, max_group_size
    self.max_groupings = (None if max_groupings is None else _positive_int(
        "max_groupings", max_groupings, "Adaptive"))
    self.global_every = _positive_int("global_every", global_every, "Adaptive")
    self.max_global_every = _positive_int("max_global_every",
                                          max_global_every, "Adaptive")
    self.adaptive_global = bool(adaptive_global)
    self.divergence_low = _positive_float("divergence_low", divergence_low,
                                          "Adaptive")
    self.divergence_high = _positive_float("divergence_high", divergence_high,
                                           "Adaptive")
    self.weighting = weighting
    self.straggler_ratio = _positive_float("straggler_ratio", straggler_ratio,
                                           "Adaptive")
    if isinstance(max_staleness, bool) or not isinstance(
        max_staleness, int) or max_staleness < 0:
      raise ValueError("Adaptive: `max_staleness` must be an int >= 0, got "
                       f"{max_staleness!r}.")
    self.max_staleness = max_staleness
    if max_overshoot is not None and not (
        isinstance(max_overshoot, (int, float)) and max_overshoot >= 0):
      raise ValueError("Adaptive: `max_overshoot` must be None or a number "
                       f">= 0, got {max_overshoot!r}.")
    self.max_overshoot = max_overshoot
    if min_utilization is not None and (
        isinstance(min_utilization, bool) or
        not isinstance(min_utilization, (int, float)) or
        not 0 < min_utilization <= 1):
      raise ValueError("Adaptive: `min_utilization` must be None or a number "
                       f"in (0, 1], got {min_utilization!r}.")
    self.min_utilization = min_utilization

  def plan(self, table, round_, state=None):
    return planner.plan(table, self, round_, state)

  def config(self):
    out = {k: v for k, v in vars(self).items() if k != "period_rule"}
    out["period_rule"] = self.period_rule.config()
    out["schedule"] = "Adaptive"
    return out


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
    self.learning_rate = _positive_float("learning_rate", learning_rate,
                                         "OuterMomentum")
    if (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
        or not 0 <= momentum < 1):
      raise ValueError("OuterMomentum: `momentum` must be in [0, 1), got "
                       f"{momentum!r}.")
    self.momentum = float(momentum)
    self.nesterov = bool(nesterov)

  def config(self):
    return {"outer": "OuterMomentum", "learning_rate": self.learning_rate,
            "momentum": self.momentum, "nesterov": self.nesterov}

  fingerprint = Schedule.fingerprint

  def __repr__(self):
    return (f"OuterMomentum(learning_rate={self.learning_rate}, "
            f"momentum={self.momentum}, nesterov={self.nesterov})")
