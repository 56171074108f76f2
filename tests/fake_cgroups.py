"""Fake cgroup roots for the CPU-limit tests: plain directories standing for
the cgroup mounts, and the real hierarchy's top (or a skip saying why)."""

import os
import pathlib

import pytest

from oscars_tf.tools import cpu_limits


def real_base():
  """The real cpu hierarchy's top, or skip saying why there is none."""
  try:
    return cpu_limits.CpuLimits([1], root=cpu_limits.DEFAULT_ROOT).detect()[1]
  except cpu_limits.CpuLimitError as e:
    pytest.skip(f"no usable cgroups here: {e}")


def fake_v1(root):
  (root / "cpu").mkdir(parents=True)
  for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cgroup.procs"):
    (root / "cpu" / name).write_text("")
  return root / "cpu"


def fake_v2(root, controllers="cpuset cpu io memory pids"):
  root.mkdir(parents=True, exist_ok=True)
  (root / "cgroup.controllers").write_text(controllers + "\n")
  (root / "cgroup.subtree_control").write_text("")
  (root / "cgroup.procs").write_text("")
  return root


@pytest.fixture
def fake_rmdir(monkeypatch):
  # A cgroup directory holds only control files, and rmdir removes it with
  # them; in a plain directory the files must go first.
  def rmdir(path):
    for f in pathlib.Path(path).iterdir():
      if f.is_dir():
        raise OSError(39, "Directory not empty", str(path))
      f.unlink()
    os.rmdir(path)
  monkeypatch.setattr(cpu_limits, "_rmdir", rmdir)
