"""Backend of the `oscars` TensorBoard dashboard ("where did my time go?").

Installed with the package through the `tensorboard_plugins` entry point, so
`tensorboard --logdir DIR` serves an **Oscars** tab. It reads the round
summaries that `oscars_tf.observability.summaries` writes through
TensorBoard's own data provider (no file access of its own) and imports no
TensorFlow. A *job* is a directory holding `worker_<i>/` runs and the
chief's `cluster/` run; a job at the log directory's root is named after
the directory (its id stays ".").

Routes (under /data/plugin/oscars/):
  /index.js, /static/<file>.js   the page: plain ES modules, no build step
  /jobs                          [{id, name, workers}] of every job
  /job?name=ID                   per-worker totals and the job's headline
                                 numbers (views.summary)
  /timeline?name=ID&t0=&t1=&width=   the Gantt timeline of that window,
                                 exact or binned per pixel column, and its
                                 events (views.timeline)
  /charts?name=ID&t0=&t1=&width=     step rate, T, period, divergence, loss
                                 and utilization over wall time (views.charts)

TensorBoard keeps a sample of each scalar tag (by default 1,000 points, i.e.
rounds); the views then show the sampled rounds and say so (`sampled`).
For every round of a long job start it with
`tensorboard --logdir DIR --samples_per_plugin=scalars=0` (keep all).
"""

import os
import threading

from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from oscars_tf.observability.dashboard import job_data
from oscars_tf.observability.dashboard import views

PLUGIN_NAME = "oscars"
_STATIC = os.path.join(os.path.dirname(__file__), "static")
_TAGS = {f"oscars/{t}" for t in job_data.WORKER_TAGS}
_CACHED_JOBS = 8
# Points TensorBoard keeps per scalar tag unless --samples_per_plugin says
# otherwise (its DEFAULT_TENSOR_SIZE_GUIDANCE for "scalars"; 0: all).
_TENSORBOARD_KEEPS = 1000


class OscarsPlugin(base_plugin.TBPlugin):
  """Serves the routes of the module docstring."""

  plugin_name = PLUGIN_NAME

  def __init__(self, context):
    self._provider = context.data_provider
    self._root_name = root_name(getattr(context, "logdir", None))
    hints = getattr(context, "sampling_hints", None) or {}
    self._kept = hints.get("scalars", _TENSORBOARD_KEEPS)
    self._lock = threading.Lock()
    self._cache = {}  # job id -> (fingerprint, JobData, sampled)

  def get_plugin_apps(self):
    return {"/index.js": self._serve_static, "/static/*": self._serve_static,
            "/jobs": self._serve_jobs, "/job": self._serve_job,
            "/timeline": self._serve_timeline, "/charts": self._serve_charts}

  def is_active(self):
    return False  # activated by data_plugin_names when scalars exist

  def data_plugin_names(self):
    return ("scalars",)

  def frontend_metadata(self):
    return base_plugin.FrontendMetadata(es_module_path="/index.js",
                                        tab_name="Oscars")

  @wrappers.Request.application
  def _serve_static(self, request):
    name = os.path.basename(request.path)
    path = os.path.join(_STATIC, name)
    # Only the files shipped in static/ (no path beyond a base name).
    if not name.endswith(".js") or not os.path.isfile(path):
      return http_util.Respond(request, "not found", "text/plain", code=404)
    with open(path, "rb") as f:
      return http_util.Respond(request, f.read(), "text/javascript")

  def _runs(self, request):
    """(ctx, experiment id, {run: ScalarTimeSeries by tag}) of oscars runs."""
    ctx = plugin_util.context(request.environ)
    eid = plugin_util.experiment_id(request.environ)
    tags = self._provider.list_scalars(ctx, experiment_id=eid,
                                       plugin_name="scalars")
    return ctx, eid, {r: t for r, t in tags.items()
                      if job_data.job_of(r) and any(
                          k.startswith("oscars/") for k in t)}

  @wrappers.Request.application
  def _serve_jobs(self, request):
    _, _, runs = self._runs(request)
    ids = {}
    for run in runs:
      if job_data.RUN.match(run).group("leaf") != "cluster":
        ids[job_data.job_of(run)] = ids.get(job_data.job_of(run), 0) + 1
    jobs = [{"id": j, "name": self._root_name if j == "." else j,
             "workers": n} for j, n in sorted(ids.items())]
    return _json(request, {"jobs": jobs})

  def _job(self, request):
    """(JobData, sampled) of the request's job, or an error response."""
    name = request.args.get("name", "")
    if not name or ".." in name.split("/") or name.startswith("/"):
      return None, _json(request, {"error": f"bad job name {name!r}"}, 400)
    ctx, eid, runs = self._runs(request)
    mine = {r: t for r, t in runs.items() if job_data.job_of(r) == name}
    if not mine:
      return None, _json(request, {"error": f"unknown job {name!r}"}, 404)
    # The data changes while a job runs: re-read when any series grew.
    fingerprint = tuple(sorted(
        (r, tag, s.max_step, s.max_wall_time) for r, t in mine.items()
        for tag, s in t.items()))
    with self._lock:
      cached = self._cache.get(name)
    if cached and cached[0] == fingerprint:
      return cached[1:], None
    wanted = sorted({tag for t in mine.values() for tag in t
                     if tag in _TAGS or tag.startswith("oscars/events/")})
    data = self._provider.read_scalars(
        ctx, experiment_id=eid, plugin_name="scalars", downsample=10**9,
        run_tag_filter=provider.RunTagFilter(runs=list(mine), tags=wanted))
    job = job_data.JobData.from_scalars(data)
    sampled = any(_sampled(data.get(r, {}).get("oscars/compute_s", ()),
                           self._kept) for r in mine)
    with self._lock:
      if len(self._cache) >= _CACHED_JOBS:
        self._cache.pop(next(iter(self._cache)))
      self._cache[name] = (fingerprint, job, sampled)
    return (job, sampled), None

  def _respond_with_view(self, request, make_view):
    """The job the request names, through make_view(job), as JSON marked
    whether TensorBoard kept only a sample of its rounds."""
    found, error = self._job(request)
    if error:
      return error
    job, sampled = found
    return _json(request, dict(make_view(job), sampled=sampled))

  @wrappers.Request.application
  def _serve_job(self, request):
    return self._respond_with_view(request, views.summary)

  @wrappers.Request.application
  def _serve_timeline(self, request):
    return self._respond_with_view(request, lambda job: views.timeline(
        job, _number(request, "t0"), _number(request, "t1"),
        int(_number(request, "width") or 1000)))

  @wrappers.Request.application
  def _serve_charts(self, request):
    return self._respond_with_view(request, lambda job: views.charts(
        job, _number(request, "t0"), _number(request, "t1"),
        int(_number(request, "width") or 600)))


def root_name(logdir):
  """The name of a job at the log directory's root: the directory's base
  name ("." when TensorBoard was given no single directory)."""
  if not logdir or "," in logdir:
    return "."
  return os.path.basename(os.path.normpath(logdir)) or "."


def _sampled(points, kept):
  """Whether TensorBoard dropped some of these points: it keeps `kept` at
  most (0: all), so a full reservoir with holes between its steps was cut
  (a worker out of some rounds has holes too, but fewer points)."""
  if not kept or len(points) < kept:
    return False
  steps = [p.step for p in points]
  return max(steps) - min(steps) + 1 > len(steps)


def _number(request, key):
  value = request.args.get(key)
  try:
    return float(value) if value not in (None, "") else None
  except ValueError:
    return None


def _json(request, body, code=200):
  return http_util.Respond(request, body, "application/json", code=code)
