"""Summaries and timeline after a real 3-worker run, read back with
TensorBoard's own event reading API."""

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator

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


@pytest.fixture(scope="module")
def logged_run():
  result = multiworker.run("fit", 3, {"adaptive": {}, "epochs": 2,
                                      "tensorboard": True,
                                      "simulate": "10ms*1,1,3"})
  return result, os.path.join(result.outdir, "tb")


def test_every_worker_writes_its_round_scalars(logged_run):
  _, logdir = logged_run
  for w in range(3):
    acc = _scalars(os.path.join(logdir, f"worker_{w}"))
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["tensors"])
    for name in ("rate", "local_steps", "wait_s", "comm_s", "compute_s",
                 "divergence", "bytes_sent", "time_budget"):
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


def test_timelines_merge_into_one_trace(logged_run):
  _, logdir = logged_run
  proc = subprocess.run([sys.executable, "-m", "oscars_tf.observability.summaries",
                         "merge", logdir], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr
  events = json.load(open(os.path.join(logdir, "timeline.json")))
  spans = [e for e in events["traceEvents"] if e["ph"] == "X"]
  assert {e["tid"] for e in spans} == {0, 1, 2}
  assert {e["name"] for e in spans} == {"compute", "wait", "communicate"}
  assert all(e["dur"] >= 0 for e in spans)


# -- the `oscars` TensorBoard dashboard, served by stock TensorBoard --------

OUTPUT_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                          "test-output")


@pytest.fixture(scope="module")
def tensorboard_url(logged_run):
  import socket  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  _, logdir = logged_run
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
          raise RuntimeError("tensorboard did not start")
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


def test_plugin_is_listed_and_serves_the_job(tensorboard_url):
  status, listing = _get(tensorboard_url + "/data/plugins_listing")
  assert status == 200 and listing["oscars"]["enabled"]
  status, jobs = _get(tensorboard_url + "/data/plugin/oscars/jobs")
  assert status == 200 and jobs["jobs"] == ["."]
  status, job = _get(tensorboard_url + "/data/plugin/oscars/job?name=.")
  assert status == 200
  assert [w["worker"] for w in job["workers"]] == [0, 1, 2]
  assert all(w["rate"] > 0 and w["wait_s"] >= 0 for w in job["workers"])
  assert [t["worker"] for t in job["table"]] == [0, 1, 2]


@pytest.mark.parametrize("name, code", [("../etc", 400), ("/etc", 400),
                                        ("a/../../b", 400), ("", 400),
                                        ("no_such_job", 404)])
def test_plugin_rejects_bad_job_names(tensorboard_url, name, code):
  import urllib.parse  # pylint: disable=g-import-not-at-top
  status, body = _get(tensorboard_url + "/data/plugin/oscars/job?name=" +
                      urllib.parse.quote(name))
  assert status == code and "error" in body


def test_dashboard_in_a_real_browser(tensorboard_url):
  chromium, driver = "/usr/bin/chromium", "/usr/bin/chromedriver"
  if not (os.path.exists(chromium) and os.path.exists(driver)):
    pytest.skip("Chromium is not installed (apt-get install chromium "
                "chromium-driver; .ci/run does)")
  webdriver = pytest.importorskip("selenium.webdriver")
  from selenium.webdriver.chrome.service import Service  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.common.by import By  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.support.ui import WebDriverWait  # pylint: disable=g-import-not-at-top
  options = webdriver.ChromeOptions()
  options.binary_location = chromium
  for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
               "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--disable-dev-shm-usage",
               "--window-size=1400,1000"):
    options.add_argument(flag)
  browser = webdriver.Chrome(service=Service(driver), options=options)
  try:
    browser.get(tensorboard_url + "/#oscars")
    frame = WebDriverWait(browser, 60).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "iframe"))[0]
    browser.switch_to.frame(frame)
    rows = WebDriverWait(browser, 60).until(
        lambda b: b.find_elements(By.CSS_SELECTOR,
                                  "#oscars-workers tr.worker-row"))
    texts = [r.text for r in rows]
    assert [t.split()[1] for t in texts] == ["0", "1", "2"], texts
    assert all(float(t.split()[2]) > 0 for t in texts), texts  # steps/s
    assert browser.find_elements(By.CSS_SELECTOR, "#oscars-heatmap td")
    assert "straggler" in texts[2]  # SIMULATED 3x slower worker
    browser.switch_to.default_content()
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    shot = os.path.join(OUTPUT_DIR, "oscars_dashboard.png")
    browser.save_screenshot(shot)
    assert os.path.getsize(shot) > 10000
  finally:
    browser.quit()
