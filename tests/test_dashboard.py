"""The dashboard's data side (job_data.py, views.py) on synthetic jobs: no
TensorFlow, no TensorBoard server, no browser (test_observability.py has
those, on a real run)."""

import base64
import collections
import time

import numpy as np
import pytest

import dashboard_helpers
from oscars_tf.observability.dashboard import job_data
from oscars_tf.observability.dashboard import plugin
from oscars_tf.observability.dashboard import views

Point = collections.namedtuple("Point", "step wall_time value")


def _shares(view):
  n = len(view["workers"])
  return np.frombuffer(base64.b64decode(view["shares"]), np.uint8).reshape(
      n, 3, view["width"]).astype(float) / 255


def test_a_small_window_is_exact_and_a_large_one_is_binned():
  job = dashboard_helpers.synthetic_job(4, 50)
  exact = views.timeline(job, width=500)
  assert exact["mode"] == "exact" and exact["segments"] == 200
  assert [len(r) for r in exact["rows"]] == [50] * 4
  # round, start, compute, wait, comm, group, in flight beside compute
  first = exact["rows"][0][0]
  assert first[0] == 0 and first[1] == pytest.approx(0.0, abs=1e-6)
  assert len(first) == 7 and first[6] == 0.0  # no overlap logged
  binned = views.timeline(job, width=500, max_segments=100)
  assert binned["mode"] == "binned" and "rows" not in binned
  shares = _shares(binned)
  # Rounds follow each other without gaps: every column is all in a phase.
  total = shares.sum(axis=1)
  assert np.all(total[:, 1:-1] > 0.98) and np.all(total <= 1.0 + 3 / 255)


def test_binning_keeps_each_phases_time():
  job = dashboard_helpers.synthetic_job(3, 200, seed=3)
  view = views.timeline(job, width=333, max_segments=0)
  seconds = _shares(view).sum(axis=2) * job.duration / view["width"]
  for i, w in enumerate(job.workers):
    np.testing.assert_allclose(
        seconds[i], [w.compute.sum(), w.wait.sum(), w.comm.sum()],
        rtol=0.01, atol=job.duration / view["width"])


def test_a_zoomed_window_shows_only_its_rounds():
  job = dashboard_helpers.synthetic_job(2, 1000)
  w = job.workers[0]
  t0, t1 = float(w.start[100]), float(w.start[110])
  view = views.timeline(job, t0, t1, width=800)
  assert view["mode"] == "exact"
  rounds = [int(r[0]) for r in view["rows"][0]]
  assert rounds[0] in (99, 100) and rounds[-1] == 110


def test_groups_colour_the_binned_columns():
  job = dashboard_helpers.synthetic_job(16, 8)  # groups of 8; every 4th global
  view = views.timeline(job, width=400, max_segments=0)
  cells = np.frombuffer(base64.b64decode(view["group_cells"]),
                        "<u2").reshape(16, 400)
  assert set(np.unique(cells[8])) <= {0, 8, views.NO_GROUP}
  assert 8 in set(cells[8]) and 0 in set(cells[8])
  assert view["groups"] == [0, 8]


def test_events_are_placed_and_binned_when_too_many():
  job = dashboard_helpers.synthetic_job(4, 2000)
  kinds = collections.Counter(e.kind for e in job.events)
  assert kinds == {"dropped": 1, "rejoined": 1, "poisoned": 1,
                   "global_sync": 500, "epoch_end": 2, "period": 3}
  dropped = next(e for e in job.events if e.kind == "dropped")
  assert (dropped.worker, dropped.round) == (1, 10)
  assert dropped.t == pytest.approx(float(job.workers[1].end[10]))
  period = [e for e in job.events if e.kind == "period"]
  assert [(e.round, e.value) for e in period] == [
      (500, 16.0), (1000, 8.0), (1500, 16.0)]
  view = views.timeline(job, width=100)
  assert len(view["events"]) <= 100 * 3 + 6
  assert sum(e["count"] for e in view["events"]) == sum(kinds.values())


def test_charts_follow_the_window_and_band_many_workers():
  few = views.charts(dashboard_helpers.synthetic_job(3, 100), width=1000)
  by_id = {c["id"]: c for c in few["charts"]}
  # The synthetic job logs no overlap: its optional chart is left out.
  assert [c[0] for c in views.CHARTS
          if c[0] not in views.OPTIONAL_CHARTS] == list(by_id)
  assert [line["worker"] for line in by_id["rate"]["lines"]] == [0, 1, 2]
  assert len(by_id["rate"]["lines"][0]["points"]) == 100
  assert by_id["rate"]["lines"][0]["breaks"] == []
  assert len(by_id["time_budget"]["lines"]) == 1
  util = by_id["utilization"]["lines"][0]["points"]
  assert len(util) == 100 and all(0 < v <= 1 for _, v in util)
  # Worker 1 of the synthetic job is out of rounds 11-19: its line breaks.
  gappy = dashboard_helpers.synthetic_job(2, 40)
  w = gappy.workers[1]
  keep = (w.rounds <= 10) | (w.rounds >= 20)
  for field in ("rounds", "start", "compute", "wait", "comm", "group"):
    setattr(w, field, getattr(w, field)[keep])
  w.series = {k: v[keep] for k, v in w.series.items()}
  rate = views.charts(gappy, width=1000)["charts"][0]
  assert [line["breaks"] for line in rate["lines"]] == [[], [11]]
  many = views.charts(dashboard_helpers.synthetic_job(40, 500), width=50)
  rate = next(c for c in many["charts"] if c["id"] == "rate")
  assert [line["label"] for line in rate["lines"]] == [
      "highest", "median", "lowest"]
  assert all(len(line["points"]) <= 50 for line in rate["lines"])


def test_job_data_from_tensorboard_points():
  """Rounds placed from since_arrival_s and the event's wall time; a
  round written twice keeps the later write; the cluster's event tags."""
  def series(values, wall=100.0):
    return [Point(r, wall + r, v) for r, v in enumerate(values)]
  tags = {"oscars/compute_s": series([1.0, 2.0]),
          "oscars/wait_s": series([0.5, 0.0]),
          "oscars/comm_s": series([0.25, 0.25]),
          "oscars/since_arrival_s": series([0.75, 0.25]),
          "oscars/group": series([0.0, 0.0]),
          "oscars/period": series([4.0, 8.0]),
          "oscars/epoch_end": [Point(1, 101.0, 1.0)]}
  tags["oscars/compute_s"].append(Point(1, 50.0, 9.0))  # older write
  data = {"worker_0": tags, "worker_1": dict(tags),
          "cluster": {"oscars/events/poisoned/worker_1": [Point(1, 0, 1.0)]},
          "not_a_worker": {"oscars/compute_s": series([1.0])}}
  job = job_data.JobData.from_scalars(data)
  assert job.worker_ids == [0, 1] and job.rounds == 2
  w = job.workers[0]
  # Round 0: arrived at 100 - 0.75, after 1 s of compute.
  assert job.origin == pytest.approx(98.25)
  np.testing.assert_allclose(w.start, [0.0, 0.5])  # 101 - 0.25 - 2
  np.testing.assert_allclose(w.compute, [1.0, 2.0])
  assert [(e.kind, e.round, e.worker) for e in job.events] == [
      ("period", 1, None), ("poisoned", 1, 1), ("epoch_end", 1, None)]


def test_events_of_rounds_tensorboard_left_out_are_still_placed():
  """TensorBoard keeps a sample of a long run's rounds (1,000 per tag by
  default). An event's round is rarely in it: a drop or an epoch end there
  was dropped from the timeline (20 drops showed as 2). It is placed
  between the nearest rounds kept."""
  kept = list(range(0, 100, 10))  # the rounds TensorBoard kept

  def series(value):
    return [Point(r, 100.0 + r, value) for r in kept]
  tags = {"oscars/compute_s": series(0.5), "oscars/wait_s": series(0.0),
          "oscars/comm_s": series(0.0), "oscars/since_arrival_s": series(0.0),
          "oscars/group": series(0.0),
          "oscars/epoch_end": [Point(r, 100.0 + r, 1.0) for r in (33, 66)]}
  dropped = [Point(r, 100.0 + r, 1.0) for r in (5, 47, 85)]
  job = job_data.JobData.from_scalars({
      "worker_0": tags,
      "cluster": {"oscars/events/dropped/worker_1": dropped}})
  placed = {(e.kind, e.round): e.t for e in job.events}
  # Round r ended at 100 + r (the origin is round 0's start, 99.5).
  for kind, r in [("epoch_end", 33), ("epoch_end", 66), ("dropped", 5),
                  ("dropped", 47), ("dropped", 85)]:
    assert placed[(kind, r)] == pytest.approx(r + 0.5), (kind, r, placed)
  # Past the last round kept there is nothing to place it by.
  assert job.round_times([200])[1][0] != job.round_times([200])[1][0]


def test_rounds_without_since_arrival_are_placed_by_their_write_time():
  """Logs from before oscars/since_arrival_s: the round ended when its
  comm_s was written."""
  def series(values):
    return [Point(r, 100.0 + 10 * r, v) for r, v in enumerate(values)]
  job = job_data.JobData.from_scalars({"worker_0": {
      "oscars/compute_s": series([1.0, 1.0]),
      "oscars/wait_s": series([0.5, 0.5]),
      "oscars/comm_s": series([0.5, 0.5])}})
  w = job.workers[0]
  assert job.origin == pytest.approx(98.0)
  np.testing.assert_allclose(w.start, [0.0, 10.0])
  np.testing.assert_allclose(w.end, [2.0, 12.0])


def test_job_names_and_sampling():
  assert job_data.job_of("worker_3") == "."
  assert job_data.job_of("sweep/a/cluster") == "sweep/a"
  assert job_data.job_of("worker_3/train") is None
  assert plugin.root_name("/tmp/logs/run_7/") == "run_7"
  assert plugin.root_name("a:/x,b:/y") == "."
  full = [Point(s, 0, 0) for s in range(10)]
  holes = [Point(s, 0, 0) for s in range(0, 20, 2)]
  assert not plugin._sampled(full, 10) and plugin._sampled(holes, 10)
  assert not plugin._sampled(holes, 0) and not plugin._sampled(holes, 11)


def test_400_workers_by_10000_rounds_stay_small_and_quick():
  """The scale of the issue: the timeline sends workers x columns cells,
  not 4 million spans. (Times under a loaded 2-core machine; the bounds
  are loose.)"""
  start = time.perf_counter()
  job = dashboard_helpers.synthetic_job(400, 10_000)
  built = time.perf_counter() - start
  start = time.perf_counter()
  view = views.timeline(job, width=1200)
  binned = time.perf_counter() - start
  start = time.perf_counter()
  zoomed = views.timeline(job, 100.0, 101.0, width=1200)
  charts = views.charts(job, width=600)
  rest = time.perf_counter() - start
  print(f"400 x 10,000: job {built:.2f} s, binned timeline {binned:.2f} s, "
        f"zoomed timeline + charts {rest:.2f} s")
  assert view["mode"] == "binned" and view["rounds"] == 10_000
  assert len(view["shares"]) < 2.5e6  # base64 of 400 x 3 x 1200 bytes
  assert _shares(view).shape == (400, 3, 1200)
  assert len(view["events"]) <= views.MAX_EVENTS * 4
  assert zoomed["mode"] == "exact" and 0 < zoomed["segments"] < 3000
  assert all(len(line["points"]) <= 600 for c in charts["charts"]
             for line in c["lines"])
  assert binned < 30 and rest < 30


def test_the_dashboard_imports_no_tensorflow():
  """TensorBoard loads the plugin in its own process: it must not pay for
  (or need) TensorFlow."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys; import oscars_tf.observability.dashboard.plugin; "
          "print(sorted(m for m in ('tensorflow', 'keras') "
          "if m in sys.modules))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120, check=True)
  assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
