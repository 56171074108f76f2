"""oscars-launch --cpu_limit_from=ready: quotas a worker applies once ready
(tools/cpu_limits.py's deferred mode, `apply_pending`).

On fake cgroup roots (plain directories) these need nothing; the test marked
"real" creates real cgroups and is skipped, saying why, where it cannot.
"""

import json
import re
import subprocess
import sys

import pytest

import fake_cgroups  # tests/fake_cgroups.py
from oscars_tf.tools import cpu_limits

fake_rmdir = fake_cgroups.fake_rmdir  # a fixture

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]


def _pending(env):
  return json.loads(env[cpu_limits.PENDING_ENV])


@pytest.mark.usefixtures("fake_rmdir")
def test_v1_workers_start_unlimited_and_apply_their_quota(tmp_path):
  fake_cgroups.fake_v1(tmp_path)
  with cpu_limits.CpuLimits([1, 0.25], root=tmp_path,
                            deferred=True) as limits:
    files = [limits.quota_file(i) for i in range(2)]
    assert [f.read_text() for f in files] == ["-1", "-1"]
    assert limits.unapplied() == [0, 1]
    assert "from when the worker is ready" in limits.describe()[1]
    envs = limits.worker_env()
    assert envs[1][cpu_limits.ENV] == "0.25"
    assert _pending(envs[1]) == {"file": str(files[1]), "text": "25000",
                                 "limit": 0.25}
    env = dict(envs[1])
    assert cpu_limits.apply_pending(env) == 0.25
    assert cpu_limits.PENDING_ENV not in env  # applied once
    assert cpu_limits.apply_pending(env) is None
    assert files[1].read_text() == "25000"
    assert limits.unapplied() == [0]
    limits.rearm()  # a restarted job starts unlimited again
    assert [f.read_text() for f in files] == ["-1", "-1"]


@pytest.mark.usefixtures("fake_rmdir")
def test_v2_unlimited_is_max_and_the_quota_keeps_its_period(tmp_path):
  fake_cgroups.fake_v2(tmp_path)
  with cpu_limits.CpuLimits([0.5], root=tmp_path, deferred=True) as limits:
    assert limits.quota_file(0).read_text() == "max 100000"
    cpu_limits.apply_pending(dict(limits.worker_env()[0]))
    assert limits.quota_file(0).read_text() == "50000 100000"
    assert limits.unapplied() == []


@pytest.mark.usefixtures("fake_rmdir")
def test_not_deferred_writes_the_quota_at_once_and_nothing_is_pending(
    tmp_path):
  fake_cgroups.fake_v1(tmp_path)
  with cpu_limits.CpuLimits([0.5], root=tmp_path) as limits:
    assert limits.quota_file(0).read_text() == "50000"
    assert cpu_limits.PENDING_ENV not in limits.worker_env()[0]
    assert limits.unapplied() == []
  assert cpu_limits.apply_pending({}) is None  # launched without it


def test_a_quota_that_cannot_be_written_is_a_one_line_error(tmp_path):
  env = {cpu_limits.PENDING_ENV: json.dumps(
      {"file": str(tmp_path / "gone" / "cpu.max"), "text": "1 2",
       "limit": 0.5})}
  with pytest.raises(cpu_limits.CpuLimitError,
                     match=r"cannot apply the CPU limit: .*gone/cpu.max"):
    cpu_limits.apply_pending(env)


def test_ready_without_a_cpu_limit_is_a_usage_error():
  proc = subprocess.run(LAUNCH + ["--cpu_limit_from=ready", "--num_workers",
                                  "1", "--", sys.executable, "-c", "pass"],
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 1
  assert "--cpu_limit_from=ready: needs --cpu_limit" in proc.stderr


# Worker 0 applies its limit once "ready", worker 1 never does.
PROGRAM = """
import json, os, pathlib
from oscars_tf.tools import cpu_limits
spec = json.loads(os.environ[cpu_limits.PENDING_ENV])
quota = pathlib.Path(spec["file"])
before = quota.read_text().strip()
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
  cpu_limits.apply_pending()
print("RESULT " + json.dumps({"before": before,
                              "after": quota.read_text().strip()}))
"""


def test_real_quota_holds_from_ready_and_a_worker_never_applying_it_is_named():
  base = fake_cgroups.real_base()
  proc = subprocess.Popen(
      LAUNCH + ["--cpu_limit=0.25", "--cpu_limit_from=ready",
                "--num_workers", "2", "--", sys.executable, "-c", PROGRAM],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    proc.stdout, proc.stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 0, proc.stderr
  found = {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(
      r"^\[(\d+)\] RESULT (.*)$", proc.stdout, re.MULTILINE)}
  unlimited = ("-1", "max 100000")
  assert found[0]["before"] in unlimited, found
  assert found[0]["after"] in ("25000", "25000 100000"), found
  assert found[1]["after"] in unlimited, found
  assert "EMULATED CPU limit of 0.25 CPU applied" in proc.stderr
  assert ("WARNING: worker 1 never applied its CPU limit (it ran "
          "unlimited)") in proc.stderr, proc.stderr
  assert "worker 0 never applied" not in proc.stderr
  # Removed at the end: this launcher's own (named by its pid; a job of the
  # other test stream may have cgroups of its own meanwhile).
  assert not list(base.glob(f"oscars-{proc.pid}-*")), proc.pid
