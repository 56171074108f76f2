"""One worker's epochs in rounds: the cluster's steps toward an epoch's
target, the round that ends it, and this worker's slice of each round's
data. No TensorFlow.

With a target (cluster-wide steps per epoch), the epoch's last round is
planned so that the members' steps add up to it, and every member ends
the epoch at that round's end. Every member holds the same plan and the
same count, so each can tell its own slice of a round (fit's shared sample
order: frontends/shared_order.py) without asking the others.
"""

from oscars_tf.policy import plan_changes


class EpochBook:
  """The epoch accounting and data slices of one worker's rounds.

  Args:
    me: this worker's index.
    weighting: the schedule's weighting ("work", ...): plans refit to an
      epoch's steps keep it.
  """

  def __init__(self, me, weighting):
    self.me = me
    self._weighting = weighting
    self.target = None     # cluster-wide steps per epoch, if planned
    self.done = 0          # cluster-wide steps of the epoch so far
    self.over = False      # read by Keras' epoch loop between steps
    self.index = 0         # this worker's epoch (Keras' numbering)
    self.offset = 0        # the cluster's epoch less this worker's:
                           # > 0 after it rejoined (it missed some)
    self.exhausted = False  # this worker's data for the epoch ran out
    self.step_quantum = 1  # k_i are multiples of it (Keras'
                           # steps_per_execution; same on all workers)
    # Called as slice_listener(epoch, first_step, steps) with this worker's
    # part of each round of a planned epoch, once the round's plan is fixed
    # (fit's shared sample order: frontends/shared_order.py).
    self.slice_listener = None
    self._told = None

  def quantized(self, plan):
    """`plan` with every k_i a multiple of the step quantum."""
    return plan_changes.quantized(plan, self.step_quantum, self._weighting)

  def begin(self, plan, target_steps=None):
    """Starts an epoch of `target_steps` cluster-wide steps (None: no
    target); returns `plan` fit to it, and tells this worker's slice."""
    self.done, self.over, self.exhausted = 0, False, False
    self.target = target_steps
    plan = self.epoch_plan(plan, target_steps)
    self.tell_slice(plan)
    return plan

  def epoch_plan(self, plan, target_steps):
    """`plan` as an epoch of `target_steps` begins with it."""
    if target_steps is not None:
      plan = plan_changes.fit_to_epoch(plan, target_steps, self._weighting)
    return self.quantized(plan)

  def next_plan(self, planned, ended, table, agreed):
    """`planned`, the schedule's plan of the round after `ended` from that
    round's `table`, quantized and fit to what is left of the epoch once
    `table`'s steps are counted; `over` turns True where the epoch ends.
    `agreed`: every member of `ended` was out of data."""
    plan = self.quantized(planned)
    if agreed:  # every member's data ran out
      self.over = True
    elif self.target is not None:
      self.done += sum(e.steps for e in table.entries)
      remaining = self.target - self.done
      if ended.epoch_end or remaining <= 0:
        self.over = True  # every worker ends the epoch here
      else:
        plan = self.quantized(plan_changes.fit_to_epoch(
            plan, remaining, self._weighting))
    return plan

  def listen_slices(self, listener):
    """Sets the slice listener (None: none)."""
    self.slice_listener, self._told = listener, None

  def tell_first_slice(self, plan, target_steps, epoch):
    """Tells the slice listener this worker's part of the first round of
    epoch `epoch` before it begins, as `begin` will plan it from `plan`
    (Keras reads a batch to build the model before the first epoch
    begins)."""
    if self.slice_listener is None or target_steps is None:
      return
    k = self.epoch_plan(plan, target_steps).local_steps
    self._tell((epoch + self.offset, sum(k[:self.me]), k[self.me]))

  def tell_slice(self, plan):
    """This worker's part of the coming round, planned as `plan`, of a
    planned epoch: its steps follow the cluster's steps so far and those of
    the workers before it in the plan, which every member holds alike."""
    if self.slice_listener is None or self.target is None or self.over:
      return
    k = plan.local_steps
    self._tell((self.index + self.offset, self.done + sum(k[:self.me]),
                k[self.me]))

  def _tell(self, part):
    if part != self._told:  # told ahead by tell_first_slice
      self._told = part
      self.slice_listener(*part)
