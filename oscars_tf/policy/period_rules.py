"""Period rules: how many steps the fastest worker runs per round.

Each rule is pure policy in the style of optax's transforms: `init(period)`
makes its state, a frozen dataclass of its own, and `update(state, table,
config)` returns the next state from the round's step-rate table, changing
nothing. A state's `period` is what the rule asks for; the planner bounds
it by `Adaptive.min_period` / `max_period` and keeps the bounded one
(planner_state.PlannerState holds the rule's state as one field). Rules
combine as optax's chain does: `CostAware` runs a base rule on the base's
own state, nested in its own, and raises the base's period to a floor.
`schedules.Adaptive` takes a rule and exports them under the same names.
No TensorFlow.

Example:
  from oscars_tf import schedules
  from oscars_tf.policy import records
  rule = schedules.AdaComm()
  config = schedules.Adaptive(period_rule=rule, initial_period=16)
  state = rule.init(16.0)
  for loss in (4.0, 1.0):  # loss_0, then a quarter of it
    row = records.TableEntry(rate=10.0, round=0, loss=loss)
    state = rule.update(state, records.StepRateTable((row,), ("h",)), config)
  state.period  # 8.0: 16 * sqrt(1 / 4)
"""

import dataclasses
import math
from typing import Optional
from typing import Protocol
from typing import runtime_checkable

import numpy as np

from oscars_tf import arguments


@dataclasses.dataclass(frozen=True)
class RuleState:
  """What a period rule carries from round to round; every rule's state
  adds its own fields to `period`.

  Travels to a rejoining worker as JSON (`to_json`, `from_json`), and the
  plan's digest reads its fields as they were before the rules had states
  of their own (`flat_fields`).
  """
  period: float  # steps of the fastest worker per round

  def to_json(self) -> dict:
    """A JSON-able dict: the rule's name and the state's fields."""
    out = {"rule": _NAMES[type(self)]}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      out[f.name] = value.to_json() if isinstance(value, RuleState) else value
    return out

  @staticmethod
  def from_json(d: dict) -> "RuleState":
    """The state `to_json` gave `d` of."""
    cls = _STATES[d["rule"]]
    return cls(**{f.name: (RuleState.from_json(d[f.name])
                           if isinstance(d[f.name], dict) else d[f.name])
                  for f in dataclasses.fields(cls)})

  def flat_fields(self) -> dict:
    """Its fields under the names the planner's state gave them when it
    held every rule's (`initial_loss`, `sync_cost`, `base_period`); none
    here."""
    return {}


def is_rule(value):
  """Whether `value` is a period rule: an instance (a rule's class has
  `init` and `update` too, unbound)."""
  return isinstance(value, PeriodRule) and not isinstance(value, type)


@runtime_checkable
class PeriodRule(Protocol):
  """What `Adaptive(period_rule=)` and `CostAware(base=)` take."""

  def init(self, period: float) -> RuleState:
    """The state before any round: `period`, the initial period."""

  def update(self, state: RuleState, table, config) -> RuleState:
    """The next state from the round's table (pure)."""

  def config(self) -> dict:
    """A JSON-able description (in the schedule's fingerprint)."""


@dataclasses.dataclass(frozen=True)
class ConstantState(RuleState):
  """Constant's state: the period alone."""


class Constant:
  """Keeps the period at `Adaptive.initial_period`: local SGD with a
  constant period (Stich, "Local SGD Converges Fast and Communicates
  Little", ICLR 2019), in rounds of equal time.

  Example:
    schedules.Adaptive(period_rule=schedules.Constant(), initial_period=8)
  """

  def init(self, period):
    return ConstantState(period)

  def update(self, state, table, config):
    del table, config
    return state

  def config(self):
    return {"rule": "Constant"}


@dataclasses.dataclass(frozen=True)
class AdaCommState(RuleState):
  """AdaComm's state: the period and loss_0 (NaN until a loss is
  reported)."""
  initial_loss: float = math.nan

  def flat_fields(self):
    return {"initial_loss": self.initial_loss}


class AdaComm:
  """Period shrinks as the loss falls: H_r = H_0 * sqrt(loss_r / loss_0).

  Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best
  Error-Runtime Trade-off in Local-Update SGD", SysML 2019: long periods
  early (fast progress per second), short ones as the loss flattens (low
  error floor). loss_r is the mean of the workers' reported losses, H_0
  `Adaptive.initial_period`.

  Example:
    schedules.Adaptive(period_rule=schedules.AdaComm())
  """

  def init(self, period):
    return AdaCommState(period)

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


@dataclasses.dataclass(frozen=True)
class CostAwareState(RuleState):
  """CostAware's state: its period, the smoothed cost of an averaging
  point (NaN until measured), and its base rule's own state (None
  without a base)."""
  sync_cost: float = math.nan  # smoothed seconds an averaging point costs
  base: Optional[RuleState] = None

  def flat_fields(self):
    base = {} if self.base is None else self.base.flat_fields()
    return {**base, "sync_cost": self.sync_cost,
            "base_period": math.nan if self.base is None else
            self.base.period}


class CostAware:
  """Never averages more often than the averaging's measured cost allows.

  The period is the larger of two: what a `base` rule asks for the
  model's sake (AdaComm() by default: long early, shorter as the loss
  falls), and the shortest round whose averaging point takes at most
  `max_overhead` of it: c / (T + c) <= max_overhead, so
  T = c * (1 - max_overhead) / max_overhead, times the fastest worker's
  rate. c is what the last worker to arrive at the previous averaging
  point spent there (it waited for no one: the exchange and the collective
  only), smoothed over rounds; a round in which any member met a collective
  for the first time (TensorFlow resolves each group and instance once, a
  round trip to the group's leader; its row then has no cost) measures
  nothing, as it says nothing of the next.
  Cheap averaging (an even cluster on a fast network) leaves the base rule
  free, down to every step with base=None;
  expensive averaging (slow links, a large model) stretches the rounds so
  the links do not set the pace. The period is bounded by
  `Adaptive.min_period` / `max_period` like every rule's. The base rule
  runs on its own state (nested in this one) and its own period, never on
  the raised one: a rule that scales the last period would ratchet up.

  Local SGD's error-runtime trade-off (Wang & Joshi, SysML 2019): the
  period weighs what a step and an averaging cost, as measured each round,
  instead of a constant tuned for one cluster.

  Args:
    max_overhead: 0.1, the share of each round averaging may take, in
      (0, 1).
    smoothing: 0.5, weight of the newest measurement in the running cost,
      in (0, 1].
    base: AdaComm() (default), another rule, or None (the cost alone).

  Example:
    schedules.Adaptive(period_rule=schedules.CostAware(max_overhead=0.05))
  """

  def __init__(self, max_overhead: float = 0.1, smoothing: float = 0.5,
               base="AdaComm"):
    self.max_overhead = arguments.positive_number(
        "CostAware", "max_overhead", max_overhead)
    self.smoothing = arguments.positive_number(
        "CostAware", "smoothing", smoothing)
    if self.max_overhead >= 1 or self.smoothing > 1:
      raise ValueError("CostAware: need 0 < max_overhead < 1 and 0 < "
                       f"smoothing <= 1, got max_overhead={max_overhead!r}, "
                       f"smoothing={smoothing!r}.")
    self.base = AdaComm() if base == "AdaComm" else base
    if self.base is not None and (not is_rule(self.base) or
                                  isinstance(self.base, CostAware)):
      raise TypeError("CostAware: `base` must be None or a period rule "
                      "(AdaComm(), QuadraticSync(), DivergenceBand(), "
                      f"Constant()), got {base!r}.")

  def init(self, period):
    return CostAwareState(
        period, base=None if self.base is None else self.base.init(period))

  def update(self, state, table, config):
    if self.base is not None:
      own = state.base if state.base is not None else self.base.init(
          state.period)
      base = self.base.update(own, table, config)
      state = dataclasses.replace(state, period=base.period, base=base)
    floor, cost = self.cost_floor(state, table)
    if floor is None:
      return state
    return dataclasses.replace(
        state, period=float(max(state.period if self.base else 1, floor)),
        sync_cost=cost)

  def cost_floor(self, state, table):
    """(the shortest period the cost allows, the smoothed cost), or
    (None, None) before both a cost and a rate are measured."""
    # Column by column: 10,000 rows a Python test each took 15 ms a plan.
    entries = table.entries
    rounds = np.fromiter((e.round for e in entries), float, len(entries))
    costs = np.fromiter((e.sync_cost for e in entries), float, len(entries))
    rates = np.fromiter((e.rate for e in entries), float, len(entries))
    costs = costs[rounds == rounds.max()] if len(entries) else costs
    if not np.isfinite(costs).all():
      costs = costs[:0]  # someone met a collective for the first time
    costs = costs[costs > 0]
    with np.errstate(invalid="ignore"):
      rates = rates[np.isfinite(rates) & (rates > 0)]
    if not rates.size or not (costs.size or math.isfinite(state.sync_cost)):
      return None, None
    if not costs.size:  # no round measured (collectives met for the first time)
      cost = state.sync_cost
    else:
      cost = float(costs.min())  # the last to arrive: no wait for others
      if math.isfinite(state.sync_cost):
        cost = self.smoothing * cost + (1 - self.smoothing) * state.sync_cost
    budget = cost * (1 - self.max_overhead) / self.max_overhead
    return max(1.0, math.ceil(budget * float(rates.max()))), cost

  def config(self):
    return {"rule": "CostAware", "max_overhead": self.max_overhead,
            "smoothing": self.smoothing,
            "base": None if self.base is None else self.base.config()}


@dataclasses.dataclass(frozen=True)
class QuadraticSyncState(RuleState):
  """QuadraticSync's state: the period alone."""


class QuadraticSync:
  """Quadratic synchronization rule: H = max(H_base, floor((beta / lr)^2)).

  Gu, Lyu, Arora, Huang, "Why (and When) does Local SGD Generalize Better
  than SGD?", ICLR 2023: as the learning rate decays, average less often.
  lr is the median of the learning rates the workers report.

  Args:
    beta: 0.1, a number > 0.
    base_period: 2, the shortest period (an int >= 1).

  Example:
    schedules.Adaptive(period_rule=schedules.QuadraticSync(beta=0.2))
  """

  def __init__(self, beta: float = 0.1, base_period: int = 2):
    self.beta = arguments.positive_number("QuadraticSync", "beta", beta)
    self.base_period = arguments.positive_int(
        "QuadraticSync", "base_period", base_period)

  def init(self, period):
    return QuadraticSyncState(period)

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


@dataclasses.dataclass(frozen=True)
class DivergenceBandState(RuleState):
  """DivergenceBand's state: the period alone."""


class DivergenceBand:
  """Keeps the replicas' measured divergence inside [low, high].

  Divergence is |w_i - mean| / |mean| just before an averaging. Above
  `high` the period is divided by `factor`; below `low` multiplied by it.
  Averaging as the models drift apart, not on a clock, as in Kamp et al.,
  "Efficient Decentralized Deep Learning by Dynamic Model Averaging",
  ECML PKDD 2018.

  Args:
    low: 0.005, high: 0.05, the band (0 < low < high).
    factor: 2.0, a number > 1.

  Example:
    schedules.Adaptive(period_rule=schedules.DivergenceBand(high=0.1))
  """

  def __init__(self, low: float = 0.005, high: float = 0.05,
               factor: float = 2.0):
    self.low = arguments.positive_number("DivergenceBand", "low", low)
    self.high = arguments.positive_number("DivergenceBand", "high", high)
    self.factor = arguments.positive_number("DivergenceBand", "factor", factor)
    if self.low >= self.high or self.factor <= 1:
      raise ValueError("DivergenceBand: need low < high and factor > 1, got "
                       f"low={low!r}, high={high!r}, factor={factor!r}.")

  def init(self, period):
    return DivergenceBandState(period)

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


# Each state's name in JSON: its rule's (as in the rule's `config()`).
_STATES = {"Constant": ConstantState, "AdaComm": AdaCommState,
           "CostAware": CostAwareState, "QuadraticSync": QuadraticSyncState,
           "DivergenceBand": DivergenceBandState}
_NAMES = {cls: name for name, cls in _STATES.items()}
