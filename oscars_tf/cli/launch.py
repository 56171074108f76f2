"""oscars-launch: start N local workers of one training job.

    oscars-launch --num_workers 4 -- python train.py --epochs 3

Each worker gets its own TF_CONFIG on a free loopback port. The cluster's
gRPC is unauthenticated and TensorFlow listens on all interfaces, so the job
runs in a private network namespace whose only interface is loopback
(--network; see netns.py): nothing is reachable from outside unless asked.
--network=emulated gives each worker a namespace and address of its own
instead, on links shaped to --bandwidth (see tools/worker_netns.py).
Every output line is prefixed with the worker index. A worker other than
the chief killed by a signal is lost: the others drop it and go on
(--keep_going). When the chief dies or a worker fails with an error, the
others are stopped and the launcher exits non-zero with a message naming
the worker; with --restarts=K it starts all workers again instead, up to K
times, and training resumes from its last checkpoint. A worker killed
inside an averaging collective aborts the others' collectives: they save
their state and exit with code 75, and the launcher restarts the job by
itself (--lost_peer_restarts), resuming from that state. With --num_ps,
the job is TensorFlow's ParameterServerStrategy cluster (a chief, the
workers, the ps tasks): the workers' and ps tasks' servers run until the
chief exits, and the chief's exit ends the job.

No worker outlives the launcher: SIGTERM, SIGINT (Ctrl-C) and SIGHUP are
forwarded to every worker's process group, SIGKILL follows after
--grace_seconds, and the launcher exits with 128 + the signal's number; a
launcher killed with SIGKILL takes its workers with it (Linux's parent-death
signal). Workers start with TensorFlow's C++ start-up logging quieted
(--tf_log_level). With --cpu_limit each worker runs in a cgroup of its own
with a real CPU quota (EMULATED heterogeneity; see cpu_limits.py).
With --nnodes N, the same command runs once on every node (--node_rank,
--rendezvous): the nodes meet at node 0, and each starts its own workers
with the whole job's TF_CONFIG (cli/multi_node.py, tools/rendezvous.py).
`oscars-launch --help` lists the flags by section. Imports no TensorFlow.
"""

import os
import sys
import time

from absl import app
from absl import flags

from oscars_tf.cli import launch_attempts
from oscars_tf.cli import multi_node
from oscars_tf.cli import node_attempts
from oscars_tf.errors import WorkerStartError
from oscars_tf.tools import command_help
from oscars_tf.tools import cpu_limits
from oscars_tf.tools import emulation
from oscars_tf.tools import netns
from oscars_tf.tools import rendezvous
from oscars_tf.tools import worker_netns
from oscars_tf.tools.job_layout import free_ports  # noqa: F401
from oscars_tf.tools.job_layout import tf_configs  # noqa: F401
from oscars_tf.tools.worker_processes import FORWARDED_SIGNALS  # noqa: F401 (oscars_tf.cli.launch.Job)
from oscars_tf.tools.worker_processes import Job  # noqa: F401 (oscars_tf.cli.launch.Job)
from oscars_tf.tools.worker_processes import Signals  # noqa: F401 (oscars_tf.cli.launch.Job)
from oscars_tf.tools.worker_processes import describe_exit  # noqa: F401 (oscars_tf.cli.launch.Job)

FLAGS = flags.FLAGS

USAGE = "oscars-launch [flags] -- CMD..."
DESCRIPTION = (
    "Starts N local workers of one training job, each with its own "
    "TF_CONFIG,\nand stops them all together: on a failure, a --timeout or "
    "a signal.")
# --help lists the flags in these sections, in this order.
SECTIONS = (
    ("cluster", ("num_workers", "num_ps", "coordinator", "timeout",
                 "tf_log_level")),
    ("recovery", ("keep_going", "restarts", "lost_peer_restarts",
                  "grace_seconds")),
    ("networking", ("network", "host", "bandwidth")),
    ("nodes", multi_node.FLAG_NAMES),
    ("emulation", ("simulate_step_time", "cpu_limit", "cpu_limit_from")),
)
# TensorFlow's C++ runtime logs a dozen INFO and WARNING lines per worker at
# start-up (CUDA probing, CPU features, oneDNN, absl::InitializeLog); level 2
# keeps errors. gRPC's own logging likewise.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "GRPC_VERBOSITY": "ERROR"}


def define_flags(flag_values=FLAGS):
  """Defines the launcher's flags (see SECTIONS) in `flag_values`."""
  fv = {"flag_values": flag_values}
  for define in (_cluster_flags, _recovery_flags, _networking_flags,
                 multi_node.define_flags, _emulation_flags):
    define(fv)


def _cluster_flags(fv):
  """SECTIONS' cluster: the tasks of the job, its timeout, its logging."""
  flags.DEFINE_integer("num_workers", 2, "Number of worker processes.",
                       lower_bound=1, **fv)
  flags.DEFINE_integer(
      "num_ps", 0, "Parameter servers: with N > 0 the job is "
      "ParameterServerStrategy's cluster, a `chief` task (the coordinator), "
      "--num_workers `worker` tasks and N `ps` tasks (log prefixes [chief], "
      "[0], [ps0]). The workers' and ps tasks' servers run until the chief "
      "exits; then the launcher stops them (SIGTERM, SIGKILL after "
      "--grace_seconds); the job succeeds when the chief exits 0. Per-worker "
      "settings (--simulate_step_time) apply to the `worker` tasks by "
      "index.", lower_bound=0, **fv)
  flags.DEFINE_boolean(
      "coordinator", False, "Start one more task, the cluster's "
      "`coordinator` (log prefix [coordinator]), that hosts TensorFlow's "
      "coordination service instead of the chief (python -m "
      "oscars_tf.cli.coordinator): then the chief's process does not serve "
      "every worker's requests, which matters at hundreds of workers. It "
      "trains nothing; it is stopped when the workers are done, and its "
      "death ends the job as the chief's does. Not with ps tasks or an "
      "emulated network.", **fv)
  flags.DEFINE_float("timeout", 0.0, "Stop the whole job after this many "
                     "seconds (0: no limit).", lower_bound=0, **fv)
  flags.DEFINE_integer(
      "tf_log_level", int(QUIET_ENV["TF_CPP_MIN_LOG_LEVEL"]),
      "TF_CPP_MIN_LOG_LEVEL for the workers (0: all, 1: no INFO, 2: no "
      "WARNING either, 3: no ERROR either). The default hides TensorFlow's "
      "start-up noise unless TF_CPP_MIN_LOG_LEVEL is already set in the "
      "environment; given explicitly, the flag wins. GRPC_VERBOSITY=ERROR "
      "is set too unless already set.", lower_bound=0, upper_bound=3, **fv)


def _recovery_flags(fv):
  """SECTIONS' recovery: what a worker's death or failure does."""
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
  flags.DEFINE_integer("lost_peer_restarts", 3, "When a worker other than "
                       "the chief is killed by a signal while the others "
                       "average with it, TensorFlow aborts their collectives "
                       "for good: they save their state (examples/train.py "
                       "--checkpoint_dir) and exit with code 75. Then start "
                       "all workers again, up to this many times (not counted "
                       "in the restarts flag's budget); training resumes "
                       "from the newest saved state (at most the round in "
                       "flight is lost). 0: only the restarts flag restarts.",
                       lower_bound=0, **fv)
  flags.DEFINE_float("grace_seconds", 10.0, "How long workers get to exit "
                     "after the launcher signals them (SIGTERM when a worker "
                     "fails or on --timeout; the signal itself when the "
                     "launcher gets SIGTERM, SIGINT or SIGHUP) before "
                     "SIGKILL. A second signal to the launcher cuts it "
                     "short.", lower_bound=0, **fv)


def _networking_flags(fv):
  """SECTIONS' networking: where the workers listen, and their links."""
  flags.DEFINE_enum("network", "auto", ["auto", "isolated", "host",
                                        "emulated"],
                    "isolated: run the job in a private network namespace "
                    "with loopback only, so TensorFlow's gRPC listeners "
                    "(which bind 0.0.0.0) are unreachable from outside; the "
                    "workers then have no network (data sets that download "
                    "need --network=host). host: the machine's network. "
                    "auto: isolated where the machine allows it, else host "
                    "with a warning. isolated and auto need a loopback "
                    "--host (127.x, or a name such as localhost that "
                    "resolves there): with another, isolated refuses and "
                    "auto runs on the machine's network with a warning. "
                    "emulated: EMULATED links: each worker in a network "
                    "namespace of its own, at its own address on a veth "
                    "link to a bridge that reaches nothing else (as private "
                    "as isolated), shaped to --bandwidth; --host does not "
                    "apply. Needs root and iproute2 (ip, tc).", **fv)
  flags.DEFINE_string("host", "127.0.0.1",
                      "Address the workers bind: IPv4, or a name that "
                      "resolves to it. The cluster's gRPC has no "
                      "authentication: use loopback or a private network.",
                      **fv)
  flags.DEFINE_string("bandwidth", "",
                      "With --network=emulated: each worker's link rate, "
                      "one for all or a comma list, one per worker, in tc's "
                      "units (100mbit, 1gbit, 500kbit). A token bucket "
                      "filter (tc tbf) on each end of the link limits both "
                      "what the worker sends and what it receives, so "
                      "traffic between two workers flows at the lower of "
                      "their rates. With --num_ps, the chief and ps tasks "
                      "get links at the fastest worker's rate. Passed to "
                      "each worker as OSCARS_BANDWIDTH. Empty: links not "
                      "shaped.", **fv)


def _emulation_flags(fv):
  """SECTIONS' emulation: SIMULATED and EMULATED heterogeneity."""
  flags.DEFINE_string("simulate_step_time", "",
                      "SIMULATED heterogeneity: a per-worker delay added to "
                      "each training step, e.g. '20ms*1,1,2,4' or "
                      "'20ms;2:4x@60s' (see oscars_tf.simulate). Passed to "
                      "the workers as OSCARS_SIMULATE_STEP_TIME.", **fv)
  flags.DEFINE_string("cpu_limit", "",
                      "EMULATED heterogeneity: run each worker in a cgroup "
                      "of its own with a real CPU quota, as Kubernetes "
                      "enforces resources.limits.cpu (CFS quota: limit x "
                      "100 ms of CPU time per 100 ms). CPUs per worker, "
                      "e.g. '1,1,0.5,0.25', or one value for all ('500m' "
                      "= 0.5). Needs Linux, a cgroup cpu controller (v1 or "
                      "v2) and root. Passed to each worker as "
                      "OSCARS_CPU_LIMIT.", **fv)
  flags.DEFINE_enum("cpu_limit_from", "start", ["start", "ready"],
                    "When --cpu_limit applies. start: from the worker's "
                    "first instruction, as Kubernetes does. ready: once the "
                    "worker calls oscars_tf.tools.cpu_limits.apply_pending() "
                    "(examples/train.py does after its first training step), "
                    "like a start-up CPU boost: TensorFlow's start-up takes "
                    "seconds instead of minutes under small limits. The "
                    "launcher warns about a worker that never applied it.",
                    **fv)


def help_text(flag_values=FLAGS):
  """The launcher's --help: usage, description, flags by section."""
  return command_help.help_text(USAGE, DESCRIPTION, SECTIONS, flag_values)


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
  if FLAGS.network == "emulated":  # --host does not apply
    return
  try:  # a usage error, not a traceback from the job
    isolate, warning = netns.where_to_run(FLAGS.network, FLAGS.host)
    netns.check_listens(FLAGS.host)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if warning:
    print(f"oscars-launch: WARNING: {warning}", file=sys.stderr)
  if not isolate:
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
  os.execv(prefix[0], prefix + [sys.executable, "-m", "oscars_tf.cli.launch"] +
           argv[1:])


def _worker_env():
  explicit = FLAGS["tf_log_level"].present
  env = quiet_env(os.environ, FLAGS.tf_log_level if explicit else None)
  if FLAGS.simulate_step_time:
    from oscars_tf import simulate  # pylint: disable=g-import-not-at-top
    try:
      profile = simulate.StepTimeProfile.parse(FLAGS.simulate_step_time)
      if FLAGS.nnodes == 1:  # across nodes: the job's size comes later
        profile.check_workers(FLAGS.num_workers)
    except ValueError as e:
      raise app.UsageError(f"--simulate_step_time: {e}") from None
    for line in profile.describe(FLAGS.num_workers):
      print(f"oscars-launch: {line}", file=sys.stderr)
    env["OSCARS_SIMULATE_STEP_TIME"] = FLAGS.simulate_step_time
  return env


def _coordinator_command():
  """The coordinator task's command (--coordinator), or None."""
  if not FLAGS.coordinator:
    return None
  if FLAGS.num_ps or FLAGS.network == "emulated":
    raise app.UsageError(
        "--coordinator: not with "
        f"{'--num_ps' if FLAGS.num_ps else '--network=emulated'} (a "
        "ParameterServerStrategy job has its own chief; emulated links are "
        "per worker).")
  if FLAGS.num_workers < 2:
    raise app.UsageError("--coordinator: needs --num_workers of 2 or more "
                         "(one worker has no coordination service).")
  return [sys.executable, "-m", "oscars_tf.cli.coordinator"]


def _run(command):
  """Runs the job (restarting it as --restarts says); the exit code."""
  address = multi_node.check_flags(FLAGS)  # None: one node
  coordinator = _coordinator_command()
  if address is None:
    _isolate(sys.argv)
  env = _worker_env()
  deadline = time.monotonic() + FLAGS.timeout if FLAGS.timeout else None
  # Every attempt's workers join the same cgroups and namespaces, removed
  # at the end.
  with Signals() as signals, emulation.cpu_quotas(
      FLAGS.cpu_limit, FLAGS.num_workers,
      FLAGS.cpu_limit_from == "ready") as limits, emulation.network(
          FLAGS.network, FLAGS.bandwidth, FLAGS.num_workers, FLAGS.num_ps,
          FLAGS["host"].present) as spaces:
    if address is not None:
      return _run_node(command, env, deadline, signals, limits, address)
    job, codes, failed = launch_attempts.run(
        command, env, coordinator, deadline, signals, limits, spaces, FLAGS)
  return launch_attempts.exit_code(job, codes, failed, signals, FLAGS)


def _run_node(command, env, deadline, signals, limits, address):
  """One node's part of a job on several nodes; the exit code."""
  try:
    channel = multi_node.meet(FLAGS, address,
                              stop=lambda: signals.received)
  except rendezvous.Stopped:
    print(f"oscars-launch: got {signals.received.name} during the "
          "rendezvous; no worker started.", file=sys.stderr)
    return 128 + signals.received
  try:
    job, decision = node_attempts.run(command, env, deadline, signals,
                                      limits, channel, FLAGS)
  finally:
    channel.close()
  return node_attempts.exit_code(job, decision, signals, FLAGS)


def main(argv):
  command = argv[1:]
  if command and command[0] == "--":
    command = command[1:]
  try:
    if not command:
      raise app.UsageError("give the worker command after --, e.g. "
                           "oscars-launch --num_workers 2 -- python train.py")
    return _run(command)
  except emulation.FlagError as e:
    print(f"oscars-launch: error: {e}\nusage: {USAGE}\nTry --help.",
          file=sys.stderr)
    return 1
  except cpu_limits.CpuLimitError as e:
    # The machine, not the command line: one line, no usage.
    print(f"oscars-launch: error: --cpu_limit: {e}", file=sys.stderr)
    return 1
  except app.UsageError as e:
    # absl would print __main__'s docstring: the console script's is empty.
    print(f"oscars-launch: error: {e}\nusage: {USAGE}\nTry --help.",
          file=sys.stderr)
    return 1
  except WorkerStartError as e:
    print(f"oscars-launch: error: {e}", file=sys.stderr)
    return 1
  except rendezvous.RendezvousError as e:
    print(f"oscars-launch: error: rendezvous: {e}", file=sys.stderr)
    return 1
  except worker_netns.Unavailable as e:
    print(f"oscars-launch: error: --network=emulated: "
          f"{worker_netns.one_line(e)}", file=sys.stderr)
    return 1


def run():
  define_flags()
  # absl's --helpfull starts with __main__'s docstring; the console-script
  # wrapper has none.
  if not sys.modules["__main__"].__doc__:
    sys.modules["__main__"].__doc__ = f"usage: {USAGE}\n\n{DESCRIPTION}\n"
  app.run(main, flags_parser=command_help.flags_parser(help_text))


if __name__ == "__main__":
  run()
