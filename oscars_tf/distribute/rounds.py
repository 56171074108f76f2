"""The graph side of one worker's rounds: its step counters and the ops of
an averaging point.

At a round end the graph calls the round book (protocol/round_book.py)
through `tf.py_function` for this worker's part in the round (a RoundPart:
who averages with whom, with which weights), averages the model inside
its group with those tensors (one op serves every group), and calls the
book again to plan the next round.
"""

import contextlib

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph
from tensorflow.python.ops import control_flow_util_v2

from oscars_tf.distribute import compression as compression_lib
from oscars_tf.distribute import overlap as overlap_lib
from oscars_tf.policy import plan_changes
from oscars_tf.protocol import group_keys
from oscars_tf.protocol import round_book
from oscars_tf.protocol import round_parts
from oscars_tf.runtime import averagers
from oscars_tf.runtime import averaging
from oscars_tf.runtime import collective_watch
from oscars_tf.runtime import fault_injection
from oscars_tf.runtime import py_function_errors
from oscars_tf.runtime import sharded_sync

# The dtype of each RoundPart field as it crosses tf.py_function.
PART_DTYPES = round_parts.RoundPart(
    table=tf.float64, weight=tf.float32, takes_model=tf.bool,
    group_key=tf.int32, group_size=tf.int32, nccl=tf.bool, is_global=tf.bool,
    rejoining=tf.bool, state_weight=tf.float32, host_key=tf.int32,
    host_size=tf.int32, weight_in_host=tf.float32, is_leader=tf.bool,
    leaders_key=tf.int32, leaders_size=tf.int32, host_share=tf.float32,
    is_rack_leader=tf.bool, racks_key=tf.int32, racks_size=tf.int32,
    rack_share=tf.float32, sharded=tf.bool, shard_rank=tf.int32,
    pieces=tf.int32, cut_denominator=tf.int64, segment_cuts=tf.int64,
    segment_ids=tf.int32, segment_keys=tf.int32, segment_sizes=tf.int32,
    segment_top_keys=tf.int32, host_leads_rack=tf.bool,
    shard_racks_size=tf.int32)


def inside_while_loop():
  """Whether the function being traced runs inside a tf.while_loop."""
  graph = tf.compat.v1.get_default_graph()
  while isinstance(graph, func_graph.FuncGraph):
    if isinstance(graph, control_flow_util_v2.WhileBodyFuncGraph):
      return True
    graph = graph.outer_graph
  return False


def _part_shape(name, n):
  """The static shape of RoundPart field `name` for `n` workers."""
  if name == "table":
    return [n * round_book.ROW]
  if name in round_parts.VECTOR_LENGTHS:
    return [round_parts.VECTOR_LENGTHS[name]]
  return []


class Rounds:
  """Counts one worker's steps and builds the ops of its averaging points;
  the bookkeeping is its `book`."""

  def __init__(self, book, host_device, averaging_device, communication,
               timeout, per_group_nccl=False, averaging_dtype=None,
               compression=None, addresses=(), overlap=False):
    self.book = book
    # The last round's group, in members' worth of gradient noise (read at
    # its averaging's write: second_moments.py).
    self.effective_group_size = 1.0
    self._averaging_dtype = averaging_dtype  # None: each tensor's own
    # The model's averager: the round's group ("auto" on GPUs: NCCL for a
    # group on one host, ring across hosts); across hosts a global sync
    # shard by shard or host by host; a member alone meets none.
    averager = self._group_averager(averaging_device, communication,
                                    timeout, per_group_nccl)
    if book.multi_host:
      intra = "NCCL" if per_group_nccl else communication
      averager = averagers.AcrossHosts(
          averager, averagers.HierarchicalAverager(
              averaging_device, intra, timeout, averaging_dtype),
          sharded_sync.ShardedAverager(averaging_device, intra, timeout,
                                       averaging_dtype))
    self._averager = averagers.UnlessAlone(averager)
    # compression="int8"/"int4": the model's changes, quantized, on the
    # host's CPU; the exact averager for the rest and some rounds.
    self._compressed = compression_lib.CompressedRound(
        compression, self._averager, host_device, timeout, book.me,
        averaging_dtype, watch=collective_watch.PeerWatch(
            lambda: [addresses[j] for j in book.round_peers()
                     if j != book.me])) if compression else None
    # overlap=True/"always": averagings beside the next round's steps.
    self._overlapped = (overlap_lib.OverlappedRoundEnd(
        self, self._average, always=overlap == "always") if overlap else None)
    # State every sound member holds equal, sent to a rejoiner in its
    # group: exact, under its own instance keys.
    self._shared_averager = self._group_averager(
        averaging_device, communication, timeout, per_group_nccl,
        role="shared", exact=True)
    with tf.device(host_device), tf.init_scope():
      k, scale = book.my_steps(book.plan, 0)
      self.local_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    name="oscars_local_step")
      self.next_sync = tf.Variable(k, dtype=tf.int64, trainable=False,
                                   name="oscars_next_sync")
      self.last_sync_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="oscars_last_sync_step")
      self.syncs = tf.Variable(0, dtype=tf.int64, trainable=False,
                               name="oscars_syncs")
      # Group, key and weight come from the round's membership decision at
      # the round end (a RoundPart); only these carry over between rounds.
      self.scale = tf.Variable(scale, dtype=tf.float32, trainable=False)

  def begin_epoch(self, target_steps=None):
    """Starts an epoch (eager): see RoundBook.begin_epoch."""
    k, scale = self.book.begin_epoch(int(self.local_step.numpy()),
                                     target_steps)
    self.next_sync.assign(k)
    self.scale.assign(scale)

  def _group_averager(self, device, communication, timeout, per_group_nccl,
                      role="model", exact=False):
    """The averager of a round's group (its size and key from the round's
    part; the whole cluster's by default)."""
    global_key = group_keys.GROUP_KEY_BASE
    if per_group_nccl:
      return averagers.PerGroupAverager(
          self.book.n, global_key, device, timeout, self._averaging_dtype,
          role, exact)
    return averaging.GroupAverager(
        self.book.n, global_key, device, communication, timeout,
        self._averaging_dtype, role, exact)

  # -- py_function bodies (carried: what they raise keeps its class) -------

  @py_function_errors.carried
  def _on_step(self, step):
    self.book.step(int(step))
    return np.int64(0)

  @py_function_errors.carried
  def _on_arrive(self, step, loss, finite):
    fault_injection.at_arrival(self.book.round)  # tests stop a worker here
    part = self.book.arrive(int(step), float(loss), bool(finite))
    self.effective_group_size = plan_changes.effective_group_size(
        self.book.plan, self.book.me)
    return [np.asarray(v, d.as_numpy_dtype)
            for v, d in zip(part, PART_DTYPES)]

  @py_function_errors.carried
  def _on_ends_epoch(self):
    # The round's plan, the same on every member (plans agree).
    return np.bool_(self.book.plan.epoch_end)

  @py_function_errors.carried
  def _on_averaged(self, table_vec, divergence, step, bytes_sent):
    k, scale = self.book.averaged(table_vec.numpy(), float(divergence),
                                  int(step), int(bytes_sent))
    return np.int64(k), np.float32(scale)

  # -- graph side ----------------------------------------------------------

  def step_ops(self):
    """Ops of every training step: the simulated delay, then the count."""
    simulate = self.book.simulate
    if simulate is not None and simulate.active:
      with tf.control_dependencies([tf.py_function(
          self._on_step, [self.local_step], tf.int64)]):
        return self.local_step.assign_add(1)
    return self.local_step.assign_add(1)

  def averaging_in_flight(self):
    """Whether an overlapped averaging is in flight."""
    return self._overlapped is not None and self._overlapped.busy()

  def waiting(self):
    """A context in which round ends wait for their averaging (overlap)."""
    if self._overlapped is None:
      return contextlib.nullcontext()
    return self._overlapped.waiting()

  def _average(self, values, part, exact, compression):
    """(The group's weighted sum of `values`, the bytes this member sent);
    `exact` (a bool tensor, the same on every member): not compressed."""
    if compression is None:
      return (self._averager.weighted_sum(values, part),
              averaging.sent_bytes(values, part.group_size,
                                   self._averaging_dtype))
    return self._compressed.weighted_sum(values, part, compression, exact)

  def share_if_rejoining(self, shared_state, part):
    """At a round a worker rejoins in, every member of its group takes the
    sound members' `shared_state`; all members share the decision, so all
    take the same branch."""
    if not shared_state:
      return tf.no_op()
    return tf.cond(part.rejoining & (part.group_size > 1),
                   lambda: _share(shared_state, part, self._shared_averager),
                   tf.no_op)

  def count_round(self, next_sync, scale, step):
    """The counters' updates once a round is averaged (or in flight)."""
    return tf.group([self.next_sync.assign(tf.reshape(next_sync, [])),
                     self.scale.assign(tf.reshape(scale, [])),
                     self.last_sync_step.assign(step),
                     self.syncs.assign_add(1)])

  def round_end_ops(self, step, loss, read_values, write_values, start=None,
                    reset_state=None, shared_state=None, compression=None,
                    key=None):
    """Ops of an averaging point (see module docstring).

    Args:
      step: this worker's local step count (tensor).
      loss: a scalar loss to report, or NaN.
      read_values: () -> list of tensors, this worker's current values.
      write_values: (averaged, is_global, progress=None) -> op assigning
        the averaged values (G(avg) + progress, the local steps' change
        while an overlapped averaging was in flight: overlap.py).
      start: for FedNova weighting, () -> list of round-start values.
      reset_state: () -> op, run on a poisoned worker after it took the
        group's model (e.g. clearing non-finite optimizer slots).
      shared_state: variables every sound member holds equal (the outer
        optimizer's): at a round where a worker rejoins, every member takes
        the sound members' values before `write_values`.
      compression: the set's `compression.CompressionState` when its
        changes are sent compressed, else None.
      key: the set's key (`averaged_variables.key_of`).
    """
    if self._overlapped is not None:
      return self._overlapped.ops(key, step, loss, read_values, write_values,
                                  reset_state, shared_state, compression)
    values = read_values()
    # Poison guard: a worker whose weights are not all finite says so in the
    # table; it then contributes zeros (NaN * 0 is NaN) with weight 0, the
    # others renormalize, and it takes the group's average like everyone.
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v))
                            for v in values])
    part = self._arrive(step, loss, finite)
    poisoned = part.takes_model
    with tf.control_dependencies([part.table]):
      if start is not None:
        begin = start()
        values = [b + tf.cast(self.scale, v.dtype) * (v - b)
                  for v, b in zip(values, begin)]
      values = [tf.where(poisoned, tf.zeros_like(v), v) for v in values]
      exact = (tf.reshape(tf.py_function(self._on_ends_epoch, [], tf.bool),
                          []) if compression is not None else False)
      averaged, sent = self._average(values, part, exact, compression)
      divergence = tf.where(poisoned, tf.constant(np.nan, tf.float32),
                            averaging.relative_distance(values, averaged))
    # After the model's collective (every member launches them in the same
    # order).
    with tf.control_dependencies(averaged):
      shared = self.share_if_rejoining(shared_state, part)
    with tf.control_dependencies([shared]):
      written = write_values(averaged, part.is_global)
    if reset_state is not None:
      with tf.control_dependencies([written]):
        written = tf.cond(poisoned, reset_state, tf.no_op)
    with tf.control_dependencies([written]):
      next_sync, scale = tf.py_function(
          self._on_averaged, [part.table, divergence, step, sent],
          [tf.int64, tf.float32])
    return self.count_round(next_sync, scale, step)

  def part_spec(self):
    """The RoundPart of TensorSpecs `_arrive`'s tensors have."""
    return round_parts.RoundPart(*[
        tf.TensorSpec(_part_shape(name, self.book.n), dtype)
        for name, dtype in zip(PART_DTYPES._fields, PART_DTYPES)])

  def _arrive(self, step, loss, finite):
    """This worker's RoundPart of the round, as tensors (the round book's
    `arrive`, through tf.py_function)."""
    n = self.book.n
    return round_parts.RoundPart(*[
        tf.reshape(o, _part_shape(name, n))
        for name, o in zip(PART_DTYPES._fields, tf.py_function(
            self._on_arrive, [step, tf.cast(loss, tf.float64), finite],
            list(PART_DTYPES)))])


def _share(variables, part, averager):
  """Assigns the group's sum of `variables` weighted by
  `part.state_weight`: the holders' values (a weight of 0 sends zeros: a
  non-finite value times 0 is NaN). `averager` sends them in full
  precision whatever the averaging dtype: the holders' state must come
  back unchanged."""
  weight = part.state_weight
  mine = [tf.where(weight > 0, v, tf.zeros_like(v)) for v in variables]
  return tf.group([v.assign(a) for v, a in zip(
      variables, averager.weighted_sum(mine, part._replace(weight=weight)))])

