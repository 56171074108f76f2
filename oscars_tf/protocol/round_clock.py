"""A worker's round clock: its compute time apart from its waits, its
measured rate, and the simulated sleeps. No TensorFlow.

A round's compute time runs from its start (the last averaging point, or a
start or resume) to the worker's arrival at the next one; what follows, the
wait for the round's table and the averaging, is not its speed. The rate
meter (rate_table.RateMeter) takes compute steps over compute seconds
only, and the worker's next row reports the averaging point's cost.
"""

import math
import time

from oscars_tf.protocol import rate_table


class RoundClock:
  """The times of one worker's rounds and the rate measured from them.

  Args:
    me: this worker's index (the simulated slowness is per worker).
    simulate: the simulated slowness (simulate.py), or None.
  """

  def __init__(self, me, simulate=None):
    self.me = me
    self.simulate = simulate
    self.meter = rate_table.RateMeter()
    self.totals = {"wait_s": 0.0, "comm_s": 0.0, "compute_s": 0.0,
                   "bytes_sent": 0, "collectives": 0, "simulated_s": 0.0}
    self.rate_before = math.nan  # the meter before this round's sample
    self.last_sync_cost = math.nan  # arrival to averaged, last round
    self.arrival_steps = 0      # this round's steps, at its arrival
    self.arrival_compute = 0.0  # and its compute seconds
    self._round_start = None
    self._first_step = None
    self._arrive = self._table = 0.0
    self._skip_steps = 0  # round 0: steps before the clock started

  def start(self):
    """Time from here on counts as compute (starts, resumes, round ends)."""
    self._round_start = time.monotonic()

  def first_step_done(self, round_, steps):
    """Round 0's clock restarts after the first step, which traces the
    function: its rate is then measured, saving a second probe round."""
    if round_ == 0:
      self._round_start = time.monotonic()
      self._skip_steps = steps

  def sleep_planned(self, step):
    """Per step, only when simulating heterogeneity: the planned sleep."""
    now = time.monotonic()
    if self._first_step is None:
      self._first_step = now
    delay = self.simulate.seconds(self.me, step, now - self._first_step)
    if delay > 0:
      time.sleep(delay)
      self.totals["simulated_s"] += delay

  def arrive(self, round_, steps):
    """This worker reached round `round_`'s averaging point after `steps`
    steps: the round's compute time goes to the meter."""
    now = time.monotonic()
    compute = now - (self._round_start or now)
    self.rate_before = self.meter.rate  # if late, the stall is not its speed
    # Round 0 holds tracing and start-up unless its clock restarted after
    # the first step: it would understate every rate.
    if round_ > 0:
      self.meter.add(steps, compute)
    elif self._skip_steps and steps > self._skip_steps:
      self.meter.add(steps - self._skip_steps, compute)
    self.totals["compute_s"] += compute
    self._arrive = now
    self.arrival_steps = steps
    self.arrival_compute = compute

  def table_read(self):
    """The round's table is in: the wait is over, the averaging begins."""
    self._table = time.monotonic()

  def averaged(self, now, bytes_sent, first_meeting):
    """The round's averaging ended at `now` (time.monotonic()); returns
    its (wait, comm) seconds. A round whose collectives met for the first
    time reports no cost: TensorFlow resolves a group the first time it
    meets it, which says nothing of the next rounds."""
    wait, comm = self._table - self._arrive, now - self._table
    self.totals["wait_s"] += wait
    self.totals["comm_s"] += comm
    self.last_sync_cost = math.nan if first_meeting else wait + comm
    self.totals["bytes_sent"] += bytes_sent
    self.totals["collectives"] += 1
    return wait, comm

  def taken(self, bytes_sent, waited):
    """An overlapped averaging was taken after `waited` seconds of waiting
    for it, after the round's start: a cost of the averaging (the next row
    reports it), not compute time."""
    if self._round_start is not None:
      self._round_start += waited
    if not math.isnan(self.last_sync_cost):
      self.last_sync_cost += waited
    self.totals["comm_s"] += waited
    self.totals["bytes_sent"] += bytes_sent

  def arrived_at(self, now):
    """The wall time (time.time()) of this round's arrival, `now` being
    time.monotonic()."""
    return time.time() - (now - self._arrive)

  def others_due_s(self, plan, members):
    """Seconds until `plan`'s other `members` should arrive, at 1.5 times
    their planned compute time: the chief, out of data early, waits that
    long before its straggler timeout runs (RoundBook._decide)."""
    due = [k / r for j, (k, r) in enumerate(zip(plan.local_steps,
                                                plan.rates))
           if j != self.me and j in members and r > 0]
    elapsed = time.monotonic() - (self._round_start or time.monotonic())
    return max([0.0] + [1.5 * d - elapsed for d in due if math.isfinite(d)])
