"""Summaries to TensorBoard and a Chrome trace timeline, per worker.

Everything here runs at averaging points only (inside the round's
`tf.py_function`, after the collectives) or after training: never on the
per-step path, and never a collective of its own.

Layout under a log directory:
  worker_<i>/        this worker's scalars (x axis: round): oscars/rate,
                     local_steps, time_budget, period, compute_s, wait_s,
                     comm_s, bytes_sent, divergence, loss, group (its lowest
                     member), epoch, poisoned_workers, with overlap=True
                     overlap_s and take_wait_s (at the take), since_arrival_s
                     (seconds from the worker's arrival at the averaging
                     point to this write: the event's own float64 wall time
                     less it places the round in wall time, which a float32
                     scalar could not), and on the rounds they happen only
                     oscars/global_sync and oscars/epoch_end (1.0)
  cluster/           the chief's global view: oscars/table/rate/worker_<j>,
                     oscars/table/local_steps/worker_<j>, the plan digest and
                     groups (text), stragglers, and on the rounds they happen
                     oscars/events/{dropped,rejoined,poisoned}/worker_<j>
  timeline_worker_<i>.json   compute / wait / communicate spans (Chrome trace
                     events), and with overlap a second row per worker,
                     its averagings in flight beside compute; `python -m
                     oscars_tf.observability.summaries merge DIR` joins
                     them into DIR/timeline.json for Perfetto or
                     chrome://tracing, one row per worker (and row).
"""

import json
import os
import sys
import time

import tensorflow as tf

WORKER_SCALARS = ("rate", "local_steps", "time_budget", "compute_s", "wait_s",
                  "comm_s", "divergence", "loss")
CLUSTER_EVENTS = ("dropped", "rejoined", "poisoned")  # lists in the record


def _period(plan):
  """The plan's period (steps of the fastest worker per round), or None."""
  return getattr(getattr(plan, "state", None), "period", None)


class RoundSummaries:
  """Writes one worker's summaries at each round end (see module doc)."""

  def __init__(self, logdir, worker_index, is_chief, book=None):
    self.logdir = logdir
    self.worker_index = worker_index
    self.writer = tf.summary.create_file_writer(
        os.path.join(logdir, f"worker_{worker_index}"))
    self.cluster_writer = (tf.summary.create_file_writer(
        os.path.join(logdir, "cluster")) if is_chief else None)
    self._bytes = 0
    # The round book (epochs) and the period of the round in flight: the
    # observer is handed the *next* round's plan.
    self._book = book
    self._period = _period(book.plan) if book is not None else None

  def _step(self, record):
    """Round `record`'s step: numbered on from the rounds of the attempts a
    restored job resumed (TensorBoard keeps one series per tag; a restart
    numbering from 0 again would write over the run's first rounds)."""
    before = self._book.rounds_before if self._book is not None else 0
    return record.round + before

  def __call__(self, record, table, plan):
    """Writes the round of `record` (a round_history.RoundRecord, the
    newest), its `table`, and the next round's `plan`."""
    step = self._step(record)
    self._bytes += record.bytes_sent
    with self.writer.as_default(step=step):
      self._round_context(record)
      for name in WORKER_SCALARS:
        value = getattr(record, name)
        if value is not None and value == value:  # skip NaN
          tf.summary.scalar(f"oscars/{name}", float(value))
      tf.summary.scalar("oscars/bytes_sent", float(self._bytes))
      tf.summary.scalar("oscars/group", float(min(record.group)))
      # Poison guard events: workers averaged without (non-finite weights).
      tf.summary.scalar("oscars/poisoned_workers",
                        float(len(record.poisoned)))
    self._period = _period(plan)
    if self.cluster_writer is None:
      return
    with self.cluster_writer.as_default(step=step):
      for kind in CLUSTER_EVENTS:
        for j in getattr(record, kind):
          tf.summary.scalar(f"oscars/events/{kind}/worker_{j}", 1.0)
      for j, e in enumerate(table.entries):
        if e.rate == e.rate:
          tf.summary.scalar(f"oscars/table/rate/worker_{j}", e.rate)
        tf.summary.scalar(f"oscars/table/local_steps/worker_{j}", e.steps)
      tf.summary.scalar("oscars/stragglers", float(len(plan.stragglers)))
      tf.summary.text("oscars/plan", json.dumps({
          "digest": record.plan, "groups": record.groups,
          "local_steps": record.planned_all,
          "global_sync": record.global_sync}))

  def taken(self, record):
    """Writes what an overlapped averaging's end adds to its round's
    `record`: its bytes, divergence, seconds beside compute and waited."""
    self._bytes += record.bytes_sent
    with self.writer.as_default(step=self._step(record)):
      for name in ("divergence", "overlap_s", "take_wait_s"):
        value = getattr(record, name)
        if value == value:
          tf.summary.scalar(f"oscars/{name}", float(value))
      tf.summary.scalar("oscars/bytes_sent", float(self._bytes))

  def _round_context(self, record):
    """Where the round sits in time and training (the dashboard's timeline
    and event marks)."""
    if record.arrived_at is not None:
      tf.summary.scalar("oscars/since_arrival_s",
                        time.time() - record.arrived_at)
    if self._period is not None:
      tf.summary.scalar("oscars/period", float(self._period))
    if record.global_sync:
      tf.summary.scalar("oscars/global_sync", 1.0)
    if self._book is not None:
      tf.summary.scalar("oscars/epoch", float(
          self._book.epoch_index + self._book.epoch_offset))
      if self._book.epoch_over:  # set before the observer is called
        tf.summary.scalar("oscars/epoch_end", 1.0)

  def flush(self):
    self.writer.flush()
    if self.cluster_writer is not None:
      self.cluster_writer.flush()


class RoundLogging:
  """One worker's round logs: its summaries as rounds end, its timeline at
  the end (from the round book's history)."""

  def __init__(self, cluster, book):
    self._cluster = cluster
    self._book = book
    self._logdir = None
    self._summaries = None
    self._timeline_of = None  # the last round the timeline written holds

  @property
  def logdir(self):
    """Where this worker writes its round summaries, or None."""
    return self._logdir

  def set_logdir(self, logdir):
    """Writes this worker's round summaries under `logdir` from now on."""
    if logdir and logdir != self._logdir:
      self._logdir = logdir
      self._summaries = RoundSummaries(
          logdir, self._cluster.worker_index, self._cluster.is_chief,
          self._book)
      self._book.observer = self._summaries

  def flush(self):
    """Writes out the summaries buffered so far, if logging."""
    if self._summaries is not None:
      self._summaries.flush()

  def finish_logs(self):
    """Flushes summaries and writes this worker's timeline (if logging and
    rounds ended since it was last written: `fit`'s end, then the exit's,
    which a `fit` that raised or a loop that never called it leaves)."""
    if self._logdir:
      self._summaries.flush()
      history = self._book.history
      last = history[-1].round if len(history) else None
      if last != self._timeline_of or last is None:
        write_timeline(self._logdir, history, self._cluster.worker_index)
        self._timeline_of = last


def trace_events(history, worker_index):
  """Chrome trace events (µs) for one worker's rounds (RoundRecords)."""
  events = []
  for r in history:
    arrive = r.arrived_at * 1e6
    spans = (("compute", arrive - r.compute_s * 1e6, r.compute_s),
             ("wait", arrive, r.wait_s),
             ("communicate", arrive + r.wait_s * 1e6, r.comm_s))
    # overlap=True: the averaging ran on beside compute (its own row),
    # then the worker waited for what was left of it.
    launched = arrive + (r.wait_s + r.comm_s) * 1e6
    if r.take_wait_s > 0:
      spans += (("communicate", launched + r.overlap_s * 1e6,
                 r.take_wait_s),)
    for name, start, seconds in spans:
      events.append(_span(name, start, seconds, worker_index, r))
    if r.overlap_s > 0:
      events.append(_span("averaging in flight", launched,
                          r.overlap_s + r.take_wait_s, worker_index, r,
                          pid=1))
  events.append({"name": "thread_name", "ph": "M", "pid": 0,
                 "tid": worker_index,
                 "args": {"name": f"worker {worker_index}"}})
  events.append({"name": "thread_name", "ph": "M", "pid": 1,
                 "tid": worker_index,
                 "args": {"name": f"worker {worker_index}: averaging in "
                                  "flight"}})
  return events


def _span(name, start, seconds, worker_index, record, pid=0):
  return {"name": name, "ph": "X", "ts": start, "dur": seconds * 1e6,
          "pid": pid, "tid": worker_index,
          "args": {"round": record.round, "plan": record.plan}}


# Through tf.io.gfile, as the summaries are: a log directory may be a
# bucket (gs://, s3://) as well as a local path.


def write_timeline(logdir, history, worker_index):
  """Writes `timeline_worker_<i>.json` under `logdir`; returns its path."""
  tf.io.gfile.makedirs(logdir)
  path = os.path.join(logdir, f"timeline_worker_{worker_index}.json")
  with tf.io.gfile.GFile(path + ".tmp", "w") as f:
    json.dump({"traceEvents": trace_events(history, worker_index)}, f)
  tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
  return path


def merge_timelines(logdir):
  """Joins every worker's timeline into `logdir/timeline.json`; returns
  (its path, "file: why" of each file left out, unreadable)."""
  events, skipped = [], []
  for path in sorted(tf.io.gfile.glob(
      os.path.join(logdir, "timeline_worker_*.json"))):
    try:
      with tf.io.gfile.GFile(path) as f:
        events.extend(json.load(f)["traceEvents"])
    except (ValueError, KeyError, TypeError) as e:
      why = f"no {e}" if isinstance(e, KeyError) else str(e)
      skipped.append(f"{os.path.basename(path)}: {why}")
  if not events:
    raise FileNotFoundError(
        f"no timeline_worker_*.json under {logdir!r}" if not skipped else
        f"no readable timeline_worker_*.json under {logdir!r} "
        f"({'; '.join(skipped)})")
  out = os.path.join(logdir, "timeline.json")
  with tf.io.gfile.GFile(out, "w") as f:
    json.dump({"traceEvents": events}, f)
  return out, skipped


# The command line. It has no flags; -h and --help print this.
USAGE = "python -m oscars_tf.observability.summaries merge LOGDIR"
DESCRIPTION = (
    "Joins the timeline_worker_<i>.json files under LOGDIR into one Chrome "
    "trace,\nLOGDIR/timeline.json (Perfetto, chrome://tracing); prints its "
    "path.")
HELP_ARGS = ("-h", "--help", "-?", "--helpshort")


def main(argv):
  args = argv[1:]
  if any(arg in HELP_ARGS for arg in args):
    print(f"usage: {USAGE}\n\n{DESCRIPTION}")
    return 0
  if len(args) != 2 or args[0] != "merge":
    print(f"usage: {USAGE}\nTry --help.", file=sys.stderr)
    return 1
  try:
    out, skipped = merge_timelines(args[1])
  except (OSError, tf.errors.OpError) as e:  # no timelines, an unreadable dir
    print(f"summaries merge: {e}", file=sys.stderr)
    return 1
  for why in skipped:
    print(f"summaries merge: left out {why}", file=sys.stderr)
  print(out)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
