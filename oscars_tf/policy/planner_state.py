"""The planner's state: what it carries from round to round, identical on
every member; the period rule's own state is one of its fields.

It travels to a rejoining worker as JSON (`to_json`, `from_json`: the
round book's chief plan), and a plan's digest hashes it as it was before
each period rule had a state of its own (`digest_items`), so a plan's
digest is what it was for the same inputs. No TensorFlow.
"""

import dataclasses
import math
from typing import Tuple

from oscars_tf.policy import period_rules


@dataclasses.dataclass(frozen=True)
class PlannerState:
  """What the planner carries from round to round (identical on all).

  Example:
    state = PlannerState(schedules.AdaComm().init(16.0), global_every=4)
    PlannerState.from_json(json.loads(json.dumps(state.to_json())))
  """
  # The period rule's state (period_rules.py); its period, bounded by the
  # schedule's min_period / max_period, is this round's.
  rule: period_rules.RuleState
  global_every: int          # rounds between global syncs
  rounds_since_global: int = 0
  groups: Tuple[Tuple[int, ...], ...] = ()  # the last non-global grouping
  # Every distinct non-global grouping made so far, in the order made (at
  # most the schedule's `max_groupings`: planner.stable_groups). Left out
  # of the digest: up to 16 x workers ints hashed every round would cost
  # the chief ~0.1 s at 10,000 workers; the groups they yield are in it.
  groupings: Tuple[Tuple[Tuple[int, ...], ...], ...] = dataclasses.field(
      default=(), metadata={"digest": False})
  previous_global: bool = False  # the round before the last was global

  @property
  def period(self) -> float:
    """Local steps of the fastest worker per round (the rule's, bounded)."""
    return self.rule.period

  def to_json(self) -> dict:
    """A JSON-able dict: the fields as they are (no deep copy: asdict's of
    up to 16 groupings of every worker took 0.15 s at 10,000 workers),
    the rule's state as its own dict."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["rule"] = self.rule.to_json()
    return out

  @classmethod
  def from_json(cls, d: dict) -> "PlannerState":
    """The state `to_json` gave `d` of (its groups as JSON gives them:
    lists, which the planner takes as it takes tuples)."""
    return cls(**{**d, "rule": period_rules.RuleState.from_json(d["rule"])})

  def digest_items(self):
    """(name, value) pairs a plan's digest hashes (records.Plan.digest):
    the fields of the time one state held every rule's, in their order
    then, a rule's fields it has none of NaN."""
    flat = {"initial_loss": math.nan, "sync_cost": math.nan,
            "base_period": math.nan, **self.rule.flat_fields()}
    return (("period", self.period), ("global_every", self.global_every),
            ("rounds_since_global", self.rounds_since_global),
            ("initial_loss", flat["initial_loss"]), ("groups", self.groups),
            ("previous_global", self.previous_global),
            ("sync_cost", flat["sync_cost"]),
            ("base_period", flat["base_period"]))


def state_to_json(state):
  """A plan's `state` as JSON-able values, for a rejoining worker: a
  PlannerState's `to_json()`, another dataclass's fields as they are (a
  schedule of one's own), else None."""
  if isinstance(state, PlannerState):
    return state.to_json()
  if dataclasses.is_dataclass(state):
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
  return None


def state_from_json(cls, d):
  """The state of type `cls` that `state_to_json` gave `d` of."""
  return cls.from_json(d) if issubclass(cls, PlannerState) else cls(**d)
