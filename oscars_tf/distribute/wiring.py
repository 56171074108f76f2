"""A worker's strategy components, built from the strategy's arguments.

`build` wires, once per strategy, what `extended.OscarsExtended` uses: the
averaging choices (communication, device, wire dtype), the start-up
averager, the control plane, the round book and its logs, the rounds,
their round ends, the epochs, what is averaged, the outer optimizer's
state and compressed averaging's. The extended keeps only TensorFlow's
strategy contract.
"""

import atexit
import dataclasses
from typing import Callable
from typing import Optional

from absl import logging
import tensorflow as tf

from oscars_tf import schedules as schedules_lib
from oscars_tf import simulate as simulate_lib
from oscars_tf.distribute import averaged_variables
from oscars_tf.distribute import compression as compression_lib
from oscars_tf.distribute import control_plane
from oscars_tf.distribute import epochs as epochs_lib
from oscars_tf.distribute import outer as outer_lib
from oscars_tf.distribute import round_ends
from oscars_tf.distribute import rounds as rounds_lib
from oscars_tf.observability import summaries
from oscars_tf.protocol import agreement
from oscars_tf.protocol import group_keys
from oscars_tf.protocol import round_book
from oscars_tf.runtime import averaging


@dataclasses.dataclass(frozen=True)
class Arguments:
  """The strategy's arguments the components take, checked (see
  `strategy.OscarsStrategy`)."""
  schedule: schedules_lib.Schedule
  optimizer_state: str        # one of startup.OPTIMIZER_STATES
  communication: str          # as asked: "auto", "ring" or "nccl"
  collective_timeout: float
  local_replicas: str         # one of replicas.LOCAL_REPLICAS
  straggler_timeout: float
  simulate: Optional[simulate_lib.StepTimeProfile]  # None: no simulation
  outer_optimizer: Optional[schedules_lib.OuterMomentum]
  averaging_dtype: Optional[tf.DType]  # as asked; None: each its own
  compression: Optional[str] = None  # "int8", "int4" or None (off)
  overlap: bool = False              # averagings beside the next round

  @property
  def local_sgd(self):
    return self.local_replicas == "local_sgd"


@dataclasses.dataclass(frozen=True)
class Parts:
  """A worker's components, wired (see `build`)."""
  host: str                   # this worker's CPU: counters, round starts
  communication: str          # across workers: "RING" or "NCCL"
  averaging_dtype: Optional[tf.DType]  # after the GPU fallback
  averager: averaging.GroupAverager    # the whole cluster's (start-up)
  agreements: Optional[agreement.Agreements]  # None: a single worker
  book: round_book.RoundBook
  round_logs: summaries.RoundLogging
  rounds: rounds_lib.Rounds
  ends: round_ends.RoundEnds
  epochs: epochs_lib.Epochs
  averaged: averaged_variables.AveragedVariables
  outer: outer_lib.OuterStates
  compression: compression_lib.CompressionStates


@dataclasses.dataclass(frozen=True)
class _Averaging:
  """Where and how a worker averages."""
  host: str
  device: str                 # the collectives' device
  communication: str          # across workers: "RING" or "NCCL"
  per_group_nccl: bool        # "auto" on GPUs: NCCL within a host
  dtype: Optional[tf.DType]   # on the wire, after the GPU fallback


def _averaging(info, devices, hosts, args):
  """The averaging choices of worker `info` on replica `devices` (`hosts`:
  each worker's host)."""
  host = (info.device_prefix() + "/device:CPU:0" if info.is_multi_worker
          else "/job:localhost/replica:0/task:0/device:CPU:0")
  device_type = tf.DeviceSpec.from_string(devices[0]).device_type
  communication = averaging.choose_communication(
      args.communication, [device_type] * info.num_workers, hosts)
  per_group_nccl = args.communication == "auto" and device_type == "GPU"
  device = (devices[0] if communication == "NCCL" or per_group_nccl
            else host)
  dtype, fallback = averaging.wire_dtype(args.averaging_dtype,
                                         device != host)
  if fallback:
    logging.warning("oscars_tf: %s", fallback)
  return _Averaging(host, device, communication, per_group_nccl, dtype)


def build(info, devices, args, averages: Callable[[], bool],
          end_round_now: Callable[[], None]):
  """The components of worker `info` (a `cluster.ClusterInfo`).

  Args:
    info: the worker's cluster.
    devices: its replica devices (`replicas.resolve_devices`).
    args: the strategy's `Arguments`.
    averages: whether rounds average anything yet (see `epochs.Epochs`).
    end_round_now: ends the round at once (eager; see `epochs.Epochs`).

  Returns:
    `Parts`. A multi-worker one ends its rounds at the process's exit.
  """
  averaged = averaged_variables.AveragedVariables(args.optimizer_state)
  outer = outer_lib.OuterStates(args.outer_optimizer)
  compression = compression_lib.CompressionStates(args.compression)
  hosts = [address.rpartition(":")[0] for _, _, address in info.workers]
  a = _averaging(info, devices, hosts, args)
  averager = averaging.GroupAverager(
      group_size=info.num_workers,
      group_key=group_keys.GROUP_KEY_BASE,  # the whole cluster
      device=a.device, communication=a.communication,
      timeout=args.collective_timeout)
  plane = control_plane.connect(info, hosts, args.straggler_timeout,
                                args.collective_timeout)
  book = round_book.RoundBook(
      info, args.schedule, learning_rate_fn=averaged.learning_rate,
      simulate=args.simulate, membership=plane.membership)
  round_logs = summaries.RoundLogging(info, book)
  rounds = rounds_lib.Rounds(
      book, a.host, a.device, a.communication, args.collective_timeout,
      per_group_nccl=a.per_group_nccl, averaging_dtype=a.dtype,
      compression=args.compression,
      addresses=[address for _, _, address in info.workers],
      overlap=args.overlap)
  ends = round_ends.RoundEnds(
      rounds, averaged, outer, args.schedule, args.local_sgd,
      averages_across=info.is_multi_worker or args.local_sgd,
      compression=compression)
  epochs = epochs_lib.Epochs(rounds, info, args.schedule, averages=averages,
                             end_round_now=end_round_now)
  if info.is_multi_worker:
    _end_at_exit(epochs, round_logs, args.collective_timeout)
  return Parts(a.host, a.communication, a.dtype, averager, plane.agreements,
               book, round_logs, rounds, ends, epochs, averaged, outer,
               compression)


def _end_at_exit(epochs, round_logs, collective_timeout):
  """A multi-worker process's exit ends its rounds and leaves the others."""
  epochs_lib.note_uncaught_errors()
  # atexit runs these last-registered first: end the rounds, leave,
  # then make the interpreter's shutdown quick.
  atexit.register(epochs_lib.teardown_quickly, round_logs)
  atexit.register(epochs.leave_at_exit, collective_timeout)
  atexit.register(epochs.finish_at_exit)
