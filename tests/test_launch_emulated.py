"""oscars-launch --network=emulated: a namespace per worker, shaped links.

The flag checks run anywhere. The rest needs root, `ip` and `tc` with tbf,
or is skipped saying so: real workers send real TCP traffic (and gRPC, in
a training job) through links shaped with tbf, and every namespace must be
gone when the launcher is, however it ended. Every wait is bounded.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import faults
from oscars_tf.tools import worker_netns

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]
MBYTES = 4


@pytest.fixture(scope="module")
def emulation():
  """Skips unless this machine can emulate a shaped link."""
  try:
    worker_netns.emulate(1, ["20mbit"], prefix="oscars_probe").remove()
  except worker_netns.Unavailable as e:
    pytest.skip(f"--network=emulated unavailable here: {e}")


def _run(args, command, timeout=60, env=None):
  return subprocess.run(LAUNCH + args + ["--"] + command, capture_output=True,
                        text=True, timeout=timeout, env=env, check=False)


# -- the flags -------------------------------------------------------------


@pytest.mark.parametrize("text, bits", [
    ("100mbit", 1e8), ("1gbit", 1e9), ("500kbit", 5e5), ("1.5Mbit", 1.5e6),
    ("10mbps", 8e7), ("1mibit", 2**20)])
def test_rates_read_as_tc_reads_them(text, bits):
  assert worker_netns.parse_rate(text) == bits


@pytest.mark.parametrize("text", [
    "100", "fast", "100mb", "-5mbit", "0mbit", "1bit", "", "1e3mbit"])
def test_what_is_not_a_rate_is_refused(text):
  with pytest.raises(ValueError, match=re.escape(repr(text))):
    worker_netns.parse_rate(text)


def test_bandwidth_is_one_rate_for_all_or_one_per_worker():
  assert worker_netns.parse_bandwidth("10mbit", 3) == ["10mbit"] * 3
  assert worker_netns.parse_bandwidth("1gbit, 20mbit", 2) == ["1gbit",
                                                              "20mbit"]
  with pytest.raises(ValueError, match="2 rates for 3 workers"):
    worker_netns.parse_bandwidth("1mbit,2mbit", 3)
  with pytest.raises(ValueError, match="'x' is not a rate"):
    worker_netns.parse_bandwidth("1mbit,x", 2)


def test_the_bucket_holds_a_few_packets_or_10_ms():
  assert worker_netns.tbf("20mbit") == ["tbf", "rate", "20mbit", "burst",
                                        "32768", "latency", "50ms"]
  assert worker_netns.tbf("1gbit")[4] == str(1_250_000)


@pytest.mark.parametrize("args, message", [
    (["--bandwidth=20mbit"], "--bandwidth needs --network=emulated"),
    (["--network=emulated", "--bandwidth=fast"],
     "--bandwidth: 'fast' is not a rate"),
    (["--network=emulated", "--bandwidth=1mbit,2mbit", "--num_workers=3"],
     "--bandwidth: 2 rates for 3 workers"),
    (["--network=emulated", "--host=127.0.0.2"],
     "--host does not apply to --network=emulated"),
    (["--network=emulated", "--num_workers=255"],
     "--network=emulated: at most 254 workers"),
], ids=["no_emulation", "not_a_rate", "count", "host", "too_many"])
def test_bad_flags_are_usage_errors(args, message):
  proc = _run(args, ["true"])
  assert proc.returncode == 1
  assert f"oscars-launch: error: {message}" in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr


def test_a_machine_that_refuses_says_why(monkeypatch, tmp_path):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(worker_netns.Unavailable, match="needs root"):
    worker_netns.emulate(2, ["1mbit"] * 2)
  monkeypatch.setattr(os, "geteuid", lambda: 0)
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(worker_netns.Unavailable, match="needs `ip`"):
    worker_netns.emulate(2, ["1mbit"] * 2)


def _our_names(pid):
  """Names under /run/netns of the launcher with this pid."""
  try:
    return [n for n in os.listdir("/run/netns")
            if n.startswith(f"oscars_launch{pid}_")]
  except FileNotFoundError:
    return []


def test_tc_refusing_tbf_is_one_line_and_leaves_nothing(emulation, tmp_path):
  # A `tc` that refuses every qdisc, as a kernel without sch_tbf does.
  fake = tmp_path / "tc"
  fake.write_text("#!/bin/sh\necho 'Error: Specified qdisc kind is "
                  "unknown.' >&2\nexit 2\n")
  fake.chmod(0o755)
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
  proc = subprocess.Popen(
      LAUNCH + ["--network=emulated", "--bandwidth=20mbit", "--",
                "echo", "ran"], stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, env=env)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 1 and "ran" not in out
  assert err == ("oscars-launch: error: --network=emulated: tc refused a tbf "
                 "qdisc: Error: Specified qdisc kind is unknown.\n"), err
  assert _our_names(proc.pid) == []


# -- real links ------------------------------------------------------------


_NSFS_DEV = os.stat("/proc/self/ns/net").st_dev


def _holders(inodes):
  """Pids whose process is in, or holds a file of, one of these network
  namespaces (given by inode): a namespace none holds is gone."""
  found = set()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    paths = [f"/proc/{pid}/ns/net"]
    try:
      paths += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
      pass
    for path in paths:
      try:
        st = os.stat(path)
      except OSError:
        continue
      if st.st_dev == _NSFS_DEV and st.st_ino in inodes:
        found.add(int(pid))
  return found


def _assert_gone(inodes, launcher_pid, timeout=15):
  deadline = time.monotonic() + timeout
  while _holders(inodes) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _holders(inodes), f"namespaces {inodes} still held"
  assert _our_names(launcher_pid) == []


# Worker 1 sends MBYTES to worker 0, then worker 0 sends as much back; each
# sender times its transfer until the receiver's one-byte answer and prints
# Mbit/s. Each also prints its address, OSCARS_BANDWIDTH, interfaces and
# network namespace.
_THROUGHPUT = r"""
import json, os, socket, sys, time
c = json.loads(os.environ['TF_CONFIG']); i = c['task']['index']
hosts = [w.rsplit(':', 1)[0] for w in c['cluster']['worker']]
port = int(c['cluster']['worker'][0].rsplit(':', 1)[1])
n = int(sys.argv[1]) << 20
print('me', i, hosts[i], os.environ.get('OSCARS_BANDWIDTH'),
      ','.join(sorted(x for _, x in socket.if_nameindex())),
      os.stat('/proc/self/ns/net').st_ino, flush=True)
def send(s):
  t0 = time.monotonic()
  s.sendall(b'x' * n)
  assert s.recv(1) == b'k'
  print('sent_mbit', n * 8 / (time.monotonic() - t0) / 1e6, flush=True)
def receive(s):
  got = 0
  while got < n:
    b = s.recv(1 << 16)
    assert b, 'connection closed early'
    got += len(b)
  s.sendall(b'k')
if i == 0:
  server = socket.create_server((hosts[0], port))
  server.settimeout(30)
  s = server.accept()[0]
  s.settimeout(30)
  receive(s)
  send(s)
else:
  end = time.monotonic() + 30
  while True:
    try:
      s = socket.create_connection((hosts[0], port), timeout=30)
      break
    except OSError:
      assert time.monotonic() < end, 'worker 0 never listened'
      time.sleep(0.05)
  send(s)
  receive(s)
"""


@pytest.mark.parametrize("bandwidth", ["20mbit", "80mbit,20mbit"])
def test_traffic_between_workers_flows_at_the_shaped_rate(emulation,
                                                          bandwidth):
  # "80mbit,20mbit": worker 0 sends at up to 80 Mbit/s, but worker 1's
  # download is held to 20 on the hub's end of its link.
  proc = subprocess.Popen(
      LAUNCH + ["--network=emulated", f"--bandwidth={bandwidth}",
                "--num_workers", "2", "--timeout=60", "--", sys.executable,
                "-c", _THROUGHPUT, str(MBYTES)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  out, err = proc.communicate(timeout=90)
  assert proc.returncode == 0, out + err
  rates = bandwidth.split(",") * (2 if "," not in bandwidth else 1)
  me = {int(m[0]): m[1:] for m in
        re.findall(r"^\[\d\] me (\d) (\S+) (\S+) (\S+) (\d+)$", out, re.M)}
  for i in range(2):
    assert me[i][:3] == (f"10.214.0.{i + 1}", rates[i], "eth0,lo"), me
  if "," in bandwidth:
    assert "EMULATED network: worker 1 at 10.214.0.2, link shaped with tbf "\
        "rate 20mbit (both directions)" in err, err
  else:
    assert "EMULATED network: worker i at 10.214.0.(i+1), link shaped with "\
        "tbf rate 20mbit (both directions)" in err, err
  sent = {int(w): float(r) for w, r in
          re.findall(r"^\[(\d)\] sent_mbit (\S+)$", out, re.M)}
  print(f"\n--bandwidth={bandwidth}, {MBYTES} MB each way: worker 1 -> 0 "
        f"{sent[1]:.1f} Mbit/s, worker 0 -> 1 {sent[0]:.1f} Mbit/s")
  for rate in sent.values():
    assert 0.5 * 20 <= rate <= 1.2 * 20, sent
  _assert_gone({int(me[i][3]) for i in range(2)}, proc.pid)


def test_a_restarted_job_runs_in_the_same_namespaces(emulation, tmp_path):
  # Worker 0 fails on the first attempt, once worker 1 has said where it
  # runs (a file: on a loaded machine worker 1 may start after worker 0 has
  # failed, and the launcher stops it); on the second, worker 1 reaches it.
  started = tmp_path / "worker1-started"
  code = (
      "import json, os, socket, sys, time\n"
      "c = json.loads(os.environ['TF_CONFIG']); i = c['task']['index']\n"
      "host, port = c['cluster']['worker'][0].rsplit(':', 1)\n"
      "attempt = os.environ['OSCARS_LAUNCH_ATTEMPT']\n"
      "print('ns', attempt, i, os.stat('/proc/self/ns/net').st_ino,"
      " flush=True)\n"
      f"started = {str(started)!r}\n"
      "if attempt == '0' and i == 1:\n"
      "  open(started, 'w').close(); time.sleep(30)\n"
      "if attempt == '0':\n"
      "  end = time.monotonic() + 30\n"
      "  while not os.path.exists(started):\n"
      "    assert time.monotonic() < end; time.sleep(0.05)\n"
      "  sys.exit(3)\n"
      "if i == 0:\n"
      "  s = socket.create_server((host, int(port))); s.settimeout(30)\n"
      "  s.accept()[0].sendall(b'hello')\n"
      "else:\n"
      "  end = time.monotonic() + 30\n"
      "  while True:\n"
      "    try:\n"
      "      s = socket.create_connection((host, int(port)), timeout=30)\n"
      "      break\n"
      "    except OSError:\n"
      "      assert time.monotonic() < end; time.sleep(0.05)\n"
      "  print('got', s.recv(5).decode(), flush=True)\n")
  proc = subprocess.Popen(
      LAUNCH + ["--network=emulated", "--num_workers=2", "--restarts=1",
                "--grace_seconds=1", "--timeout=60", "--", sys.executable,
                "-c", code],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  out, err = proc.communicate(timeout=90)
  assert proc.returncode == 0, out + err
  assert "links not shaped" in err and "restart 1 of 1" in err, err
  assert "[1] got hello" in out, out
  ns = {(a, int(i)): int(n) for a, i, n in
        re.findall(r"^\[\d\] ns (\d) (\d) (\d+)$", out, re.M)}
  assert ns[("0", 0)] == ns[("1", 0)] != ns[("0", 1)] == ns[("1", 1)], ns
  _assert_gone(set(ns.values()), proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_the_namespaces_go_with_the_launcher(emulation, tmp_path, sig):
  code = ("import os, sys, time\n"
          "path = os.path.join(sys.argv[1], os.environ['OSCARS_BANDWIDTH'] +"
          " str(os.getpid()))\n"
          "open(path + '.tmp', 'w').write("
          "str(os.stat('/proc/self/ns/net').st_ino))\n"
          "os.replace(path + '.tmp', path)\n"
          "time.sleep(60)\n")
  launcher = subprocess.Popen(
      LAUNCH + ["--network=emulated", "--bandwidth=1mbit", "--num_workers=2",
                "--grace_seconds=1", "--", sys.executable, "-c", code,
                str(tmp_path)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      start_new_session=True)
  try:
    files = lambda: [p for p in tmp_path.iterdir()  # noqa: E731
                     if p.name.startswith("1mbit") and
                     not p.name.endswith(".tmp")]
    faults.wait_for(lambda: len(files()) == 2, 60, "both workers")
    inodes = {int(p.read_text()) for p in files()}
    assert len(inodes) == 2 and _holders(inodes)
    launcher.send_signal(sig)
    launcher.wait(timeout=20)
    _assert_gone(inodes, launcher.pid)
  finally:
    faults.kill(launcher)


def test_training_over_emulated_links_finishes(emulation, tmp_path):
  result = tmp_path / "result.json"
  launcher = faults.launch(
      2, ["--dataset=digits", "--epochs=2", f"--result_json={result}"],
      ["--network=emulated", "--bandwidth=200mbit", "--timeout=150"])
  out, err = faults.finish(launcher, 180)
  assert launcher.returncode == 0, err[-3000:]
  assert "EMULATED network" in err and "rate 200mbit" in err, err[-3000:]
  assert set(faults.final_lines(out)) == {0, 1}, out[-3000:]
  assert json.loads(result.read_text())["test_accuracy"] > 0.5
  assert _our_names(launcher.pid) == []
