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
times, and training resumes from its last checkpoint.

No worker outlives the launcher: SIGTERM, SIGINT (Ctrl-C) and SIGHUP are
forwarded to every worker's process group, SIGKILL follows after
--grace_seconds, and the launcher exits with 128 + the signal's number; a
launcher killed with SIGKILL takes its workers with it (Linux's parent-death
signal). Workers start with TensorFlow's C++ start-up logging quieted
(--tf_log_level). `oscars-launch --help` lists the flags by section.
Imports no TensorFlow.
"""

import ctypes
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from oscars_tf import netns

FLAGS = flags.FLAGS

USAGE = "oscars-launch [flags] -- CMD..."
DESCRIPTION = (
    "Starts N local workers of one training job, each with its own "
    "TF_CONFIG,\nand stops them all together: on a failure, a --timeout or "
    "a signal.")
# --help lists the flags in these sections, in this order.
SECTIONS = (
    ("cluster", ("num_workers", "timeout", "tf_log_level")),
    ("recovery", ("keep_going", "restarts", "grace_seconds")),
    ("networking", ("network", "host")),
    ("emulation", ("simulate_step_time",)),
)
HELP_ARGS = ("-h", "--help", "-?", "--helpshort")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# TensorFlow's C++ runtime logs a dozen INFO and WARNING lines per worker at
# start-up (CUDA probing, CPU features, oneDNN, absl::InitializeLog); level 2
# keeps errors. gRPC's own logging likewise.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "GRPC_VERBOSITY": "ERROR"}


def define_flags(flag_values=FLAGS):
  """Defines the launcher's flags (see SECTIONS) in `flag_values`."""
  fv = {"flag_values": flag_values}
  flags.DEFINE_integer("num_workers", 2, "Number of worker processes.",
                       lower_bound=1, **fv)
  flags.DEFINE_float("timeout", 0.0, "Stop the whole job after this many "
                     "seconds (0: no limit).", lower_bound=0, **fv)
  flags.DEFINE_integer(
      "tf_log_level", int(QUIET_ENV["TF_CPP_MIN_LOG_LEVEL"]),
      "TF_CPP_MIN_LOG_LEVEL for the workers (0: all, 1: no INFO, 2: no "
      "WARNING either, 3: no ERROR either). The default hides TensorFlow's "
      "start-up noise unless TF_CPP_MIN_LOG_LEVEL is already set in the "
      "environment; given explicitly, the flag wins. GRPC_VERBOSITY=ERROR "
      "is set too unless already set.", lower_bound=0, upper_bound=3, **fv)
  flags.DEFINE_boolean("keep_going", True, "When a worker other than the "
                       "chief is killed by a signal, the others drop it and "
                       "finish training without it (OscarsStrategy's "
                       "straggler_timeout). With --nokeep_going, any death "
                       "stops the job.", **fv)
  flags.DEFINE_integer("restarts", 0, "When the chief dies, or a worker "
                       "fails with an error (or dies, with --nokeep_going), "
                       "stop the others and start all workers again, up to "
                       "this many times (training resumes from the last "
                       "averaged checkpoint if the workers save one, e.g. "
                       "examples/train.py --checkpoint_dir).", lower_bound=0,
                       **fv)
  flags.DEFINE_float("grace_seconds", 10.0, "How long workers get to exit "
                     "after the launcher signals them (SIGTERM when a worker "
                     "fails or on --timeout; the signal itself when the "
                     "launcher gets SIGTERM, SIGINT or SIGHUP) before "
                     "SIGKILL. A second signal to the launcher cuts it "
                     "short.", lower_bound=0, **fv)
  flags.DEFINE_enum("network", "auto", ["auto", "isolated", "host"],
                    "isolated: run the job in a private network namespace "
                    "with loopback only, so TensorFlow's gRPC listeners "
                    "(which bind 0.0.0.0) are unreachable from outside; the "
                    "workers then have no network (data sets that download "
                    "need --network=host). host: the machine's network. "
                    "auto: isolated where the machine allows it, else host "
                    "with a warning. Only with a loopback --host.", **fv)
  flags.DEFINE_string("host", "127.0.0.1",
                      "Address the workers bind. The cluster's gRPC has no "
                      "authentication: use loopback or a private network.",
                      **fv)
  flags.DEFINE_string("simulate_step_time", "",
                      "SIMULATED heterogeneity: a per-worker delay added to "
                      "each training step, e.g. '20ms*1,1,2,4' or "
                      "'20ms;2:4x@60s' (see oscars_tf.simulate). Passed to "
                      "the workers as OSCARS_SIMULATE_STEP_TIME.", **fv)


def help_text(flag_values=FLAGS):
  """The launcher's --help: usage, description, flags by section."""
  lines = [f"usage: {USAGE}", "", DESCRIPTION, ""]
  for title, names in SECTIONS:
    lines.append(f"{title}:")
    for name in names:
      flag = flag_values[name]
      dashes = f"--[no]{name}" if flag.boolean else f"--{name}"
      lines.append(flags.text_wrap(f"{dashes}: {flag.help}", indent="    ",
                                   firstline_indent="  "))
      syntax = flag.parser.syntactic_help
      lines.append(f"    (default: {flag.default_as_str}"
                   f"{'; ' + syntax if syntax else ''})")
    lines.append("")
  lines.append("absl's own flags (logging, --flagfile): --helpfull.")
  return "\n".join(lines)


def quiet_env(environ, tf_log_level=None):
  """`environ` for the workers, with TensorFlow's start-up logging quiet.

  QUIET_ENV fills in what `environ` does not set; an explicit `tf_log_level`
  overrides TF_CPP_MIN_LOG_LEVEL either way.
  """
  env = dict(environ)
  if tf_log_level is not None:
    env["TF_CPP_MIN_LOG_LEVEL"] = str(tf_log_level)
  for name, value in QUIET_ENV.items():
    env.setdefault(name, value)
  return env


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


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache
def _prctl():
  """libc's prctl(2), or None where there is none (not Linux)."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None
  prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
  prctl.restype = ctypes.c_int
  return prctl


def _die_with_parent():
  """A Popen preexec_fn: SIGKILL the child when its parent dies, or None.

  A launcher killed with SIGKILL runs no handler, so only the kernel can
  stop its workers: PR_SET_PDEATHSIG. The kernel sends it when the *thread*
  that started the child exits, so a Job must be started from a thread that
  outlives its workers (the launcher's main thread). Off Linux this returns
  None and only signal forwarding and process groups stop the workers.
  """
  prctl = _prctl()
  if prctl is None:
    return None
  parent = os.getpid()

  def preexec():
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # The parent died before prctl took hold.
      os.kill(os.getpid(), signal.SIGKILL)
  return preexec


class Signals:
  """Catches SIGTERM, SIGINT and SIGHUP while the launcher runs a job.

  The handler only records the signal: Job.wait sees it within one poll and
  forwards it to the workers. A signal ignored when the launcher starts
  (e.g. SIGHUP under nohup) stays ignored, as shells do.
  """

  def __init__(self):
    self.received = None  # the first signal, a signal.Signals
    self.count = 0
    self._previous = {}

  def __enter__(self):
    for sig in FORWARDED_SIGNALS:
      if signal.getsignal(sig) is not signal.SIG_IGN:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc_info):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame):
    del frame
    self.count += 1
    if self.received is None:
      self.received = signal.Signals(signum)


class Job:
  """A set of local worker processes started with their TF_CONFIGs.

  Each worker leads its own process group (signals reach whatever it
  starts) and, on Linux, is killed by the kernel if the thread that created
  the Job dies (see _die_with_parent).
  """

  def __init__(self, command, num_workers, host="127.0.0.1", env=None,
               worker_env=None, out=None, hosts=None, err=None):
    self.command = list(command)
    self.num_workers = num_workers
    self.procs = []
    self.lost = {}  # worker -> (exit code, seconds since start)
    self.killed = []  # workers that needed SIGKILL after the grace period
    self._threads = []
    # Two pipes, each pumped by whole lines: a log line on stderr is never
    # glued onto a progress bar's unfinished line on stdout. A capturing
    # `out` without `err` gets both.
    err = err or (out if out is not None else sys.stderr)
    out = out or sys.stdout
    preexec = _die_with_parent()
    for i, config in enumerate(tf_configs(num_workers, host, hosts=hosts)):
      penv = dict(os.environ if env is None else env)
      penv["TF_CONFIG"] = config
      penv.update((worker_env or {}).get(i, {}))
      # preexec_fn with the pump threads running is safe here: CPython runs
      # it in the forked child holding the GIL, and it takes no lock (prctl
      # is resolved before the fork; getppid and kill are syscalls).
      p = subprocess.Popen(self.command, env=penv, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, start_new_session=True,
                           preexec_fn=preexec)  # noqa: PLW1509
      for stream, sink in ((p.stdout, out), (p.stderr, err)):
        t = threading.Thread(target=_pump, args=(stream, f"[{i}] ", sink),
                             daemon=True)
        t.start()
        self._threads.append(t)
      self.procs.append(p)

  def wait(self, timeout=None, grace=10.0, poll=0.05, keep_going=False,
           interrupt=None):
    """Waits for all workers; returns (exit codes, failed index or None).

    The first worker to exit non-zero ends the job: the others get SIGTERM,
    then SIGKILL after `grace` seconds. With `keep_going`, a worker other
    than the chief that is killed by a signal (SIGKILL, an OOM kill, a
    crash) is *lost* instead: the others drop it at their next round end and
    go on (see `lost`). A worker that exits with an error code still ends
    the job, since that is a bug or a bad input every worker may share.
    Past `timeout` seconds, failed is "timeout". Once `interrupt` (a
    Signals) has received a signal, every worker gets that signal, then
    SIGKILL after `grace`, and failed is "signal"; a further signal cuts
    the grace period short (in any stop).
    """
    deadline = None if not timeout else time.monotonic() + timeout
    failed = None
    t0 = time.monotonic()
    while True:
      if interrupt is not None and interrupt.received:
        failed = "signal"
        break
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
      seen = interrupt.count if interrupt is not None else 0
      self.stop(grace, interrupt.received if failed == "signal" else
                signal.SIGTERM,
                hurry=lambda: interrupt is not None and interrupt.count > seen)
    for t in self._threads:
      t.join(timeout=5)
    return [p.poll() for p in self.procs], failed

  def stop(self, grace=10.0, sig=signal.SIGTERM, hurry=None):
    """Sends `sig` to every live worker's process group, then SIGKILL.

    SIGKILL goes to the workers still running after `grace` seconds, or as
    soon as `hurry()` is true. Returns their indices (also in `killed`).
    """
    for p in self.procs:
      _signal_group(p, sig)
    end = time.monotonic() + grace
    while (time.monotonic() < end and not (hurry and hurry()) and
           any(p.poll() is None for p in self.procs)):
      time.sleep(0.05)
    late = [i for i, p in enumerate(self.procs) if p.poll() is None]
    for p in self.procs:
      _signal_group(p, signal.SIGKILL)
      p.wait()
    self.killed = sorted(set(self.killed) | set(late))
    return late


def _signal_group(proc, sig):
  # Only while the leader is unreaped: after that its group id may be
  # reused by an unrelated process group.
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
  `unshare` (without --fork) execs in place: the launcher keeps its pid, so
  signals sent to it arrive here and the workers' parent, whose death
  SIGKILLs them, is this process.
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


def _worker_env():
  explicit = FLAGS["tf_log_level"].present
  env = quiet_env(os.environ, FLAGS.tf_log_level if explicit else None)
  if FLAGS.simulate_step_time:
    from oscars_tf import simulate  # pylint: disable=g-import-not-at-top
    try:
      profile = simulate.StepTimeProfile.parse(FLAGS.simulate_step_time)
    except ValueError as e:
      raise app.UsageError(f"--simulate_step_time: {e}")
    for line in profile.describe(FLAGS.num_workers):
      print(f"oscars-launch: {line}", file=sys.stderr)
    env["OSCARS_SIMULATE_STEP_TIME"] = FLAGS.simulate_step_time
  return env


def _run(command):
  """Runs the job (restarting it as --restarts says); the exit code."""
  _isolate(sys.argv)
  env = _worker_env()
  deadline = time.monotonic() + FLAGS.timeout if FLAGS.timeout else None
  with Signals() as signals:
    for attempt in range(FLAGS.restarts + 1):
      # A new job, on new ports: the old ones may still be in TIME_WAIT.
      job = Job(command, FLAGS.num_workers, FLAGS.host,
                env=dict(env, OSCARS_LAUNCH_ATTEMPT=str(attempt)))
      left = (None if deadline is None else
              max(deadline - time.monotonic(), 0.01))
      codes, failed = job.wait(left, FLAGS.grace_seconds,
                               keep_going=FLAGS.keep_going, interrupt=signals)
      if (signals.received or failed in (None, "timeout") or
          attempt == FLAGS.restarts):
        break
      print(f"oscars-launch: worker {failed} "
            f"{_describe_exit(codes[failed])}; stopped the others; "
            f"restarting all {FLAGS.num_workers} workers (restart "
            f"{attempt + 1} of {FLAGS.restarts}).", file=sys.stderr)
  if signals.received:
    late = (f"; SIGKILL to worker(s) {job.killed}, still running "
            f"{FLAGS.grace_seconds:g}s after it" if job.killed else "")
    print(f"oscars-launch: got {signals.received.name}; forwarded it to "
          f"every worker and stopped them all{late}.", file=sys.stderr)
    return 128 + signals.received
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


def main(argv):
  command = argv[1:]
  if command and command[0] == "--":
    command = command[1:]
  try:
    if not command:
      raise app.UsageError("give the worker command after --, e.g. "
                           "oscars-launch --num_workers 2 -- python train.py")
    return _run(command)
  except app.UsageError as e:
    # absl would print __main__'s docstring: the console script's is empty.
    print(f"oscars-launch: error: {e}\nusage: {USAGE}\nTry --help.",
          file=sys.stderr)
    return 1


def _parse_flags(argv):
  """absl's flag parsing, but -h/--help print help_text() and exit 0.

  absl's --help lists only the "key flags" of __main__, which for the
  console script is the entry-point wrapper: it would list none. Help flags
  after `--` belong to the worker command.
  """
  ours = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  if any(arg in HELP_ARGS for arg in ours):
    try:
      print(help_text(), flush=True)
    except BrokenPipeError:  # `oscars-launch --help | head`
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)
  return app.parse_flags_with_usage(argv)


def run():
  define_flags()
  # absl's --helpfull starts with __main__'s docstring; the console-script
  # wrapper has none.
  if not sys.modules["__main__"].__doc__:
    sys.modules["__main__"].__doc__ = f"usage: {USAGE}\n\n{DESCRIPTION}\n"
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
