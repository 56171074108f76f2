"""Simulated heterogeneity: a per-worker delay added to each real step.

Machines here have 2 cores and no accelerator, so speed differences are
simulated honestly: each worker sleeps a planned time per training step on
top of its real compute, and everything that prints it says SIMULATED.

Spec (flag `--simulate_step_time`, env `OSCARS_SIMULATE_STEP_TIME`):

    BASE[*M0,M1,...][;W:Mx@WHEN]...

  BASE   time per step at 1x: "20ms", "0.02s" or "0".
  M_i    multiplier of worker i (missing ones are 1): "20ms*1,1,2,4" gives
         20, 20, 40 and 80 ms per step.
  W:Mx@WHEN  from WHEN on, worker W's multiplier is M; WHEN is seconds
         since its first step ("60s") or a local step ("500").
         "20ms;2:4x@60s": everyone 20 ms, worker 2 4x slower after 60 s.

Pure Python, no TensorFlow.
"""

import dataclasses
import math
import re
from typing import List
from typing import Tuple

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def _duration(text, spec):
  m = _DURATION.match(text)
  if not m:
    raise ValueError(f"simulate_step_time {spec!r}: {text!r} is not a time "
                     "like '20ms' or '0.02s'.")
  value = float(m.group(1))
  return value / 1000.0 if m.group(2) == "ms" else value


@dataclasses.dataclass(frozen=True)
class StepTimeProfile:
  """Simulated seconds per step for each worker, possibly changing."""
  base: float
  multipliers: Tuple[float, ...]
  changes: Tuple[Tuple[int, float, str, float], ...]  # (worker, mult, unit, at)
  spec: str = ""

  @classmethod
  def parse(cls, spec: str) -> "StepTimeProfile":
    if spec is not None and not isinstance(spec, str):
      raise ValueError("simulate_step_time must be a string such as "
                       f"'20ms*1,1,2,4', got {spec!r}.")
    if not spec or not spec.strip():
      return cls(0.0, (), (), "")
    head, *changes = spec.split(";")
    base_text, _, mults_text = head.partition("*")
    base = _duration(base_text, spec)
    mults = []
    for m in filter(None, (x.strip() for x in mults_text.split(","))):
      try:
        value = float(m.rstrip("x"))
      except ValueError:
        raise ValueError(f"simulate_step_time {spec!r}: multiplier {m!r} is "
                         "not a number.") from None
      if not 0 <= value < math.inf:  # nan and inf too
        raise ValueError(f"simulate_step_time {spec!r}: multipliers must be "
                         f"finite numbers >= 0, got {m!r}.")
      mults.append(value)
    parsed = []
    for c in filter(None, (x.strip() for x in changes)):
      m = re.match(r"^(\d+):([0-9.]+)x?@([0-9.]+)(s?)$", c)
      if not m:
        raise ValueError(f"simulate_step_time {spec!r}: change {c!r} is not "
                         "'W:Mx@60s' or 'W:Mx@500'.")
      parsed.append((int(m.group(1)), float(m.group(2)),
                     "s" if m.group(4) else "step", float(m.group(3))))
    if base < 0:
      raise ValueError(f"simulate_step_time {spec!r}: BASE must be >= 0.")
    return cls(base, tuple(mults), tuple(parsed), spec)

  def check_workers(self, num_workers: int):
    """Raises ValueError if the spec names workers a cluster of
    `num_workers` does not have (a spec written for another job)."""
    if len(self.multipliers) > num_workers:
      raise ValueError(
          f"simulate_step_time {self.spec!r}: {len(self.multipliers)} "
          f"multipliers for {num_workers} workers.")
    for w, _, _, _ in self.changes:
      if w >= num_workers:
        raise ValueError(
            f"simulate_step_time {self.spec!r}: worker {w} changes, but "
            f"the workers are 0..{num_workers - 1}.")

  @property
  def active(self) -> bool:
    return self.base > 0

  def multiplier(self, worker: int, step: int, elapsed_s: float) -> float:
    mult = self.multipliers[worker] if worker < len(self.multipliers) else 1.0
    for w, m, unit, at in self.changes:
      if w == worker and (elapsed_s >= at if unit == "s" else step >= at):
        mult = m
    return mult

  def seconds(self, worker: int, step: int, elapsed_s: float) -> float:
    """Simulated delay of `worker`'s step `step`, `elapsed_s` into training."""
    return self.base * self.multiplier(worker, step, elapsed_s)

  def describe(self, num_workers: int) -> List[str]:
    lines = [f"SIMULATED heterogeneity ({self.spec}): worker {i} sleeps "
             f"{self.seconds(i, 0, 0.0) * 1000:.1f} ms per step"
             for i in range(num_workers)]
    lines += [f"SIMULATED change: worker {w} becomes {m:g}x after "
              f"{at:g}{'s' if unit == 's' else ' steps'}"
              for w, m, unit, at in self.changes]
    return lines
