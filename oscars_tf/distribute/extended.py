"""The extended of `OscarsStrategy`: where the layers meet TF's contract.

Glue only: the cluster comes from cluster.py/runtime.py, when to average from
a schedule (policy), how to average from averaging.py. What this file adds is
where those meet TensorFlow's strategy contract:

* Inside a worker, the local devices are replicas of a `MirroredStrategy`
  (gradients summed across them every step). `num_replicas_in_sync`,
  `reduce`, `gather` and replica-context `all_reduce` are worker-local, so
  Keras' per-step loss scaling, gradient all-reduce and metric reduction never
  reach another worker: there is no hidden barrier.
* A step that updates variables is recognised while it is traced (the
  optimizer calls `extended.update`); right after it, the strategy appends
  "count the step; if the schedule says so, average the model with the other
  workers" (round_ends.py). So `model.fit`, `steps_per_execution` and
  custom loops with `strategy.run` all average at the same planned points.

The components (round book, control plane, rounds, epochs, averagers, outer
optimizer state) are built once, by wiring.py.
"""

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy

from oscars_tf import arguments
from oscars_tf.distribute import averaged_variables
from oscars_tf.distribute import inputs
from oscars_tf.distribute import multi_worker_roles
from oscars_tf.distribute import outer as outer_lib
from oscars_tf.distribute import replicas
from oscars_tf.distribute import round_state
from oscars_tf.distribute import startup
from oscars_tf.distribute import wiring
from oscars_tf.distribute.replicas import (
  component_variables as _component_variables,
)
from oscars_tf.distribute.replicas import is_float as _is_float
from oscars_tf.protocol import agreement
from oscars_tf.runtime import averaging


class OscarsExtended(multi_worker_roles.MultiWorkerRoles,
                     inputs.WorkerInputs, replicas.LocalSGDReplicas,
                     mirrored_strategy.MirroredExtended):
  """Implementation of `OscarsStrategy` (see its docstring)."""

  def __init__(self, container, info, devices, args):
    """`info`: the worker's `cluster.ClusterInfo`; `devices`: as given to
    the strategy; `args`: its checked `wiring.Arguments`."""
    self._cluster = info
    self._roles_resolver = None  # multi_worker_roles: built when asked for
    self._local_sgd = args.local_sgd
    self._schedule = args.schedule
    self._optimizer_state = args.optimizer_state
    local_devices = replicas.resolve_devices(devices, info)
    super().__init__(container, devices=local_devices)
    parts = wiring.build(info, local_devices, args, averages=self._averages,
                         end_round_now=self.average_now)
    self._host = parts.host
    self._communication = parts.communication
    self._averaging_dtype = parts.averaging_dtype
    self._averager = parts.averager
    self._agreements = parts.agreements
    self._book = parts.book
    self.round_logs = parts.round_logs
    self._rounds = parts.rounds
    self._ends = parts.ends
    self.epochs = parts.epochs
    self._averaged = parts.averaged
    self._outer = parts.outer
    self._compression = parts.compression
    self._overlap = args.overlap
    self._started_sets = set()    # variable sets already checked+broadcast
    self._round_state = None      # round_state.Keeper: saves on a lost peer
    self._last_variables = []
    self._update_log = []         # stack of variables updated per traced call
    self._suppress_sharding = 0   # inputs.WorkerInputs: see unsharded

  # -- what is averaged ---------------------------------------------------

  def track(self, model, optimizer=None):
    """Average `model`'s weights (and `optimizer`'s slots if asked)."""
    self._averaged.track(model, optimizer)

  def start(self):
    """Checks and broadcasts the tracked variables now (eager, at `fit`'s
    start), not at the first step: a worker whose shard turns out to be
    empty still takes part, and so the averaging points can be ended
    without a step of its own (see `epochs.Epochs.finish`)."""
    variables = self._averaged.select([])
    if variables:
      self._last_variables = variables
      self._start_once(variables)

  @property
  def round_book(self):
    """This worker's round bookkeeping (a `round_book.RoundBook`)."""
    return self._book

  # -- recognising training steps -----------------------------------------

  def _update(self, var, fn, args, kwargs, group):
    if self._update_log:
      self._update_log[-1].append(var)
    return super()._update(var, fn, args, kwargs, group)

  def _replica_ctx_update(self, var, fn, args, kwargs, group):
    if self._update_log:
      self._update_log[-1].append(var)
    return super()._replica_ctx_update(var, fn, args, kwargs, group)

  def _call_for_each_replica(self, fn, args, kwargs):
    self._update_log.append([])
    try:
      result = super()._call_for_each_replica(fn, args, kwargs)
    finally:
      # A training step updates a floating-point variable; a call that only
      # counts (tf_keras' mirrored test and predict batch counters) is not
      # one, and must not move the rounds.
      updated = [v for v in self._update_log.pop() if _is_float(v)]
    if self._update_log:
      # A call inside a step's (a LossScaleOptimizer applies the gradients
      # through merge_call): one step, the outer call's, with these updates.
      self._update_log[-1].extend(updated)
      return result
    if updated:
      # Count the step only once its update has happened: a step whose input
      # fetch fails (end of data) must not count, and in a graph, ops on
      # unrelated resources are otherwise free to run first.
      done = [tf.identity(_component_variables(v)[0]) for v in updated[:1]]
      with tf.control_dependencies(done):
        self._after_train_step(self._averaged.select(updated),
                               self._loss_of(result))
    return result

  def _loss_of(self, result):
    """The step's loss if it returned one (Keras: logs["loss"]), else NaN."""
    value = result.get("loss") if isinstance(result, dict) else result
    try:
      parts = [tf.convert_to_tensor(p) for p in self._local_results(value)]
    except (TypeError, ValueError):
      return tf.constant(np.nan, tf.float32)
    if not parts or parts[0].shape.rank != 0 or not parts[0].dtype.is_floating:
      return tf.constant(np.nan, tf.float32)
    return tf.reduce_mean([tf.cast(p, tf.float32) for p in parts])

  def _after_train_step(self, variables, loss):
    self._last_variables = variables
    self._start_once(variables)
    self._ends.after_step(variables, loss)

  # -- averaging ----------------------------------------------------------

  def _start_once(self, variables):
    """Checks that workers agree, then broadcasts worker 0's model (and
    outer state).

    Runs eagerly (lifted out of any function being traced), once per set of
    variables, before the first step executes: every worker starts from the
    chief's initial weights, and a worker with another model fails here with
    a clear error instead of corrupting the others.
    """
    key = averaged_variables.key_of(variables)
    if key in self._started_sets:
      return
    self._started_sets.add(key)
    with tf.init_scope():
      if self._cluster.is_multi_worker:
        handshake = startup.Handshake(
            self._averager, self._cluster, self._collective_or_timeout)
        handshake.check_workers_agree(variables, startup.Settings(
            self._schedule, self._optimizer_state, self._communication,
            self._outer.optimizer, self._book.step_quantum,
            self._averaging_dtype, self._compression.compression,
            self._overlap))
        handshake.broadcast_from_chief(
            replicas.read_values(variables, self._local_sgd),
            lambda values: replicas.write_values(variables, values))
      started = replicas.read_values(variables, self._local_sgd)
      with tf.device(self._host):
        self._ends.keep_start(variables, started)
        if self._outer.optimizer is not None:
          takes_step = outer_lib.takes_outer_step(variables,
                                                  self._averaged.model)
          outer = self._outer.create(key, takes_step, started)
          if self._cluster.is_multi_worker:  # each restored its own
            handshake.broadcast_from_chief(outer.variables, outer.assign,
                                           role="shared")
        if self._compression.compression:  # from the model all start with
          self._compression.create(key, started, outer_lib.takes_outer_step(
              variables, self._averaged.model))
      self._book.mark_round_start()

  def _collective_or_timeout(self, fn, what):
    with self.peer_errors_explained(what):
      return fn()

  def peer_errors_explained(self, what, collectives_only=False):
    """A context in which a failed collective raises PeerTimeoutError or
    WorkerLostError saying what happened at `what` (see averaging), once
    the round state is saved (see keep_round_state)."""
    return round_state.saved_when_peer_lost(self._round_state, (
        averaging.peer_errors_explained(
            what, self._cluster.worker_index, self._cluster.num_workers,
            self._averager.timeout, collectives_only)),
        peers=self._book.round_peers)

  def keep_round_state(self, model, directory):
    """From now on a lost peer makes this worker save `model` and its
    position in `directory` first (see round_state; checkpoint.restore)."""
    if self._cluster.is_multi_worker:
      outer = self._outer
      self._round_state = round_state.Keeper(
          model, directory, self._cluster.worker_index, self._rounds,
          outer_state=lambda: (outer.arrays() if outer.optimizer is not None
                               else None))

  @property
  def cluster(self):
    """The `cluster.ClusterInfo` of this worker."""
    return self._cluster

  @property
  def outer(self):
    """The outer optimizer and its state per variable set
    (`outer.OuterStates`)."""
    return self._outer

  @property
  def schedule(self):
    return self._schedule

  @property
  def averaging_dtype(self):
    """The dtype float weights are averaged in: None (their own), or
    tf.bfloat16 / tf.float16 (after the GPU fallback, see averaging)."""
    return self._averaging_dtype

  @property
  def compression(self):
    """"int8" or "int4" (the changes are sent compressed), or None."""
    return self._compression.compression

  @property
  def overlap(self):
    """False, True or "always": averagings beside the next round."""
    return self._overlap

  def set_steps_per_execution(self, steps):
    """Keras' steps per call: rounds then end with a call (see
    `plan_changes.quantized`). Every worker must use the same."""
    if not arguments.is_int(steps) or steps < 1:
      raise ValueError("OscarsStrategy: compile(steps_per_execution=...) must "
                       f"be a positive int, got {steps!r}.")
    self._book.step_quantum = int(steps)

  def needs_sync(self):
    """True when a step ran since the last averaging point, or an
    averaging is in flight (eager)."""
    return self._averages() and (
        int(self._rounds.local_step.numpy()) !=
        int(self._rounds.last_sync_step.numpy()) or
        self._rounds.averaging_in_flight())

  def sync_now(self):
    """Ends the round now (eager). Every worker must call it together."""
    needed = self.needs_sync()
    if needed:
      self.average_now()
    return needed

  def average_now(self):
    """Ends the round now, whatever the plan said (eager); with overlap,
    waits for its averaging: the model is an average when it returns."""
    end = self._ends.function(self._last_variables)
    # In the strategy's scope, as the training step that calls `end` too:
    # the same context, so the same trace.
    with self._container_strategy().scope(), self._rounds.waiting():
      self._collective_or_timeout(
          lambda: end(self._rounds.local_step.read_value(),
                      tf.constant(np.nan, tf.float32)), "an averaging point")

  def mark_round_start(self):
    self._book.mark_round_start()

  def _averages(self):
    """Whether rounds average anything yet: a model is stepping and there
    is someone to average with (other workers, or local SGD replicas)."""
    return ((self._cluster.is_multi_worker or self._local_sgd) and
            bool(self._last_variables))

  def mark_first_step_done(self):
    self._book.mark_first_step_done(int(self._rounds.local_step.numpy()))

  # -- agreements between rounds --------------------------------------------

  def gather_numbers(self, numbers):
    """{worker: numbers} of the members, agreed through the chief (eager;
    every member calls it at the same point). A member stalled past the
    straggler timeout is left out (see agreement.py)."""
    if self._agreements is None:
      return {self._cluster.worker_index: [float(x) for x in numbers]}
    return self._agreements.gather(self._book.round, self._book.members,
                                   numbers)

  def exchange(self, name, text):
    """{worker: text} of every worker (eager, all at the same point; see
    agreement.Agreements.exchange)."""
    if self._agreements is None:
      return {self._cluster.worker_index: text}
    return self._agreements.exchange(name, text,
                                     range(self._cluster.num_workers))

  def average_numbers(self, numbers):
    """Mean of a list of floats over the members (see gather_numbers)."""
    return agreement.mean(self.gather_numbers(numbers), len(numbers)) if (
        numbers) else []

  def stats(self):
    r = self._rounds
    return {"local_step": int(r.local_step.numpy()),
            "syncs": int(r.syncs.numpy()),
            "next_sync_step": int(r.next_sync.numpy()),
            "round": self._book.round, **self._book.totals}
