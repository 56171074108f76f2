"""Round bookkeeping of one worker: counters, timing, table, plan.

A round ends at an averaging point. There, in this order:
  1. the worker measures its compute rate for the round (waits excluded)
     and exchanges table rows through the coordination service: the chief
     decides the round's members — a worker not there within the straggler
     timeout is dropped — and every member reads the same decision, so all
     hold the same table snapshot (see membership.py);
  2. the model is averaged inside this round's group, restricted to the
     members (group key, size and weight are tensors, so one op serves
     every group);
  3. every member plans the next round from the same snapshot — the same
     plan everywhere — and logs its digest.
Steps 1 and 3 are Python (`tf.py_function`), only at averaging points.
"""

import collections
import dataclasses
import math
import time

import numpy as np
import tensorflow as tf
from absl import logging

from oscars_tf import averaging
from oscars_tf import group_keys as group_keys_lib
from oscars_tf import membership as membership_lib
from oscars_tf import rate_table
from oscars_tf import planner

ROW = len(planner.FIELDS)
FIELD_HEALTHY = planner.FIELDS.index("healthy")
FIELD_STEPS = planner.FIELDS.index("steps")
FIELD_EXHAUSTED = planner.FIELDS.index("exhausted")
FIELD_ROUND = planner.FIELDS.index("round")
NO_SYNC = np.iinfo(np.int64).max  # next_sync while an epoch is over
PUBLISH_EVERY_S = 1.0
HISTORY_KEEP = 10_000  # rounds kept in `history` (a long run stays bounded)
HIER_FIELDS = (("host_key", tf.int32), ("host_size", tf.int32),
               ("weight_in_host", tf.float32), ("is_leader", tf.bool),
               ("leaders_key", tf.int32), ("leaders_size", tf.int32),
               ("host_share", tf.float32))


class Rounds:
  """Plans and runs the averaging points of one worker."""

  def __init__(self, info, schedule, host_device, averaging_device,
               communication, timeout, learning_rate_fn=None,
               simulate=None, publish=True, per_group_nccl=False,
               membership=None):
    self.me = info.worker_index
    self.n = info.num_workers
    self.hosts = tuple(a.rpartition(":")[0] for _, _, a in info.workers)
    self.schedule = schedule
    self.learning_rate_fn = learning_rate_fn or (lambda: math.nan)
    self.simulate = simulate
    self.publish = publish and info.is_multi_worker
    self.meter = rate_table.RateMeter()
    self.round = 0
    empty = planner.StepRateTable(
        tuple(planner.TableEntry() for _ in range(self.n)), self.hosts)
    self.plan = schedule.plan(empty, 0)
    # One dict per finished round, the last HISTORY_KEEP of them.
    self.history = collections.deque(maxlen=HISTORY_KEEP)
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
    self._logged_imputed = frozenset()
    self._logged_period = None
    self._weighting = getattr(schedule, "weighting", "work")
    self._t_round_start = None
    self._t_first_step = None
    self._t_arrive = self._t_table = 0.0
    self._t_published = -math.inf
    self._skip_steps = 0  # round 0: steps before the clock started
    self._rate_before = math.nan  # the meter before this round's sample
    self._poisoned = []   # workers with non-finite weights this round
    self._last_sync_step = 0
    self._last_divergence = math.nan
    self._host_device = host_device
    self.group_keys = group_keys_lib.GroupKeys(self.n)
    self._global_key = group_keys_lib.GROUP_KEY_BASE
    # Multi-worker: who is in each round (None: one worker, always alone).
    self.membership = membership
    self.members = tuple(range(self.n))
    self._decision = None
    # "auto" on GPUs: NCCL for a group on one host, ring across hosts.
    self._per_group = per_group_nccl
    self._multi_host = len(set(self.hosts)) > 1
    self._hierarchical = averaging.HierarchicalAverager(
        averaging_device, "NCCL" if per_group_nccl else communication,
        timeout)
    self._group_averager = (
        averaging.PerGroupAverager(self.n, self._global_key, averaging_device,
                                   timeout) if per_group_nccl else
        averaging.GroupAverager(self.n, self._global_key, averaging_device,
                                communication, timeout))
    with tf.device(host_device), tf.init_scope():
      k, scale = self._my_steps(self.plan, 0)
      self.local_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    name="oscars_local_step")
      self.next_sync = tf.Variable(k, dtype=tf.int64, trainable=False,
                                   name="oscars_next_sync")
      self.last_sync_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="oscars_last_sync_step")
      self.syncs = tf.Variable(0, dtype=tf.int64, trainable=False,
                               name="oscars_syncs")
      # Group, key and weight come from the round's membership decision at
      # the round end (see _exchange); only these carry over between rounds.
      self.scale = tf.Variable(scale, dtype=tf.float32, trainable=False)

  # -- Python side (py_function bodies and eager helpers) -----------------

  def _my_steps(self, plan, step):
    """The step of this worker's next averaging point, and its FedNova
    update scale, under `plan`."""
    return step + plan.local_steps[self.me], plan.update_scales[self.me]

  def _my_group(self, plan):
    """This worker's group in `plan`: key, size, one host?, global?"""
    group = plan.group_of(self.me)
    one_host = len({self.hosts[i] for i in group}) == 1
    return (self.group_keys.key(group), len(group), one_host,
            plan.global_sync)

  def _hier_part(self, plan, sound):
    """Hierarchical-sync numbers of this worker (used for a global sync
    across hosts; on one host, placeholders)."""
    if not self._multi_host:
      return (0, 1, 1.0, True, 0, 1, 1.0)
    part = planner.host_part(plan, self.me, self.hosts, self.members, sound)
    return (self.group_keys.key(part.host), len(part.host),
            part.weight_in_host, self.me == part.host[0],
            self.group_keys.key(part.leaders), len(part.leaders),
            part.host_share)

  def _register_groups(self, plan):
    """Keys for every group this round may use, in the same order on every
    member (see group_keys.py): the plan's, and across hosts each host's
    members and the hosts' leaders (for a global sync)."""
    self.group_keys.register(plan.groups)
    if self._multi_host:
      by_host = {}
      for i in sorted(self.members):
        by_host.setdefault(self.hosts[i], []).append(i)
      hosts = sorted(by_host.values())
      self.group_keys.register(hosts + [[h[0] for h in hosts]])

  def _assign_plan(self, step):
    """Eagerly points the plan variables at `self.plan` (epoch starts)."""
    k, scale = self._my_steps(self.plan, step)
    self.next_sync.assign(k)
    self.scale.assign(scale)

  def mark_round_start(self):
    """Time from here on counts as compute (called at starts and resumes)."""
    self._t_round_start = time.monotonic()

  def mark_first_step_done(self, steps):
    """Round 0's clock restarts after the first step, which traces the
    function: its rate is then measured, saving a second probe round."""
    if self.round == 0:
      self._t_round_start = time.monotonic()
      self._skip_steps = steps

  def _on_step(self, step):
    """Per step, only when simulating heterogeneity: the planned sleep."""
    now = time.monotonic()
    if self._t_first_step is None:
      self._t_first_step = now
    if self.simulate is not None:
      delay = self.simulate.seconds(self.me, int(step),
                                    now - self._t_first_step)
      if delay > 0:
        time.sleep(delay)
        self.totals["simulated_s"] += delay
    return np.int64(0)

  def _on_arrive(self, step, loss, finite):
    now = time.monotonic()
    steps = int(step) - self._last_sync_step
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
    row = [self.meter.rate, self.round, float(loss), self._last_divergence,
           float(self.learning_rate_fn()), steps, float(bool(finite)),
           float(self.exhausted)]
    return self._exchange(row, int(step))

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

  def _exchange(self, row, step):
    """The round's membership and table, then this worker's part in it:
    (table, weight, takes_model, group key, size, nccl, global, rejoining,
    state weight, *hier)."""
    if self.membership is None:
      decision = membership_lib.Decision(self.round, (0,), (), (), (row,))
    else:
      state = self.plan.state
      decision = self.membership.exchange(
          self.round, row, self.epoch_done,
          chief_plan={"epoch_end": self.plan.epoch_end,
                      "epoch": self.epoch_index,
                      "local_steps": list(self.plan.local_steps),
                      "group_keys": self.group_keys.groups,
                      "state": (dataclasses.asdict(state)
                                if dataclasses.is_dataclass(state) else None)},
          expected_s=self._others_still_due_s(),
          rate_before=self._rate_before)
      if decision.round != self.round:  # dropped, now let back in
        self._adopt(decision)
    self._t_table = time.monotonic()
    self._decision = decision
    if decision.dropped or decision.newcomers:
      logging.warning(
          "oscars_tf: worker %d round %d: members %s (dropped %s, rejoining "
          "%s)", self.me, self.round, list(decision.members),
          list(decision.dropped), list(decision.newcomers))
    self.members = decision.members
    self.plan = planner.with_members(self.plan, decision.members,
                                       decision.newcomers, self._weighting)
    rows = np.full([self.n, ROW], np.nan)
    for j, r in enumerate(decision.rows):
      if r is not None:
        rows[j, :len(r)] = r[:ROW]
    # A rejoiner's rate (measured before its stall) is its speed now: as of
    # this round, or the planner would take it for stale and plan it at the
    # median after a long stall.
    rows[list(decision.newcomers), FIELD_ROUND] = self.round
    steps = np.nan_to_num(rows[:, FIELD_STEPS]).astype(np.int64)
    exhausted = np.nan_to_num(rows[:, FIELD_EXHAUSTED]) > 0.5
    self.plan, self._epoch_agreed = planner.with_arrivals(
        self.plan, decision.members, steps, exhausted, self._weighting)
    healthy = [j in decision.members and rows[j, FIELD_HEALTHY] > 0.5
               for j in range(self.n)]
    self._poisoned = [j for j in decision.members if not healthy[j]]
    if self._poisoned:
      logging.warning(
          "oscars_tf: worker %d round %d: worker(s) %s have non-finite "
          "weights; averaging without them, and they take the group's model",
          self.me, self.round, self._poisoned)
    # Newcomers, like poisoned members, add nothing and take the model.
    sound = [ok and j not in decision.newcomers for j, ok in enumerate(healthy)]
    weight = planner.healthy_weight(self.plan, self.me, sound)
    group = self.plan.group_of(self.me)
    takes_model = not sound[self.me]
    if not any(sound[j] for j in group):
      logging.error("oscars_tf: worker %d round %d: every member of group %s "
                    "has non-finite weights: training diverged (try a lower "
                    "learning rate).", self.me, self.round, list(group))
      takes_model = False
    self._register_groups(self.plan)
    key, size, nccl, whole = self._my_group(self.plan)
    hier = self._hier_part(self.plan, sound)
    # State sound members share (outer momentum) goes to newcomers: equal
    # weights over the group's sound members, whatever their steps.
    holders = [j for j in group if sound[j]] or list(group)
    state_weight = 1.0 / len(holders) if self.me in holders else 0.0
    return (rows.reshape(-1), np.float32(weight), np.bool_(takes_model),
            np.int32(key), np.int32(size), np.bool_(nccl), np.bool_(whole),
            np.bool_(bool(decision.newcomers)), np.float32(state_weight),
            *(np.dtype(d.as_numpy_dtype).type(v)
              for (_, d), v in zip(HIER_FIELDS, hier)))

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

  def _on_averaged(self, table_vec, divergence, step, bytes_sent):
    now = time.monotonic()
    wait, comm = self._t_table - self._t_arrive, now - self._t_table
    self.totals["wait_s"] += wait
    self.totals["comm_s"] += comm
    self.totals["bytes_sent"] += int(bytes_sent)
    self.totals["collectives"] += 1
    self._last_divergence = float(divergence)
    table = planner.StepRateTable.from_rows(
        np.asarray(table_vec).reshape(self.n, ROW), self.hosts)
    self.history.append({
        "round": self.round, "plan": self.plan.digest(),
        "local_steps": self._arrival_steps,
        "planned_steps": self.plan.local_steps[self.me],
        "group": list(self.plan.group_of(self.me)),
        "global_sync": self.plan.global_sync,
        "epoch_end": self.plan.epoch_end,
        "compute_s": self._arrival_compute, "wait_s": wait, "comm_s": comm,
        "arrived_at": time.time() - (now - self._t_arrive),
        "rate": self.meter.rate, "divergence": float(divergence),
        "loss": table.entries[self.me].loss,
        "learning_rate": table.entries[self.me].learning_rate,
        "table_rates": [e.rate for e in table.entries],
        "time_budget": self.plan.time_budget, "end_step": int(step),
        "stragglers": list(self.plan.stragglers), "bytes_sent": int(bytes_sent),
        "poisoned": list(self._poisoned),
        "members": list(self._decision.members),
        "dropped": list(self._decision.dropped),
        "rejoined": list(self._decision.newcomers),
        "groups": [list(g) for g in self.plan.groups],
        "planned_all": list(self.plan.local_steps)})
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
        self.plan = self._quantized(planner.fit_to_epoch(
            self.plan, remaining, self._weighting))
    if self.observer is not None:
      try:
        self.observer(self.history[-1], table, self.plan)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("oscars_tf: summaries failed (training goes on): %s",
                        e)
    self._log_changes()
    logging.vlog(1, "oscars_tf: worker %d round %d plan %s k=%s groups=%s",
                 self.me, self.round, self.plan.digest(),
                 list(self.plan.local_steps), list(self.plan.groups))
    # The published rows are for people and tools (plans come from the
    # round's decision), so they are refreshed at most every PUBLISH_EVERY_S: two RPCs to
    # the coordination service per round would cost short rounds dearly.
    if (self.publish and self.membership is not None and
        now - self._t_published >= PUBLISH_EVERY_S):
      self._t_published = now
      try:
        rate_table.publish(self.membership.store, self.me,
                           table.entries[self.me], self.plan.digest())
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("oscars_tf: could not publish the rate row: %s", e)
    self._last_sync_step = int(step)
    self._t_round_start = time.monotonic()
    k, scale = self._my_steps(self.plan, int(step))
    self._tell_slice()
    if self.epoch_over:
      # No round ends until the next epoch starts: steps Keras runs past the
      # epoch's end (the rest of a steps_per_execution batch) count toward
      # the next epoch's first round, planned when that epoch begins.
      k = NO_SYNC
    return np.int64(k), np.float32(scale)

  def _quantized(self, plan):
    return planner.quantized(plan, self.step_quantum, self._weighting)

  def _log_changes(self):
    """State changes once each (plan lines are at --v=1)."""
    imputed = frozenset(self.plan.imputed) & frozenset(self.members)
    if self.round > 1 and imputed != self._logged_imputed:
      if imputed:
        logging.warning("oscars_tf: worker %d round %d: no usable rate from "
                        "worker(s) %s; planning them at the median rate.",
                        self.me, self.round, sorted(imputed))
      self._logged_imputed = imputed
    period = getattr(self.plan.state, "period", None)
    if period != self._logged_period:
      if self._logged_period is not None:
        logging.info("oscars_tf: worker %d round %d: period %.3g -> %.3g "
                     "steps of the fastest worker.", self.me, self.round,
                     self._logged_period, period)
      self._logged_period = period

  def begin_epoch(self, target_steps=None):
    """Starts an epoch (eager); `target_steps` are cluster-wide steps.

    With a target, the epoch's last round is planned so that the cluster's
    steps add up to it, and `epoch_over` turns True at that round's end on
    every worker.
    """
    self.epoch_done, self.epoch_over, self.exhausted = 0, False, False
    self.epoch_target = target_steps
    self.plan = self._epoch_plan(target_steps)
    self._assign_plan(int(self.local_step.numpy()))
    self._tell_slice()

  def _epoch_plan(self, target_steps):
    plan = self.plan
    if target_steps is not None:
      plan = planner.fit_to_epoch(plan, target_steps, self._weighting)
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

  # -- graph side ----------------------------------------------------------

  def step_ops(self):
    """Ops of every training step: the simulated delay, then the count."""
    if self.simulate is not None and self.simulate.active:
      with tf.control_dependencies([tf.py_function(
          self._on_step, [self.local_step], tf.int64)]):
        return self.local_step.assign_add(1)
    return self.local_step.assign_add(1)

  def round_end_ops(self, step, loss, read_values, write_values, start=None,
                    reset_state=None, shared_state=None):
    """Ops of an averaging point (see module docstring).

    Args:
      step: this worker's local step count (tensor).
      loss: a scalar loss to report, or NaN.
      read_values: () -> list of tensors, this worker's current values.
      write_values: (list of tensors) -> op assigning the averaged values.
      start: for FedNova weighting, () -> list of round-start values.
      reset_state: () -> op, run on a poisoned worker after it took the
        group's model (e.g. clearing non-finite optimizer slots).
      shared_state: variables every sound member holds equal (the outer
        optimizer's): at a round where a worker rejoins, every member takes
        the sound members' values before `write_values`.
    """
    values = read_values()
    # Poison guard: a worker whose weights are not all finite says so in the
    # table; it then contributes zeros (NaN * 0 is NaN) with weight 0, the
    # others renormalize, and it takes the group's average like everyone.
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v))
                            for v in values])
    outs = tf.py_function(
        self._on_arrive, [step, tf.cast(loss, tf.float64), finite],
        [tf.float64, tf.float32, tf.bool, tf.int32, tf.int32, tf.bool,
         tf.bool, tf.bool, tf.float32] + [d for _, d in HIER_FIELDS])
    (table, weight, poisoned, group_key, group_size, use_nccl, is_global,
     rejoining, state_weight) = [
         tf.reshape(o, s) for o, s in zip(outs[:9], [[self.n * ROW]] +
                                          [[]] * 8)]
    hier = {name: tf.reshape(o, []) for (name, _), o in zip(HIER_FIELDS,
                                                             outs[9:])}
    with tf.control_dependencies([table]):
      if start is not None:
        begin = start()
        values = [b + tf.cast(self.scale, v.dtype) * (v - b)
                  for v, b in zip(values, begin)]
      values = [tf.where(poisoned, tf.zeros_like(v), v) for v in values]
      sent = averaging.packed_bytes(values)

      def group_sum(tensors, w, role="model"):
        if self._per_group:
          return self._group_averager.weighted_sum(
              tensors, w, group_size, group_key, use_nccl, role=role)
        return self._group_averager.weighted_sum(
            tensors, w, role=role, group_size=group_size, group_key=group_key)

      def together():
        return group_sum(values, weight)

      def hierarchical():
        return self._hierarchical.weighted_sum(values, hier)

      if self._multi_host:  # a global sync crosses hosts hierarchically
        grouped = together
        together = lambda: tf.cond(is_global, hierarchical, grouped)  # pylint: disable=unnecessary-lambda-assignment
      averaged = tf.cond(group_size > 1, together,
                         lambda: [tf.identity(v) for v in values])
      divergence = tf.where(poisoned, tf.constant(np.nan, tf.float32),
                            _relative_distance(values, averaged))
    shared = []
    if shared_state:
      # After the model's collective (every member launches them in the
      # same order); all members share the decision, so all take the same
      # branch.
      with tf.control_dependencies(averaged):
        shared = [tf.cond(
            rejoining & (group_size > 1),
            lambda: _share(shared_state, state_weight, group_sum), tf.no_op)]
    with tf.control_dependencies(shared):
      written = write_values(averaged, is_global)
    if reset_state is not None:
      with tf.control_dependencies([written]):
        written = tf.cond(poisoned, reset_state, tf.no_op)
    with tf.control_dependencies([written]):
      next_sync, scale = tf.py_function(
          self._on_averaged, [table, divergence, step, sent],
          [tf.int64, tf.float32])
    updates = [self.next_sync.assign(tf.reshape(next_sync, [])),
               self.scale.assign(tf.reshape(scale, [])),
               self.last_sync_step.assign(step),
               self.syncs.assign_add(1)]
    return tf.group(updates)


def _share(variables, weight, group_sum):
  """Assigns the group's weighted sum of `variables`: the holders' values
  (a weight of 0 sends zeros: a non-finite value times 0 is NaN)."""
  mine = [tf.where(weight > 0, v, tf.zeros_like(v)) for v in variables]
  return tf.group([v.assign(a) for v, a in
                   zip(variables, group_sum(mine, weight, "shared"))])


def _relative_distance(values, averaged):
  """|values - averaged| / |averaged| over all tensors (float32)."""
  num = tf.add_n([tf.reduce_sum(tf.square(tf.cast(v - a, tf.float32)))
                  for v, a in zip(values, averaged)])
  den = tf.add_n([tf.reduce_sum(tf.square(tf.cast(a, tf.float32)))
                  for a in averaged])
  return tf.sqrt(num) / (tf.sqrt(den) + 1e-12)
