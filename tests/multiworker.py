"""Runs real worker processes over real gRPC on loopback, for tests.

Every wait is bounded: a job that runs past its timeout is killed (whole
process groups) and the test fails with the workers' output.
"""

import atexit
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile

import forkserver
import job_log
from oscars_tf.cli import launch

WORKER_PROGRAM = pathlib.Path(__file__).with_name("worker_programs.py")
# Every job's output directory, one per test process, removed as it exits:
# a run of the suite leaves nothing in the system's temporary directory.
JOBS_DIR = tempfile.mkdtemp(prefix="oscars_jobs_")
atexit.register(shutil.rmtree, JOBS_DIR, ignore_errors=True)


@dataclasses.dataclass
class JobResult:
  codes: list
  failed: object
  outputs: list  # per worker: the dict it wrote, or None
  log: str
  outdir: str

  def tail(self, n=60):
    lines = [line for line in self.log.splitlines()
             if "GRPC error" not in line and
             "Error received from peer" not in line]
    return "\n".join(lines[-n:])


def worker_env(extra=None):
  env = dict(os.environ)
  env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
              "TF_NUM_INTRAOP_THREADS": "1", "PYTHONUNBUFFERED": "1"})
  env.pop("TF_CONFIG", None)
  env.update(extra or {})
  return env


def run(scenario, num_workers, params=None, timeout=180, per_worker_env=None,
        kill_on_failure=True, expect_success=True, hosts=None, program=None,
        env=None):
  """Runs `scenario` of worker_programs.py (or of `program`, a path whose
  first argument is then the params) on `num_workers` processes."""
  outdir = tempfile.mkdtemp(prefix=f"{scenario}_", dir=JOBS_DIR)
  params = dict(params or {}, outdir=outdir)
  log = job_log.JobLog()
  command = ([sys.executable, str(program), json.dumps(params)] if program
             else [sys.executable, str(WORKER_PROGRAM), scenario,
                   json.dumps(params)])
  job_env = worker_env(env)
  job = launch.Job(command, num_workers, env=job_env,
                   worker_env=per_worker_env, out=log, hosts=hosts,
                   spawn=forkserver.spawner(job_env))
  try:
    if kill_on_failure:
      codes, failed = job.wait(timeout=timeout, grace=3)
    else:
      codes, failed = _wait_all(job, timeout)
  finally:
    job.stop(grace=1)
  outputs = []
  for i in range(num_workers):
    path = os.path.join(outdir, f"worker_{i}.json")
    outputs.append(json.load(open(path)) if os.path.exists(path) else None)
  result = JobResult(codes, failed, outputs, log.text(), outdir)
  if expect_success:
    assert failed is None and all(c == 0 for c in codes), (
        f"job {scenario} failed ({failed}, codes {codes}):\n{result.tail()}")
  return result


def run_command(command, num_workers, timeout=180, env=None):
  """Runs `command` (argv) on `num_workers` launched workers; (codes, log)."""
  log = job_log.JobLog()
  job_env = worker_env(env)
  job = launch.Job(command, num_workers, env=job_env, out=log,
                   spawn=forkserver.spawner(job_env))
  try:
    codes, failed = job.wait(timeout=timeout, grace=3)
  finally:
    job.stop(grace=1)
  return codes, failed, log.text()


def _wait_all(job, timeout):
  """Waits for every worker to exit by itself (no early kill)."""
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if all(p.poll() is not None for p in job.procs):
      return [p.poll() for p in job.procs], None
    time.sleep(0.05)
  job.stop(grace=1)
  return [p.poll() for p in job.procs], "timeout"
