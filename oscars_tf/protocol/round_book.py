"""One worker's round bookkeeping: counters, timing, table, plan. No TensorFlow.

A round ends at an averaging point. There, in this order:
  1. `arrive`: the worker measures its compute rate for the round (waits
     excluded) and exchanges table rows through the coordination service:
     the chief decides the round's members — a worker not there within the
     straggler timeout is dropped — and every member reads the same
     decision, so all hold the same table snapshot (see membership.py).
     The result is this worker's `RoundPart`;
  2. the model is averaged inside this round's group (the graph side,
     distribute/rounds.py, with the `RoundPart`'s key, size and weights);
  3. `averaged`: every member plans the next round from the same snapshot
     — the same plan everywhere — and logs its digest.
The graph side calls 1 and 3 through `tf.py_function`, only at averaging
points, so everything here is plain Python, testable over a fake store.
"""

import dataclasses
import math
import time

from absl import logging
import numpy as np

from oscars_tf.policy import plan_changes
from oscars_tf.policy import planner
from oscars_tf.policy import records
from oscars_tf.protocol import group_keys as group_keys_lib
from oscars_tf.protocol import membership as membership_lib
from oscars_tf.protocol import plan_log
from oscars_tf.protocol import rate_table
from oscars_tf.protocol import round_history
from oscars_tf.protocol import round_parts
from oscars_tf.protocol.round_parts import NextRound

ROW = len(records.FIELDS)
FIELD_HEALTHY = records.FIELDS.index("healthy")
FIELD_STEPS = records.FIELDS.index("steps")
FIELD_EXHAUSTED = records.FIELDS.index("exhausted")
FIELD_ROUND = records.FIELDS.index("round")
NO_SYNC = np.iinfo(np.int64).max  # next_sync while an epoch is over


class RoundBook:
  """The Python side of one worker's rounds."""

  def __init__(self, info, schedule, learning_rate_fn=None, simulate=None,
               publish=True, membership=None):
    self.me = info.worker_index
    self.n = info.num_workers
    self.hosts = tuple(a.rpartition(":")[0] for _, _, a in info.workers)
    self.multi_host = round_parts.multi_host(self.hosts)
    self.schedule = schedule
    self.learning_rate_fn = learning_rate_fn or (lambda: math.nan)
    self.simulate = simulate
    self.publish = publish and info.is_multi_worker
    self.meter = rate_table.RateMeter()
    self.round = 0
    empty = records.StepRateTable(
        tuple(records.TableEntry() for _ in range(self.n)), self.hosts)
    self.plan = schedule.plan(empty, 0)
    self.history = round_history.RoundHistory(self.n)
    self.observer = None  # called as observer(entry, table, next_plan)
    # Called as slice_listener(epoch, first_step, steps) with this worker's
    # part of each round of a planned epoch, once the round's plan is fixed
    # (fit's shared sample order: frontends/shared_order.py).
    self.slice_listener = None
    self._told = None
    self.totals = {"wait_s": 0.0, "comm_s": 0.0, "compute_s": 0.0,
                   "bytes_sent": 0, "collectives": 0, "simulated_s": 0.0}
    self.epoch_target = None     # cluster-wide steps per epoch, if planned
    self.epoch_done = 0
    self.epoch_over = False      # read by Keras' epoch loop between steps
    self.epoch_index = 0         # this worker's epoch (Keras' numbering)
    self.epoch_offset = 0        # the cluster's epoch less this worker's:
                                 # > 0 after it rejoined (it missed some)
    self.exhausted = False       # this worker's data for the epoch ran out
    self.step_quantum = 1        # k_i are multiples of it (Keras'
                                 # steps_per_execution; same on all workers)
    self._epoch_agreed = False   # this round's members were all exhausted
    self._change_log = plan_log.PlanChangeLog(self.me)
    self._weighting = getattr(schedule, "weighting", "work")
    # No ring of a global sync across hosts has more host leaders than the
    # schedule's group bound (a third level past that: round_parts.py).
    self._max_leaders = (getattr(schedule, "max_group_size", None) or
                         planner.DEFAULT_MAX_GROUP_SIZE)
    self._t_round_start = None
    self._t_first_step = None
    self._t_arrive = self._t_table = 0.0
    self._publisher = rate_table.RowPublisher(self.me)
    self._arrival_steps = 0
    self._arrival_compute = 0.0
    self._skip_steps = 0  # round 0: steps before the clock started
    self._rate_before = math.nan  # the meter before this round's sample
    self._poisoned = []   # workers with non-finite weights this round
    self._sharded = False  # this round's global sync went shard by shard
    self._peers = None  # whom this round's collectives meet (round_peers)
    self.last_sync_step = 0  # local step of the last average (Python's)
    self._last_divergence = math.nan
    self._last_sync_cost = math.nan  # arrival to averaged, last round
    self._collectives = round_parts.MetCollectives()
    self._first_meeting = False  # this round's averaging meets a new one
    self.group_keys = group_keys_lib.GroupKeys(self.n)
    # Multi-worker: who is in each round (None: one worker, always alone).
    self.membership = membership
    self.members = tuple(range(self.n))
    self._decision = None

  def my_steps(self, plan, step):
    """NextRound of this worker under `plan` from local step `step`."""
    return NextRound(step + plan.local_steps[self.me],
                     plan.update_scales[self.me])

  def mark_round_start(self):
    """Time from here on counts as compute (called at starts and resumes)."""
    self._t_round_start = time.monotonic()

  def mark_first_step_done(self, steps):
    """Round 0's clock restarts after the first step, which traces the
    function: its rate is then measured, saving a second probe round."""
    if self.round == 0:
      self._t_round_start = time.monotonic()
      self._skip_steps = steps

  def step(self, step):
    """Per step, only when simulating heterogeneity: the planned sleep."""
    now = time.monotonic()
    if self._t_first_step is None:
      self._t_first_step = now
    delay = self.simulate.seconds(self.me, step, now - self._t_first_step)
    if delay > 0:
      time.sleep(delay)
      self.totals["simulated_s"] += delay

  def arrive(self, step, loss, finite):
    """This worker reached its averaging point at local step `step`: its
    row goes to the round's exchange; returns its RoundPart."""
    now = time.monotonic()
    steps = step - self.last_sync_step
    compute = now - (self._t_round_start or now)
    self._rate_before = self.meter.rate  # if late, the stall is not its speed
    # Round 0 holds tracing and start-up unless its clock restarted after
    # the first step: it would understate every rate.
    if self.round > 0:
      self.meter.add(steps, compute)
    elif self._skip_steps and steps > self._skip_steps:
      self.meter.add(steps - self._skip_steps, compute)
    self.totals["compute_s"] += compute
    self._t_arrive = now
    self._arrival_steps = steps
    self._arrival_compute = compute
    row = [self.meter.rate, self.round, loss, self._last_divergence,
           float(self.learning_rate_fn()), steps, float(finite),
           float(self.exhausted), self._last_sync_cost]
    return self._exchange(row)

  def _others_still_due_s(self):
    """Seconds until the members still training should arrive: the chief,
    out of data early, waits that long before its straggler timeout runs."""
    if not self.exhausted:
      return 0.0
    due = [k / r for j, (k, r) in enumerate(zip(self.plan.local_steps,
                                                self.plan.rates))
           if j != self.me and j in self.members and r > 0]
    elapsed = time.monotonic() - (self._t_round_start or time.monotonic())
    return max([0.0] + [1.5 * d - elapsed for d in due if math.isfinite(d)])

  def _decide(self, row):
    """The round's membership decision (alone: this worker, always)."""
    if self.membership is None:
      return membership_lib.Decision(self.round, (0,), (), (), (row,))
    state = self.plan.state
    # Made only in a round with newcomers, and the state's fields as they
    # are (JSON copies them; asdict's deep copy of up to 16 groupings of
    # every worker took 0.15 s at 10,000 workers).
    def chief_plan():
      return {
          "epoch_end": self.plan.epoch_end, "epoch": self.epoch_index,
          "local_steps": list(self.plan.local_steps),
          "group_keys": self.group_keys.groups,
          "state": ({f.name: getattr(state, f.name)
                     for f in dataclasses.fields(state)}
                    if dataclasses.is_dataclass(state) else None)}

    decision = self.membership.exchange(
        self.round, row, self.epoch_done, chief_plan=chief_plan,
        expected_s=self._others_still_due_s(),
        rate_before=self._rate_before,
        expected_steps=self.plan.local_steps)
    if decision.round != self.round:  # dropped, now let back in
      self._adopt(decision)
    return decision

  def _exchange(self, row):
    """The round's membership and table, then this worker's part in it."""
    decision = self._decide(row)
    self._t_table = time.monotonic()
    self._decision = decision
    if decision.dropped or decision.newcomers:
      # The changes, not every member: one line stays short at any size.
      logging.warning(
          "oscars_tf: worker %d round %d: %d of %d workers are members "
          "(dropped %s, rejoining %s)", self.me, self.round,
          len(decision.members), self.n, list(decision.dropped),
          list(decision.newcomers))
    self.members = decision.members
    self.plan = plan_changes.with_members(self.plan, decision.members,
                                     decision.newcomers, self._weighting)
    rows = decision.table_rows(self.n, ROW)
    # A rejoiner's rate (measured before its stall) is its speed now: as of
    # this round, or the planner would take it for stale and plan it at the
    # median after a long stall.
    rows[list(decision.newcomers), FIELD_ROUND] = self.round
    is_member = np.zeros(self.n, bool)  # not `in` a tuple: O(workers^2)
    is_member[list(decision.members)] = True
    healthy = (is_member & (rows[:, FIELD_HEALTHY] > 0.5)).tolist()
    self._poisoned = [j for j in decision.members if not healthy[j]]
    # Newcomers, like poisoned members, add nothing and take the model
    # (unless no other member is finite: see sound_workers).
    sound = round_parts.sound_workers(healthy, decision.newcomers)
    if self._poisoned:
      logging.warning(
          "oscars_tf: worker %d round %d: worker(s) %s have non-finite "
          "weights; averaging without them, and they take the group's model",
          self.me, self.round, self._poisoned)
      self.plan = plan_changes.with_sound_groups(
          self.plan, decision.members, sound, self._weighting)
    steps = np.nan_to_num(rows[:, FIELD_STEPS]).astype(np.int64)
    exhausted = np.nan_to_num(rows[:, FIELD_EXHAUSTED]) > 0.5
    self.plan, self._epoch_agreed = plan_changes.with_arrivals(
        self.plan, decision.members, steps, exhausted, self._weighting)
    layout = round_parts.register_groups(
        self.group_keys, self.plan, self.hosts, self.members,
        self._max_leaders)
    part = round_parts.part_of(
        self.me, self.round, self.plan, self.hosts, self.members, sound,
        self.group_keys, rows.reshape(-1), bool(decision.newcomers),
        self._max_leaders, layout)
    self._sharded = part.is_global and part.sharded
    # Whom this round's collectives meet (a global sync: every member).
    self._peers = (self.members if part.is_global else
                   self.plan.group_of(self.me))
    self._first_meeting = self._collectives.first_meeting(part)
    return part

  def round_peers(self):
    """The workers of this worker's collectives in the current round."""
    return tuple(self.members if self._peers is None else self._peers)

  def _adopt(self, decision):
    """A rejoining worker takes the cluster's round, epoch accounting and
    planner state from the chief, so it plans and ends epochs like the
    others from here on."""
    logging.warning(
        "oscars_tf: worker %d was dropped at round %d (late at its round "
        "end) and rejoins at round %d with the group's model.", self.me,
        self.round, decision.round)
    self.round, self.epoch_done = decision.round, decision.epoch_done
    self.meter.reset(self._rate_before)  # the stall is not its speed
    adopted = decision.chief_plan or {}
    self.group_keys = group_keys_lib.GroupKeys(
        self.n, adopted.get("group_keys", [])[1:])
    self.epoch_offset = adopted.get("epoch", self.epoch_index) - (
        self.epoch_index)
    # The round's plan as the others hold it (its own is from before the
    # stall): the weights of this round, host shares included, then agree.
    self.plan = dataclasses.replace(
        self.plan, epoch_end=bool(adopted.get("epoch_end", False)),
        local_steps=tuple(adopted.get("local_steps", self.plan.local_steps)))
    if adopted.get("state") is not None:
      self.plan = dataclasses.replace(
          self.plan, state=type(self.plan.state)(**adopted["state"]))

  def averaged(self, table_vec, divergence, step, bytes_sent):
    """The round's averaging is done: records it, plans the next round
    from the round's table; returns this worker's NextRound."""
    now = time.monotonic()
    wait, comm = self._t_table - self._t_arrive, now - self._t_table
    self.totals["wait_s"] += wait
    self.totals["comm_s"] += comm
    self._last_sync_cost = math.nan if self._first_meeting else wait + comm
    self.totals["bytes_sent"] += bytes_sent
    self.totals["collectives"] += 1
    self._last_divergence = divergence
    table = records.StepRateTable.from_rows(
        np.asarray(table_vec).reshape(self.n, ROW), self.hosts)
    self._record(table, divergence, step, bytes_sent, wait, comm, now)
    self.round += 1
    ended = self.plan
    self.plan = self._quantized(
        self.schedule.plan(table, self.round, self.plan.state))
    if self._epoch_agreed:  # every member's data ran out
      self.epoch_over = True
    elif self.epoch_target is not None:
      self.epoch_done += sum(e.steps for e in table.entries)
      remaining = self.epoch_target - self.epoch_done
      if ended.epoch_end or remaining <= 0:
        self.epoch_over = True  # every worker ends the epoch here
      else:
        self.plan = self._quantized(plan_changes.fit_to_epoch(
            self.plan, remaining, self._weighting))
    if self.observer is not None:
      try:
        self.observer(self.history[-1], table, self.plan)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("oscars_tf: summaries failed (training goes on): %s",
                        e)
    self._change_log.log(self.round, self.plan, self.members)
    if logging.vlog_is_on(1):  # its arguments are O(workers) to make
      logging.vlog(1, "oscars_tf: worker %d round %d plan %s k=%s groups=%s",
                   self.me, self.round, self.plan.digest(),
                   list(self.plan.local_steps), list(self.plan.groups))
    if self.publish and self.membership is not None:
      self._publisher.maybe_publish(self.membership.store,
                                    table.entries[self.me], self.plan, now)
    self.last_sync_step = step
    self._t_round_start = time.monotonic()
    nxt = self.my_steps(self.plan, step)
    self._tell_slice()
    if self.epoch_over:
      # No round ends until the next epoch starts: steps Keras runs past the
      # epoch's end (the rest of a steps_per_execution batch) count toward
      # the next epoch's first round, planned when that epoch begins.
      nxt = nxt._replace(next_sync=NO_SYNC)
    return nxt

  def _record(self, table, divergence, step, bytes_sent, wait, comm, now):
    """Adds the finished round to `history`."""
    self.history.add({
        "round": self.round, "plan": self.plan.digest(),
        "local_steps": self._arrival_steps,
        "planned_steps": self.plan.local_steps[self.me],
        "group": list(self.plan.group_of(self.me)),
        "global_sync": self.plan.global_sync,
        "sharded_sync": self._sharded,  # across hosts, shard by shard
        "epoch_end": self.plan.epoch_end,
        "compute_s": self._arrival_compute, "wait_s": wait, "comm_s": comm,
        "arrived_at": time.time() - (now - self._t_arrive),
        "rate": self.meter.rate, "divergence": divergence,
        "loss": table.entries[self.me].loss,
        "learning_rate": table.entries[self.me].learning_rate,
        "table_rates": [e.rate for e in table.entries],
        "time_budget": self.plan.time_budget, "end_step": step,
        "stragglers": list(self.plan.stragglers), "bytes_sent": bytes_sent,
        "poisoned": list(self._poisoned),
        "members": list(self._decision.members),
        "dropped": list(self._decision.dropped),
        "rejoined": list(self._decision.newcomers),
        "groups": [list(g) for g in self.plan.groups],
        "planned_all": list(self.plan.local_steps)})

  def _quantized(self, plan):
    return plan_changes.quantized(plan, self.step_quantum, self._weighting)

  def begin_epoch(self, step, target_steps=None):
    """Starts an epoch at local step `step`; `target_steps` are
    cluster-wide steps. Returns this worker's NextRound.

    With a target, the epoch's last round is planned so that the cluster's
    steps add up to it, and `epoch_over` turns True at that round's end on
    every worker.
    """
    self.epoch_done, self.epoch_over, self.exhausted = 0, False, False
    self.epoch_target = target_steps
    self.plan = self._epoch_plan(target_steps)
    self._tell_slice()
    return self.my_steps(self.plan, step)

  def _epoch_plan(self, target_steps):
    plan = self.plan
    if target_steps is not None:
      plan = plan_changes.fit_to_epoch(plan, target_steps, self._weighting)
    return self._quantized(plan)

  def listen_slices(self, listener):
    """Sets the slice listener (None: none)."""
    self.slice_listener, self._told = listener, None

  def tell_first_slice(self, target_steps, epoch):
    """Tells the slice listener this worker's part of the first round of
    epoch `epoch` before it begins, as `begin_epoch` will plan it (Keras
    reads a batch to build the model before the first epoch begins)."""
    if self.slice_listener is None or target_steps is None:
      return
    k = self._epoch_plan(target_steps).local_steps
    self._tell((epoch + self.epoch_offset, sum(k[:self.me]), k[self.me]))

  def _tell_slice(self):
    """This worker's part of the coming round of a planned epoch: its steps
    follow the cluster's steps so far and those of the workers before it
    in the plan, which every member holds alike."""
    if (self.slice_listener is None or self.epoch_target is None or
        self.epoch_over):
      return
    k = self.plan.local_steps
    self._tell((self.epoch_index + self.epoch_offset,
                self.epoch_done + sum(k[:self.me]), k[self.me]))

  def _tell(self, part):
    if part != self._told:  # told ahead by tell_first_slice
      self._told = part
      self.slice_listener(*part)
