"""EMULATED CPU heterogeneity: one cgroup per worker with a real CPU quota.

    oscars-launch --cpu_limit=1,1,0.5,0.25 --num_workers 4 -- CMD

Each worker runs in a cgroup of its own whose CPU bandwidth is capped the
way Kubernetes enforces a container's `resources.limits.cpu`: the kernel's
CFS bandwidth control lets the cgroup run `limit x period` microseconds of
CPU time per period (100 ms), then throttles it until the next period. With
cgroup v1 that is the `cpu` controller's `cpu.cfs_period_us` and
`cpu.cfs_quota_us`; with cgroup v2, `cpu.max` ("quota period"). Unlike
--simulate_step_time (a sleep per step) this slows down everything the
worker runs, its TensorFlow threads included.

The cgroups sit under one job-unique parent, `oscars-<pid>-<random>`, at the
top of the cpu hierarchy. The parent's CPU weight is that of as many plain
processes as there are workers: under contention the job gets the share its
workers would get outside cgroups (a cgroup otherwise weighs as one). A
worker joins its cgroup in the forked child,
before exec (`preexec`), so it is limited from its first instruction on, and
so is every thread and process it starts. `remove` moves processes still in
them to the top cgroup and removes the cgroups; parents left behind by a
launcher killed with SIGKILL are removed by the next one.

The limits' values (`parse`, `quota_us`) are cpu_limit_values.py's.

Needs Linux, a writable cpu controller (root, or a delegated cgroup) and, for
cgroup v2, the cpu controller enabled for the top cgroup's children.
Imports no TensorFlow.
"""

import errno
import json
import os
import pathlib
import re
import secrets
import sys
import time

from oscars_tf.tools.cpu_limit_values import MIN_LIMIT  # noqa: F401 (cpu_limits.MIN_LIMIT)
from oscars_tf.tools.cpu_limit_values import PERIOD_US
from oscars_tf.tools.cpu_limit_values import parse  # noqa: F401 (cpu_limits.parse)
from oscars_tf.tools.cpu_limit_values import quota_us

ROOT_ENV = "OSCARS_CGROUP_ROOT"  # where cgroup file systems are mounted
DEFAULT_ROOT = "/sys/fs/cgroup"
ENV = "OSCARS_CPU_LIMIT"  # each worker's limit, for its records
# --cpu_limit_from=ready: where and what the worker writes once ready.
PENDING_ENV = "OSCARS_CPU_LIMIT_PENDING"
_PARENT = re.compile(r"^oscars-(\d+)-[0-9a-f]+$")


class CpuLimitError(Exception):
  """The machine cannot apply the limits; the message is one line naming
  what is missing."""


def apply_pending(environ=None):
  """Applies this worker's deferred CPU limit (oscars-launch
  --cpu_limit_from=ready); call it once start-up is done. Returns the limit
  in CPUs, or None where none is pending. Idempotent.

  Raises CpuLimitError where the quota cannot be written: the worker would
  otherwise run unlimited while reporting a limit.
  """
  environ = os.environ if environ is None else environ
  pending = environ.pop(PENDING_ENV, None)
  if not pending:
    return None
  spec = json.loads(pending)
  try:
    _write(spec["file"], spec["text"])
  except OSError as e:
    raise CpuLimitError(f"cannot apply the CPU limit: {spec['file']}: "
                        f"{e.strerror or e}") from None
  print(f"oscars_tf: EMULATED CPU limit of {spec['limit']:g} CPU applied "
        f"(worker ready, pid {os.getpid()})", file=sys.stderr, flush=True)
  return float(spec["limit"])


def _read(path):
  return pathlib.Path(path).read_text().strip()


def _write(path, text):
  # Like `echo text > path`: a cgroup file takes one value per write.
  with open(path, "w") as f:
    f.write(text)


def _rmdir(path):
  os.rmdir(path)


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


class CpuLimits:
  """One cgroup per worker, each with a CPU quota (a context manager).

  Args:
    limits: number of CPUs per worker, e.g. from `parse`.
    root: where the cgroup file systems are mounted; default
      $OSCARS_CGROUP_ROOT or /sys/fs/cgroup (tests point it at a fake).
    period_us: the CFS period.
    deferred: start every cgroup unlimited; each worker applies its quota
      itself once ready (`apply_pending`), like Kubernetes' start-up CPU
      boost: TensorFlow's import and cluster start-up then take seconds,
      not minutes, under the smallest limits.
  """

  def __init__(self, limits, root=None, period_us=PERIOD_US, deferred=False):
    self.limits = list(limits)
    self.deferred = deferred
    self.root = pathlib.Path(root or os.environ.get(ROOT_ENV) or
                             DEFAULT_ROOT)
    self.period_us = period_us
    self.version = None  # 1 or 2, once created
    self.base = None  # the top of the cpu hierarchy
    self.parent = None  # this job's cgroup, once created
    self.dirs = []  # the workers' cgroups

  def detect(self):
    """(cgroup version, top of the cpu hierarchy); CpuLimitError if none.

    cgroup v2 where the unified hierarchy offers the cpu controller, at the
    root or (hybrid layout) at root/unified; else v1's cpu controller.
    """
    if not sys.platform.startswith("linux"):
      raise CpuLimitError(f"needs Linux cgroups; this is {sys.platform}")
    for version, base, probe in (
        (2, self.root, "cgroup.controllers"),
        (1, self.root / "cpu", "cpu.cfs_quota_us"),
        (2, self.root / "unified", "cgroup.controllers")):
      try:
        text = _read(base / probe)
      except OSError:
        continue
      if version == 1 or "cpu" in text.split():
        break
    else:
      raise CpuLimitError(
          f"no cgroup cpu controller mounted under {self.root} (neither "
          f"cgroup v1's {self.root}/cpu/cpu.cfs_quota_us nor cgroup v2's "
          f"cgroup.controllers listing cpu)")
    if not os.access(base, os.W_OK):
      raise CpuLimitError(
          f"cgroup v{version} {base} is not writable by uid {os.geteuid()} "
          "(needs root, or a delegated cgroup)")
    return version, base

  def create(self):
    """Creates the job's cgroup and one per worker, with their quotas.

    Raises CpuLimitError (nothing left behind) where the machine does not
    allow it.
    """
    self.version, self.base = self.detect()
    self._remove_stale()
    parent = self.base / f"oscars-{os.getpid()}-{secrets.token_hex(4)}"
    step = "create"
    try:
      if self.version == 2:
        # v2 sets a cgroup's cpu.max only where its parent enables the cpu
        # controller for its children.
        step = "enable the cpu controller in"
        self._enable_cpu(self.base)
        step = "create"
        os.mkdir(parent)
        self.parent = parent
        step = "enable the cpu controller in"
        self._enable_cpu(parent)
      else:
        os.mkdir(parent)
        self.parent = parent
      step = "set the CPU weight of"
      n = len(self.limits)
      if self.version == 2:
        _write(parent / "cpu.weight", str(min(100 * n, 10_000)))
      else:
        _write(parent / "cpu.shares", str(min(1024 * n, 262_144)))
      for i in range(len(self.limits)):
        step = "create"
        path = parent / f"worker-{i}"
        os.mkdir(path)
        self.dirs.append(path)
        step = "set the CPU quota of"
        if self.version == 1:
          _write(path / "cpu.cfs_period_us", str(self.period_us))
        _write(self.quota_file(i), self._quota_text(i, applied=False))
    except OSError as e:
      where = e.filename or parent
      self.remove()
      raise CpuLimitError(f"cannot {step} cgroup v{self.version} {where}: "
                          f"{e.strerror or e}") from None
    return self

  def quota_file(self, i):
    return self.dirs[i] / ("cpu.max" if self.version == 2 else
                           "cpu.cfs_quota_us")

  def _quota_text(self, i, applied=True):
    """What worker i's quota file holds: its quota, or (deferred and not
    yet `applied`) no limit."""
    if self.deferred and not applied:
      quota = "max" if self.version == 2 else "-1"
    else:
      quota = str(quota_us(self.limits[i], self.period_us))
    return f"{quota} {self.period_us}" if self.version == 2 else quota

  def rearm(self):
    """Deferred: every worker unlimited again until it is ready (a new
    attempt of the job reuses the cgroups)."""
    if self.deferred:
      for i in range(len(self.dirs)):
        _write(self.quota_file(i), self._quota_text(i, applied=False))

  def unapplied(self):
    """Deferred: the workers whose quota was never applied (they ran
    unlimited)."""
    if not self.deferred:
      return []
    unlimited = self._quota_text(0, applied=False).split()[0]
    out = []
    for i in range(len(self.dirs)):
      try:
        if _read(self.quota_file(i)).split()[0] == unlimited:
          out.append(i)
      except OSError:
        pass
    return out

  @staticmethod
  def _enable_cpu(path):
    control = path / "cgroup.subtree_control"
    try:
      enabled = "cpu" in _read(control).split()
    except FileNotFoundError:
      enabled = False
    if not enabled:  # a write needs more rights than a read
      try:
        _write(control, "+cpu")
      except OSError as e:
        if e.errno == errno.EBUSY:  # v2's "no internal processes" rule
          e.strerror = (f"{e.strerror} (cgroup v2 enables controllers for "
                        "children only of a cgroup without processes)")
        raise

  def describe(self):
    """One line per worker, saying the limit is EMULATED and how."""
    lines = []
    for i, limit in enumerate(self.limits):
      quota = quota_us(limit, self.period_us)
      how = (f"cpu.max={quota} {self.period_us}" if self.version == 2 else
             f"cpu.cfs_quota_us={quota}")
      when = (", from when the worker is ready (cpu_limits.apply_pending); "
              "unlimited during start-up" if self.deferred else "")
      lines.append(f"EMULATED CPU limit: worker {i} gets {limit:g} CPU "
                   f"(cgroup v{self.version} {how}{when})")
    return lines

  def worker_env(self):
    """{worker: {ENV: its limit}}, for the workers' environments; deferred,
    also PENDING_ENV: the quota file and what to write there."""
    env = {i: {ENV: f"{limit:g}"} for i, limit in enumerate(self.limits)}
    if self.deferred:
      for i in env:
        env[i][PENDING_ENV] = json.dumps(
            {"file": str(self.quota_file(i)), "text": self._quota_text(i),
             "limit": self.limits[i]})
    return env

  def preexec(self, i):
    """A Popen preexec_fn that moves the forked child into worker i's cgroup.

    It runs before exec, so the worker's program and every thread or
    process it starts are limited from the start. Only syscalls: the path
    is encoded before the fork. Where the move fails, the child says so on
    its stderr and exits with 126, as a command that cannot run.
    """
    path = os.fsencode(self.dirs[i] / "cgroup.procs")

    def join():
      try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
          os.write(fd, b"%d" % os.getpid())
        finally:
          os.close(fd)
      except OSError as e:
        os.write(2, b"oscars-launch: cannot join cgroup %s: %s\n" %
                 (path, os.fsencode(e.strerror or str(e))))
        os._exit(126)
    return join

  def remove(self, timeout=5.0):
    """Removes the cgroups; returns those it could not remove (none).

    Processes still in a worker's cgroup (e.g. left running by a worker
    that exited) are moved to the top cgroup first; a cgroup that stays
    busy is retried until `timeout` seconds. Idempotent.
    """
    left = []
    deadline = time.monotonic() + timeout
    for path in self.dirs + ([self.parent] if self.parent else []):
      if not self._rmdir_evicting(path, deadline):
        left.append(path)
    self.dirs, self.parent = [], None
    return left

  def _rmdir_evicting(self, path, deadline):
    while True:
      self._evict(path)
      try:
        _rmdir(path)
        return True
      except FileNotFoundError:
        return True
      except OSError as e:
        # EBUSY: a process forked or exited while we moved the others.
        if e.errno != errno.EBUSY or time.monotonic() > deadline:
          return False
      time.sleep(0.02)

  def _evict(self, path):
    try:
      pids = _read(path / "cgroup.procs").split()
    except OSError:
      return
    for pid in pids:
      try:
        _write(self.base / "cgroup.procs", pid)
      except OSError:  # it exited meanwhile
        pass

  def _remove_stale(self):
    """Removes job cgroups whose launcher is gone (killed with SIGKILL)."""
    try:
      names = os.listdir(self.base)
    except OSError:
      return
    for name in names:
      m = _PARENT.match(name)
      if not m or _alive(int(m.group(1))):
        continue
      parent = self.base / name
      try:
        children = [parent / c for c in os.listdir(parent)
                    if (parent / c).is_dir()]
        for path in children + [parent]:
          if _read(path / "cgroup.procs"):
            break  # still in use: leave it
          _rmdir(path)
      except OSError:
        pass

  def __enter__(self):
    if self.parent is None:
      self.create()
    return self

  def __exit__(self, *exc_info):
    self.remove()
