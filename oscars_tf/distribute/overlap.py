"""Overlapped averaging (`OscarsStrategy(overlap=True)`): a round's
averaging runs beside the next round's local steps.

At a round end the worker sends what it holds, `w_sent`, starts its
group's averaging in a thread of its own and goes on with the next round.
At its next round end it takes the average and keeps the local progress it
made meanwhile:

    w  <-  G(avg) + (w_now - w_sent)

G being the outer step at global syncs (else the identity). The outer
gradient `w_sent - avg` of the round that ended is applied one round late
to a model that has moved on: the delayed outer update of overlapping
DiLoCo (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512, with an
overlap of a whole round; Kale et al. 2025, arXiv 2502.12996, study that
delay). Without a mixing factor: every member adds the same G(avg), so
members of one group differ by their own progress only, as they would
after an exact averaging and the same local steps.

The worker waits for its averaging instead (w_now = w_sent: the exact
average) where the model must be one: a round that ends an epoch (its model
is evaluated, checkpointed and returned by `fit`), a round a worker
rejoins in (it takes the group's model and shared state), a round with a
poisoned member (it takes the model and resets its optimizer), and a
member alone (nothing to wait for). With `overlap=True` it also waits
where the averaging is cheap, at most a tenth of the round's compute
(policy/overlap_rule.py): there the late average would cost quality and
hide next to nothing. `overlap="always"` never waits for that reason.

Every member runs every averaging through the same function, so members
that wait and members that go on meet in the same collectives. A peer
lost while an averaging is in flight fails it; the error is raised where
the worker takes the average, and the job restarts from round states as
it does for a death inside a blocking averaging (distribute/round_state.py).
"""

import contextlib
import threading
import time

from absl import logging
import numpy as np
import tensorflow as tf

from oscars_tf.policy import overlap_rule
from oscars_tf.protocol import round_parts
from oscars_tf.runtime import averaging
from oscars_tf.runtime import py_function_errors


class InFlight:
  """The one averaging of a worker in flight: started in a thread, taken
  at the next round end (plain Python around `average`, testable alone).

  Args:
    average: (values, part, exact) -> (averaged, what else it measures);
      runs in the averaging's thread.
  """

  def __init__(self, average):
    self.average = average
    self._thread = None
    self._outcome = None   # what `average` returned, or the exception raised
    self.sent = None       # what the averaging in flight sends
    self.round = None      # its round
    self.is_global = False
    self.started = None    # time.monotonic() at its start
    self.finished = None   # ... at its end, in its thread
    self.first_meeting = False  # its group's first: slower than the next

  @property
  def busy(self):
    return self._thread is not None

  def start(self, values, part, exact, round_, is_global):
    """Starts the averaging of `values` in `part`'s group."""
    if self.busy:
      raise RuntimeError("oscars_tf: an averaging is already in flight.")
    self.sent, self.round, self.is_global = values, round_, is_global
    self.started, self.finished, self._outcome = time.monotonic(), None, None
    self._thread = threading.Thread(
        target=self._run, args=(values, part, exact), daemon=True,
        name=f"oscars-averaging-round-{round_}")
    self._thread.start()

  def _run(self, values, part, exact):
    try:
      self._outcome = self.average(values, part, exact)
    except BaseException as e:  # pylint: disable=broad-except
      self._outcome = e  # raised where the average is taken
    finally:
      self.finished = time.monotonic()

  def take(self):
    """Waits for the averaging in flight: (averaged, its measures, seconds
    waited here); raises what the averaging raised."""
    waited = time.monotonic()
    self._thread.join()
    waited = time.monotonic() - waited
    self._thread, outcome = None, self._outcome
    self._outcome = None
    if isinstance(outcome, BaseException):
      raise outcome
    return outcome[0], outcome[1], waited


class OverlappedRoundEnd:
  """The graph side of an overlapped round end (see module docstring), for
  `rounds.Rounds`."""

  def __init__(self, rounds, average, always=False):
    """`average(values, part, exact, compression)`: the graph ops of one
    averaging, (averaged, bytes sent); `always`: overlap cheap averagings
    too."""
    self._rounds = rounds
    self._book = rounds.book
    self._average = average
    self._share = 0.0 if always else overlap_rule.DEFAULT_SHARE
    self._in_flight = {}   # each averaged set's InFlight
    self._rules = {}       # ... and OverlapRule
    self._waiting = 0      # > 0: every round end waits (`waiting`)
    self._prepared = set()  # the sets whose averaging is traced

  def busy(self):
    """Whether an averaging is in flight."""
    return any(f.busy for f in self._in_flight.values())

  @contextlib.contextmanager
  def waiting(self):
    """Round ends run inside wait for their averaging (an explicit
    `strategy.sync()`, the rounds that end an epoch together)."""
    self._waiting += 1
    try:
      yield
    finally:
      self._waiting -= 1

  # -- py_function bodies -------------------------------------------------

  def _flight(self, key, compression):
    if key not in self._in_flight:
      def average(values, part, exact):
        averaged, sent_bytes = self._average(values, part, exact,
                                             compression)
        return averaged, (sent_bytes, averaging.relative_distance(
            values, averaged))

      self._in_flight[key] = InFlight(tf.function(average, autograph=False))
      self._rules[key] = overlap_rule.OverlapRule(self._share)
    return self._in_flight[key]

  def _prepare(self, key, compression, templates):
    """Traces and builds set `key`'s averaging function now, while the
    training function is traced (before a clock starts), not at the first
    round end, beside the steps. In a thread of its own: the averaging
    threads' context (no graph, no device scope) is its cache key."""
    if key in self._prepared:
      return
    fn = self._flight(key, compression).average
    specs = ([tf.TensorSpec(t.shape, t.dtype) for t in templates],
             self._rounds.part_spec(), tf.TensorSpec([], tf.bool))
    failed = []

    def trace():
      try:
        fn.get_concrete_function(*specs)
        # Run once alone (no collective, no state changed), so the runtime
        # builds the function's kernels now too, not beside the steps.
        with tf.device("CPU:0"):  # where the py_function hands it values
          values, part, exact = tf.nest.map_structure(
              lambda spec: tf.zeros(spec.shape, spec.dtype), specs)
        fn(values, part._replace(group_size=tf.constant(1)),
           tf.constant(True))
      except Exception as e:  # pylint: disable=broad-except
        failed.append(e)  # raised here, on the thread that traces

    thread = threading.Thread(target=trace, name="oscars-averaging-trace")
    thread.start()
    thread.join()
    if failed:
      raise failed[0]
    self._prepared.add(key)

  def _take(self, key, templates, wait_only):
    """(taken?, is_global, averaged..., sent...) of set `key`'s averaging
    in flight; `wait_only`: the worker waits for the one it just started."""
    flight = self._in_flight.get(key)
    if flight is None or not flight.busy:
      # Nothing to write: empty placeholders, not two copies of the model.
      return [np.bool_(False), np.bool_(False)] + _empty(templates) * 2
    try:
      averaged, (sent_bytes, divergence), waited = flight.take()
    except Exception as e:
      logging.warning(
          "oscars_tf: worker %d: the averaging of round %d failed %s: %s",
          self._book.me, flight.round,
          "while it waited" if wait_only else
          "in flight beside the next round's steps", e)
      raise
    overlapped = 0.0 if wait_only else max(
        0.0, flight.finished - flight.started - waited)
    # Its cost, unless it met its group for the first time (TensorFlow
    # resolves the group then) or sent nothing (a member alone).
    if not flight.first_meeting and sent_bytes > 0:
      self._rules[key].measured(flight.finished - flight.started)
    self._book.completed(flight.round, int(sent_bytes), waited, overlapped,
                         float(divergence))
    # The tensors themselves (no copy); what was sent only where the
    # worker went on (it waited: now = sent).
    sent = _empty(templates) if wait_only else list(flight.sent)
    flight.sent = None  # not held a round longer
    return [np.bool_(True), np.bool_(flight.is_global)] + list(averaged) + sent

  def _start(self, key, compression, count, *args):
    values, rest = list(args[:count]), args[count:]
    part = round_parts.RoundPart(*rest[:-1])
    flight = self._flight(key, compression)
    flight.start(values, part, rest[-1], self._book.round,
                 bool(part.is_global.numpy()))
    flight.first_meeting = bool(self._book.exchange.first_meeting)
    return np.bool_(True)

  def _planned(self, key, table_vec, step):
    """The round's book-keeping at the averaging's start: the next round,
    and whether to wait for this averaging now."""
    book = self._book
    ends_epoch = book.plan.epoch_end
    exchange = book.exchange
    waits = bool(self._waiting or ends_epoch or exchange.poisoned or
                 exchange.decision.newcomers or
                 len(book.plan.group_of(book.me)) <= 1 or
                 not self._rules[key].overlaps(book.clock.arrival_compute))
    k, scale = book.averaged(table_vec.numpy(), np.nan, int(step), 0)
    return np.int64(k), np.float32(scale), np.bool_(waits or book.epoch_over)

  # -- graph side ----------------------------------------------------------

  def ops(self, key, step, loss, read_values, write_values, reset_state=None,
          shared_state=None, compression=None):
    """An overlapped round end's ops; the arguments are
    `Rounds.round_end_ops`'."""
    rounds = self._rounds
    templates = read_values()
    self._prepare(key, compression, templates)
    taken = self._apply(key, templates, read_values, write_values,
                        wait_only=False)
    with tf.control_dependencies([taken]):
      values = read_values()
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v))
                            for v in values])
    part = rounds._arrive(step, loss, finite)  # pylint: disable=protected-access
    poisoned = part.takes_model
    with tf.control_dependencies([part.table]):
      values = [tf.where(poisoned, tf.zeros_like(v), v) for v in values]
      exact = tf.reshape(tf.py_function(
          rounds._on_ends_epoch, [], tf.bool), [])  # pylint: disable=protected-access
      started = tf.py_function(
          py_function_errors.carried(
              lambda *a: self._start(key, compression, len(values), *a)),
          values + list(part) + [exact], tf.bool)
    with tf.control_dependencies([started]):
      next_sync, scale, waits = tf.py_function(
          py_function_errors.carried(
              lambda table, step: self._planned(key, table, step)),
          [part.table, step],
          [tf.int64, tf.float32, tf.bool])

    def wait_now():
      # As a blocking round: a rejoiner takes the group's shared state
      # (outer start and momentum) after the model's collective and
      # before the write, whose outer step uses it.
      taken = self._take_op(key, templates, wait_only=True)
      with tf.control_dependencies(taken[:1]):
        shared = rounds.share_if_rejoining(shared_state, part)
      with tf.control_dependencies([shared]):
        done = self._write_taken(taken, templates, read_values,
                                 write_values, wait_only=True)
      with tf.control_dependencies([done]):
        if reset_state is None:
          return tf.no_op()
        return tf.cond(poisoned, reset_state, tf.no_op)

    with tf.control_dependencies([next_sync]):
      waited = tf.cond(tf.reshape(waits, []), wait_now, tf.no_op)
    with tf.control_dependencies([waited]):
      return rounds.count_round(next_sync, scale, step)

  def _apply(self, key, templates, read_values, write_values, wait_only):
    """Takes set `key`'s averaging in flight, if any, and writes
    G(avg) + (now - sent) (now = sent where the worker waited)."""
    return self._write_taken(self._take_op(key, templates, wait_only),
                             templates, read_values, write_values, wait_only)

  def _take_op(self, key, templates, wait_only):
    """Set `key`'s averaging in flight, taken: [has one, is global,
    averaged..., sent...] (empty values where none was)."""
    return tf.py_function(
        py_function_errors.carried(
            lambda: self._take(key, templates, wait_only)), [],
        [tf.bool, tf.bool] + [t.dtype for t in templates] * 2)

  def _write_taken(self, out, templates, read_values, write_values,
                   wait_only):
    """Writes what `_take_op` took, if anything."""
    has, is_global = tf.reshape(out[0], []), tf.reshape(out[1], [])
    n = len(templates)

    def write():  # shaped here: untaken, the values are empty
      averaged = [tf.reshape(a, t.shape) for a, t in zip(out[2:2 + n],
                                                         templates)]
      if wait_only:
        return write_values(averaged, is_global)
      sent = [tf.reshape(s, t.shape) for s, t in zip(out[2 + n:], templates)]
      now = read_values()
      progress = [n_ - s if t.dtype.is_floating else None
                  for n_, s, t in zip(now, sent, templates)]
      return write_values(averaged, is_global, progress)

    return tf.cond(has, write, tf.no_op)


def _empty(templates):
  """Placeholders of `templates`' dtypes for a py_function's output."""
  return [np.zeros([0], t.dtype.as_numpy_dtype) for t in templates]


def refuse_with(schedule):
  """The reason `overlap=True` cannot go with `schedule`, or None."""
  if schedule.weighting == "normalized":
    return ("FedNova's normalized weighting rescales each round's update "
            "from the round's start, which an averaging still in flight "
            "has moved")
  return None

