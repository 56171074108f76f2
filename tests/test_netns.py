"""Workers on separate network namespaces: real addresses, shaped links.

Each worker runs in its own network namespace (`ip netns`) with its own
address on a veth pair to a bridge in a hub namespace; the test creates and
removes all of them (it needs root, or is skipped saying so). The links are
delayed with `tc netem` where the kernel has it, else rate-limited with
`tbf` (this project's CI kernel has no sch_netem; the test says which it
used). Training must converge over them, and a link cut mid-training must
be handled like a death: the chief drops the cut-off worker and the others
finish.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import faults
import multiworker

SUBNET = "10.213.77"
PORT = 23456
STRAGGLER_S = 3


# Each worker's link: delayed (netem) or rate-limited (tbf).
QDISCS = {"netem": ["netem", "delay", "5ms", "1ms"],
          "tbf": ["tbf", "rate", "200mbit", "burst", "256kb", "latency",
                  "50ms"]}


@pytest.fixture
def namespaces():
  with faults.network_namespaces(3, SUBNET) as spaces:
    yield spaces


def _start(spaces, tmp_path, args):
  cluster = {"worker": [f"{spaces.address(i)}:{PORT}"
                        for i in range(len(spaces.workers))]}
  procs = []
  for i, ns in enumerate(spaces.workers):
    env = multiworker.worker_env({"TF_CONFIG": json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}})})
    log = open(tmp_path / f"worker_{i}.log", "w")
    procs.append(subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, faults.TRAIN, *args],
        env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True))
  return procs


def _stop(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _wait(proc, timeout, tmp_path, i):
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    raise AssertionError(
        f"worker {i} still running after {timeout} s:\n" +
        (tmp_path / f"worker_{i}.log").read_text()[-3000:]) from None


@pytest.mark.parametrize("shaping", ["netem", "tbf"])
def test_training_over_shaped_links_survives_a_cut_link(namespaces, tmp_path,
                                                        shaping):
  problem = namespaces.shape(QDISCS[shaping])
  if problem:
    pytest.skip(f"tc qdisc {shaping} unavailable on this kernel: {problem}")
  ckpt, result = tmp_path / "ckpt", tmp_path / "result.json"
  procs = _start(namespaces, tmp_path, [
      "--dataset=digits", "--epochs=14", "--simulate_step_time=100ms",
      f"--straggler_timeout={STRAGGLER_S}", "--collective_timeout=60",
      f"--checkpoint_dir={ckpt}", f"--result_json={result}"])
  try:
    faults.wait_for(lambda: faults.epoch_of(ckpt) >= 3, 150, "epoch 3")
    cut_at = time.time()
    namespaces.cut(2)
    codes = [_wait(procs[i], 150, tmp_path, i) for i in (0, 1)]
  finally:
    _stop(procs)
  logs = [(tmp_path / f"worker_{i}.log").read_text() for i in range(3)]
  assert codes == [0, 0], logs[0][-3000:]
  out = json.loads(result.read_text())
  drop = next(e for e in out["membership"] if e["dropped"])
  assert drop["dropped"] == [2], out["membership"]
  assert out["final_members"] == [0, 1]
  assert [c["epoch"] for c in out["curve"]][-1] == 14
  assert out["test_accuracy"] >= 0.93, out["test_accuracy"]
  print(f"\n{shaping} ({namespaces.shaping}): link of worker 2 cut; dropped "
        f"at round {drop['round']}, "
        f"{drop['arrived_at'] + drop['wait_s'] - cut_at:.1f} s after the cut;"
        f" test accuracy {out['test_accuracy']:.4f} on workers 0 and 1")
