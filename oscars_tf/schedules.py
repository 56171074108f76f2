"""When to average: schedules are pure policy (no TensorFlow import).

A schedule answers one question for the strategy: after an averaging point at
local step `step`, at which local step is the next one? The strategy keeps the
step counters and runs the collectives; a schedule only does arithmetic, so it
can be tested without a cluster and gives the same answer on every worker.
"""

import hashlib
import json
import warnings


class Schedule:
  """Base class: a deterministic rule for the next averaging point."""

  def next_sync_step(self, step: int) -> int:
    """Local step of the next averaging point after one at `step`."""
    raise NotImplementedError

  def config(self) -> dict:
    """A JSON-able description; workers must agree on it."""
    raise NotImplementedError

  def fingerprint(self) -> int:
    """A 24-bit number that differs when `config()` differs.

    24 bits so that it travels exactly in a float32 collective.
    """
    text = json.dumps(self.config(), sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:3], "big")


class Fixed(Schedule):
  """Periodic model averaging: average every `every` local steps.

  This is local SGD with a constant period (Stich, "Local SGD Converges Fast
  and Communicates Little", ICLR 2019; PyTorch's `PeriodicModelAverager`).
  `every=1` averages after every step: synchronous model averaging, which for
  plain SGD equals synchronous data-parallel SGD, and serves as the baseline.

  Args:
    every: positive int, number of local steps between averaging points.
    warmup_steps: int >= 0 (default 0); during the first `warmup_steps` steps
      the model is averaged after every step (as PyTorch's averager does for
      its warm-up stage), after which the period is `every`.

  Example:
    strategy = oscars_tf.OscarsStrategy(schedule=oscars_tf.schedules.Fixed(8))
  """

  def __init__(self, every: int = 8, warmup_steps: int = 0):
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
      raise ValueError(f"Fixed: `every` must be a positive int, got {every!r}.")
    if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
        or warmup_steps < 0):
      raise ValueError("Fixed: `warmup_steps` must be an int >= 0, got "
                       f"{warmup_steps!r}.")
    if every == 1 and warmup_steps:
      warnings.warn("Fixed(every=1) averages every step already; "
                    "`warmup_steps` has no effect.")
    self.every = every
    self.warmup_steps = warmup_steps

  def next_sync_step(self, step: int) -> int:
    if step < self.warmup_steps:
      return step + 1
    return step + self.every

  def config(self) -> dict:
    return {"schedule": "Fixed", "every": self.every,
            "warmup_steps": self.warmup_steps}

  def __repr__(self):
    return f"Fixed(every={self.every}, warmup_steps={self.warmup_steps})"
