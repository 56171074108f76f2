"""The start of training: every worker checks that the others built the
same model and strategy, then takes the chief's initial weights (and the
chief's outer optimizer state: each worker restored its own).

Runs eagerly, once per set of variables, before the first step: a worker
with another model or other strategy arguments fails here with a clear
error (WorkerMismatchError) instead of corrupting the others' averages.
"""

import dataclasses
import zlib

import numpy as np

from oscars_tf.distribute.replicas import component_variables
from oscars_tf.errors import WorkerMismatchError

OPTIMIZER_STATES = ("local", "average", "group_variance")


@dataclasses.dataclass(frozen=True)
class Settings:
  """The strategy arguments every worker must share."""
  schedule: object            # has fingerprint()
  optimizer_state: str        # one of OPTIMIZER_STATES
  communication: str          # "RING" or "NCCL"
  outer_optimizer: object     # None or has fingerprint()
  steps_per_execution: int
  averaging_dtype: object = None  # None or the tf.DType averagings send
  compression: object = None  # None, "int8" or "int4"
  overlap: bool = False


# Names of signature()'s numbers, in order, for the error message.
_SIGNATURE_NAMES = ("variable count", "element count", "shapes/dtypes",
                    "schedule", "optimizer_state", "communication",
                    "outer_optimizer", "steps_per_execution",
                    "averaging_dtype", "compression", "overlap")


def signature(variables, settings):
  """Numbers every worker must agree on (each exact in float32)."""
  first = [component_variables(v)[0] for v in variables]
  shapes = repr([(tuple(c.shape), c.dtype.name) for c in first])
  return [len(variables),
          sum(int(np.prod(c.shape)) for c in first),
          zlib.crc32(shapes.encode()) % (1 << 24),
          settings.schedule.fingerprint(),
          OPTIMIZER_STATES.index(settings.optimizer_state),
          ("RING", "NCCL").index(settings.communication),
          (settings.outer_optimizer.fingerprint()
           if settings.outer_optimizer else 0),
          settings.steps_per_execution,
          # Another dtype means other instance keys: a hang until the
          # timeout, so it is checked here.
          (settings.averaging_dtype.as_datatype_enum
           if settings.averaging_dtype is not None else 0),
          # Other collectives altogether: checked for the same reason.
          {None: 0, "int8": 8, "int4": 4}[settings.compression],
          # When a model holds an exact average (epoch ends) differs.
          int(bool(settings.overlap))]


class Handshake:
  """The start-up collectives of one worker (all workers run them)."""

  def __init__(self, averager, cluster, guarded):
    """`guarded(fn, what)` runs a collective, explaining peer errors."""
    self._averager = averager
    self._cluster = cluster
    self._guarded = guarded

  def check_workers_agree(self, variables, settings):
    mine = signature(variables, settings)
    low, high = self._guarded(lambda: self._averager.min_max(mine),
                              "the start of training")
    bad = [n for n, a, b in zip(_SIGNATURE_NAMES, low.numpy(), high.numpy())
           if a != b]
    if bad:
      raise WorkerMismatchError(
          f"workers disagree on {', '.join(bad)}: worker "
          f"{self._cluster.worker_index} has {len(variables)} variables, "
          f"{mine[1]} elements, schedule {settings.schedule!r}, "
          f"optimizer_state={settings.optimizer_state!r}. Every worker must "
          "build the same model and the same OscarsStrategy arguments.")

  def broadcast_from_chief(self, values, write, role="model"):
    """`write(chief's values)` on every worker; `values` are this worker's
    values of the variables (`role`: their collectives' instance keys, see
    averaging.instance_key). Sent exactly, in their own dtypes."""
    weight = 1.0 if self._cluster.is_chief else 0.0
    write(self._guarded(
        lambda: self._averager.reduce(values, weight, role=role,
                                      exact=True),
        "the initial broadcast"))
