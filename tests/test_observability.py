"""Summaries and timeline after a real, uneven 3-worker run, read back with
TensorBoard's own event reading API, and the `oscars` dashboard on it in
stock TensorBoard and headless Chromium.

The run: workers 0 and 1 on one emulated host, worker 2 (3x slower,
SIMULATED) on another, so rounds average in two groups with a global sync
every third round; worker 1's weights turn NaN at epoch 1 (poisoned, left
out); the period adapts. Screenshots of each dashboard view go to
$OSCARS_TEST_ARTIFACTS or test-output/ (the path is printed).
"""

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator

import dashboard_helpers
import multiworker

pytestmark = pytest.mark.timeout(300)


def _scalars(path):
  acc = event_accumulator.EventAccumulator(path, size_guidance={
      event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


def _values(acc, tag):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if tag in acc.Tags()["scalars"]:
    return [e.value for e in acc.Scalars(tag)]
  return [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]


UNEVEN = {"adaptive": {"initial_period": 4, "max_period": 8,
                       "global_every": 3, "adaptive_global": False},
          "epochs": 3, "batch_size": 16, "tensorboard": True,
          "simulate": "10ms*1,1,3", "poison_at_epoch": [1, 1], "timeout": 60}
HOSTS = ["127.0.0.1", "127.0.0.1", "127.0.0.2"]
COPY = "compare_copy"  # a second job in the dashboard's log directory


@pytest.fixture(scope="module")
def logged_run():
  result = multiworker.run("fit", 3, UNEVEN, hosts=HOSTS)
  return result, os.path.join(result.outdir, "tb")


def test_every_worker_writes_its_round_scalars(logged_run):
  _, logdir = logged_run
  for w in range(3):
    acc = _scalars(os.path.join(logdir, f"worker_{w}"))
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["tensors"])
    for name in ("rate", "local_steps", "wait_s", "comm_s", "compute_s",
                 "divergence", "bytes_sent", "time_budget", "period",
                 "epoch", "epoch_end", "global_sync", "since_arrival_s"):
      assert f"oscars/{name}" in tags, (w, name, tags)
    rates = _values(acc, "oscars/rate")
    assert rates and all(v > 0 for v in rates)
    assert all(v >= 0 for v in _values(acc, "oscars/wait_s"))


def test_the_chief_writes_the_table_and_the_plan(logged_run):
  _, logdir = logged_run
  acc = _scalars(os.path.join(logdir, "cluster"))
  tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["tensors"])
  assert {f"oscars/table/rate/worker_{j}" for j in range(3)} <= tags
  assert "oscars/plan" in tags
  assert "oscars/events/poisoned/worker_1" in tags  # the NaN worker


def test_timelines_merge_into_one_trace(logged_run):
  _, logdir = logged_run
  proc = subprocess.run(
      [sys.executable, "-m", "oscars_tf.observability.summaries", "merge",
       logdir], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  events = json.load(open(os.path.join(logdir, "timeline.json")))
  spans = [e for e in events["traceEvents"] if e["ph"] == "X"]
  assert {e["tid"] for e in spans} == {0, 1, 2}
  assert {e["name"] for e in spans} == {"compute", "wait", "communicate"}
  assert all(e["dur"] >= 0 for e in spans)


# -- the `oscars` TensorBoard dashboard, served by stock TensorBoard --------

@pytest.fixture(scope="module")
def tensorboard_url(logged_run):
  """Stock TensorBoard on the run's log directory, which holds two jobs:
  the run at the root (named after the directory, "tb") and a copy of it
  under compare_copy/ (several jobs side by side)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import socket  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  _, logdir = logged_run
  for run in os.listdir(logdir):
    if run.startswith("worker_") or run == "cluster":
      shutil.copytree(os.path.join(logdir, run),
                      os.path.join(logdir, COPY, run), dirs_exist_ok=True)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen(
      [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host",
       "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 90
    while True:
      try:
        urllib.request.urlopen(url + "/data/plugins_listing", timeout=5)
        break
      except OSError:
        if time.monotonic() > deadline or proc.poll() is not None:
          raise RuntimeError("tensorboard did not start") from None
        time.sleep(0.5)
    yield url
  finally:
    proc.kill()
    proc.wait(timeout=30)


def _get(url):
  import urllib.error  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  try:
    with urllib.request.urlopen(url, timeout=30) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_plugin_is_listed_and_serves_the_job(tensorboard_url, logged_run):
  result, _ = logged_run
  status, listing = _get(tensorboard_url + "/data/plugins_listing")
  assert status == 200 and listing["oscars"]["enabled"]
  status, jobs = _get(tensorboard_url + "/data/plugin/oscars/jobs")
  # The job at the log directory's root is named after the directory.
  assert status == 200 and jobs["jobs"] == [
      {"id": ".", "name": "tb", "workers": 3},
      {"id": COPY, "name": COPY, "workers": 3}]
  status, job = _get(tensorboard_url + "/data/plugin/oscars/job?name=.")
  assert status == 200
  assert [w["worker"] for w in job["workers"]] == [0, 1, 2]
  assert all(w["rate"] > 0 and w["wait_s"] >= 0 for w in job["workers"])
  assert [w["rounds"] for w in job["workers"]] == [
      len(o["rounds"]) for o in result.outputs]
  assert not job["sampled"]
  status, view = _get(tensorboard_url +
                      "/data/plugin/oscars/timeline?name=.&width=900")
  assert status == 200 and view["mode"] == "exact"
  assert view["workers"] == [0, 1, 2]
  status, charts = _get(tensorboard_url + "/data/plugin/oscars/charts?name=.")
  assert status == 200 and len(charts["charts"]) == 6


@pytest.mark.parametrize("route", ["job", "timeline", "charts"])
@pytest.mark.parametrize("name, code", [("../etc", 400), ("/etc", 400),
                                        ("a/../../b", 400), ("", 400),
                                        ("no_such_job", 404)])
def test_plugin_rejects_bad_job_names(tensorboard_url, route, name, code):
  import urllib.parse  # pylint: disable=g-import-not-at-top
  status, body = _get(f"{tensorboard_url}/data/plugin/oscars/{route}?name=" +
                      urllib.parse.quote(name))
  assert status == code and "error" in body


def test_plugin_serves_only_its_own_modules(tensorboard_url):
  import urllib.error  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  base = tensorboard_url + "/data/plugin/oscars"
  for name in ("index.js", "static/timeline.js", "static/util.js"):
    with urllib.request.urlopen(f"{base}/{name}", timeout=30) as r:
      assert r.status == 200 and b"export" in r.read()
  for name in ("static/../plugin.py", "static/plugin.py", "static/nope.js"):
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(f"{base}/{name}", timeout=30)
    assert e.value.code == 404, name


def _expected(result, logdir):
  """What the dashboard must show for the run, from the workers' own round
  histories (and the period each round was planned with)."""
  chief = result.outputs[0]["rounds"]
  acc = _scalars(os.path.join(logdir, "worker_0"))
  period = _values(acc, "oscars/period")
  return {
      "rounds": [sorted(r["round"] for r in o["rounds"])
                 for o in result.outputs],
      "events": {
          "poisoned": sum(len(r["poisoned"]) for r in chief),
          "dropped": sum(len(r["dropped"]) for r in chief),
          "rejoined": sum(len(r["rejoined"]) for r in chief),
          "global_sync": sum(bool(r["global_sync"]) for r in chief),
          "epoch_end": result.outputs[0]["epochs_run"],
          "period": sum(a != b for a, b in zip(period, period[1:]))}}


def _wait_rendered(browser, view, after=0):
  """Waits for the dashboard's view `view` to finish a render later than
  render number `after`; returns the render's number."""
  from selenium.webdriver.common.by import By  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.support.ui import WebDriverWait  # pylint: disable=g-import-not-at-top

  def done(b):
    node = b.find_element(By.ID, "oscars-view")
    state = node.get_attribute("data-state")
    if state == "error":
      return node
    if (state == "ready" and node.get_attribute("data-view") == view and
        int(node.get_attribute("data-renders") or 0) > after):
      return node
    return False
  node = WebDriverWait(browser, 60).until(done)
  assert node.get_attribute("data-state") == "ready", node.text
  return int(node.get_attribute("data-renders"))


def _shoot(browser, name):
  browser.switch_to.default_content()
  path = os.path.join(dashboard_helpers.artifacts_dir(), name)
  browser.save_screenshot(path)
  print(f"screenshot: {path}")
  assert os.path.getsize(path) > 10000
  frame = browser.find_elements("css selector", "iframe")[0]
  browser.switch_to.frame(frame)


def test_dashboard_in_a_real_browser(tensorboard_url, logged_run):
  """Every view of the dashboard in headless Chromium: the counts it draws
  match the run, nothing goes to the console, a screenshot of each."""
  result, logdir = logged_run
  want = _expected(result, logdir)
  browser = dashboard_helpers.chrome(1400, 1300)
  from selenium.webdriver.common.action_chains import ActionChains  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.common.by import By  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.support.ui import Select  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.support.ui import WebDriverWait  # pylint: disable=g-import-not-at-top
  css = browser.find_elements
  try:
    browser.get(tensorboard_url + "/#oscars")
    frame = WebDriverWait(browser, 60).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "iframe"))[0]
    browser.switch_to.frame(frame)
    renders = _wait_rendered(browser, "timeline")
    jobs = browser.find_element(By.ID, "oscars-jobs").text
    assert "tb (3)" in jobs and f"{COPY} (3)" in jobs, jobs

    # The timeline of each job (the same run twice, so equal), one time
    # axis; a row per worker, three spans per round it logged.
    panels = css(By.CSS_SELECTOR, "section.job-panel")
    assert [p.get_attribute("data-job") for p in panels] == [".", COPY]
    assert panels[0].find_element(By.CSS_SELECTOR, "svg").get_attribute(
        "data-t1") == panels[1].find_element(
            By.CSS_SELECTOR, "svg").get_attribute("data-t1")
    root = '.job-panel[data-job="."] '
    timeline = browser.find_element(By.CSS_SELECTOR,
                                    root + "svg.oscars-timeline")
    assert timeline.get_attribute("data-mode") == "exact"
    assert timeline.get_attribute("data-workers") == "3"
    rounds = want["rounds"]
    assert int(timeline.get_attribute("data-rounds")) == len(
        set().union(*rounds))
    assert len(css(By.CSS_SELECTOR, root + "text.worker-label")) == 3
    assert len(css(By.CSS_SELECTOR, root + "rect.seg")) == 3 * sum(
        map(len, rounds))
    for w, mine in enumerate(rounds):
      drawn = css(By.CSS_SELECTOR,
                  root + f'rect.seg.compute[data-worker="{w}"]')
      assert sorted(int(r.get_attribute("data-round")) for r in drawn) == mine
    drawn = {kind: len(css(By.CSS_SELECTOR,
                           root + f'g.event[data-kind="{kind}"]'))
             for kind in want["events"]}
    assert drawn == want["events"]
    assert drawn["poisoned"] >= 1 and drawn["epoch_end"] == 3
    poisoned = css(By.CSS_SELECTOR, root + 'g.event[data-kind="poisoned"]')[0]
    assert poisoned.get_attribute("data-worker") == "1"
    _shoot(browser, "oscars_timeline.png")

    # Groups as colours: workers 0 and 1 share a host's group, worker 2
    # averages alone between global syncs.
    Select(browser.find_element(By.ID, "oscars-colour-by")).select_by_value(
        "group")
    renders = _wait_rendered(browser, "timeline", renders)
    legend = browser.find_element(By.CSS_SELECTOR, ".legend").text
    assert "group 0" in legend and "group 2" in legend, legend
    fills = {w: {r.get_attribute("fill") for r in css(
        By.CSS_SELECTOR, root + f'rect.seg.compute[data-worker="{w}"]')}
             for w in range(3)}
    assert fills[0] == fills[1] and len(fills[2] - fills[0]) == 1, fills
    _shoot(browser, "oscars_timeline_groups.png")

    # Zoom: drag across part of the plot (both jobs follow).
    svg = browser.find_element(By.CSS_SELECTOR, root + "svg.oscars-timeline")
    span = float(svg.get_attribute("data-t1")) - float(
        svg.get_attribute("data-t0"))
    ActionChains(browser).move_to_element_with_offset(svg, -200, 20) \
        .click_and_hold().move_by_offset(250, 0).release().perform()
    renders = _wait_rendered(browser, "timeline", renders)
    svg = browser.find_element(By.CSS_SELECTOR, root + "svg.oscars-timeline")
    assert css(By.CSS_SELECTOR, "svg.oscars-timeline")[1].get_attribute(
        "data-t0") == svg.get_attribute("data-t0")
    zoomed = float(svg.get_attribute("data-t1")) - float(
        svg.get_attribute("data-t0"))
    assert 0 < zoomed < 0.5 * span, (zoomed, span)
    assert int(svg.get_attribute("data-segments")) < sum(map(len, rounds))
    browser.find_element(By.ID, "oscars-zoom-out").click()
    renders = _wait_rendered(browser, "timeline", renders)

    # Charts: a line per worker where each worker has its own series.
    browser.find_element(By.CSS_SELECTOR, 'button[data-view="charts"]').click()
    renders = _wait_rendered(browser, "charts", renders)
    assert len(css(By.CSS_SELECTOR, "svg.oscars-chart")) == 2 * 6
    charts = {c.get_attribute("data-chart"): c
              for c in css(By.CSS_SELECTOR, 'svg.oscars-chart[data-job="."]')}
    assert sorted(charts) == sorted(["rate", "time_budget", "period",
                                     "divergence", "loss", "utilization"])
    lines = charts["rate"].find_elements(By.CSS_SELECTOR, "path.line")
    assert [int(p.get_attribute("data-points")) for p in lines] == [
        len(r) for r in rounds]
    util = charts["utilization"].find_elements(By.CSS_SELECTOR, "path.line")
    assert len(util) == 1 and int(util[0].get_attribute(
        "data-points")) == len(set().union(*rounds))
    _shoot(browser, "oscars_charts.png")

    browser.find_element(By.CSS_SELECTOR,
                         'button[data-view="workers"]').click()
    renders = _wait_rendered(browser, "workers", renders)
    texts = [r.text for r in css(By.CSS_SELECTOR, root + "tr.worker-row")]
    assert [t.split()[1] for t in texts] == ["0", "1", "2"], texts
    rates = [float(t.split()[2]) for t in texts]  # steps/s
    assert all(r > 0 for r in rates) and min(rates) == rates[2], texts
    # (SIMULATED 3x slower; flagged below half the median rate, which a
    # loaded machine may blur, so as the backend says.)
    _, job = _get(tensorboard_url + "/data/plugin/oscars/job?name=.")
    assert ["straggler" in t for t in texts] == [
        w["straggler"] for w in job["workers"]], texts
    _shoot(browser, "oscars_workers.png")

    browser.find_element(By.CSS_SELECTOR,
                         'button[data-view="compare"]').click()
    renders = _wait_rendered(browser, "compare", renders)
    rows = css(By.CSS_SELECTOR, "tr.job-row")
    assert [r.get_attribute("data-job") for r in rows] == [".", COPY]
    assert rows[0].text.split()[:2] == ["tb", "3"]
    assert rows[0].text.split()[1:] == rows[1].text.split()[1:]  # a copy
    _shoot(browser, "oscars_compare.png")
    # Unticking a job takes it out of every view.
    browser.find_element(By.CSS_SELECTOR,
                         f'#oscars-jobs input[value="{COPY}"]').click()
    renders = _wait_rendered(browser, "compare", renders)
    assert len(css(By.CSS_SELECTOR, "tr.job-row")) == 1
    assert dashboard_helpers.console_errors(browser) == []
  finally:
    browser.quit()


def test_a_binned_timeline_of_400_workers_in_the_browser():
  """400 workers x 10,000 rounds (synthetic, no TensorBoard: it would take
  minutes to load 40 million points): the binned timeline and the charts'
  bands render with the dashboard's own modules, quickly."""
  from selenium.webdriver.common.by import By  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.support.ui import WebDriverWait  # pylint: disable=g-import-not-at-top

  from oscars_tf.observability.dashboard import views  # pylint: disable=g-import-not-at-top
  job = dashboard_helpers.synthetic_job(400, 10_000)
  timeline = views.timeline(job, width=1200)
  url, server = dashboard_helpers.serve_views(
      timeline, views.charts(job, width=600))
  browser = dashboard_helpers.chrome(1400, 1300)
  try:
    browser.get(url)
    body = WebDriverWait(browser, 60).until(lambda b: b.find_element(
        By.CSS_SELECTOR, "body[data-render-ms]"))
    took = float(body.get_attribute("data-render-ms"))
    print(f"400 x 10,000 binned timeline and charts drawn in {took:.0f} ms")
    svg = browser.find_element(By.CSS_SELECTOR, "svg.oscars-timeline")
    assert svg.get_attribute("data-mode") == "binned"
    assert svg.get_attribute("data-workers") == "400"
    canvas = browser.find_element(By.CSS_SELECTOR, "canvas.binned")
    assert canvas.get_attribute("data-cells") == str(400 * 1200)
    assert len(browser.find_elements(By.CSS_SELECTOR, "g.event")) == len(
        timeline["events"])
    rate = browser.find_element(By.CSS_SELECTOR,
                                'svg.oscars-chart[data-chart="rate"]')
    assert len(rate.find_elements(By.CSS_SELECTOR, "path.line")) == 3  # band
    path = os.path.join(dashboard_helpers.artifacts_dir(),
                        "oscars_timeline_400x10000.png")
    browser.save_screenshot(path)
    print(f"screenshot: {path}")
    assert dashboard_helpers.console_errors(browser) == []
    assert took < 20000  # loose: a loaded 2-core machine
  finally:
    browser.quit()
    server.shutdown()
