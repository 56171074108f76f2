"""Tests for the multi-node rendezvous (tools/rendezvous.py) and
`oscars-launch --nnodes` (cli/multi_node.py): the nodes meet over loopback,
in threads and as real launchers. No TensorFlow: the workers are tiny
Python programs that write their TF_CONFIG."""

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags
import pytest

from oscars_tf.cli import launch
from oscars_tf.cli import multi_node
from oscars_tf.tools import job_layout
from oscars_tf.tools import rendezvous
from oscars_tf.tools import worker_processes

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]
# Writes the worker's TF_CONFIG to DIR/<task index>.json.
WRITE_CONFIG = ("import json, os, sys; c = os.environ['TF_CONFIG']; "
                "i = json.loads(c)['task']['index']; "
                "open(os.path.join(sys.argv[1], f'{i}.json'), 'w').write(c)")


def _hello(rank, k, nnodes=3, job="job", host=None, first_port=20000):
  ports = range(first_port + 10 * rank, first_port + 10 * rank + k)
  return rendezvous.hello(job, nnodes, rank, k, ports, host)


def test_the_cluster_numbers_workers_node_by_node_chief_on_node_0():
  hellos = [_hello(2, 3, host="10.0.0.3"), _hello(0, 2, host="10.0.0.1"),
            _hello(1, 1, host="10.0.0.2")]
  cluster = rendezvous.build_cluster(hellos)
  assert cluster["workers"] == [
      "10.0.0.1:20000", "10.0.0.1:20001", "10.0.0.2:20010",
      "10.0.0.3:20020", "10.0.0.3:20021", "10.0.0.3:20022"]
  assert [(n["node_rank"], n["host"], n["first_worker"], n["num_workers"])
          for n in cluster["nodes"]] == [(0, "10.0.0.1", 0, 2),
                                         (1, "10.0.0.2", 2, 1),
                                         (2, "10.0.0.3", 3, 3)]
  for rank, indices in ((0, [0, 1]), (1, [2]), (2, [3, 4, 5])):
    first, configs = rendezvous.node_configs(cluster, rank)
    configs = [json.loads(c) for c in configs]
    assert first == indices[0]
    assert [c["task"] for c in configs] == [
        {"type": "worker", "index": i} for i in indices]
    assert all(c["cluster"] == {"worker": cluster["workers"]}
               for c in configs)
  assert "workers 0-1 of 6 at 10.0.0.1 (worker 0 is the chief)" in (
      rendezvous.describe(cluster, 0))
  assert "node 1 of 3: worker 2 of 6" in rendezvous.describe(cluster, 1)


def test_the_cluster_refuses_two_workers_on_one_address_and_no_node_0():
  with pytest.raises(ValueError, match="two workers at 10.0.0.1:20000"):
    rendezvous.build_cluster([_hello(0, 1, host="10.0.0.1"),
                              _hello(1, 1, host="10.0.0.1", first_port=19990)])
  with pytest.raises(ValueError, match=r"have ranks \[1, 2\]"):
    rendezvous.build_cluster([_hello(1, 1, host="a"), _hello(2, 1, host="b")])
  with pytest.raises(ValueError, match=r"have ranks \[0, 1, 1\]"):
    rendezvous.build_cluster([_hello(0, 1, host="a"), _hello(1, 1, host="b"),
                              _hello(1, 1, host="c")])


def test_a_restart_without_a_gone_node_renumbers_the_workers():
  # Node 1's launcher is gone: the next attempt is nodes 0 and 2.
  cluster = rendezvous.build_cluster([_hello(0, 2, host="a"),
                                      _hello(2, 1, host="c")])
  assert cluster["workers"] == ["a:20000", "a:20001", "c:20020"]
  first, configs = rendezvous.node_configs(cluster, 2)
  assert first == 2 and len(configs) == 1
  assert json.loads(configs[0])["task"] == {"type": "worker", "index": 2}


@pytest.mark.parametrize("change, reason", [
    ({"nnodes": 4}, "node 1 has --nnodes=4, node 0 has --nnodes=3"),
    ({"job_id": "other"}, "node 1 has job id 'other', node 0 has 'job'"),
    ({"node_rank": 3}, "--node_rank=3 is not in 1..2"),
    ({"node_rank": 0}, "--node_rank=0 is not in 1..2"),
    ({"oscars_rendezvous": 0}, "rendezvous protocol 0, node 0 speaks 1"),
    ({"ports": [1]}, "one port per worker"),
])
def test_node_0_refuses_a_hello_that_does_not_fit(change, reason):
  own = _hello(0, 2, host="10.0.0.1")
  assert rendezvous.check_hello(_hello(1, 2), own, {0}) is None
  assert reason in rendezvous.check_hello(dict(_hello(1, 2), **change), own,
                                          {0})
  assert "node 1 has already joined" in rendezvous.check_hello(
      _hello(1, 2), own, {0, 1})


class _Node(threading.Thread):
  """A node's join() in a thread: its cluster or its error, in `result`."""

  def __init__(self, port, message, timeout=10.0):
    super().__init__(daemon=True)
    self.args = (("127.0.0.1", port), message, timeout)
    self.result = None

  def run(self):
    try:
      self.result = rendezvous.join(*self.args)
    except rendezvous.RendezvousError as e:
      self.result = e


def _free_port():
  return job_layout.free_ports(1)[0]


def test_three_nodes_meet_and_get_one_cluster():
  # Node 2 starts before node 0 listens: it retries until node 0 answers.
  port = _free_port()
  early = _Node(port, _hello(2, 3))
  early.start()
  time.sleep(0.6)
  listener = rendezvous.listen("127.0.0.1", port)
  late = _Node(port, _hello(1, 1, host="127.0.0.3"))
  late.start()
  cluster = rendezvous.serve(listener, _hello(0, 2, host="127.0.0.1"),
                             timeout=10)
  for node in (early, late):
    node.join(timeout=10)
    assert node.result == cluster
  assert cluster["workers"] == [
      "127.0.0.1:20000", "127.0.0.1:20001", "127.0.0.3:20010",
      "127.0.0.1:20020", "127.0.0.1:20021", "127.0.0.1:20022"]
  # Node 2 gave no host: it is the address its connection came from.
  assert [n["host"] for n in cluster["nodes"]] == [
      "127.0.0.1", "127.0.0.3", "127.0.0.1"]
  with pytest.raises(OSError):  # node 0 no longer listens
    socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_node_that_left_before_the_others_joined_may_join_again():
  """Node 1 joined, then its launcher stopped (Ctrl-C, or its own
  --join_timeout ran out while node 2 was late). Its rerun is let in, and
  the cluster goes to live nodes only. Before, the rerun was refused as
  already joined, and the cluster sent into the closed connection."""
  listener = rendezvous.listen("127.0.0.1", 0)
  port = listener.getsockname()[1]
  said, left = [], threading.Event()

  def say(line):
    said.append(line)
    if "node 1 left" in line:
      left.set()
  served = {}
  server = threading.Thread(target=lambda: served.update(
      cluster=rendezvous.serve(listener, _hello(0, 1, nnodes=3), 20,
                               say=say)), daemon=True)
  server.start()
  with socket.create_connection(("127.0.0.1", port), timeout=5) as gone:
    gone.sendall(json.dumps(_hello(1, 1)).encode() + b"\n")
  assert left.wait(10), said
  nodes = [_Node(port, _hello(1, 1)), _Node(port, _hello(2, 1))]
  for node in nodes:
    node.start()
  server.join(15)
  for node in nodes:
    node.join(10)
    assert node.result == served["cluster"], node.result
  assert len(served["cluster"]["workers"]) == 3


def test_kept_connections_find_a_dead_peer_by_keepalive():
  """The connections kept for the whole job (node 0's Hub, each node's
  Link) probe an idle peer: a machine that died without closing them is
  found in about a minute and a half, not the kernel's two hours."""
  listener = rendezvous.listen("127.0.0.1", 0)
  port = listener.getsockname()[1]
  served = {}
  server = threading.Thread(target=lambda: served.update(
      out=rendezvous.serve(listener, _hello(0, 1, nnodes=2), 10, keep=True)),
      daemon=True)
  server.start()
  cluster, conn = rendezvous.join(("127.0.0.1", port),
                                  _hello(1, 1, nnodes=2), 10, keep=True)
  server.join(10)
  (hub_conn,) = served["out"][1].values()
  try:
    assert served["out"][0] == cluster
    for c in (conn, hub_conn):
      assert c.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
      if hasattr(socket, "TCP_KEEPIDLE"):
        probes = [c.getsockopt(socket.IPPROTO_TCP, getattr(socket, n))
                  for n in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")]
        assert probes[0] + probes[1] * probes[2] == rendezvous.KEEPALIVE_S
  finally:
    conn.close()
    hub_conn.close()


def test_a_node_of_another_job_or_size_is_refused_with_one_line():
  listener = rendezvous.listen("127.0.0.1", 0)
  port = listener.getsockname()[1]
  said = []
  server = threading.Thread(target=lambda: said.append(rendezvous.serve(
      listener, _hello(0, 1, nnodes=2, host="127.0.0.1"), timeout=10,
      say=said.append)), daemon=True)
  server.start()
  for change, reason in (
      ({"nnodes": 3}, "node 1 has --nnodes=3, node 0 has --nnodes=2"),
      ({"job_id": "x"}, "node 1 has job id 'x', node 0 has 'job' "
                        "(--job_id)")):
    stray = _Node(port, dict(_hello(1, 1, nnodes=2), **change))
    stray.run()
    assert isinstance(stray.result, rendezvous.RendezvousError)
    assert str(stray.result) == (f"node 0 at 127.0.0.1:{port} refused this "
                                 f"node: {reason}")
    assert "\n" not in str(stray.result)
  # Node 0 said so, and still waits for the right node 1.
  right = _Node(port, _hello(1, 1, nnodes=2))
  right.run()
  server.join(timeout=10)
  assert said[:2] == [
      "refused a node from 127.0.0.1: node 1 has --nnodes=3, node 0 has "
      "--nnodes=2",
      "refused a node from 127.0.0.1: node 1 has job id 'x', node 0 has "
      "'job' (--job_id)"]
  assert said[2] == right.result and len(right.result["workers"]) == 2


def test_a_node_that_never_comes_up_is_named_within_the_timeout():
  listener = rendezvous.listen("127.0.0.1", 0)
  node1 = _Node(listener.getsockname()[1], _hello(1, 1, nnodes=4))
  node1.start()
  start = time.monotonic()
  with pytest.raises(rendezvous.RendezvousError) as e:
    rendezvous.serve(listener, _hello(0, 1, nnodes=4, host="127.0.0.1"),
                     timeout=1.5)
  assert 1.5 <= time.monotonic() - start < 8
  assert str(e.value) == ("node(s) [2, 3] of 4 did not join within 1.5 s "
                          "(joined: [0, 1])")
  node1.join(timeout=5)  # the node that joined hears the end
  assert "closed without a reply" in str(node1.result)


def test_a_node_whose_node_0_never_answers_gives_up_in_time():
  port = _free_port()  # nothing listens there
  start = time.monotonic()
  with pytest.raises(rendezvous.RendezvousError) as e:
    rendezvous.join(("127.0.0.1", port), _hello(1, 1), timeout=1.0)
  assert 1.0 <= time.monotonic() - start < 8
  assert str(e.value) == (f"node 0 did not answer at 127.0.0.1:{port} "
                          "within 1 s (last try: Connection refused)")
  # Something listens but never replies: the same bound.
  with rendezvous.listen("127.0.0.1", 0) as mute:
    start = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError,
                       match=r"took the hello but sent no cluster within "
                       r"1 s \(are all --nnodes=3 nodes started\?\)"):
      rendezvous.join(mute.getsockname(), _hello(1, 1), timeout=1.0)
    assert time.monotonic() - start < 8


def test_a_signal_stops_either_side_at_once():
  listener = rendezvous.listen("127.0.0.1", 0)
  start = time.monotonic()
  with pytest.raises(rendezvous.Stopped):
    rendezvous.serve(listener, _hello(0, 1, host="127.0.0.1"), timeout=30,
                     stop=lambda: time.monotonic() - start > 0.3)
  with pytest.raises(rendezvous.Stopped):
    rendezvous.join(("127.0.0.1", _free_port()), _hello(1, 1), timeout=30,
                    stop=lambda: time.monotonic() - start > 0.6)
  assert time.monotonic() - start < 6


def _flags(*args):
  fv = flags.FlagValues()
  launch.define_flags(fv)
  fv(["oscars-launch", *args])
  return fv


@pytest.mark.parametrize("args, error", [
    (["--nnodes=2"], "--nnodes=2: needs --rendezvous HOST:PORT"),
    (["--node_rank=1"], "--node_rank: needs --nnodes > 1"),
    # On one node these would do nothing (a worker's flags go after --).
    (["--join_timeout=5"], "--join_timeout: needs --nnodes > 1"),
    (["--job_id=x"], "--job_id: needs --nnodes > 1"),
    (["--nnodes=2", "--node_rank=2", "--rendezvous=127.0.0.1:9"],
     "--node_rank=2: not in 0..1 (--nnodes=2)"),
    (["--nnodes=2", "--rendezvous=127.0.0.1"],
     "--rendezvous: '127.0.0.1' is not HOST:PORT"),
    (["--nnodes=2", "--rendezvous=0.0.0.0:9"], "not 0.0.0.0"),
    (["--nnodes=2", "--rendezvous=127.0.0.1:9", "--num_ps=1"],
     "--num_ps: ParameterServerStrategy clusters do not work across nodes"),
    (["--nnodes=2", "--rendezvous=127.0.0.1:9", "--coordinator"],
     "--coordinator: a coordinator task do"),
    (["--nnodes=2", "--rendezvous=127.0.0.1:9", "--bandwidth=1gbit"],
     "--bandwidth: EMULATED per-worker links"),
    (["--nnodes=2", "--rendezvous=127.0.0.1:9", "--network=isolated"],
     "--network=isolated: the other nodes must reach"),
])
def test_flags_that_cannot_work_are_one_line(args, error):
  with pytest.raises(app.UsageError) as e:
    multi_node.check_flags(_flags(*args))
  assert error in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("given, warned", [
    ("node0.example", True), ("127.0.0.1", False), ("localhost", False)])
def test_a_node_0_name_that_resolves_to_loopback_is_warned_of(
    monkeypatch, capsys, given, warned):
  """Debian-style hosts files map a machine's own name to 127.0.1.1: node
  0 would listen where no other machine reaches. An address given as
  loopback (one machine, as in these tests) is meant."""
  monkeypatch.setattr(rendezvous, "ipv4", lambda host: (
      "127.0.1.1" if host == "node0.example" else "127.0.0.1"))
  address = multi_node.check_flags(_flags(
      "--nnodes=2", f"--rendezvous={given}:9", "--network=host"))
  assert address[0].startswith("127.")
  err = capsys.readouterr().err
  assert ("resolves to the loopback address 127.0.1.1" in err) == warned, err


def test_flags_of_one_node_are_none_and_job_id_has_a_default():
  assert multi_node.check_flags(_flags()) is None
  fv = _flags("--nnodes=2", "--rendezvous=127.0.0.1:9", "--network=host")
  assert multi_node.check_flags(fv) == ("127.0.0.1", 9)
  assert multi_node.job_id(fv, {}) == "127.0.0.1:9"
  assert multi_node.job_id(fv, {"SLURM_JOB_ID": "42"}) == "42"
  assert multi_node.job_id(_flags("--job_id=j"), {"SLURM_JOB_ID": "4"}) == "j"


def test_a_node_without_the_chief_loses_a_killed_worker_and_goes_on():
  # Node 1's first worker is worker 2, not the chief: its death is a loss.
  first, configs = rendezvous.node_configs(rendezvous.build_cluster(
      [_hello(0, 2, nnodes=2, host="127.0.0.1"),
       _hello(1, 2, nnodes=2, host="127.0.0.1")]), 1)
  job = worker_processes.Job(
      [sys.executable, "-c", "import json, os, signal, time\n"
       "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 2:\n"
       "  os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(0.5)\n"],
      2, configs=configs, first_worker=first)
  codes, failed = job.wait(timeout=20, grace=1, keep_going=True)
  assert (codes, failed) == ([-signal.SIGKILL, 0], None)
  assert job.tasks == [("worker", 2), ("worker", 3)] and list(job.lost) == [0]


def _node(rank, port, k, out_dir, extra=()):
  env = dict(os.environ)
  env.pop("SLURM_JOB_ID", None)  # the job id defaults to --rendezvous
  return subprocess.Popen(
      LAUNCH + ["--nnodes=2", f"--node_rank={rank}",
                f"--rendezvous=127.0.0.1:{port}", f"--num_workers={k}",
                "--network=host", "--join_timeout=30", *extra, "--",
                sys.executable, "-c", WRITE_CONFIG, str(out_dir)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_two_launchers_start_one_cluster_of_three_workers(tmp_path):
  port = _free_port()
  nodes = [_node(1, port, 1, tmp_path)]  # before node 0: it retries
  nodes.insert(0, _node(0, port, 2, tmp_path))
  try:
    outs = [p.communicate(timeout=60) for p in nodes]
  finally:
    for p in nodes:
      p.kill()
  for p, (_, err) in zip(nodes, outs):
    assert p.returncode == 0, err
  assert "workers 0-1 of 3 at 127.0.0.1 (worker 0 is the chief)" in outs[0][1]
  assert "node 1 of 2: worker 2 of 3 at 127.0.0.1." in outs[1][1]
  assert "all 1 workers of node 1 finished" in outs[1][1]
  assert sorted(os.listdir(tmp_path)) == ["0.json", "1.json", "2.json"]
  configs = [json.loads((tmp_path / f"{i}.json").read_text())
             for i in range(3)]
  assert [c["task"] for c in configs] == [
      {"type": "worker", "index": i} for i in range(3)]
  workers = configs[0]["cluster"]["worker"]
  assert len(set(workers)) == 3
  assert all(w.startswith("127.0.0.1:") for w in workers)
  assert all(c["cluster"] == {"worker": workers} for c in configs)


def test_a_launcher_whose_node_0_never_answers_says_so_in_one_line(tmp_path):
  port = _free_port()
  proc = _node(1, port, 1, tmp_path, ["--join_timeout=1"])
  try:
    _, err = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 1, err
  assert err.strip() == (
      f"oscars-launch: error: rendezvous: node 0 did not answer at "
      f"127.0.0.1:{port} within 1 s (last try: Connection refused)"), err
  assert not os.listdir(tmp_path)


def test_a_signal_to_a_waiting_node_0_ends_its_launcher_at_once(tmp_path):
  proc = _node(0, _free_port(), 1, tmp_path)
  try:
    with selectors.DefaultSelector() as sel:  # its first line, bounded
      sel.register(proc.stderr, selectors.EVENT_READ)
      assert sel.select(timeout=30), "no line from node 0 in 30 s"
    first = proc.stderr.readline()
    assert "node 0 of 2: waiting up to 30 s for the other nodes" in first
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert err.strip() == ("oscars-launch: got SIGTERM during the rendezvous; "
                         "no worker started."), err
  assert not os.listdir(tmp_path)
