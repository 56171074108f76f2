"""`OscarsStrategy`'s arguments, checked before it joins the cluster: a
user's mistake is one clear error, never a traceback from inside
TensorFlow or one that comes after the server started."""

import os

import tensorflow as tf

from oscars_tf import arguments
from oscars_tf import schedules as schedules_lib
from oscars_tf import simulate as simulate_lib
from oscars_tf.distribute import compression as compression_lib
from oscars_tf.distribute import overlap as overlap_lib
from oscars_tf.distribute import replicas
from oscars_tf.distribute import wiring
from oscars_tf.distribute.startup import OPTIMIZER_STATES
from oscars_tf.runtime import averaging

LOCAL_REPLICAS = replicas.LOCAL_REPLICAS
OWNER = "OscarsStrategy"  # as argument errors name it


# TensorFlow takes timeouts in int64 milliseconds: a larger finite one
# (1e18, for "never") failed inside it, after the worker joined. About 31
# years.
MAX_TIMEOUT_S = 1e9


def _timeout(name, value, seconds):
  value = arguments.positive_number(OWNER, name, value, seconds)
  if value > MAX_TIMEOUT_S:
    arguments.fail(OWNER, name, f"at most {MAX_TIMEOUT_S:g} seconds", value)
  return value


def checked(schedule, optimizer_state, communication, collective_timeout,
            local_replicas, simulate_step_time, outer_optimizer,
            straggler_timeout, averaging_dtype, join_timeout, compression=None,
            overlap=False, logdir=None):
  """`OscarsStrategy`'s arguments, checked in their order, with their
  defaults filled in: (the components' `wiring.Arguments`, join_timeout)."""
  schedule = schedules_lib.Adaptive() if schedule is None else schedule
  if not isinstance(schedule, schedules_lib.Schedule):
    raise TypeError("`schedule` must be an oscars_tf.schedules.Schedule "
                    f"such as Adaptive() or Fixed(every=8), got "
                    f"{schedule!r}.")
  arguments.one_of(OWNER, "optimizer_state", optimizer_state, OPTIMIZER_STATES)
  if outer_optimizer is not None and not isinstance(
      outer_optimizer, schedules_lib.OuterMomentum):
    raise TypeError("`outer_optimizer` must be None or "
                    "oscars_tf.schedules.OuterMomentum(...), got "
                    f"{outer_optimizer!r}.")
  arguments.one_of(OWNER, "local_replicas", local_replicas, LOCAL_REPLICAS)
  arguments.one_of(OWNER, "communication", communication,
                   averaging.COMMUNICATIONS)
  seconds = "a finite number of seconds"
  collective_timeout = _timeout("collective_timeout", collective_timeout,
                                seconds)
  if straggler_timeout is None:
    straggler_timeout = min(60.0, collective_timeout)
  if not (arguments.is_number(straggler_timeout) and
          0 < straggler_timeout <= collective_timeout):
    arguments.fail(OWNER, "straggler_timeout", "a number of seconds > 0 and "
                   f"at most `collective_timeout` ({collective_timeout})",
                   straggler_timeout)
  join_timeout = _timeout("join_timeout", join_timeout, seconds)
  averaging_dtype = averaging.averaging_dtype_of(averaging_dtype)
  if compression is not None:
    arguments.one_of(OWNER, "compression", compression,
                     compression_lib.COMPRESSIONS + (None,))
    if averaging_dtype is not None:
      raise ValueError(
          f"{OWNER}: `compression={compression!r}` sends the model's "
          "changes in its own integers; it takes no `averaging_dtype` "
          f"(got {averaging_dtype.name!r}): leave that at float32.")
  if not (isinstance(overlap, bool) or overlap == "always"):
    arguments.fail(OWNER, "overlap", 'True, False or "always"', overlap)
  if overlap and overlap_lib.refuse_with(schedule):
    raise ValueError(f"{OWNER}: `overlap={overlap!r}` cannot go with "
                     f"{schedule!r}: {overlap_lib.refuse_with(schedule)}.")
  _check_logdir(logdir)
  if simulate_step_time is None:
    simulate_step_time = os.environ.get("OSCARS_SIMULATE_STEP_TIME", "")
  profile = simulate_lib.StepTimeProfile.parse(simulate_step_time)
  return wiring.Arguments(
      schedule, optimizer_state, communication, collective_timeout,
      local_replicas, straggler_timeout,
      simulate=profile if profile.active else None,
      outer_optimizer=outer_optimizer,
      averaging_dtype=averaging_dtype, compression=compression,
      overlap=overlap), join_timeout


def _check_logdir(logdir):
  """ValueError unless `logdir` is None or a directory there or made now."""
  if logdir is not None and not isinstance(logdir, (str, os.PathLike)):
    arguments.fail(OWNER, "logdir", "a directory's path (str or "
                   "os.PathLike)", logdir)
  if logdir:
    try:  # TensorFlow's file system: a bucket's path as well as a local one
      tf.io.gfile.makedirs(os.fspath(logdir))
    except (tf.errors.OpError, OSError) as e:
      why = getattr(e, "message", None) or e
      raise ValueError(f"{OWNER}: `logdir` {os.fspath(logdir)!r} cannot be "
                       f"made a directory: {why}.") from None
