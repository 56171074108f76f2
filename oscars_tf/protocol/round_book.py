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

`RoundBook` holds the round and its plan and calls its roles in that
order: the round's clock and rate meter (round_clock.py), the exchange
that turns this worker's row into its `RoundPart` (round_exchange.py), and
the epochs and data slices (epoch_book.py); the finished rounds go to
round_history.py.
"""

import dataclasses
import math
import time

from absl import logging
import numpy as np

from oscars_tf.policy import planner
from oscars_tf.policy import records
from oscars_tf.protocol import epoch_book
from oscars_tf.protocol import plan_log
from oscars_tf.protocol import rate_table
from oscars_tf.protocol import rejoin
from oscars_tf.protocol import round_clock
from oscars_tf.protocol import round_exchange
from oscars_tf.protocol import round_history
from oscars_tf.protocol import round_parts
from oscars_tf.protocol.round_parts import NextRound

ROW = records.ROW_WIDTH  # a row's floats (the graph's table: rounds.py)
NO_SYNC = np.iinfo(np.int64).max  # next_sync while an epoch is over


class _Kept:
  """A book attribute one of its roles keeps: `_Kept("epochs", "over")`
  as `epoch_over` reads and sets `book.epochs.over`. The strategy, the
  front ends, tests and the rejoin path (`_adopt`) use the book's names."""

  def __init__(self, role, name):
    self._role, self._name = role, name

  def __get__(self, book, owner=None):
    if book is None:
      return self
    return getattr(getattr(book, self._role), self._name)

  def __set__(self, book, value):
    setattr(getattr(book, self._role), self._name, value)


class RoundBook:
  """The Python side of one worker's rounds.

  Args:
    info: the cluster (cluster.ClusterInfo): this worker's index, every
      worker's address, whether there are several.
    schedule: the schedule that plans each round from the table.
    learning_rate_fn: () -> the optimizer's learning rate (for the table).
    simulate: the simulated slowness (simulate.py), or None.
    publish: whether to publish this worker's row now and then for people
      and tools (rate_table.RowPublisher); only with several workers.
    membership: the round's membership (membership.Membership), or None
      for one worker, always alone.
  """

  # The names the strategy, the front ends, summaries, benchmarks, tests
  # and `_adopt` read and set on the book, kept by its roles.
  meter = _Kept("clock", "meter")
  totals = _Kept("clock", "totals")
  simulate = _Kept("clock", "simulate")
  _rate_before = _Kept("clock", "rate_before")
  membership = _Kept("exchange", "membership")
  members = _Kept("exchange", "members")
  group_keys = _Kept("exchange", "group_keys")
  epoch_target = _Kept("epochs", "target")
  epoch_done = _Kept("epochs", "done")
  epoch_over = _Kept("epochs", "over")
  epoch_index = _Kept("epochs", "index")
  epoch_offset = _Kept("epochs", "offset")
  exhausted = _Kept("epochs", "exhausted")
  step_quantum = _Kept("epochs", "step_quantum")
  slice_listener = _Kept("epochs", "slice_listener")

  def __init__(self, info, schedule, learning_rate_fn=None, simulate=None,
               publish=True, membership=None):
    self.me = info.worker_index
    self.n = info.num_workers
    self.hosts = tuple(a.rpartition(":")[0] for _, _, a in info.workers)
    self.multi_host = round_parts.multi_host(self.hosts)
    self.schedule = schedule
    self.learning_rate_fn = learning_rate_fn or (lambda: math.nan)
    self.publish = publish and info.is_multi_worker
    self.round = 0
    # Rounds of the attempts a restored job resumed (checkpoint.restore):
    # its saved states and summaries number on from them.
    self.rounds_before = 0
    empty = records.StepRateTable(
        tuple(records.TableEntry() for _ in range(self.n)), self.hosts)
    self.plan = schedule.plan(empty, 0)
    self.history = round_history.RoundHistory(self.n)
    self.observer = None  # called as observer(record, table, next_plan)
    self._change_log = plan_log.PlanChangeLog(self.me)
    self._weighting = schedule.weighting
    # No ring of a global sync across hosts has more host leaders than the
    # schedule's group bound (a third level past that: round_parts.py).
    self._max_leaders = (schedule.max_group_size or
                         planner.DEFAULT_MAX_GROUP_SIZE)
    self.clock = round_clock.RoundClock(self.me, simulate)
    self.exchange = round_exchange.RoundExchange(
        self.me, self.hosts, membership, self._weighting, self._max_leaders)
    self.epochs = epoch_book.EpochBook(self.me, self._weighting)
    self._publisher = rate_table.RowPublisher(self.me)
    self.last_sync_step = 0  # local step of the last average (Python's)
    self._last_divergence = math.nan

  def my_steps(self, plan, step):
    """NextRound of this worker under `plan` from local step `step`."""
    return NextRound(step + plan.local_steps[self.me],
                     plan.update_scales[self.me])

  def mark_round_start(self):
    """Time from here on counts as compute (called at starts and resumes)."""
    self.clock.start()

  def mark_first_step_done(self, steps):
    """Round 0's clock restarts after the first step, which traces the
    function: its rate is then measured, saving a second probe round."""
    self.clock.first_step_done(self.round, steps)

  def step(self, step):
    """Per step, only when simulating heterogeneity: the planned sleep."""
    self.clock.sleep_planned(step)

  def arrive(self, step, loss, finite):
    """This worker reached its averaging point at local step `step`: its
    row goes to the round's exchange; returns its RoundPart."""
    steps = step - self.last_sync_step
    self.clock.arrive(self.round, steps)
    row = records.TableEntry(
        rate=self.meter.rate, round=self.round, loss=loss,
        divergence=self._last_divergence,
        learning_rate=float(self.learning_rate_fn()), steps=steps,
        healthy=finite, exhausted=self.exhausted,
        sync_cost=self.clock.last_sync_cost)
    return self._exchange(row.to_values())

  def _decide(self, row):
    """The round's membership decision; a worker dropped before takes the
    cluster's round and plan (`_adopt`). The chief, out of data early,
    waits for the members still training before its straggler timeout
    runs."""
    due_s = (self.clock.others_due_s(self.plan, self.members)
             if self.exhausted and self.membership is not None else 0.0)
    decision = self.exchange.decide(
        self.round, row, self.plan, self.epoch_index, self.epoch_done,
        due_s, self._rate_before)
    if decision.round != self.round:  # dropped, now let back in
      self._adopt(decision)
    return decision

  def _exchange(self, row):
    """The round's membership and table, then this worker's part in it."""
    decision = self._decide(row)
    self.clock.table_read()
    self.plan, part = self.exchange.part_in(decision, self.round, self.plan)
    return part

  def round_peers(self):
    """The workers of this worker's collectives in the current round."""
    return self.exchange.round_peers()

  def _adopt(self, decision):
    """A rejoining worker takes the chief's round, epochs and plan."""
    rejoin.adopt(self, decision, self._rate_before)

  def averaged(self, table_vec, divergence, step, bytes_sent):
    """The round's averaging is done: records it, plans the next round
    from the round's table; returns this worker's NextRound."""
    now = time.monotonic()
    wait, comm = self.clock.averaged(now, bytes_sent,
                                     self.exchange.first_meeting)
    self._last_divergence = divergence
    table = records.StepRateTable.from_rows(
        np.asarray(table_vec).reshape(self.n, ROW), self.hosts)
    self._record(table, divergence, step, bytes_sent, wait, comm, now)
    self.round += 1
    ended = self.plan
    self.plan = self.epochs.next_plan(
        self.schedule.plan(table, self.round, self.plan.state), ended, table,
        self.exchange.epoch_agreed)
    self._tell_round(table, now)
    self.last_sync_step = step
    self.clock.start()
    nxt = self.my_steps(self.plan, step)
    self.epochs.tell_slice(self.plan)
    if self.epoch_over:
      # No round ends until the next epoch starts: steps Keras runs past the
      # epoch's end (the rest of a steps_per_execution batch) count toward
      # the next epoch's first round, planned when that epoch begins.
      nxt = nxt._replace(next_sync=NO_SYNC)
    return nxt

  def completed(self, round_, bytes_sent, waited, overlapped, divergence):
    """Round `round_`'s overlapped averaging was taken (distribute/
    overlap.py): after `waited` seconds of waiting for it, `overlapped`
    seconds of it beside compute; `averaged` recorded the round at its
    start (its comm_s: the start). Its cost, bytes and divergence go to the
    clock, the record, the observer's `taken` and the next row."""
    self.clock.taken(bytes_sent, waited)
    self._last_divergence = divergence
    record = self.history.amend(round_, lambda r: dataclasses.replace(
        r, bytes_sent=bytes_sent, divergence=divergence, overlap_s=overlapped,
        take_wait_s=waited))
    taken = getattr(self.observer, "taken", None)
    if record is not None and taken is not None:
      try:
        taken(record)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("oscars_tf: summaries failed (training goes on): %s",
                        e)

  def _tell_round(self, table, now):
    """The next round's plan to the observer, the log and (now and then)
    the published row."""
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

  def _record(self, table, divergence, step, bytes_sent, wait, comm, now):
    """Adds the finished round to `history`."""
    decision, mine = self.exchange.decision, table.entries[self.me]
    self.history.add(round_history.RoundRecord(
        round=self.round, plan=self.plan.digest(),
        local_steps=self.clock.arrival_steps,
        planned_steps=self.plan.local_steps[self.me],
        group=list(self.plan.group_of(self.me)),
        global_sync=self.plan.global_sync,
        sharded_sync=self.exchange.sharded,
        epoch_end=self.plan.epoch_end,
        compute_s=self.clock.arrival_compute, wait_s=wait, comm_s=comm,
        arrived_at=self.clock.arrived_at(now),
        rate=self.meter.rate, divergence=divergence,
        loss=mine.loss, learning_rate=mine.learning_rate,
        table_rates=[e.rate for e in table.entries],
        time_budget=self.plan.time_budget, end_step=step,
        stragglers=list(self.plan.stragglers), bytes_sent=bytes_sent,
        poisoned=list(self.exchange.poisoned),
        members=list(decision.members), dropped=list(decision.dropped),
        rejoined=list(decision.newcomers),
        groups=[list(g) for g in self.plan.groups],
        planned_all=list(self.plan.local_steps)))

  def begin_epoch(self, step, target_steps=None):
    """Starts an epoch at local step `step`; `target_steps` are
    cluster-wide steps. Returns this worker's NextRound.

    With a target, the epoch's last round is planned so that the cluster's
    steps add up to it, and `epoch_over` turns True at that round's end on
    every worker.
    """
    self.plan = self.epochs.begin(self.plan, target_steps)
    return self.my_steps(self.plan, step)

  def listen_slices(self, listener):
    """Sets the slice listener (None: none)."""
    self.epochs.listen_slices(listener)

  def tell_first_slice(self, target_steps, epoch):
    """Tells the slice listener this worker's part of the first round of
    epoch `epoch` before it begins, as `begin_epoch` will plan it (Keras
    reads a batch to build the model before the first epoch begins)."""
    self.epochs.tell_first_slice(self.plan, target_steps, epoch)
