"""oscars-launch: start N local workers of one training job.

    oscars-launch --num_workers 4 -- python train.py --epochs 3

Each worker gets its own TF_CONFIG on a free loopback port. The cluster's
gRPC is unauthenticated and TensorFlow listens on all interfaces, so the job
runs in a private network namespace whose only interface is loopback
(--network; see netns.py): nothing is reachable from outside unless asked.
Every output line is prefixed with the worker index. A worker other than
the chief killed by a signal is lost: the others drop it and go on
(--keep_going). When the chief dies or a worker fails with an error, the
others are stopped and the launcher exits non-zero with a message naming
the worker; with --restarts=K it starts all workers again instead, up to K
times, and training resumes from its last checkpoint. Ctrl-C stops all
workers. Imports no TensorFlow.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

from oscars_tf import netns

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_integer("num_workers", 2, "Number of worker processes.",
                       lower_bound=1)
  flags.DEFINE_string("host", "127.0.0.1",
                      "Address the workers bind. The cluster's gRPC has no "
                      "authentication: use loopback or a private network.")
  flags.DEFINE_enum("network", "auto", ["auto", "isolated", "host"],
                    "isolated: run the job in a private network namespace "
                    "with loopback only, so TensorFlow's gRPC listeners "
                    "(which bind 0.0.0.0) are unreachable from outside; the "
                    "workers then have no network (data sets that download "
                    "need --network=host). host: the machine's network. "
                    "auto: isolated where the machine allows it, else host "
                    "with a warning. Only with a loopback --host.")
  flags.DEFINE_float("grace_seconds", 10.0, "After one worker fails, how long "
                     "the others get to exit after SIGTERM before SIGKILL.",
                     lower_bound=0)
  flags.DEFINE_float("timeout", 0.0, "Stop the whole job after this many "
                     "seconds (0: no limit).", lower_bound=0)
  flags.DEFINE_boolean("keep_going", True, "When a worker other than the "
                       "chief is killed by a signal, the others drop it and "
                       "finish training without it (OscarsStrategy's "
                       "straggler_timeout). With --nokeep_going, any death "
                       "stops the job.")
  flags.DEFINE_integer("restarts", 0, "When the chief dies, or a worker "
                       "fails with an error (or dies, with --nokeep_going), "
                       "stop the others and start all workers again, up to "
                       "this many times (training resumes from the last "
                       "averaged checkpoint if the workers save one, e.g. "
                       "examples/train.py --checkpoint_dir).", lower_bound=0)
  flags.DEFINE_string("simulate_step_time", "",
                      "SIMULATED heterogeneity: a per-worker delay added to "
                      "each training step, e.g. '20ms*1,1,2,4' or "
                      "'20ms;2:4x@60s' (see oscars_tf.simulate). Passed to "
                      "the workers as OSCARS_SIMULATE_STEP_TIME.")


def free_ports(n, host="127.0.0.1"):
  """n distinct free TCP ports on host (bound once, then released)."""
  sockets, ports = [], []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind((host, 0))
      sockets.append(s)
      ports.append(s.getsockname()[1])
  finally:
    for s in sockets:
      s.close()
  return ports


def tf_configs(num_workers, host="127.0.0.1", ports=None, hosts=None):
  """One TF_CONFIG JSON string per worker of a local cluster.

  `hosts` (one address per worker) places workers on different addresses,
  e.g. 127.0.0.1 and 127.0.0.2 to stand for two hosts on loopback.
  """
  ports = ports or free_ports(num_workers, host)
  hosts = hosts or [host] * num_workers
  cluster = {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]}
  return [json.dumps({"cluster": cluster,
                      "task": {"type": "worker", "index": i}})
          for i in range(num_workers)]


def _pump(stream, prefix, out):
  for line in iter(stream.readline, b""):
    out.write(prefix + line.decode(errors="replace"))
    out.flush()
  stream.close()


class Job:
  """A set of local worker processes started with their TF_CONFIGs."""

  def __init__(self, command, num_workers, host="127.0.0.1", env=None,
               worker_env=None, out=None, hosts=None):
    self.command = list(command)
    self.num_workers = num_workers
    self.procs = []
    self._threads = []
    out = out or sys.stdout
    for i, config in enumerate(tf_configs(num_workers, host, hosts=hosts)):
      penv = dict(os.environ if env is None else env)
      penv["TF_CONFIG"] = config
      penv.update((worker_env or {}).get(i, {}))
      p = subprocess.Popen(self.command, env=penv, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
      t = threading.Thread(target=_pump, args=(p.stdout, f"[{i}] ", out),
                           daemon=True)
      t.start()
      self.procs.append(p)
      self._threads.append(t)

  def wait(self, timeout=None, grace=10.0, poll=0.05, keep_going=False):
    """Waits for all workers; returns (exit codes, failed index or None).

    The first worker to exit non-zero ends the job: the others get SIGTERM,
    then SIGKILL after `grace` seconds. With `keep_going`, a worker other
    than the chief that is killed by a signal (SIGKILL, an OOM kill, a
    crash) is *lost* instead: the others drop it at their next round end and
    go on (see `lost`). A worker that exits with an error code still ends
    the job, since that is a bug or a bad input every worker may share.
    """
    deadline = None if not timeout else time.monotonic() + timeout
    failed = None
    self.lost = {}  # worker -> (exit code, seconds since start)
    t0 = time.monotonic()
    while True:
      codes = [p.poll() for p in self.procs]
      for i, c in enumerate(codes):
        if (keep_going and i > 0 and c is not None and c < 0 and
            i not in self.lost):
          self.lost[i] = (c, time.monotonic() - t0)
          print(f"oscars-launch: worker {i} {_describe_exit(c)}; the others "
                "go on without it.", file=sys.stderr)
      bad = [i for i, c in enumerate(codes)
             if c not in (None, 0) and i not in self.lost]
      if bad:
        failed = bad[0]
        break
      if all(c == 0 or i in self.lost for i, c in enumerate(codes)):
        break
      if deadline and time.monotonic() > deadline:
        failed = "timeout"
        break
      time.sleep(poll)
    if failed is not None:
      self.stop(grace)
    for t in self._threads:
      t.join(timeout=5)
    return [p.poll() for p in self.procs], failed

  def stop(self, grace=10.0):
    """SIGTERM every live worker (its whole process group), then SIGKILL."""
    for p in self.procs:
      _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in self.procs):
      time.sleep(0.05)
    for p in self.procs:
      _signal_group(p, signal.SIGKILL)
      p.wait()


def _signal_group(proc, sig):
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      pass


def _describe_exit(code):
  if code is not None and code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


def _isolate(argv):
  """Re-runs the launcher in a private network namespace, or says why not.

  Returns only where the job is to run here (already isolated, or not to be).
  """
  if os.environ.get(netns.ENV):
    netns.bring_up_loopback()
    return
  if FLAGS.network == "host" or not FLAGS.host.startswith("127."):
    return
  prefix = netns.unshare_command()
  if prefix is None:
    if FLAGS.network == "isolated":
      raise app.UsageError(
          "--network=isolated: this machine allows no private network "
          "namespace (needs `unshare` and root or user namespaces); use "
          "--network=host on a machine whose ports are firewalled.")
    print("oscars-launch: WARNING: no private network namespace here, so "
          "TensorFlow's unauthenticated gRPC servers listen on all "
          "interfaces (0.0.0.0) of this machine. Firewall the ports, or "
          "pass --network=host to silence this.", file=sys.stderr)
    return
  os.environ[netns.ENV] = "1"
  os.execv(prefix[0], prefix + [sys.executable, "-m", "oscars_tf.launch"] +
           argv[1:])


def main(argv):
  command = argv[1:]
  if command and command[0] == "--":
    command = command[1:]
  if not command:
    raise app.UsageError("give the worker command after --, e.g. "
                         "oscars-launch --num_workers 2 -- python train.py")
  _isolate(sys.argv)
  env = None
  if FLAGS.simulate_step_time:
    from oscars_tf import simulate  # pylint: disable=g-import-not-at-top
    try:
      profile = simulate.StepTimeProfile.parse(FLAGS.simulate_step_time)
    except ValueError as e:
      raise app.UsageError(f"--simulate_step_time: {e}")
    for line in profile.describe(FLAGS.num_workers):
      print(f"oscars-launch: {line}", file=sys.stderr)
    env = dict(os.environ, OSCARS_SIMULATE_STEP_TIME=FLAGS.simulate_step_time)
  deadline = time.monotonic() + FLAGS.timeout if FLAGS.timeout else None
  for attempt in range(FLAGS.restarts + 1):
    # A new job, on new ports: the old ones may still be in TIME_WAIT.
    job_env = dict(os.environ if env is None else env,
                   OSCARS_LAUNCH_ATTEMPT=str(attempt))
    job = Job(command, FLAGS.num_workers, FLAGS.host, env=job_env)
    left = None if deadline is None else max(deadline - time.monotonic(), 0.01)
    try:
      codes, failed = job.wait(left, FLAGS.grace_seconds,
                               keep_going=FLAGS.keep_going)
    except KeyboardInterrupt:
      job.stop(FLAGS.grace_seconds)
      print("oscars-launch: interrupted; stopped all workers.",
            file=sys.stderr)
      return 130
    if failed is None or failed == "timeout" or attempt == FLAGS.restarts:
      break
    print(f"oscars-launch: worker {failed} {_describe_exit(codes[failed])}; "
          f"stopped the others; restarting all {FLAGS.num_workers} workers "
          f"(restart {attempt + 1} of {FLAGS.restarts}).", file=sys.stderr)
  if failed == "timeout":
    print(f"oscars-launch: job ran past --timeout={FLAGS.timeout:g}s; stopped "
          "all workers.", file=sys.stderr)
    return 124
  if failed is not None:
    print(f"oscars-launch: worker {failed} {_describe_exit(codes[failed])}; "
          "stopped the other workers.", file=sys.stderr)
    return 1
  if job.lost:
    print(f"oscars-launch: the job finished without worker(s) "
          f"{sorted(job.lost)}, lost during training.", file=sys.stderr)
    return 0
  print(f"oscars-launch: all {FLAGS.num_workers} workers finished.",
        file=sys.stderr)
  return 0


def run():
  define_flags()
  app.run(main)


if __name__ == "__main__":
  run()
