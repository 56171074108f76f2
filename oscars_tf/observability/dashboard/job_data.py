"""One job's round scalars as arrays, and the events they imply. No TensorFlow.

A job is a directory holding `worker_<i>/` runs (each worker's round
scalars, see observability/summaries.py) and the chief's `cluster/` run.
`JobData.from_scalars` joins a job's scalars by round (the x axis of every
tag is the round) into one `WorkerRounds` per worker: where each round's
compute / wait / communicate spans sit in wall time, and the per-round
series the charts draw. Times are seconds since the job's `origin` (the
earliest compute start), so jobs compare side by side.

A round's place in wall time: the worker arrived at the averaging point at
`wall_time(oscars/since_arrival_s) - since_arrival_s` (an event's wall time
is a float64; a float32 scalar of the time itself would be off by minutes);
compute ran for `compute_s` before that, then it waited `wait_s` and
communicated `comm_s`. Logs from before since_arrival_s existed fall back
to the wall time of `oscars/comm_s` (written just after the round ended).
"""

import dataclasses
import re
from typing import Dict
from typing import List
from typing import Optional

import numpy as np

RUN = re.compile(r"^(?:(?P<job>.+)/)?(?P<leaf>worker_(?P<i>\d+)|cluster)$")
CLUSTER_EVENT = re.compile(
    r"^oscars/events/(?P<kind>dropped|rejoined|poisoned)/worker_(?P<j>\d+)$")
# Per-worker tags the dashboard reads (under oscars/).
SPAN_TAGS = ("since_arrival_s", "compute_s", "wait_s", "comm_s", "group")
SERIES_TAGS = ("rate", "time_budget", "period", "divergence", "loss",
               "epoch", "epoch_end", "global_sync", "local_steps",
               "bytes_sent", "overlap_s")
WORKER_TAGS = SPAN_TAGS + SERIES_TAGS
FLAG_TAGS = ("global_sync", "epoch_end")  # written on their rounds only
# Event kinds, in the order the legend lists them. The first three mark a
# worker's row; the others are cluster-wide (a line across all rows).
WORKER_EVENTS = ("dropped", "rejoined", "poisoned")
CLUSTER_EVENTS = ("period", "global_sync", "epoch_end")
EVENT_KINDS = WORKER_EVENTS + CLUSTER_EVENTS


def job_of(run):
  """The job a run belongs to ("." at the log directory's root), or None
  for a run that is not an oscars_tf worker or cluster run."""
  m = RUN.match(run)
  return (m.group("job") or ".") if m else None


def _last_per_step(steps, walls, values):
  """Sorted unique steps; a step written twice (a resumed run) keeps its
  latest value."""
  steps = np.asarray(steps, np.int64)
  if steps.size == 0:
    return steps, np.asarray(walls, np.float64), np.asarray(values, np.float64)
  order = np.lexsort((np.asarray(walls), steps))
  steps, walls = steps[order], np.asarray(walls, np.float64)[order]
  values = np.asarray(values, np.float64)[order]
  last = np.r_[steps[1:] != steps[:-1], True]
  return steps[last], walls[last], values[last]


def _align(steps, tag, fill=np.nan):
  """`tag`'s values at `steps` (a (steps, walls, values) triple or None)."""
  out = np.full(steps.shape, fill, np.float64)
  if tag is None or tag[0].size == 0:
    return out
  at = np.clip(np.searchsorted(tag[0], steps), 0, tag[0].size - 1)
  hit = tag[0][at] == steps
  out[hit] = tag[2][at[hit]]
  return out


def _between(rounds, known, values):
  """`values` (at sorted rounds `known`, NaN where unknown) at `rounds`:
  exact where known, linear between the nearest known ones, NaN outside."""
  out = np.full(rounds.shape, np.nan, np.float64)
  ok = ~np.isnan(values)
  known, values = known[ok], values[ok]
  if known.size == 0:
    return out
  inside = (rounds >= known[0]) & (rounds <= known[-1])
  out[inside] = np.interp(rounds[inside], known, values)
  return out


def _flagged(worker, kind):
  """The rounds `worker` raised flag `kind` in (from its own points, else
  from its series: a WorkerRounds made without them)."""
  if kind in worker.flags:
    return worker.flags[kind].tolist()
  if kind in worker.series:
    return worker.rounds[worker.series[kind] > 0].tolist()
  return []


def _last_at(values, round_):
  """`values` (round -> value) at the last round <= `round_`, or NaN."""
  before = [r for r in values if r <= round_]
  return values[max(before)] if before else np.nan


def _first_per_round(rounds, values, smallest=False):
  """(sorted unique rounds, the first value logged for each; with
  `smallest` the smallest)."""
  order = np.argsort(rounds, kind="stable")
  rounds, values = rounds[order], values[order]
  first = np.flatnonzero(np.r_[True, rounds[1:] != rounds[:-1]])
  if rounds.size and smallest:
    return rounds[first], np.minimum.reduceat(values, first)
  return rounds[first], values[first]


@dataclasses.dataclass
class WorkerRounds:
  """One worker's rounds, sorted by round; times in absolute seconds until
  JobData shifts them to its origin."""
  worker: int
  rounds: np.ndarray    # int64
  start: np.ndarray     # compute start
  compute: np.ndarray   # seconds of each phase
  wait: np.ndarray
  comm: np.ndarray
  group: np.ndarray     # the group's lowest member (-1: unknown)
  series: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # FLAG_TAGS: the rounds each was raised in, from its own points (a
  # sparse tag keeps rounds the dense ones' sample may have left out).
  flags: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  @property
  def arrive(self):
    return self.start + self.compute

  @property
  def end(self):
    return self.start + self.compute + self.wait + self.comm

  @classmethod
  def from_tags(cls, worker, tags):
    """`tags`: {name under oscars/: (steps, wall_times, values)}."""
    base = tags.get("compute_s")
    if base is None:
      return None
    steps = base[0]
    compute = np.maximum(base[2], 0.0)
    wait = np.maximum(np.nan_to_num(_align(steps, tags.get("wait_s"))), 0.0)
    comm = np.maximum(np.nan_to_num(_align(steps, tags.get("comm_s"))), 0.0)
    since = tags.get("since_arrival_s")
    if since is not None:
      arrive = _align(steps, (since[0], since[1], since[1] - since[2]))
    else:
      arrive = np.full(steps.shape, np.nan)
    written = tags.get("comm_s") or base
    fallback = _align(steps, (written[0], written[1], written[1])) - wait - comm
    arrive = np.where(np.isnan(arrive), fallback, arrive)
    keep = ~np.isnan(arrive)
    group = np.nan_to_num(_align(steps, tags.get("group")), nan=-1)
    series = {name: _align(steps, tags.get(name))[keep]
              for name in SERIES_TAGS if name in tags}
    flags = {name: np.unique(tags[name][0][tags[name][2] > 0])
             for name in FLAG_TAGS if name in tags}
    return cls(worker, steps[keep], (arrive - compute)[keep], compute[keep],
               wait[keep], comm[keep], group[keep].astype(np.int64), series,
               flags)


@dataclasses.dataclass
class Event:
  kind: str              # one of EVENT_KINDS
  round: int
  t: float               # seconds since the job's origin
  worker: Optional[int]  # None: cluster-wide
  value: float = 1.0     # the new period; the epoch that ended


class JobData:
  """A job's workers (sorted by index) and events, times since `origin`."""

  def __init__(self, workers: List[WorkerRounds], cluster_events=None):
    self.workers = [w for w in workers if w is not None and w.rounds.size]
    starts = [w.start.min() for w in self.workers]
    self.origin = float(min(starts)) if starts else 0.0
    for w in self.workers:
      w.start = w.start - self.origin
    ends = [w.end.max() for w in self.workers]
    self.duration = float(max(ends)) if ends else 0.0
    self._reference_times()
    self.events = self._events(cluster_events or {})

  @classmethod
  def from_scalars(cls, data):
    """`data`: {run: {tag: [points with .step, .wall_time, .value]}} of one
    job, as TensorBoard's data provider reads them."""
    workers, cluster_events = [], {}
    for run, tags in data.items():
      m = RUN.match(run)
      if not m:
        continue
      triples = {t: _last_per_step([p.step for p in pts],
                                   [p.wall_time for p in pts],
                                   [p.value for p in pts])
                 for t, pts in tags.items()}
      if m.group("leaf") == "cluster":
        for tag, (steps, _, values) in triples.items():
          e = CLUSTER_EVENT.match(tag)
          if e:
            cluster_events[(e.group("kind"), int(e.group("j")))] = (
                steps[values > 0])
        continue
      workers.append(WorkerRounds.from_tags(int(m.group("i")), {
          t[len("oscars/"):]: v for t, v in triples.items()
          if t.startswith("oscars/")}))
    return cls(sorted((w for w in workers if w is not None),
                      key=lambda w: w.worker), cluster_events)

  @property
  def worker_ids(self):
    return [w.worker for w in self.workers]

  @property
  def rounds(self):
    """Rounds that any worker logged."""
    return self._rounds.size

  def _reference_times(self):
    """Per round over all workers: the earliest compute start and round
    end (members of a round end it together), for cluster-wide marks."""
    if not self.workers:
      self._rounds = np.zeros(0, np.int64)
      self._round_start = self._round_end = np.zeros(0)
      return
    rounds = np.concatenate([w.rounds for w in self.workers])
    self._rounds = np.unique(rounds)
    self._round_start = _first_per_round(
        rounds, np.concatenate([w.start for w in self.workers]), True)[1]
    self._round_end = _first_per_round(
        rounds, np.concatenate([w.end for w in self.workers]), True)[1]

  def round_times(self, rounds):
    """(start, end) of `rounds` over the cluster: as logged, or between the
    nearest rounds logged (TensorBoard keeps a sample of a long run's
    rounds: an event's round is often not one of them); NaN outside."""
    rounds = np.asarray(rounds, np.int64)
    return (_between(rounds, self._rounds, self._round_start),
            _between(rounds, self._rounds, self._round_end))

  def _events(self, cluster_events):
    events = []
    by_worker = {w.worker: w for w in self.workers}
    for (kind, j), rounds in sorted(cluster_events.items()):
      _, end = self.round_times(rounds)
      mine = by_worker.get(j)
      for r, t in zip(rounds.tolist(), end.tolist()):
        if mine is not None:  # on its own row, at its own round end
          at = np.searchsorted(mine.rounds, r)
          if at < mine.rounds.size and mine.rounds[at] == r:
            t = float(mine.end[at])
        if t == t:
          events.append(Event(kind, r, t, j))
    events.extend(self._cluster_events())
    events.sort(key=lambda e: (e.t, EVENT_KINDS.index(e.kind)))
    return events

  def _cluster_events(self):
    """Period changes, global syncs and epoch ends, from every worker's
    flags (a worker out of some rounds still reports the others)."""
    flagged = {kind: sorted(set().union(*[
        _flagged(w, kind) for w in self.workers])) for kind in FLAG_TAGS}
    first = {}
    for kind in ("period", "epoch"):
      having = [w for w in self.workers if kind in w.series]
      rounds = np.concatenate([w.rounds for w in having] or [[]])
      values = np.concatenate([w.series[kind] for w in having] or [[]])
      ok = ~np.isnan(values)
      known, value = (_first_per_round(rounds[ok], values[ok]) if ok.any()
                      else ([], []))
      first[kind] = dict(zip(np.asarray(known).tolist(),
                             np.asarray(value).tolist()))
    period, epoch = first["period"], first["epoch"]
    events = []
    rounds = flagged["global_sync"]
    for r, t in zip(rounds, self.round_times(rounds)[1].tolist()):
      events.append(Event("global_sync", r, t, None))
    rounds = flagged["epoch_end"]
    for r, t in zip(rounds, self.round_times(rounds)[1].tolist()):
      events.append(Event("epoch_end", r, t, None, _last_at(epoch, r)))
    known = sorted(period)
    changes = [r for a, r in zip(known, known[1:]) if period[r] != period[a]]
    for r, t in zip(changes, self.round_times(changes)[0].tolist()):
      events.append(Event("period", r, t, None, period[r]))
    return [e for e in events if e.t == e.t]
