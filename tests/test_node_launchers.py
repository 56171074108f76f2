"""One job across several launchers (`oscars-launch --nnodes`), on
loopback: a failure, a lost peer, a signal or a launcher's death on any
node is handled for the whole job (cli/node_attempts.py,
tools/node_channel.py). The workers are tests/node_worker.py, not
TensorFlow: these tests are about the launchers; test_multi_node.py
trains across emulated hosts.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

import faults

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]


def _free_port():
  from oscars_tf.tools.job_layout import free_ports  # noqa: PLC0415
  return free_ports(1, "127.0.0.1")[0]


class _Nodes:
  """Launchers of one job, node 0 first; each node's workers given."""

  def __init__(self, tmp_path, workers, plan, extra=(), per_node=None,
               commands=None):
    port, self.dir = _free_port(), tmp_path
    command = [sys.executable, os.path.join(HERE, "node_worker.py"),
               str(tmp_path), json.dumps(plan)]
    env = dict(os.environ)
    env.pop("SLURM_JOB_ID", None)
    self.procs = [subprocess.Popen(
        LAUNCH + [f"--nnodes={len(workers)}", f"--node_rank={rank}",
                  f"--rendezvous=127.0.0.1:{port}", f"--num_workers={k}",
                  "--network=host", "--join_timeout=30", "--grace_seconds=5",
                  *(extra if rank == 0 else ()),
                  *(per_node or {}).get(rank, ()), "--",
                  *(commands or {}).get(rank, command)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank, k in enumerate(workers)]

  def started(self, names):
    faults.wait_for(lambda: all((self.dir / f"{n}.pid").exists()
                                for n in names), 60, f"{names} started",
                    self.procs[0])

  def pid(self, name):
    return int((self.dir / f"{name}.pid").read_text())

  def finish(self, timeout=60):
    """(exit codes, stderr texts) of every launcher."""
    outs = []
    try:
      for p in self.procs:
        outs.append(p.communicate(timeout=timeout)[1])
    finally:
      for p in self.procs:
        p.kill()
        p.wait()
    return [p.returncode for p in self.procs], outs

  def done(self):
    return sorted(f.name[:-5] for f in self.dir.glob("*.done"))


def _alive(pid):
  """Whether `pid` runs (a zombie, killed and not yet reaped by init,
  does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _all_gone(pids):
  # Killed workers end within moments; init reaps the orphans.
  faults.wait_for(lambda: not any(_alive(p) for p in pids), 20,
                  f"workers {pids} gone")


def test_a_failure_on_node_1_restarts_every_node_together(tmp_path):
  nodes = _Nodes(tmp_path, [2, 1], {"0.2": "fail", "0.0": "hang",
                                    "0.1": "hang"}, ["--restarts=1"])
  codes, errs = nodes.finish()
  assert codes == [0, 0], errs
  assert nodes.done() == ["1.0", "1.1", "1.2"]  # attempt 1, every worker
  why = ("node 1: worker 2 exited with code 3; restarting every node's "
         "workers")
  assert why in errs[0] and why in errs[1], errs
  assert "(attempt 1, a restart)" in errs[1]
  assert "all 1 workers of node 1 finished" in errs[1]


def test_without_restarts_a_failure_on_node_1_ends_every_node_with_1(
    tmp_path):
  nodes = _Nodes(tmp_path, [1, 1], {"0.1": "fail", "0.0": "hang"})
  codes, errs = nodes.finish()
  assert codes == [1, 1], errs
  assert ("node 1: worker 1 exited with code 3; stopped every node's "
          "workers.") in errs[0]
  assert not nodes.done()


def test_a_death_on_node_1_with_75_on_node_0_is_a_lost_peer_restart(
    tmp_path):
  # Worker 2 (node 1) dies inside a collective with the chief (node 0),
  # which exits 75: only node 0 sees the 75, only node 1 the death.
  nodes = _Nodes(tmp_path, [2, 1], {"0.2": "die", "0.0": "lost_peer",
                                    "0.1": "hang"})
  codes, errs = nodes.finish()
  assert codes == [0, 0], errs
  assert "a lost peer; restarting every node's workers from the newest" in (
      errs[0])
  assert "(attempt 1, a lost-peer restart)" in errs[1]
  assert nodes.done() == ["1.0", "1.1", "1.2"]


def test_sigterm_to_node_1s_launcher_stops_the_whole_job(tmp_path):
  nodes = _Nodes(tmp_path, [1, 2], {f"0.{i}": "hang" for i in range(3)})
  nodes.started(["0.0", "0.1", "0.2"])
  pids = [nodes.pid(f"0.{i}") for i in range(3)]
  nodes.procs[1].send_signal(signal.SIGTERM)
  codes, errs = nodes.finish()
  assert codes == [143, 143], errs
  assert "got SIGTERM; forwarded it to this node's workers and stopped " \
         "them; told node 0" in errs[1]
  assert "node 1's launcher got signal 15; stopped every node's workers." \
      in errs[0]
  _all_gone(pids)


def test_node_1s_launcher_killed_takes_its_workers_and_node_0_goes_on(
    tmp_path):
  nodes = _Nodes(tmp_path, [1, 1], {"0.1": "hang", "wait_go": True})
  nodes.started(["0.0", "0.1"])
  victim = nodes.pid("0.1")
  nodes.procs[1].kill()
  _all_gone([victim])
  (tmp_path / "go").touch()
  codes, errs = nodes.finish()
  assert codes[0] == 0, errs
  assert "node 1's launcher is gone (its connection closed)" in errs[0]
  assert "of every node but node(s) [1] (launcher gone) finished" in errs[0]
  assert nodes.done() == ["0.0"]


def test_node_0s_launcher_killed_stops_the_other_nodes_workers(tmp_path):
  nodes = _Nodes(tmp_path, [1, 2], {f"0.{i}": "hang" for i in range(3)})
  nodes.started(["0.0", "0.1", "0.2"])
  pids = [nodes.pid(f"0.{i}") for i in range(3)]
  nodes.procs[0].kill()
  codes, errs = nodes.finish()
  assert codes[1] == 1, errs
  assert ("node 0's launcher is gone (the chief with it); stopped this "
          "node's workers.") in errs[1]
  _all_gone(pids)


def test_a_node_whose_command_cannot_start_fails_the_job(tmp_path):
  """Node 1 lacks the command (a virtual environment missing on that
  machine): the job fails on every node, naming why. Before, node 1's
  launcher closed its connection, node 0 read a lost node and went on
  without it, and the job could end with 0."""
  nodes = _Nodes(tmp_path, [1, 1], {"0.0": "hang"},
                 commands={1: [str(tmp_path / "missing" / "python")]})
  codes, errs = nodes.finish()
  assert codes == [1, 1], errs
  why = (f"node 1: cannot start worker 1's command "
         f"'{tmp_path / 'missing' / 'python'}': No such file or directory; "
         "stopped every node's workers.")
  assert why in errs[0] and why in errs[1], errs
  assert "launcher is gone" not in errs[0], errs[0]


def test_a_node_that_never_starts_is_named_by_node_0(tmp_path):
  del tmp_path
  port = _free_port()
  proc = subprocess.Popen(
      LAUNCH + ["--nnodes=3", "--node_rank=0",
                f"--rendezvous=127.0.0.1:{port}", "--num_workers=1",
                "--network=host", "--join_timeout=1", "--", sys.executable,
                "-c", "pass"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    _, err = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 1, err
  assert err.strip().endswith(
      "oscars-launch: error: rendezvous: node(s) [1, 2] of 3 did not join "
      "within 1 s (joined: [0])"), err


def test_emulation_flags_work_per_node(tmp_path):
  # --cpu_limit lists this node's workers (cgroups are per machine);
  # --simulate_step_time is the job's, by global index.
  spec = "20ms*1,1,2"
  nodes = _Nodes(tmp_path, [1, 2], {}, per_node={
      0: [f"--simulate_step_time={spec}"],
      1: ["--cpu_limit=0.5,0.25", f"--simulate_step_time={spec}"]})
  codes, errs = nodes.finish()
  if codes[1] == 1 and "--cpu_limit:" in errs[1]:
    pytest.skip(f"no CPU quotas here: {errs[1].strip()[-200:]}")
  assert codes == [0, 0], errs
  env = {i: json.loads((tmp_path / f"0.{i}.env").read_text())
         for i in range(3)}
  assert [env[i].get("OSCARS_CPU_LIMIT") for i in range(3)] == [
      None, "0.5", "0.25"], env
  assert all(env[i]["OSCARS_SIMULATE_STEP_TIME"] == spec for i in range(3))
