"""EMULATED CPU heterogeneity: oscars-launch --cpu_limit (tools/cpu_limits.py).

Parsing, the errors where the machine has no usable cgroups, creation and
clean-up run against fake cgroup roots (plain directories standing for the
mounts) and need nothing. The tests marked "real" create real cgroups:
they need Linux, root and a writable cpu controller, and are skipped saying
so elsewhere.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import fake_cgroups  # tests/fake_cgroups.py
from oscars_tf.tools import cpu_limits

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]


_real_base = fake_cgroups.real_base
_fake_v1 = fake_cgroups.fake_v1
_fake_v2 = fake_cgroups.fake_v2
fake_rmdir = fake_cgroups.fake_rmdir


def _ours(base):
  return sorted(p.name for p in base.iterdir() if p.name.startswith("oscars-"))


# ---- parsing ----------------------------------------------------------------

def test_one_value_applies_to_every_worker():
  assert cpu_limits.parse("0.5", 3) == [0.5, 0.5, 0.5]


def test_one_value_per_worker_and_kubernetes_millicores():
  assert cpu_limits.parse("1, 1,0.5,250m", 4) == [1.0, 1.0, 0.5, 0.25]
  assert cpu_limits.quota_us(0.25) == 25_000


@pytest.mark.parametrize("text, workers, message", [
    ("1,0.5,0.25", 2, "3 values for 2 workers: give one (for every worker) "
                      "or exactly 2"),
    ("1,0.5", 4, "2 values for 4 workers"),
    ("0", 2, "'0': a CPU limit must be a number > 0"),
    ("1,-0.5", 2, "'-0.5': a CPU limit must be a number > 0"),
    ("nan", 1, "'nan': a CPU limit must be a number > 0"),
    ("inf", 1, "'inf': a CPU limit must be a number > 0"),
    ("fast", 2, "'fast' is not a number of CPUs"),
    ("1,,1", 3, "'' is not a number of CPUs"),
    ("0.001", 1, "at least 0.01"),
])
def test_bad_limits_say_what_is_wrong(text, workers, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    cpu_limits.parse(text, workers)


@pytest.mark.parametrize("value, message", [
    ("1,0.5,0.25", "--cpu_limit: 3 values for 2 workers"),
    ("half", "--cpu_limit: 'half' is not a number of CPUs"),
])
def test_a_bad_cpu_limit_is_a_usage_error_of_the_launcher(value, message):
  proc = subprocess.run(
      LAUNCH + ["--network=host", f"--cpu_limit={value}", "--num_workers",
                "2", "--", "true"],
      capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 1
  assert message in proc.stderr and "Traceback" not in proc.stderr, (
      proc.stderr)


# ---- where the machine cannot --------------------------------------------


def test_no_cpu_controller_is_a_one_line_error_of_the_launcher(tmp_path):
  env = dict(os.environ, **{cpu_limits.ROOT_ENV: str(tmp_path)})
  proc = subprocess.run(
      LAUNCH + ["--network=host", "--cpu_limit=1,0.5", "--num_workers", "2",
                "--", "true"],
      capture_output=True, text=True, timeout=60, check=False, env=env)
  assert proc.returncode == 1
  assert proc.stderr.splitlines() == [
      f"oscars-launch: error: --cpu_limit: no cgroup cpu controller mounted "
      f"under {tmp_path} (neither cgroup v1's {tmp_path}/cpu/cpu.cfs_quota_us"
      f" nor cgroup v2's cgroup.controllers listing cpu)"], proc.stderr
  assert proc.stdout == ""  # no worker started


def test_a_unified_hierarchy_without_the_cpu_controller_is_not_enough(
    tmp_path):
  _fake_v2(tmp_path, controllers="memory pids")
  with pytest.raises(cpu_limits.CpuLimitError,
                     match="no cgroup cpu controller mounted under"):
    cpu_limits.CpuLimits([1], root=tmp_path).create()


def test_not_linux_is_named(tmp_path, monkeypatch):
  _fake_v1(tmp_path)
  monkeypatch.setattr(sys, "platform", "darwin")
  with pytest.raises(cpu_limits.CpuLimitError,
                     match="needs Linux cgroups; this is darwin"):
    cpu_limits.CpuLimits([1], root=tmp_path).create()


def test_a_cgroup_tree_not_writable_is_named(tmp_path, monkeypatch):
  base = _fake_v1(tmp_path)
  # As root everything is writable: pretend not.
  monkeypatch.setattr(os, "access", lambda path, mode: False)
  with pytest.raises(cpu_limits.CpuLimitError) as e:
    cpu_limits.CpuLimits([1], root=tmp_path).create()
  assert str(e.value) == (f"cgroup v1 {base} is not writable by uid "
                          f"{os.geteuid()} (needs root, or a delegated "
                          "cgroup)")


def test_a_failed_quota_leaves_nothing_behind(tmp_path, monkeypatch,
                                              fake_rmdir):
  base = _fake_v1(tmp_path)
  write = cpu_limits._write

  def refuse_the_second(path, text):
    if path.parent.name == "worker-1" and path.name == "cpu.cfs_quota_us":
      raise OSError(22, "Invalid argument", str(path))
    write(path, text)
  monkeypatch.setattr(cpu_limits, "_write", refuse_the_second)
  with pytest.raises(cpu_limits.CpuLimitError,
                     match=r"cannot set the CPU quota of cgroup v1 .*"
                           r"worker-1/cpu\.cfs_quota_us: Invalid argument"):
    cpu_limits.CpuLimits([1, 0.5], root=tmp_path).create()
  assert _ours(base) == []


# ---- creation and clean-up, on fake roots -----------------------------------


def test_v1_quotas_env_and_labels(tmp_path, fake_rmdir):
  base = _fake_v1(tmp_path)
  with cpu_limits.CpuLimits([1, 0.5], root=tmp_path) as limits:
    assert limits.version == 1 and limits.base == base
    (parent,) = _ours(base)
    assert re.fullmatch(rf"oscars-{os.getpid()}-[0-9a-f]{{8}}", parent)
    assert (base / parent / "cpu.shares").read_text() == "2048"
    for i, quota in enumerate(["100000", "50000"]):
      d = base / parent / f"worker-{i}"
      assert (d / "cpu.cfs_period_us").read_text() == "100000"
      assert (d / "cpu.cfs_quota_us").read_text() == quota
    assert limits.describe() == [
        "EMULATED CPU limit: worker 0 gets 1 CPU (cgroup v1 "
        "cpu.cfs_quota_us=100000)",
        "EMULATED CPU limit: worker 1 gets 0.5 CPU (cgroup v1 "
        "cpu.cfs_quota_us=50000)"]
    assert limits.worker_env() == {0: {"OSCARS_CPU_LIMIT": "1"},
                                   1: {"OSCARS_CPU_LIMIT": "0.5"}}
  assert _ours(base) == []


def test_v2_enables_the_controller_and_sets_cpu_max(tmp_path, fake_rmdir):
  base = _fake_v2(tmp_path)
  with cpu_limits.CpuLimits([0.25], root=tmp_path) as limits:
    assert limits.version == 2
    parent = base / _ours(base)[0]
    assert (base / "cgroup.subtree_control").read_text() == "+cpu"
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu"
    assert (parent / "cpu.weight").read_text() == "100"
    assert (parent / "worker-0" / "cpu.max").read_text() == "25000 100000"
    assert limits.describe() == [
        "EMULATED CPU limit: worker 0 gets 0.25 CPU (cgroup v2 "
        "cpu.max=25000 100000)"]
  assert _ours(base) == []


def test_the_hybrid_layout_uses_the_v1_cpu_controller(tmp_path):
  # The machines here: cgroup2 at unified/ without controllers, v1 cpu/.
  _fake_v2(tmp_path / "unified", controllers="")
  _fake_v1(tmp_path)
  version, base = cpu_limits.CpuLimits([1], root=tmp_path).detect()
  assert (version, base) == (1, tmp_path / "cpu")


def test_a_worker_joins_its_cgroup_and_leftovers_move_to_the_top(
    tmp_path, fake_rmdir):
  base = _fake_v1(tmp_path)
  limits = cpu_limits.CpuLimits([1, 0.5], root=tmp_path).create()
  limits.preexec(1)()  # in this process: a fake cgroup.procs only records it
  procs = limits.dirs[1] / "cgroup.procs"
  assert procs.read_text() == str(os.getpid())
  assert limits.remove() == []
  assert (base / "cgroup.procs").read_text() == str(os.getpid())
  assert _ours(base) == []
  assert limits.remove() == []  # idempotent


def test_a_worker_that_cannot_join_exits_126_saying_why(tmp_path,
                                                         fake_rmdir):
  _fake_v1(tmp_path)
  limits = cpu_limits.CpuLimits([1], root=tmp_path).create()
  try:
    shutil.rmtree(limits.dirs[0])
    proc = subprocess.run(["true"], preexec_fn=limits.preexec(0),  # noqa: PLW1509
                          capture_output=True, text=True, timeout=30,
                          check=False)
  finally:
    limits.remove()
  assert proc.returncode == 126
  assert "oscars-launch: cannot join cgroup" in proc.stderr, proc.stderr


def test_cgroups_of_a_launcher_killed_with_sigkill_are_removed_next_time(
    tmp_path, fake_rmdir):
  base = _fake_v1(tmp_path)
  dead = subprocess.Popen(["true"])
  dead.wait(timeout=30)

  def job(pid, busy=""):
    d = base / f"oscars-{pid}-{os.urandom(4).hex()}"
    (d / "worker-0").mkdir(parents=True)
    (d / "cgroup.procs").write_text("")
    (d / "worker-0" / "cgroup.procs").write_text(busy)
    return d.name
  stale = job(dead.pid)
  busy = job(dead.pid, busy="12345\n")  # a worker still in it: kept
  live = job(os.getpid())  # its launcher runs: kept
  limits = cpu_limits.CpuLimits([1], root=tmp_path).create()
  mine = limits.parent.name
  assert set(_ours(base)) == {busy, live, mine}
  assert stale not in _ours(base)
  limits.remove()


# ---- real cgroups -----------------------------------------------------------

# Busy for WALL seconds, then reports the CPU time it got meanwhile, its
# cgroup, that cgroup's quota and how often the kernel throttled it.
WALL = 1.5
BUSY = f"""
import json, os, time
t0, cpu0 = time.monotonic(), time.process_time()
while time.monotonic() - t0 < {WALL}:
  pass
wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
rel = [l.split(":", 2)[2].strip() for l in open("/proc/self/cgroup")
       if "oscars-" in l]
d = os.environ["CG_BASE"] + rel[0]
quota = open(d + ("/cpu.max" if os.path.exists(d + "/cpu.max") else
                  "/cpu.cfs_quota_us")).read().strip()
stat = {{}}
for line in open(d + "/cpu.stat"):
  k, v = line.split()
  stat[k] = int(v)
print("RESULT", json.dumps({{"limit": os.environ["OSCARS_CPU_LIMIT"],
                            "cpu": cpu, "wall": wall,
                            "cgroup": rel[0], "quota": quota,
                            "throttled": stat["nr_throttled"]}}))
"""


def _results(stdout):
  found = {}
  for m in re.finditer(r"^\[(\d+)\] RESULT (.*)$", stdout, re.MULTILINE):
    found[int(m.group(1))] = json.loads(m.group(2))
  return found


def test_real_a_limited_worker_gets_its_quota_and_the_cgroups_go():
  base = _real_base()
  env = dict(os.environ, CG_BASE=str(base))
  launcher = subprocess.Popen(
      LAUNCH + ["--cpu_limit=1,0.25", "--num_workers", "2", "--",
                sys.executable, "-c", BUSY], stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, env=env)
  out, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 0, err
  assert ("oscars-launch: EMULATED CPU limit: worker 1 gets 0.25 CPU "
          "(cgroup v") in err, err
  r = _results(out)
  assert sorted(r) == [0, 1], out
  assert [r[0]["limit"], r[1]["limit"]] == ["1", "0.25"]
  # Each worker ran in its own cgroup, with its quota, from the start.
  for i, quota in enumerate(["100000", "25000"]):
    assert re.fullmatch(rf"/oscars-{launcher.pid}-[0-9a-f]+/worker-{i}",
                        r[i]["cgroup"]), r[i]
    assert r[i]["quota"] in (quota, f"{quota} 100000"), r[i]
  cpu0, cpu1 = r[0]["cpu"], r[1]["cpu"]
  room = cpu0 >= 0.6 * r[0]["wall"]  # the unlimited got 0.6 CPU or more
  print(f"\nCPU seconds in {WALL} s: unlimited {cpu0:.3f}, limited to 0.25 "
        f"CPU {cpu1:.3f} ({r[1]['throttled']} throttled periods)" +
        ("" if room else "; the unlimited worker got under 0.6 CPU: too "
         "busy a machine to compare them, only the ceiling was checked"))
  # The quota's ceiling, whatever else runs on the machine: 25 ms per
  # 100 ms period (plus at most what was left of one period's quota).
  assert cpu1 <= 0.25 * r[1]["wall"] + 0.05, r
  # Where the machine let the unlimited worker run (at 0.6 CPU or more),
  # the limit binds: the kernel throttled the limited one, which got less
  # than half as much. On a saturated machine neither reaches 0.25 CPU and
  # a limit cannot be told from the load.
  if room:
    assert r[1]["throttled"] > 0, r
    assert cpu1 < 0.5 * cpu0, r
  # The workers' cgroups and their parent are gone.
  assert not (base / r[1]["cgroup"].lstrip("/")).exists()
  assert not list(base.glob(f"oscars-{launcher.pid}-*"))


def test_real_leftover_processes_move_to_the_top_and_the_cgroups_go():
  base = _real_base()
  limits = cpu_limits.CpuLimits([0.5]).create()
  sleeper = subprocess.Popen(["sleep", "60"],
                             preexec_fn=limits.preexec(0))  # noqa: PLW1509
  try:
    procs = (limits.dirs[0] / "cgroup.procs").read_text().split()
    assert procs == [str(sleeper.pid)]
    parent = limits.parent
    assert limits.remove() == []
    assert not parent.exists()
    assert sleeper.poll() is None  # moved, not killed
    assert str(sleeper.pid) in (base / "cgroup.procs").read_text().split()
  finally:
    sleeper.kill()
    sleeper.wait(timeout=30)
    limits.remove()


# Prints its attempt and cgroup; with FAIL_FIRST the chief fails attempt 0;
# then each worker writes a file named by its index and, with SLEEP set,
# waits to be stopped.
WORKER = """
import os, sys, time
a = os.environ["OSCARS_LAUNCH_ATTEMPT"]
rel = [l.split(":", 2)[2].strip() for l in open("/proc/self/cgroup")
       if "oscars-" in l]
print("CGROUP", a, rel[0], flush=True)
i = os.environ["TF_CONFIG"].split('"index": ')[1].rstrip("}")
if os.environ.get("FAIL_FIRST") and a == "0" and i == "0":
  sys.exit(3)
open(os.path.join(os.environ["OUT"], i), "w").close()
if os.environ.get("SLEEP"):
  time.sleep(60)
"""


def _cgroups(stdout):
  return re.findall(r"^\[(\d)\] CGROUP (\d) (\S+)$", stdout, re.MULTILINE)


def test_real_restarts_reuse_the_cgroups_and_remove_them_at_the_end(
    tmp_path):
  base = _real_base()
  launcher = subprocess.Popen(
      LAUNCH + ["--network=host", "--restarts=1", "--cpu_limit=0.5",
                "--num_workers", "2", "--grace_seconds=5", "--",
                sys.executable, "-c", WORKER],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, OUT=str(tmp_path), FAIL_FIRST="1"))
  out, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 0, err
  assert "restart 1 of 1" in err, err
  by_worker = {}
  for worker, attempt, rel in _cgroups(out):
    by_worker.setdefault(worker, {})[attempt] = rel
  assert set(by_worker) == {"0", "1"}, out
  # The chief's attempts ran in one cgroup, its own.
  assert by_worker["0"]["0"] == by_worker["0"]["1"], by_worker
  assert by_worker["0"]["1"].endswith("/worker-0")
  assert by_worker["1"]["1"].endswith("/worker-1")
  assert not list(base.glob(f"oscars-{launcher.pid}-*"))
  for rels in by_worker.values():
    for rel in rels.values():
      assert not (base / rel.lstrip("/")).exists(), rel


def test_real_a_signal_to_the_launcher_removes_the_cgroups(tmp_path):
  base = _real_base()
  launcher = subprocess.Popen(
      LAUNCH + ["--network=host", "--cpu_limit=0.5", "--num_workers", "2",
                "--grace_seconds=5", "--", sys.executable, "-c", WORKER],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, OUT=str(tmp_path), SLEEP="1"))
  try:
    deadline = time.monotonic() + 60
    while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):
      assert time.monotonic() < deadline, "the workers never started"
      assert launcher.poll() is None, launcher.communicate()
      time.sleep(0.05)
    cgroups = list(base.glob(f"oscars-{launcher.pid}-*"))
    assert len(cgroups) == 1
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait(timeout=30)
  assert launcher.returncode == 128 + signal.SIGTERM, err
  assert not cgroups[0].exists(), err
