"""oscars-launch --num_ps: ParameterServerStrategy's cluster of a chief,
workers and ps tasks, whose servers the launcher stops when the chief is
done. The tasks here are small Python programs (no TensorFlow)."""

import json
import os
import subprocess
import sys
import time

import job_log
from oscars_tf.cli import launch

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch", "--network=host"]
# Each task writes pid_<type><index> and (chief aside) serves until stopped:
# worker tasks write sig_<type><index> on SIGTERM and exit; ps tasks ignore
# SIGTERM, so only SIGKILL stops them. The chief waits for every task's pid
# file, then runs CHIEF. Every task ends itself after 60 s at the latest.
_TASK = r"""
import json, os, signal, sys, time
c = json.loads(os.environ['TF_CONFIG'])
kind, i = c['task']['type'], c['task']['index']
d = sys.argv[1]
def write(name, data):
  with open(os.path.join(d, name + '.tmp'), 'w') as f:
    json.dump(data, f)
  os.replace(os.path.join(d, name + '.tmp'), os.path.join(d, name))
def on_term(signum, frame):
  write(f'sig_{kind}{i}', signum)
  os._exit(128 + signum)
signal.signal(signal.SIGTERM, signal.SIG_IGN if kind == 'ps' else on_term)
write(f'pid_{kind}{i}', {'pid': os.getpid(), 'x': os.environ.get('X')})
print('up', kind, i, len(c['cluster']['worker']), len(c['cluster']['ps']),
      flush=True)
end = time.monotonic() + 60
if kind == 'chief':
  names = [f'pid_worker{w}' for w in range(len(c['cluster']['worker']))]
  names += [f'pid_ps{p}' for p in range(len(c['cluster']['ps']))]
  while time.monotonic() < end and not all(
      os.path.exists(os.path.join(d, n)) for n in names):
    time.sleep(0.05)
  exec(os.environ['CHIEF'])
  sys.exit(0)
if kind == 'worker' and i == int(os.environ.get('DIE', -1)):
  os.kill(os.getpid(), signal.SIGKILL)
while time.monotonic() < end:
  time.sleep(0.1)
"""


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except OSError:
    return False


def _pids(outdir):
  return {name[len("pid_"):]: json.loads((outdir / name).read_text())["pid"]
          for name in os.listdir(outdir) if name.startswith("pid_")}


def _launch(tmp_path, chief="print('chief done')", workers=2, ps=1,
            grace=1.0, env=None):
  environ = dict(os.environ, CHIEF=chief, **(env or {}))
  start = time.monotonic()
  proc = subprocess.run(
      LAUNCH + [f"--num_workers={workers}", f"--num_ps={ps}",
                f"--grace_seconds={grace}", "--", sys.executable, "-c", _TASK,
                str(tmp_path)],
      capture_output=True, text=True, timeout=90, env=environ, check=False)
  return proc, time.monotonic() - start


def test_the_ps_cluster_has_a_chief_workers_and_ps_tasks():
  configs = [json.loads(c) for c in launch.tf_configs(3, num_ps=2)]
  cluster = configs[0]["cluster"]
  assert sorted(cluster) == ["chief", "ps", "worker"]
  assert [len(cluster[k]) for k in ("chief", "worker", "ps")] == [1, 3, 2]
  addresses = sum(cluster.values(), [])
  assert len(set(addresses)) == 6
  assert all(a.startswith("127.0.0.1:") for a in addresses)
  assert [(c["task"]["type"], c["task"]["index"]) for c in configs] == [
      ("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2), ("ps", 0),
      ("ps", 1)]
  assert all(c["cluster"] == cluster for c in configs)
  # Without ps tasks, the cluster stays workers only, worker 0 the chief.
  plain = [json.loads(c) for c in launch.tf_configs(2)]
  assert list(plain[0]["cluster"]) == ["worker"]
  assert [c["task"] for c in plain] == [{"type": "worker", "index": 0},
                                        {"type": "worker", "index": 1}]


def test_the_chief_exiting_0_ends_the_job_and_stops_every_server(tmp_path):
  proc, took = _launch(tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert ("the chief finished; stopped the 2 worker and 1 ps servers"
          in proc.stderr)
  for prefix in ("[chief] up chief 0 2 1", "[0] up worker 0 2 1",
                 "[1] up worker 1 2 1", "[ps0] up ps 0 2 1",
                 "[chief] chief done"):
    assert prefix in proc.stdout, proc.stdout
  pids = _pids(tmp_path)
  assert sorted(pids) == ["chief0", "ps0", "worker0", "worker1"]
  # No orphan: every task is gone once the launcher has returned.
  assert not [k for k, pid in pids.items() if _alive(pid)]
  # The workers got SIGTERM; the ps ignored it and got SIGKILL after the
  # grace period, not before and not much later.
  for w in (0, 1):
    assert json.loads((tmp_path / f"sig_worker{w}").read_text()) == 15
  assert not (tmp_path / "sig_ps0").exists()
  assert took < 30, took


def test_a_failing_chief_fails_the_job_and_stops_the_servers(tmp_path):
  proc, _ = _launch(tmp_path, chief="sys.exit(3)")
  assert proc.returncode == 1
  assert "chief exited with code 3; stopped the other" in proc.stderr
  pids = _pids(tmp_path)
  assert len(pids) == 4 and not [p for p in pids.values() if _alive(p)]


def test_a_killed_worker_task_is_lost_and_a_killed_ps_fails_the_job(
    tmp_path):
  # Worker 1 dies; the chief (waiting for it to be gone) finishes.
  (tmp_path / "worker").mkdir()
  proc, _ = _launch(
      tmp_path / "worker", env={"DIE": "1"},
      chief=("import pathlib; p = json.loads(pathlib.Path(d, "
             "'pid_worker1').read_text())['pid']\n"
             "while os.path.exists(f'/proc/{p}') and open(f'/proc/{p}/stat')"
             ".read().split(')')[-1].split()[0] != 'Z': time.sleep(0.05)\n"
             "time.sleep(0.5)"))
  assert proc.returncode == 0, proc.stderr
  assert "worker 1 was killed by SIGKILL; the others go on" in proc.stderr
  assert "finished without worker(s) [1]" in proc.stderr
  # The ps holds the variables: losing it is no lost worker.
  (tmp_path / "ps").mkdir()
  proc, _ = _launch(
      tmp_path / "ps",
      chief=("import signal; os.kill(json.loads(open(os.path.join(d, "
             "'pid_ps0')).read())['pid'], signal.SIGKILL); time.sleep(30)"))
  assert proc.returncode == 1
  assert "ps 0 was killed by SIGKILL; stopped the other" in proc.stderr


def test_per_worker_settings_go_to_the_worker_tasks_by_index(tmp_path):
  log = job_log.JobLog()
  job = launch.Job([sys.executable, "-c", _TASK, str(tmp_path)], 2,
                   env=dict(os.environ, CHIEF="pass"), out=log,
                   worker_env={1: {"X": "one"}, 0: {"X": "zero"}}, num_ps=2)
  assert [job.name(i) for i in range(5)] == [
      "chief", "worker 0", "worker 1", "ps 0", "ps 1"]
  try:
    codes, failed = job.wait(timeout=60, grace=1)
  finally:
    job.stop(grace=1)
  assert failed is None and codes[0] == 0, log.text()
  assert sorted(job.killed) == [3, 4]  # the ps tasks ignored SIGTERM
  seen = {name[len("pid_"):]: json.loads((tmp_path / name).read_text())["x"]
          for name in os.listdir(tmp_path) if name.startswith("pid_")}
  assert seen == {"chief0": None, "worker0": "zero", "worker1": "one",
                  "ps0": None, "ps1": None}
