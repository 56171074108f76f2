"""Backend of the `oscars` TensorBoard dashboard.

Installed with the package through the `tensorboard_plugins` entry point, so
`tensorboard --logdir DIR` serves it. It reads the round summaries that
`oscars_tf.observability.summaries` writes (TensorBoard's own data provider, no file
access of its own) and serves, per job (a directory holding `worker_<i>/`
and `cluster/` runs): the step-rate table over rounds, the group timeline,
and each worker's compute / wait / communicate breakdown.
"""

import os
import re

from werkzeug import wrappers

from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin

PLUGIN_NAME = "oscars"
_STATIC = os.path.join(os.path.dirname(__file__), "static")
_RUN = re.compile(r"^(?:(?P<job>.+)/)?(?P<leaf>worker_(?P<i>\d+)|cluster)$")
_WORKER_TAGS = ("rate", "local_steps", "compute_s", "wait_s", "comm_s",
                "group", "divergence", "bytes_sent")
STRAGGLER_RATIO = 0.5  # flagged below half the median rate (display only)


class OscarsPlugin(base_plugin.TBPlugin):
  """Serves /index.js, /jobs and /job?name=..."""

  plugin_name = PLUGIN_NAME

  def __init__(self, context):
    self._provider = context.data_provider

  def get_plugin_apps(self):
    return {"/index.js": self._serve_js, "/jobs": self._serve_jobs,
            "/job": self._serve_job}

  def is_active(self):
    return False  # activated by data_plugin_names when scalars exist

  def data_plugin_names(self):
    return ("scalars",)

  def frontend_metadata(self):
    return base_plugin.FrontendMetadata(es_module_path="/index.js",
                                        tab_name="Oscars")

  @wrappers.Request.application
  def _serve_js(self, request):
    with open(os.path.join(_STATIC, "index.js"), "rb") as f:
      return http_util.Respond(request, f.read(), "text/javascript")

  def _runs(self, request):
    ctx = plugin_util.context(request.environ)
    eid = plugin_util.experiment_id(request.environ)
    tags = self._provider.list_scalars(ctx, experiment_id=eid,
                                       plugin_name="scalars")
    return ctx, eid, {r: t for r, t in tags.items()
                      if _RUN.match(r) and any(k.startswith("oscars/")
                                               for k in t)}

  @wrappers.Request.application
  def _serve_jobs(self, request):
    _, _, runs = self._runs(request)
    jobs = sorted({_RUN.match(r).group("job") or "." for r in runs})
    return http_util.Respond(request, {"jobs": jobs}, "application/json")

  @wrappers.Request.application
  def _serve_job(self, request):
    name = request.args.get("name", "")
    if not name or ".." in name.split("/") or name.startswith("/"):
      return http_util.Respond(request, {"error": f"bad job name {name!r}"},
                               "application/json", code=400)
    ctx, eid, runs = self._runs(request)
    mine = {r: t for r, t in runs.items()
            if (_RUN.match(r).group("job") or ".") == name}
    if not mine:
      return http_util.Respond(request, {"error": f"unknown job {name!r}"},
                               "application/json", code=404)
    data = self._provider.read_scalars(
        ctx, experiment_id=eid, plugin_name="scalars", downsample=100000,
        run_tag_filter=provider.RunTagFilter(runs=list(mine)))
    return http_util.Respond(request, _job_view(data), "application/json")


def _series(points):
  return [[p.step, p.value] for p in sorted(points, key=lambda p: p.step)]


def _job_view(data):
  """The dashboard's JSON for one job (pure; see module docstring)."""
  workers, table = {}, {}
  for run, tags in data.items():
    m = _RUN.match(run)
    if m.group("leaf") == "cluster":
      for tag, points in tags.items():
        w = re.match(r"^oscars/table/rate/worker_(\d+)$", tag)
        if w:
          table[int(w.group(1))] = _series(points)
      continue
    series = {t[len("oscars/"):]: _series(p) for t, p in tags.items()
              if t[len("oscars/"):] in _WORKER_TAGS}
    workers[int(m.group("i"))] = series
  rows = []
  latest = {i: (s.get("rate") or [[0, 0.0]])[-1][1] for i, s in workers.items()}
  rates = sorted(latest.values())
  median = rates[len(rates) // 2] if rates else 0.0
  for i in sorted(workers):
    s = workers[i]
    totals = {k: sum(v for _, v in s.get(k, [])) for k in
              ("compute_s", "wait_s", "comm_s")}
    rows.append({"worker": i, "rate": latest[i], **totals,
                 "rounds": len(s.get("rate", [])),
                 "straggler": bool(median) and
                              latest[i] < STRAGGLER_RATIO * median,
                 "series": s})
  return {"workers": rows,
          "table": [{"worker": i, "rates": table[i]} for i in sorted(table)]}
