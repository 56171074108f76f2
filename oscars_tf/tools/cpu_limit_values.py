"""--cpu_limit's numbers: CPUs per worker, and the CFS quota of each.

A limit is a number of CPUs, as Kubernetes' `resources.limits.cpu`: the
worker may run `limit x period` microseconds of CPU time per CFS period
(cpu_limits.py writes it into the worker's cgroup). Imports no TensorFlow.
"""

import math

PERIOD_US = 100_000  # the kernel's and Kubernetes' default CFS period
MIN_LIMIT = 0.01  # the kernel refuses quotas under 1 ms


def parse(text, num_workers):
  """Number of CPUs per worker from "1,1,0.5,0.25" (or one value for all).

  A value is a number of CPUs, or Kubernetes' millicores ("500m" = 0.5).
  Raises ValueError with a one-line message: a count that is neither 1 nor
  `num_workers`, a value that is not a number, or one below MIN_LIMIT.
  """
  items = [x.strip() for x in text.split(",")]
  limits = []
  for item in items:
    try:
      value = (float(item[:-1]) / 1000 if item.endswith("m") else
               float(item))
    except ValueError:
      raise ValueError(f"{item!r} is not a number of CPUs (e.g. 0.5 or "
                       "500m)") from None
    if not math.isfinite(value) or value <= 0:
      raise ValueError(f"{item!r}: a CPU limit must be a number > 0")
    if value < MIN_LIMIT:
      raise ValueError(f"{item!r}: a CPU limit must be at least {MIN_LIMIT} "
                       "(the kernel's smallest quota is 1 ms per 100 ms "
                       "period)")
    limits.append(value)
  if len(limits) == 1:
    return limits * num_workers
  if len(limits) != num_workers:
    raise ValueError(f"{len(limits)} values for {num_workers} workers: give "
                     f"one (for every worker) or exactly {num_workers}")
  return limits


def quota_us(limit, period_us=PERIOD_US):
  """The CFS quota, in microseconds per period, of `limit` CPUs."""
  return int(round(limit * period_us))
