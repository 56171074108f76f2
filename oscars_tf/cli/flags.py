"""absl flags for choosing and configuring a distribution strategy.

Importing this module defines the flags, so a user's own absl binary gets
them with one import:

    from absl import app
    from oscars_tf.cli import flags as oscars_flags

    def main(argv):
      strategy = oscars_flags.make_strategy()   # before any other TF op
      ...

    if __name__ == "__main__":
      app.run(main)

No TensorFlow import at module level: flags are defined (and `--help` works)
before TensorFlow starts.
"""

from absl import flags

from oscars_tf import cluster
from oscars_tf import schedules
from oscars_tf import simulate

STRATEGIES = ("oscars", "local_sgd", "sync", "mirrored",
              "multi_worker_mirrored", "parameter_server", "default")
PERIOD_RULES = ("cost", "adacomm", "quadratic", "divergence", "constant")
RESOLVERS = ("tf_config", "slurm")

flags.DEFINE_enum(
    "strategy", "oscars", STRATEGIES,
    "oscars: OscarsStrategy with the adaptive schedule; local_sgd: "
    "OscarsStrategy averaging every --period steps; sync: OscarsStrategy "
    "averaging every step; mirrored / multi_worker_mirrored / "
    "parameter_server / default: TensorFlow's own strategies, for "
    "comparison (parameter_server: asynchronous, on the chief of an "
    "`oscars-launch --num_ps N` cluster).")
flags.DEFINE_integer("period", 8, "local_sgd: local steps between averagings.",
                     lower_bound=1)
flags.DEFINE_integer("warmup_steps", 0, "local_sgd: average after each of the "
                     "first this many steps.", lower_bound=0)
flags.DEFINE_enum("period_rule", "cost", PERIOD_RULES,
                  "oscars: how the averaging period adapts (cost: "
                  "adacomm's period, never shorter than the measured cost "
                  "of averaging allows, see --max_overhead).")
flags.DEFINE_float("max_overhead", 0.1, "oscars, --period_rule=cost: the "
                   "share of each round averaging may take.",
                   lower_bound=1e-3, upper_bound=0.999)
flags.DEFINE_integer("initial_period", 16, "oscars: steps of the fastest "
                     "worker per round before the rule has data.",
                     lower_bound=1)
flags.DEFINE_integer("min_period", 1, "oscars: lower bound of the period.",
                     lower_bound=1)
flags.DEFINE_integer("max_period", 256, "oscars: upper bound of the period.",
                     lower_bound=1)
flags.DEFINE_enum("grouping", "host", list(schedules.GROUPINGS),
                  "oscars: who averages together between global syncs.")
flags.DEFINE_integer("global_every", 4, "oscars: rounds between global "
                     "syncs when groups are smaller than the cluster.",
                     lower_bound=1)
flags.DEFINE_integer("max_group_size", None, "oscars: most members of a "
                     "group (default: 64); global syncs keep their rings "
                     "within it too.",
                     lower_bound=2)
flags.DEFINE_integer("max_groupings", None, "oscars: most distinct "
                     "groupings a run makes (default: 16).", lower_bound=1)
flags.DEFINE_float("max_overshoot", None, "oscars: a worker that would "
                   "arrive more than this fraction of T late takes one step "
                   "fewer (default: none; e.g. 0.02).", lower_bound=0.0)
flags.DEFINE_float("min_utilization", schedules.DEFAULT_MIN_UTILIZATION,
                   "oscars: T grows by whole steps of the slowest worker "
                   "until the planned compute share reaches this (0: off, T "
                   "is the period rule's; higher: fewer, longer rounds).",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_enum("weighting", "work", list(schedules.WEIGHTINGS),
                  "oscars: how members' models are weighted in an average.")
flags.DEFINE_enum("optimizer_state", "group_variance",
                  ["group_variance", "local", "average"],
                  "Optimizer slots: per worker, Adam's second moment rescaled "
                  "to the group's batch at each averaging (group_variance); "
                  "per worker (local); or averaged with the model.")
flags.DEFINE_enum("communication", "auto", ["auto", "ring", "nccl"],
                  "Collective implementation for averaging.")
flags.DEFINE_enum("averaging_dtype", "float32",
                  ["float32", "bfloat16", "float16"],
                  "OscarsStrategy: the dtype float32 weights are averaged in "
                  "(bfloat16/float16: half the bytes, rounded averages; see "
                  "OscarsStrategy's averaging_dtype).")
flags.DEFINE_enum("compression", "none", ["none", "int8", "int4"],
                  "OscarsStrategy: send each averaging's change since the "
                  "last global sync quantized to 8 or 4 bits, with error "
                  "feedback (see OscarsStrategy's compression); not with "
                  "--averaging_dtype.")
flags.DEFINE_bool("overlap", False,
                  "OscarsStrategy: run each averaging that costs more than "
                  "a tenth of a round's compute beside the next round's "
                  "local steps, keeping their progress (see "
                  "OscarsStrategy's overlap).")
flags.DEFINE_bool("overlap_always", False,
                  "OscarsStrategy: --overlap for every averaging, the cheap "
                  "ones too (overlap=\"always\").")
flags.DEFINE_float("collective_timeout", 300.0, "Seconds to wait for peers at "
                   "an averaging point before failing.", lower_bound=1e-3)
flags.DEFINE_float("straggler_timeout", None, "Seconds the chief waits at a "
                   "round end for a late worker before dropping it from the "
                   "round (default: 60, or --collective_timeout if shorter).",
                   lower_bound=1e-3)
flags.DEFINE_float("join_timeout", 120.0, "Seconds each worker waits at its "
                   "start for every task of the cluster to start before it "
                   "is ended with an error naming the missing ones.",
                   lower_bound=1e-3)
flags.DEFINE_float("tf_heartbeat_timeout", None,
                   "--strategy=multi_worker_mirrored: seconds TensorFlow's "
                   "coordination service waits for a task's heartbeat "
                   "before it fails the job (default: TensorFlow's, 10 s; "
                   "slow links need more).",
                   lower_bound=1.0)
flags.DEFINE_float("outer_momentum", None, "If set, SlowMo/DiLoCo outer "
                   "momentum in [0, 1) on the averaged trainable weights at "
                   "global syncs (its state is in --checkpoint_dir's "
                   "checkpoints).",
                   lower_bound=0.0, upper_bound=0.999)
flags.DEFINE_float("outer_learning_rate", None, "With --outer_momentum: the "
                   "outer step's learning rate (default 1; DiLoCo: 0.7 with "
                   "momentum 0.9).")
flags.DEFINE_string("simulate_step_time", None, "SIMULATED heterogeneity, "
                    "e.g. '20ms*1,1,2,4' (default: $OSCARS_SIMULATE_STEP_TIME,"
                    " which oscars-launch --simulate_step_time sets).")
flags.DEFINE_enum("cluster_resolver", "tf_config", RESOLVERS,
                  "Where the cluster comes from: $TF_CONFIG (oscars-launch, "
                  "Kubeflow) or Slurm's environment (srun).")
flags.DEFINE_integer("slurm_port", 8888, "With --cluster_resolver=slurm: "
                     "first port of the workers on each node.",
                     lower_bound=1, upper_bound=65535)
flags.DEFINE_string("logdir", None, "TensorBoard log directory.")

FLAGS = flags.FLAGS


@flags.multi_flags_validator(
    ["min_period", "initial_period", "max_period"],
    message="need --min_period <= --initial_period <= --max_period")
def _periods_ordered(values):
  return (values["min_period"] <= values["initial_period"] <=
          values["max_period"])


@flags.multi_flags_validator(
    ["strategy", "averaging_dtype"],
    message="--averaging_dtype applies to OscarsStrategy only (--strategy="
    "oscars, local_sgd or sync); TensorFlow's strategies average gradients "
    "in float32")
def _averaging_dtype_is_oscars(values):
  return (values["averaging_dtype"] == "float32" or
          values["strategy"] in ("oscars", "local_sgd", "sync"))


@flags.multi_flags_validator(
    ["strategy", "compression", "averaging_dtype"],
    message="--compression applies to OscarsStrategy only (--strategy="
    "oscars, local_sgd or sync), with --averaging_dtype=float32")
def _compression_is_oscars(values):
  return values["compression"] == "none" or (
      values["strategy"] in ("oscars", "local_sgd", "sync") and
      values["averaging_dtype"] == "float32")


@flags.multi_flags_validator(
    ["strategy", "overlap", "overlap_always"],
    message="--overlap and --overlap_always apply to OscarsStrategy only "
    "(--strategy=oscars, local_sgd or sync)")
def _overlap_is_oscars(values):
  return not (values["overlap"] or values["overlap_always"]) or values[
      "strategy"] in ("oscars", "local_sgd", "sync")


@flags.multi_flags_validator(
    ["strategy", "tf_heartbeat_timeout"],
    message="--tf_heartbeat_timeout applies to "
    "--strategy=multi_worker_mirrored only")
def _heartbeats_are_mirrored(values):
  return (values["tf_heartbeat_timeout"] is None or
          values["strategy"] == "multi_worker_mirrored")


@flags.multi_flags_validator(
    ["strategy", "outer_momentum"],
    message="--outer_momentum applies to OscarsStrategy only (--strategy="
    "oscars, local_sgd or sync): TensorFlow's strategies have no outer step")
def _outer_momentum_is_oscars(values):
  return values["outer_momentum"] is None or values["strategy"] in (
      "oscars", "local_sgd", "sync")


@flags.multi_flags_validator(
    ["outer_momentum", "outer_learning_rate"],
    message="--outer_learning_rate needs --outer_momentum (0 for an outer "
    "step without momentum)")
def _outer_rate_has_momentum(values):
  return (values["outer_learning_rate"] is None or
          values["outer_momentum"] is not None)


flags.register_validator(
    "outer_learning_rate", lambda rate: rate is None or rate > 0,
    message="--outer_learning_rate must be > 0")


@flags.validator("simulate_step_time", message="--simulate_step_time: not "
                 "a spec such as '20ms*1,1,2,4' or '20ms;2:4x@60s'")
def _simulated_step_time_parses(spec):
  try:
    simulate.StepTimeProfile.parse(spec)
  except ValueError:
    return False
  return True


def _check_fixed_period_flags(f):
  """ValueError for --period or --warmup_steps given to a strategy other
  than local_sgd: its schedule would silently go its own way."""
  given = [name for name in ("period", "warmup_steps") if f[name].present]
  if given and f.strategy != "local_sgd":
    raise ValueError(f"--{given[0]} applies to --strategy=local_sgd (a fixed "
                     f"period), not --strategy={f.strategy}")


def make_schedule(flag_values=FLAGS):
  """The `oscars_tf.schedules.Schedule` the flags describe (Oscars kinds)."""
  f = flag_values
  if f.strategy == "local_sgd":
    return schedules.Fixed(every=f.period, warmup_steps=f.warmup_steps)
  _check_fixed_period_flags(f)
  if f.strategy == "sync":
    return schedules.Fixed(every=1)
  if f.period_rule == "cost":
    rule = schedules.CostAware(max_overhead=f.max_overhead)
  else:
    rule = {"adacomm": schedules.AdaComm,
            "quadratic": schedules.QuadraticSync,
            "divergence": schedules.DivergenceBand,
            "constant": schedules.Constant}[f.period_rule]()
  return schedules.Adaptive(
      period_rule=rule, initial_period=f.initial_period,
      min_period=f.min_period, max_period=f.max_period, grouping=f.grouping,
      global_every=f.global_every, weighting=f.weighting,
      max_group_size=f.max_group_size, max_groupings=f.max_groupings,
      max_overshoot=f.max_overshoot,
      min_utilization=f.min_utilization or None)  # 0: off


def make_outer_optimizer(flag_values=FLAGS):
  """`OuterMomentum` from --outer_momentum and --outer_learning_rate, or
  None (plain averaging)."""
  f = flag_values
  if f.outer_momentum is None:
    return None
  return schedules.OuterMomentum(momentum=f.outer_momentum,
                                 learning_rate=f.outer_learning_rate or 1.0)


def make_resolver(flag_values=FLAGS):
  """A ClusterResolver for --cluster_resolver, or None for TF_CONFIG."""
  if flag_values.cluster_resolver == "tf_config":
    return None
  return cluster.slurm_resolver(port_base=flag_values.slurm_port)


def _configure_heartbeats(resolver, seconds):
  """The coordination service MultiWorkerMirroredStrategy would configure,
  with `seconds` of heartbeat timeout (it keeps a service configured before
  it: collective_all_reduce_strategy.py)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top

  from oscars_tf.runtime.server import coordination_config_pb2  # pylint: disable=g-import-not-at-top
  resolver = resolver or (
      tf.distribute.cluster_resolver.TFConfigClusterResolver())
  spec = resolver.cluster_spec()
  if not spec.jobs or resolver.task_type not in ("chief", "worker"):
    return  # one worker, or a task MWMS configures no service for
  context.context().configure_coordination_service(
      service_type="standalone",
      service_leader=multi_worker_util.coordination_leader(spec),
      heartbeat_timeout_in_ms=int(seconds * 1000),
      coordinated_jobs=[
          coordination_config_pb2.CoordinatedJob(
              name=job, num_tasks=spec.num_tasks(job))
          for job in ("chief", "worker") if job in spec.jobs])


def make_strategy(flag_values=FLAGS):
  """Builds the strategy the flags describe; call it before other TF ops."""
  f = flag_values
  _check_fixed_period_flags(f)  # before TensorFlow's import and its logs
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  resolver = make_resolver(f)
  if f.strategy in ("default", "mirrored"):
    # One machine's devices: in a cluster every task would train a model
    # of its own and write the same files as the others.
    spec = (resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver(
        )).cluster_spec()
    tasks = sum(spec.num_tasks(j) for j in spec.jobs)
    if tasks > 1:
      raise ValueError(
          f"--strategy={f.strategy} trains on one process's devices, but "
          f"this process is one of {tasks} tasks of a cluster: use "
          "--strategy=multi_worker_mirrored or oscars (or run one process).")
  if f.strategy == "default":
    return tf.distribute.get_strategy()
  if f.strategy == "mirrored":
    return tf.distribute.MirroredStrategy()
  if f.strategy == "multi_worker_mirrored":
    if f.tf_heartbeat_timeout is not None:
      _configure_heartbeats(resolver, f.tf_heartbeat_timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
  if f.strategy == "parameter_server":
    resolver = resolver or (
        tf.distribute.cluster_resolver.TFConfigClusterResolver())
    if resolver.task_type != "chief":
      # TensorFlow's pattern: workers and ps tasks only serve (see
      # examples/ps_loop.serve_unless_chief).
      raise ValueError(
          "--strategy=parameter_server: only the chief builds the strategy; "
          f"this task is {resolver.task_type!r}: run a tf.distribute.Server "
          "there (oscars-launch --num_ps N starts the chief, workers and "
          "ps tasks).")
    return tf.distribute.ParameterServerStrategy(resolver)
  import oscars_tf  # pylint: disable=g-import-not-at-top
  return oscars_tf.OscarsStrategy(
      schedule=make_schedule(f), cluster_resolver=resolver,
      optimizer_state=f.optimizer_state, communication=f.communication,
      collective_timeout=f.collective_timeout,
      straggler_timeout=f.straggler_timeout, join_timeout=f.join_timeout,
      simulate_step_time=f.simulate_step_time,
      outer_optimizer=make_outer_optimizer(f),
      logdir=f.logdir, averaging_dtype=f.averaging_dtype,
      compression=None if f.compression == "none" else f.compression,
      overlap="always" if f.overlap_always else f.overlap)
