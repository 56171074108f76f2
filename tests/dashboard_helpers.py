"""Helpers for the dashboard's tests: a synthetic job of any size (no
TensorFlow) and headless Chromium with its console log kept."""

import os

import numpy as np

from oscars_tf.observability.dashboard import job_data

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def synthetic_job(workers, rounds, seed=0, origin=1.7e9):
  """A JobData of `workers` x `rounds`: rounds of equal time T where each
  worker computes at its own speed, waits for the slowest and averages;
  groups of 8 (global every 4th round), worker 1 dropped at round 10 and
  back at 20, worker 2 poisoned at 30, the period switching between 8 and
  16 every 500 rounds and an epoch every 1,000."""
  rng = np.random.default_rng(seed)
  speed = rng.uniform(0.5, 1.0, workers)
  budget = np.full(rounds, 0.2)
  comm = rng.uniform(0.002, 0.01, (workers, rounds))
  compute = speed[:, None] * budget[None, :] * rng.uniform(
      0.9, 1.0, (workers, rounds))
  round_time = (compute + comm).max(axis=0) + 0.001
  start = origin + np.r_[0.0, np.cumsum(round_time)[:-1]]
  steps = np.arange(rounds)
  out = []
  for i in range(workers):
    wait = round_time - compute[i] - comm[i]
    group = np.where(steps % 4 == 3, 0, (i // 8) * 8)
    series = {
        "rate": 10.0 / speed[i] + np.zeros(rounds), "time_budget": budget,
        "period": 8.0 * (1 + (steps // 500) % 2),
        "divergence": rng.uniform(0, 0.05, rounds),
        "loss": 2.0 / (1 + steps / 100.0),
        "epoch": (steps // 1000).astype(float),
        "epoch_end": (steps % 1000 == 999).astype(float),
        "global_sync": (steps % 4 == 3).astype(float)}
    out.append(job_data.WorkerRounds(
        i, steps.copy(), start.copy(), compute[i], wait, comm[i], group,
        series))
  events = {("dropped", 1): np.array([10]), ("rejoined", 1): np.array([20]),
            ("poisoned", 2): np.array([30])}
  return job_data.JobData(out, events)


def artifacts_dir(tmp_path_factory=None):
  """Where tests keep screenshots: $OSCARS_TEST_ARTIFACTS, else the repo's
  test-output/ (ignored by git)."""
  path = os.environ.get("OSCARS_TEST_ARTIFACTS") or os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      "test-output")
  os.makedirs(path, exist_ok=True)
  return path


def chrome(width=1400, height=1000):
  """Headless Chromium through chromedriver, its console kept
  (driver.get_log("browser")); skips the test where either is missing."""
  import pytest  # pylint: disable=g-import-not-at-top
  if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("Chromium is not installed (apt-get install chromium "
                "chromium-driver; .ci/run does)")
  webdriver = pytest.importorskip("selenium.webdriver")
  from selenium.webdriver.chrome.service import Service  # pylint: disable=g-import-not-at-top
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
               "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--disable-dev-shm-usage",
               f"--window-size={width},{height}"):
    options.add_argument(flag)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def console_errors(driver):
  """The browser console's errors since the last call."""
  return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


STATIC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "oscars_tf", "observability", "dashboard", "static")

# A page that draws the given views with the dashboard's own modules and
# says how long that took (data-render-ms on <body>).
HARNESS = """<!doctype html><html><head><meta charset="utf-8">
<link rel="icon" href="data:,">
<style>body { font: 13px sans-serif; margin: 8px; }
.timeline-wrap { position: relative; }
.timeline-wrap > svg, .timeline-wrap > canvas { position: absolute; left: 0;
  top: 0; } svg text { font: 11px sans-serif; }
.charts { display: grid; } figure { margin: 0; }</style></head>
<body><div id="out"></div><script type="module">
import {renderCharts} from './charts.js';
import {renderTimeline, timelineLegend} from './timeline.js';
const view = await (await fetch('./timeline.json')).json();
const charts = await (await fetch('./charts.json')).json();
const start = performance.now();
document.getElementById('out').append(timelineLegend('phase', view.groups),
    renderTimeline(view, {t0: view.t0, t1: view.t1, width: 1300,
                          colourBy: 'phase', onWindow: () => {}}),
    renderCharts([charts], [{id: '.', name: 'synthetic'}],
                 {t0: view.t0, t1: view.t1, width: 1300,
                  workerCounts: [view.workers.length]}));
await new Promise((done) => requestAnimationFrame(() => done()));
document.body.dataset.renderMs = (performance.now() - start).toFixed(1);
</script></body></html>"""


def serve_views(timeline_view, charts_view):
  """Serves HARNESS, the static modules and the two views on loopback;
  returns (url of the page, server: call .shutdown() when done)."""
  import functools  # pylint: disable=g-import-not-at-top
  import http.server  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  pages = {"/harness.html": (HARNESS.encode(), "text/html"),
           "/timeline.json": (json.dumps(timeline_view).encode(),
                              "application/json"),
           "/charts.json": (json.dumps(charts_view).encode(),
                            "application/json")}

  class Handler(http.server.SimpleHTTPRequestHandler):

    def do_GET(self):  # pylint: disable=invalid-name
      if self.path in pages:
        body, kind = pages[self.path]
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
      else:
        super().do_GET()

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(
      ("127.0.0.1", 0), functools.partial(Handler, directory=STATIC))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return f"http://127.0.0.1:{server.server_address[1]}/harness.html", server
