"""What the dashboard's views draw, cut to the window on screen. No TensorFlow.

Each function takes a `JobData` (job_data.py) and a time window `[t0, t1]`
(seconds since the job's origin) `width` pixel columns wide, and returns
plain JSON-able dicts. A view never sends more than its screen can show:

* `timeline`: each worker's rounds as compute / wait / communicate spans
  (and, with overlap=True, each averaging in flight beside the next
  round's compute: the rows' last column) while the window holds at most
  `max_segments` of them ("exact"); beyond, each worker's row is cut into
  `width` columns and each column carries the share of its time spent in
  each phase and the group of the round under its middle ("binned": 400
  workers x 10,000 rounds become 400 x width cells). Events beyond
  `max_events` are binned per column too (one mark with a count).
* `charts`: per-round series over wall time (step rate, `T`, period,
  divergence, loss, averaging in flight, the cluster's compute share),
  averaged per pixel column where a line has more points than columns;
  past `MAX_LINES` workers a per-worker series becomes three lines over
  the workers (lowest, median, highest per column).
* `summary`: per-worker totals for the table, and a job's headline numbers
  for comparing jobs.
"""

import base64

import numpy as np

from oscars_tf.observability.dashboard import job_data as job_data_lib

MAX_SEGMENTS = 3000   # worker-rounds drawn one by one (3 rects each)
MAX_EVENTS = 400      # event marks drawn one by one
MAX_LINES = 16        # per-worker lines in a chart; beyond, a band
NO_GROUP = 0xFFFF     # a binned column with no round under its middle
STRAGGLER_RATIO = 0.5  # flagged below half the median rate (display only)


def _b64(array):
  return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def _window(job, t0, t1):
  t0 = 0.0 if t0 is None else float(t0)
  t1 = job.duration if t1 is None else float(t1)
  if not t1 > t0:
    t1 = t0 + max(job.duration, 1e-3)
  return t0, t1


def _covered(starts, durations, edges):
  """Seconds of the spans (`starts` sorted, not overlapping) before each
  edge: F(t) = whole spans started earlier + the part of the one under t."""
  if starts.size == 0:
    return np.zeros(edges.shape)
  total = np.r_[0.0, np.cumsum(durations)]
  k = np.searchsorted(starts, edges, side="right") - 1
  inside = np.clip(edges - starts[np.maximum(k, 0)], 0.0,
                   durations[np.maximum(k, 0)])
  return np.where(k >= 0, total[np.maximum(k, 0)] + inside, 0.0)


def bin_worker(w, edges):
  """One worker's row in `len(edges) - 1` columns: (shares (3, width) of
  each column's time in compute / wait / communicate, group (width,))."""
  order = (slice(None) if np.all(w.start[1:] >= w.start[:-1])
           else np.argsort(w.start, kind="stable"))  # (a resumed run)
  start, compute = w.start[order], w.compute[order]
  wait, comm = w.wait[order], w.comm[order]
  span = np.diff(edges)
  shares = np.empty((3, span.size))
  for i, (begin, seconds) in enumerate((
      (start, compute), (start + compute, wait),
      (start + compute + wait, comm))):
    shares[i] = np.diff(_covered(begin, seconds, edges)) / span
  middle = (edges[:-1] + edges[1:]) / 2
  k = np.searchsorted(start, middle, side="right") - 1
  end = start + compute + wait + comm
  under = (k >= 0) & (middle < end[np.maximum(k, 0)])
  group = np.where(under, w.group[order][np.maximum(k, 0)], NO_GROUP)
  group = np.where((group < 0) | (group >= NO_GROUP), NO_GROUP, group)
  return np.clip(shares, 0.0, 1.0), group.astype(np.uint16)


def _visible(w, t0, t1):
  return (w.end >= t0) & (w.start <= t1)


def timeline(job, t0=None, t1=None, width=1000, max_segments=MAX_SEGMENTS,
             max_events=MAX_EVENTS):
  """The timeline view of `job` in `[t0, t1]` (see module docstring)."""
  t0, t1 = _window(job, t0, t1)
  width = int(min(max(width, 10), 4000))
  masks = [_visible(w, t0, t1) for w in job.workers]
  shown = int(sum(m.sum() for m in masks))
  view = {"t0": t0, "t1": t1, "width": width, "duration": job.duration,
          "origin": job.origin, "workers": job.worker_ids,
          "rounds": job.rounds, "segments": shown,
          "groups": sorted({int(g) for w in job.workers for g in
                            np.unique(w.group) if g >= 0})}
  if shown <= max_segments:
    view["mode"] = "exact"
    # The last column: the seconds the round's averaging ran on beside
    # the next round's compute after its end (overlap=True; else 0).
    view["rows"] = [np.round(np.stack([
        w.rounds[m], w.start[m], w.compute[m], w.wait[m], w.comm[m],
        w.group[m], np.nan_to_num(w.series.get(
            "overlap_s", np.zeros(w.rounds.shape)))[m]], axis=1),
        6).tolist() for w, m in zip(job.workers, masks)]
  else:
    view["mode"] = "binned"
    edges = np.linspace(t0, t1, width + 1)
    shares = np.empty((len(job.workers), 3, width), np.uint8)
    groups = np.empty((len(job.workers), width), np.uint16)
    for i, w in enumerate(job.workers):
      s, g = bin_worker(w, edges)
      shares[i] = np.round(s * 255)
      groups[i] = g
    # Bytes, not JSON numbers: 400 x 3 x 1000 cells is 1.2 MB this way.
    view["shares"] = _b64(shares)
    view["group_cells"] = _b64(groups.astype("<u2"))
  view["events"] = _events_in(job.events, t0, t1, width, max_events)
  return view


def _events_in(events, t0, t1, width, max_events):
  """Events in the window: each one, or one per (kind, worker, column)
  with a count when there are more than `max_events`."""
  shown = [e for e in events if t0 <= e.t <= t1]
  if len(shown) <= max_events:
    return [{"kind": e.kind, "round": e.round, "t": round(e.t, 6),
             "worker": e.worker, "value": _json_number(e.value), "count": 1}
            for e in shown]
  bins = {}
  for e in shown:
    column = min(int((e.t - t0) / (t1 - t0) * width), width - 1)
    key = (e.kind, e.worker, column)
    if key in bins:
      bins[key]["count"] += 1
      bins[key]["last_round"] = e.round
    else:
      bins[key] = {"kind": e.kind, "round": e.round, "last_round": e.round,
                   "t": round(t0 + (column + 0.5) * (t1 - t0) / width, 6),
                   "worker": e.worker, "value": _json_number(e.value),
                   "count": 1}
  return sorted(bins.values(), key=lambda b: b["t"])


def _json_number(x):
  return None if x != x else float(x)


def _columns(x, y, t0, t1, width):
  """Mean x and y of the points in each pixel column (NaN: none)."""
  ok = ~np.isnan(y) & (x >= t0) & (x <= t1)
  x, y = x[ok], y[ok]
  column = np.minimum(((x - t0) / (t1 - t0) * width).astype(np.int64),
                      width - 1)
  count = np.bincount(column, minlength=width).astype(float)
  with np.errstate(invalid="ignore", divide="ignore"):
    return (np.bincount(column, x, width) / count,
            np.bincount(column, y, width) / count)


def _points(x, y):
  ok = ~np.isnan(y)
  return np.round(np.stack([x[ok], y[ok]], axis=1), 6).tolist()


def _line(x, y, t0, t1, width, rounds=None):
  """{points, breaks} of one line in the window: its points, averaged per
  pixel column when the line has more points than columns; `breaks`, the
  indices of points after rounds the worker missed (no line across them)."""
  ok = ~np.isnan(y) & (x >= t0) & (x <= t1)
  if ok.sum() > width:
    return {"points": _points(*_columns(x, y, t0, t1, width)), "breaks": []}
  breaks = []
  if rounds is not None:
    breaks = (np.flatnonzero(np.diff(rounds[ok]) > 1) + 1).tolist()
  return {"points": _points(x[ok], y[ok]), "breaks": breaks}


def _band(workers, name, t0, t1, width):
  """Lowest, median and highest worker per pixel column."""
  cells = np.full((len(workers), width), np.nan)
  for i, w in enumerate(workers):
    cells[i] = _columns(w.end, w.series[name], t0, t1, width)[1]
  x = t0 + (np.arange(width) + 0.5) * (t1 - t0) / width
  used = ~np.isnan(cells).all(axis=0)
  cells, x = cells[:, used], x[used]
  return [{"worker": None, "label": label, "breaks": [],
           "points": _points(x, f(cells, axis=0))}
          for label, f in (("highest", np.nanmax), ("median", np.nanmedian),
                           ("lowest", np.nanmin))]


CHARTS = (  # (id, title, per worker or cluster-wide)
    ("rate", "step rate (steps/s)", "worker"),
    ("time_budget", "time budget T (s)", "cluster"),
    ("period", "period (steps of the fastest worker)", "cluster"),
    ("divergence", "divergence before averaging", "worker"),
    ("loss", "loss", "worker"),
    ("overlap_s", "averaging in flight beside compute (s)", "worker"),
    ("utilization", "cluster utilization (compute share per round)",
     "cluster"),
)


# Charts of what only some jobs log, left out of the others'.
OPTIONAL_CHARTS = ("overlap_s",)


def utilization(job):
  """(round end, sum of compute / sum of round time) per round, over the
  workers that logged the round."""
  if not job.workers:
    return np.zeros(0), np.zeros(0)
  rounds = np.concatenate([w.rounds for w in job.workers])
  compute = np.concatenate([w.compute for w in job.workers])
  total = np.concatenate([w.compute + w.wait + w.comm for w in job.workers])
  known, inverse = np.unique(rounds, return_inverse=True)
  busy = np.bincount(inverse, compute, known.size)
  spent = np.bincount(inverse, total, known.size)
  share = np.divide(busy, spent, out=np.full(known.size, np.nan),
                    where=spent > 0)
  return job.round_times(known)[1], share


def charts(job, t0=None, t1=None, width=600):
  """The charts view of `job` in `[t0, t1]` (see module docstring)."""
  t0, t1 = _window(job, t0, t1)
  width = int(min(max(width, 10), 4000))
  out = []
  for name, title, scope in CHARTS:
    lines = []
    if name == "utilization":
      x, y = utilization(job)
      lines.append(dict(_line(x, y, t0, t1, width), worker=None))
    else:
      having = [w for w in job.workers if name in w.series]
      if name in OPTIONAL_CHARTS and not having:
        continue  # a job that never logs it (overlap off)
      if scope == "worker" and len(having) > MAX_LINES:
        lines = _band(having, name, t0, t1, width)
        having = []
      # T and the period are the plan's: the same on every member.
      for w in having[:1] if scope == "cluster" else having:
        lines.append(dict(
            _line(w.end, w.series[name], t0, t1, width, w.rounds),
            worker=None if scope == "cluster" else w.worker))
    out.append({"id": name, "title": title, "lines": lines})
  return {"t0": t0, "t1": t1, "duration": job.duration, "charts": out}


def summary(job):
  """Per-worker totals (the table) and the job's headline numbers."""
  latest = {w.worker: _last(w.series.get("rate")) for w in job.workers}
  rates = sorted(v for v in latest.values() if v == v)
  median = rates[len(rates) // 2] if rates else 0.0
  rows = []
  for w in job.workers:
    rate = latest[w.worker]
    rows.append({
        "worker": w.worker, "rate": _json_number(rate),
        "rounds": int(w.rounds.size), "compute_s": float(w.compute.sum()),
        "wait_s": float(w.wait.sum()), "comm_s": float(w.comm.sum()),
        "straggler": bool(median) and rate == rate and
                     rate < STRAGGLER_RATIO * median})
  spent = sum(r["compute_s"] + r["wait_s"] + r["comm_s"] for r in rows)
  losses = [_last(w.series.get("loss")) for w in job.workers]
  losses = [v for v in losses if v == v]
  counts = {k: 0 for k in job_data_lib.EVENT_KINDS}
  for e in job.events:
    counts[e.kind] += 1
  return {"workers": rows, "headline": {
      "workers": len(rows), "rounds": job.rounds,
      "duration_s": job.duration,
      "utilization": sum(r["compute_s"] for r in rows) / spent if spent
                     else None,
      "wait_share": sum(r["wait_s"] for r in rows) / spent if spent else None,
      "comm_share": sum(r["comm_s"] for r in rows) / spent if spent else None,
      "median_rate": median if rates else None,
      "final_loss": float(np.mean(losses)) if losses else None,
      "events": counts}}


def _last(values):
  if values is None:
    return float("nan")
  ok = values[~np.isnan(values)]
  return float(ok[-1]) if ok.size else float("nan")
