"""Period rules: how many steps the fastest worker runs per round.

Small objects with state passed in and out (`update(state, table, config)`
returns the next state), composed into `schedules.Adaptive`, which exports
them under the same names. Pure policy: no TensorFlow.
"""

import dataclasses
import math

import numpy as np

from oscars_tf import arguments


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
  only), smoothed over rounds; a round in which any member met a collective
  for the first time (TensorFlow resolves each group and instance once, a
  round trip to the group's leader; its row then has no cost) measures
  nothing, as it says nothing of the next.
  Cheap averaging (an even cluster on a fast network) leaves the base rule
  free, down to every step with base=None;
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
    self.max_overhead = arguments.positive_number(
        "CostAware", "max_overhead", max_overhead)
    self.smoothing = arguments.positive_number(
        "CostAware", "smoothing", smoothing)
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


class QuadraticSync:
  """Quadratic synchronization rule: H = max(H_base, floor((beta / lr)^2)).

  Gu, Lyu, Arora, Huang, "Why (and When) does Local SGD Generalize Better
  than SGD?", ICLR 2023: as the learning rate decays, average less often.
  lr is the median of the learning rates the workers report.
  """

  def __init__(self, beta: float = 0.1, base_period: int = 2):
    self.beta = arguments.positive_number("QuadraticSync", "beta", beta)
    self.base_period = arguments.positive_int(
        "QuadraticSync", "base_period", base_period)

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
    self.low = arguments.positive_number("DivergenceBand", "low", low)
    self.high = arguments.positive_number("DivergenceBand", "high", high)
    self.factor = arguments.positive_number("DivergenceBand", "factor", factor)
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
