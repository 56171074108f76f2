"""One training job on two and three EMULATED hosts, one launcher each.

Each "node" is a network namespace of its own with its own address on a
veth link to a bridge (tools/worker_netns.py: the machinery of
`oscars-launch --network=emulated`), one node's link shaped slower with
tc tbf. In each, `oscars-launch --nnodes N --node_rank i --rendezvous
...` runs as a user would run it on that machine (nsenter: the launcher
is the process the test signals), and starts its own workers of
examples/train.py. Needs root and iproute2, else skipped saying so; every
test ends by itself and leaves no process or namespace behind (the
fixture removes the namespaces; the launchers' workers die with them).
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

import faults
import multiworker
from oscars_tf.tools import worker_netns

SUBNET = "10.213.81"
RENDEZVOUS_PORT = 29400
# Node 2's link is slower; tbf on every node's link (the others fast).
RATES = ["1gbit", "1gbit", "100mbit"]
# A fault mid-training: drops within seconds, no collective hangs long.
FAULT_ARGS = ["--epochs=8", "--simulate_step_time=50ms",
              "--straggler_timeout=3", "--collective_timeout=30"]


@pytest.fixture
def nodes():
  with faults.network_namespaces(3, SUBNET, prefix="oscars_node") as spaces:
    problem = spaces.shape([worker_netns.tbf(r) for r in RATES],
                           download=True)
    if problem:
      pytest.skip(f"tc tbf unavailable here: {problem}")
    yield spaces


class _Job:
  """One launcher per node, in that node's namespace."""

  def __init__(self, spaces, tmp_path, workers, train_args, extra=()):
    self.tmp = tmp_path
    self.ckpt, self.result = tmp_path / "ckpt", tmp_path / "result.json"
    rendezvous = f"{spaces.address(0)}:{RENDEZVOUS_PORT}"
    self.procs = []
    for rank, k in enumerate(workers):
      log = open(tmp_path / f"node{rank}.log", "w")
      self.procs.append(subprocess.Popen(
          ["nsenter", f"--net=/run/netns/{spaces.workers[rank]}",
           sys.executable, "-m", "oscars_tf.cli.launch",
           f"--nnodes={len(workers)}", f"--node_rank={rank}",
           f"--rendezvous={rendezvous}", f"--host={spaces.address(rank)}",
           "--network=host", f"--num_workers={k}", "--join_timeout=60",
           "--job_id=test", "--grace_seconds=5", *extra, "--",
           sys.executable, faults.TRAIN, "--dataset=digits",
           f"--checkpoint_dir={self.ckpt}", f"--result_json={self.result}",
           *train_args],
          stdout=log, stderr=subprocess.STDOUT,
          env=multiworker.worker_env({}), start_new_session=True))
      log.close()

  def reach_epoch(self, epoch):
    """Returns once the chief has saved epoch `epoch` (fails past 180 s)."""
    faults.wait_for(lambda: faults.epoch_of(self.ckpt) >= epoch, 180,
                    f"epoch {epoch}", None)

  def log(self, rank):
    return (self.tmp / f"node{rank}.log").read_text()

  def wait(self, timeout=240):
    """Every launcher's exit code; a launcher still running is killed and
    the test fails with the logs."""
    codes = []
    try:
      for rank, p in enumerate(self.procs):
        try:
          codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
          raise AssertionError(f"node {rank}'s launcher still running after "
                               f"{timeout} s:\n{self.logs()}") from None
    finally:
      for p in self.procs:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return codes

  def logs(self):
    return "\n".join(f"--- node {r}\n{self.log(r)[-3000:]}"
                     for r in range(len(self.procs)))


def _accuracies(text):
  """{worker: (test accuracy, loss)} from its closing line."""
  return {int(m[1]): (m[2], m[3]) for m in re.finditer(
      r"^\[(\d+)\] .*test accuracy ([\d.]+), loss ([\d.]+)", text, re.M)}


def test_three_hosts_of_different_sizes_train_one_model_grouped_by_host(
    nodes, tmp_path):
  job = _Job(nodes, tmp_path, [2, 1, 1],
             ["--epochs=6", "--simulate_step_time=20ms*1,1,2,2"])
  codes = job.wait()
  assert codes == [0, 0, 0], job.logs()
  out = json.loads(job.result.read_text())
  assert out["workers"] == 4 and out["final_members"] == [0, 1, 2, 3]
  assert out["test_accuracy"] >= 0.9, out["test_accuracy"]
  # The plan groups by the workers' real hosts: node 0's two workers
  # together, nodes 1 and 2 on their own (rounds not global).
  groups = {tuple(map(tuple, g)) for g in out["round_groups"] if g}
  assert ((0, 1), (2,), (3,)) in groups, groups
  assert groups <= {((0, 1), (2,), (3,)), ((0, 1, 2, 3),)}, groups
  # Every worker ends with the same weights: the same closing numbers.
  finals = {}
  for rank in range(3):
    finals.update(_accuracies(job.log(rank)))
  assert sorted(finals) == [0, 1, 2, 3], job.logs()
  assert len(set(finals.values())) == 1, finals
  assert "node 2 of 3: worker 3 of 4 at 10.213.81.3." in job.log(2)


def test_a_node_whose_launcher_is_killed_leaves_and_the_job_goes_on(
    nodes, tmp_path):
  job = _Job(nodes, tmp_path, [2, 1], FAULT_ARGS)
  job.reach_epoch(2)
  job.procs[1].kill()  # SIGKILL: its worker dies with it
  codes = job.wait()
  log0 = job.log(0)
  assert codes[0] == 0, job.logs()
  assert "node 1's launcher is gone (its connection closed)" in log0
  out = json.loads(job.result.read_text())
  assert out["test_accuracy"] >= 0.9, out["test_accuracy"]
  if "a lost peer; restarting" in log0:
    # Killed inside an averaging: the job resumed on node 0 alone.
    assert out["workers"] == 2 and out["resumed_from"], out
  else:
    assert [e["dropped"] for e in out["membership"] if e["dropped"]] == [
        [2]], out["membership"]
    assert out["final_members"] == [0, 1]


def test_sigterm_to_a_node_launcher_stops_every_node(nodes, tmp_path):
  job = _Job(nodes, tmp_path, [1, 2], ["--epochs=40",
                                       "--simulate_step_time=50ms"])
  job.reach_epoch(1)
  job.procs[1].send_signal(signal.SIGTERM)
  codes = job.wait(timeout=60)
  assert codes == [143, 143], job.logs()
  assert "node 1's launcher got signal 15; stopped every node's workers." \
      in job.log(0)
  assert "got SIGTERM; forwarded it to this node's workers" in job.log(1)
  assert faults.epoch_of(job.ckpt) < 40


def test_a_worker_killed_on_another_node_is_dropped_or_restarted(
    nodes, tmp_path):
  job = _Job(nodes, tmp_path, [1, 2], FAULT_ARGS)
  job.reach_epoch(2)
  os.kill(_worker_pid(job, 2), signal.SIGKILL)
  codes = job.wait()
  assert codes == [0, 0], job.logs()
  out = json.loads(job.result.read_text())
  assert out["test_accuracy"] >= 0.9, out["test_accuracy"]
  if "a lost peer; restarting" in job.log(0):
    # Killed inside an averaging: every node restarted, worker 2 too.
    assert "(attempt 1, a lost-peer restart)" in job.log(1)
    assert out["final_members"] == [0, 1, 2] and out["resumed_from"], out
  else:
    assert [e["dropped"] for e in out["membership"] if e["dropped"]] == [
        [2]], out["membership"]
    assert "worker 2 was killed by SIGKILL; the others go on" in job.log(1)


def _worker_pid(job, index):
  """The pid of global worker `index` (its TF_CONFIG says so)."""
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = f.read()
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read()
    except OSError:
      continue
    if (b"train.py" in cmd and str(job.ckpt).encode() in cmd and
        f'"index": {index}}}'.encode() in env):
      return int(pid)
  raise AssertionError(f"worker {index} not found:\n{job.logs()}")
