"""Overlapped averaging's parts in one process: the averaging in flight,
its book-keeping, the arguments (the multi-process tests:
test_overlap_multiworker.py)."""

import dataclasses
import threading
import types

import numpy as np
import pytest
import tensorflow as tf

import oscars_tf
from oscars_tf.distribute import outer
from oscars_tf.distribute import overlap
from oscars_tf.distribute import round_ends
from oscars_tf.distribute import startup
from oscars_tf.policy import overlap_rule
from oscars_tf.protocol import round_clock
from oscars_tf.protocol import round_history
from oscars_tf.runtime import averaging


def test_the_averaging_runs_in_its_thread_and_is_taken_once():
  release = threading.Event()
  threads = []

  def average(values, part, exact):
    threads.append(threading.current_thread().name)
    assert release.wait(10)
    return [v * 2 for v in values], 12
  flight = overlap.InFlight(average)
  assert not flight.busy
  flight.start([np.ones(3)], part="part", exact=False, round_=7,
               is_global=True)
  assert flight.busy and flight.round == 7 and flight.is_global
  with pytest.raises(RuntimeError, match="already in flight"):
    flight.start([np.ones(3)], "part", False, 8, False)
  release.set()
  averaged, sent_bytes, waited = flight.take()
  assert threads == ["oscars-averaging-round-7"]
  np.testing.assert_array_equal(averaged[0], 2 * np.ones(3))
  assert sent_bytes == 12 and waited >= 0
  assert not flight.busy
  assert flight.finished >= flight.started


def test_what_the_averaging_raises_is_raised_where_it_is_taken():
  def average(values, part, exact):
    raise tf.errors.UnavailableError(None, None, "peer gone")
  flight = overlap.InFlight(average)
  flight.start([np.ones(1)], "part", False, 3, False)
  with pytest.raises(tf.errors.UnavailableError, match="peer gone"):
    flight.take()
  assert not flight.busy  # the next round can start another


def test_the_divergence_is_measured_on_the_float_values():
  sent = [tf.constant([3.0, 4.0]), tf.constant([5], tf.int64)]
  averaged = [tf.constant([0.0, 0.0]) + 1e-30, tf.constant([9], tf.int64)]
  assert float(averaging.relative_distance(sent, averaged)) > 1e10
  same = [tf.constant([3.0, 4.0])]
  assert float(averaging.relative_distance(same, same)) == 0.0
  apart = [tf.constant([3.0, 4.0])], [tf.constant([0.0, 8.0])]
  assert float(averaging.relative_distance(*apart)) == pytest.approx(
      5.0 / 8.0)


def test_waiting_for_an_averaging_is_not_compute_time():
  clock = round_clock.RoundClock(0)
  clock.start()
  start = clock._round_start  # pylint: disable=protected-access
  clock.last_sync_cost = 0.25
  clock.taken(bytes_sent=100, waited=1.5)
  assert clock._round_start == pytest.approx(start + 1.5)  # pylint: disable=protected-access
  assert clock.last_sync_cost == pytest.approx(1.75)
  assert clock.totals["comm_s"] == pytest.approx(1.5)
  assert clock.totals["bytes_sent"] == 100


def _record(round_):
  names = [f.name for f in dataclasses.fields(round_history.RoundRecord)]
  values = dict.fromkeys(names, 0)
  values.update(round=round_, comm_s=0.5, divergence=float("nan"))
  return round_history.RoundRecord(**values)


def test_a_round_taken_late_amends_its_record():
  history = round_history.RoundHistory(2)
  for r in range(3):
    history.add(_record(r))
  amended = history.amend(1, lambda r: dataclasses.replace(
      r, overlap_s=2.0, comm_s=r.comm_s + 1))
  assert amended is history[1] and amended.comm_s == 1.5
  assert [h.overlap_s for h in history] == [0.0, 2.0, 0.0]
  assert history.amend(9, lambda r: r) is None


def test_bad_overlap_arguments_are_clear_errors():
  for bad in ("yes", 1, "Always"):
    with pytest.raises(ValueError, match="`overlap` must be True, False or "
                       "\"always\", got"):
      oscars_tf.OscarsStrategy(overlap=bad)
  with pytest.raises(ValueError, match="normalized weighting"):
    oscars_tf.OscarsStrategy(overlap="always", schedule=oscars_tf.schedules.
                             Adaptive(weighting="normalized"))
  assert oscars_tf.OscarsStrategy(overlap=True).overlap is True
  assert oscars_tf.OscarsStrategy(overlap="always").overlap == "always"
  assert oscars_tf.OscarsStrategy().overlap is False


def test_the_rule_waits_until_an_averaging_is_measured_and_while_cheap():
  rule = overlap_rule.OverlapRule()
  assert rule.cost_s is None and not rule.overlaps(10.0)
  rule.measured(0.5)
  assert rule.overlaps(4.9) and not rule.overlaps(5.0)
  assert not rule.overlaps(100.0)


def test_one_slow_averaging_does_not_turn_overlap_on_nor_one_fast_off():
  rule = overlap_rule.OverlapRule(share=0.1)
  for seconds in (0.01, 0.01, 2.0):  # a pause
    rule.measured(seconds)
  assert rule.cost_s == 0.01 and not rule.overlaps(1.0)
  for seconds in (2.0, 2.0, 0.01):  # a slow network, one quick round
    rule.measured(seconds)
  assert rule.cost_s == 2.0 and rule.overlaps(1.0)
  rule.measured(None)  # nothing measured: nothing changes
  rule.measured(-1.0)
  assert rule.cost_s == 2.0


def test_always_overlaps_from_the_first_round():
  rule = overlap_rule.OverlapRule(share=0)
  assert rule.overlaps(1e9) and rule.overlaps(0.0)
  for bad in (-0.1, 1.0):
    with pytest.raises(ValueError, match="share"):
      overlap_rule.OverlapRule(share=bad)


class _Book:
  """What an overlapped round end reads of the round book at an
  averaging's start: a plain round of two members."""

  def __init__(self, compute_s):
    self.me, self.round, self.epoch_over = 0, 3, False
    self.plan = types.SimpleNamespace(epoch_end=False,
                                      group_of=lambda me: [0, 1])
    self.exchange = types.SimpleNamespace(
        poisoned=False, decision=types.SimpleNamespace(newcomers=()),
        first_meeting=False)
    self.clock = types.SimpleNamespace(arrival_compute=compute_s)

  def averaged(self, table, divergence, step, bytes_sent):
    return 8, 1.0

  def completed(self, *args):
    pass


@pytest.mark.parametrize("sent_bytes, first_meeting, counted", [
    (256, False, True), (0, False, False), (256, True, False)],
                         ids=["sent", "alone", "first_meeting"])
def test_what_an_averaging_costs_is_measured_where_it_says_something(
    sent_bytes, first_meeting, counted):
  end = overlap.OverlappedRoundEnd(types.SimpleNamespace(book=_Book(1.0)),
                                   average=None)
  flight = end._flight("weights", None)  # pylint: disable=protected-access
  flight.average = lambda values, part, exact: (values, (sent_bytes, 0.0))
  flight.start([tf.ones([2])], "part", False, 3, False)
  flight.first_meeting = first_meeting
  end._take("weights", [tf.ones([2])], wait_only=True)  # pylint: disable=protected-access
  cost = end._rules["weights"].cost_s  # pylint: disable=protected-access
  assert (cost is not None) is counted and not flight.busy


@pytest.mark.parametrize("always", [False, True])
def test_the_round_end_waits_for_a_cheap_averaging_unless_always(always):
  book = _Book(compute_s=2.0)
  end = overlap.OverlappedRoundEnd(types.SimpleNamespace(book=book),
                                   average=None, always=always)
  end._flight("weights", None)  # pylint: disable=protected-access
  table = tf.zeros([4])

  def waits():
    return bool(end._planned("weights", table, tf.constant(9))[2])  # pylint: disable=protected-access
  assert waits() is not always  # nothing measured yet
  end._rules["weights"].measured(0.05)  # pylint: disable=protected-access
  assert waits() is not always  # 2.5 % of the round
  for _ in range(2):
    end._rules["weights"].measured(0.5)  # pylint: disable=protected-access
  assert not waits()  # 25 %: overlapped
  book.plan.epoch_end = True  # an epoch end waits, always
  assert waits()


def test_the_start_up_check_covers_the_overlap():
  settings = startup.Settings(oscars_tf.schedules.Fixed(4), "local", "RING",
                              None, 1)
  variables = [tf.Variable(tf.ones([3]))]
  at = startup._SIGNATURE_NAMES.index("overlap")  # pylint: disable=protected-access
  signatures = [startup.signature(variables, dataclasses.replace(
      settings, overlap=o)) for o in (False, True)]
  assert signatures[0][at] != signatures[1][at]
  assert signatures[0][:at] == signatures[1][:at]


def test_one_worker_with_local_sgd_replicas_trains_and_never_overlaps():
  """A worker alone has no one to average with across workers: every
  round end waits (its local replicas' mean is taken at once)."""
  strategy = oscars_tf.OscarsStrategy(
      schedule=oscars_tf.schedules.Fixed(2), overlap=True,
      devices=["CPU:0"], local_replicas="local_sgd")
  import keras  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
  y = x.sum(axis=1, keepdims=True)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0]
  rounds = strategy.round_history
  assert rounds and all(r["overlap_s"] == 0.0 for r in rounds)


def test_an_overlapped_round_keeps_the_progress_of_weights_not_statistics():
  """w <- avg + (w_now - w_sent) for what SGD moves. A BatchNorm's moving
  variance (momentum 0.99, 100 steps) sent at 1.0 by one worker and 0.05
  by another, both since seeing 0.05: extrapolated, the first would hold
  0.525 + (0.398 - 1.0) = -0.077 (NaN at evaluation, unseen by the poison
  guard). Statistics take the average, as in a blocking round."""
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2),
                            keras.layers.BatchNormalization()])
  variables = model.weights
  moved = outer.takes_outer_step(variables, model)
  names = [v.path if hasattr(v, "path") else v.name for v in variables]
  assert [m for m, n in zip(moved, names) if "moving" in n] == [False] * 2
  assert sum(moved) == 4  # kernel, bias, gamma, beta
  averaged = [tf.fill(v.shape, 0.525) for v in variables]
  progress = [tf.fill(v.shape, 0.398 - 1.0) for v in variables]
  written = round_ends.with_progress(averaged, progress, moved)
  for m, w in zip(moved, written):
    np.testing.assert_allclose(w.numpy(), -0.077 if m else 0.525, atol=1e-6)
  # An integer variable (no progress given) takes the average.
  assert round_ends.with_progress([tf.constant(3)], [None], [True])[0] == 3


def test_the_averaging_is_traced_with_the_training_step_not_in_its_time():
  """The background averaging function is traced when the training step
  is (before a clock starts), once, and the round ends reuse it."""
  strategy = oscars_tf.OscarsStrategy(
      schedule=oscars_tf.schedules.Fixed(2), overlap=True,
      devices=["CPU:0"], local_replicas="local_sgd")
  import keras  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05)
  x = tf.ones([8, 4])

  @tf.function
  def train_step():
    def step():
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - 1.0))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return strategy.run(step)

  train_step.get_concrete_function()  # traced, not run
  flights = strategy.extended._rounds._overlapped._in_flight  # pylint: disable=protected-access
  assert flights and all(
      f.average.experimental_get_tracing_count() == 1
      for f in flights.values())
  for _ in range(6):
    train_step()
  assert len(strategy.round_history) >= 2
  assert all(f.average.experimental_get_tracing_count() == 1
             for f in flights.values())


def _overlapped_record(round_, arrived_at, overlap_s, take_wait_s):
  return dataclasses.replace(
      _record(round_), arrived_at=arrived_at, compute_s=1.0, wait_s=0.1,
      comm_s=0.01, overlap_s=overlap_s, take_wait_s=take_wait_s, plan="p")


def test_the_timeline_shows_the_averaging_beside_compute():
  from oscars_tf.observability import summaries  # pylint: disable=g-import-not-at-top
  history = [_overlapped_record(0, 100.0, 0.5, 0.2),
             _overlapped_record(1, 101.5, 0.0, 0.3)]
  events = summaries.trace_events(history, worker_index=3)
  flying = [e for e in events if e["name"] == "averaging in flight"]
  # Round 0's averaging started after its wait and start (comm_s) and ran
  # 0.5 s beside compute plus the 0.2 s waited for it, on its own row.
  assert len(flying) == 1 and flying[0]["pid"] == 1
  assert flying[0]["tid"] == 3
  assert flying[0]["ts"] == pytest.approx((100.0 + 0.11) * 1e6)
  assert flying[0]["dur"] == pytest.approx(0.7e6)
  waits = [e for e in events if e["name"] == "communicate" and e["pid"] == 0
           and e["args"]["round"] == 0]
  assert sorted(e["dur"] for e in waits) == pytest.approx([0.01e6, 0.2e6])
  names = {e["args"]["name"] for e in events if e["ph"] == "M"}
  assert names == {"worker 3", "worker 3: averaging in flight"}


def test_the_dashboard_draws_the_averaging_beside_compute():
  import dashboard_helpers  # pylint: disable=g-import-not-at-top
  from oscars_tf.observability.dashboard import views  # pylint: disable=g-import-not-at-top
  job = dashboard_helpers.synthetic_job(2, 20)
  flying = np.linspace(0.0, 0.19, 20)
  job.workers[1].series["overlap_s"] = flying
  rows = views.timeline(job, width=500)["rows"]
  assert [r[6] for r in rows[0]] == [0.0] * 20
  np.testing.assert_allclose([r[6] for r in rows[1]], flying, atol=1e-6)
  charts = {c["id"]: c for c in views.charts(job, width=600)["charts"]}
  assert [line["worker"] for line in charts["overlap_s"]["lines"]] == [1]


def test_a_job_without_overlap_has_no_overlap_chart():
  import dashboard_helpers  # pylint: disable=g-import-not-at-top
  from oscars_tf.observability.dashboard import views  # pylint: disable=g-import-not-at-top
  charts = views.charts(dashboard_helpers.synthetic_job(2, 20))["charts"]
  assert "overlap_s" not in [c["id"] for c in charts]
  assert len(charts) == len(views.CHARTS) - 1


def test_merging_without_timelines_is_one_line_not_a_traceback(tmp_path,
                                                               capsys):
  from oscars_tf.observability import summaries  # pylint: disable=g-import-not-at-top
  assert summaries.main(["summaries", "merge", str(tmp_path)]) == 1
  err = capsys.readouterr().err
  assert err.startswith("summaries merge: no timeline_worker_*.json under")
  assert "Traceback" not in err and err.count("\n") == 1
  (tmp_path / "timeline_worker_0.json").write_text("{not json")
  assert summaries.main(["summaries", "merge", str(tmp_path)]) == 1
  assert capsys.readouterr().err.startswith("summaries merge: ")
