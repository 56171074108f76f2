"""A round's exchange: this worker's row in, its `RoundPart` out. No
TensorFlow.

At its averaging point a worker hands its row to the round's membership
exchange (membership.py): the chief decides who is in the round, and every
member reads the same decision, rows included. From that decision each
member changes the round's plan alike (plan_changes.py: the members, the
poisoned ones, the steps they really ran) and takes its part in the
averaging (round_parts.py): the same table snapshot, the same plan, the
same group keys everywhere.
"""

from absl import logging
import numpy as np

from oscars_tf.policy import plan_changes
from oscars_tf.policy import planner_state
from oscars_tf.policy import records
from oscars_tf.protocol import group_keys as group_keys_lib
from oscars_tf.protocol import membership as membership_lib
from oscars_tf.protocol import round_parts


class RoundExchange:
  """The membership and table of one worker's rounds, and its part in each.

  What the latest exchange settled stays readable until the next one:
  `members`, `decision`, `poisoned`, `peers`, `sharded`, `first_meeting`
  and `epoch_agreed`.

  Args:
    me: this worker's index.
    hosts: every worker's host.
    membership: the round's membership (membership.Membership), or None
      for one worker, always alone.
    weighting: the schedule's weighting ("work", ...), kept by the plan's
      changes.
    max_leaders: the most host leaders in one ring of a global sync.
  """

  def __init__(self, me, hosts, membership, weighting, max_leaders):
    self.me = me
    self.n = len(hosts)
    self.hosts = hosts
    self.membership = membership
    self._weighting = weighting
    self._max_leaders = max_leaders
    self.group_keys = group_keys_lib.GroupKeys(self.n)
    self.members = tuple(range(self.n))
    self.decision = None
    self.poisoned = []    # workers with non-finite weights this round
    self.sharded = False  # this round's global sync went shard by shard
    self.peers = None     # whom this round's collectives meet
    self.first_meeting = False  # this round's averaging meets a new one
    self.epoch_agreed = False   # this round's members were all exhausted
    self._collectives = round_parts.MetCollectives()

  def decide(self, round_, row, plan, epoch, epoch_done, expected_s,
             rate_before):
    """Round `round_`'s membership decision with this worker's `row`
    (alone: this worker, always). `plan`, `epoch` and `epoch_done` are
    what a rejoining worker adopts from the chief; `expected_s` and
    `rate_before` as membership.Membership.exchange takes them. A decision
    of a later round than `round_` lets this worker back in."""
    if self.membership is None:
      return membership_lib.Decision(round_, (0,), (), (), (row,))
    state = plan.state
    # Made only in a round with newcomers, and the state's fields as they
    # are (JSON copies them; asdict's deep copy of up to 16 groupings of
    # every worker took 0.15 s at 10,000 workers).
    def chief_plan():
      return {
          "epoch_end": plan.epoch_end, "epoch": epoch,
          "local_steps": list(plan.local_steps),
          "group_keys": self.group_keys.groups,
          "state": planner_state.state_to_json(state)}

    return self.membership.exchange(
        round_, row, epoch_done, chief_plan=chief_plan,
        expected_s=expected_s, rate_before=rate_before,
        expected_steps=plan.local_steps)

  def part_in(self, decision, round_, plan):
    """`decision` of round `round_` applied to the round's `plan`: returns
    (the plan as every member changes it, this worker's RoundPart)."""
    self.decision = decision
    if decision.dropped or decision.newcomers:
      # The changes, not every member: one line stays short at any size.
      logging.warning(
          "oscars_tf: worker %d round %d: %d of %d workers are members "
          "(dropped %s, rejoining %s)", self.me, round_,
          len(decision.members), self.n, list(decision.dropped),
          list(decision.newcomers))
    self.members = decision.members
    plan = plan_changes.with_members(plan, decision.members,
                                     decision.newcomers, self._weighting)
    rows = decision.table_rows(self.n, records.ROW_WIDTH)
    # A rejoiner's rate (measured before its stall) is its speed now: as of
    # this round, or the planner would take it for stale and plan it at the
    # median after a long stall.
    rows[list(decision.newcomers), records.Column.ROUND] = round_
    plan, sound = self._without_poisoned(decision, round_, plan, rows)
    steps = np.nan_to_num(rows[:, records.Column.STEPS]).astype(np.int64)
    exhausted = np.nan_to_num(rows[:, records.Column.EXHAUSTED]) > 0.5
    plan, self.epoch_agreed = plan_changes.with_arrivals(
        plan, decision.members, steps, exhausted, self._weighting)
    layout = round_parts.register_groups(
        self.group_keys, plan, self.hosts, self.members, self._max_leaders)
    part = round_parts.part_of(
        self.me, round_, plan, self.hosts, self.members, sound,
        self.group_keys, rows.reshape(-1), bool(decision.newcomers),
        self._max_leaders, layout)
    self.sharded = part.is_global and part.sharded
    # Whom this round's collectives meet (a global sync: every member).
    self.peers = self.members if part.is_global else plan.group_of(self.me)
    self.first_meeting = self._collectives.first_meeting(part)
    return plan, part

  def _without_poisoned(self, decision, round_, plan, rows):
    """(`plan` averaging without the members whose weights are not finite,
    which take their group's model; the sound workers)."""
    is_member = np.zeros(self.n, bool)  # not `in` a tuple: O(workers^2)
    is_member[list(decision.members)] = True
    healthy = (is_member &
               (rows[:, records.Column.HEALTHY] > 0.5)).tolist()
    self.poisoned = [j for j in decision.members if not healthy[j]]
    # Newcomers, like poisoned members, add nothing and take the model
    # (unless no other member is finite: see sound_workers).
    sound = round_parts.sound_workers(healthy, decision.newcomers)
    if self.poisoned:
      logging.warning(
          "oscars_tf: worker %d round %d: worker(s) %s have non-finite "
          "weights; averaging without them, and they take the group's model",
          self.me, round_, self.poisoned)
      plan = plan_changes.with_sound_groups(
          plan, decision.members, sound, self._weighting)
    return plan, sound

  def round_peers(self):
    """The workers of this worker's collectives in the current round."""
    return tuple(self.members if self.peers is None else self.peers)
