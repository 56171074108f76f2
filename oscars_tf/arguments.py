"""Argument checks for the public constructors: one place, one wording.

Each check raises `ValueError` naming the owner and the argument, quoting
the value received and saying what was expected (as PyTorch's model
averagers and Keras do), and returns the value in the type it is used as.
`bool` is refused wherever a number is asked for: `True` is an `int` to
Python, never a period or a timeout to a user. No imports beyond the
standard library: every layer may use it.
"""

import math
import numbers
import sys


def is_number(value):
  """A real number that is not a bool (NumPy scalars included)."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value):
  """An integer that is not a bool (NumPy integers included)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def fail(owner, name, expected, value):
  """Raises the one error form: "Owner: `name` must be ..., got value."."""
  prefix = f"{owner}: " if owner else ""
  raise ValueError(f"{prefix}`{name}` must be {expected}, got {value!r}.")


def positive_int(owner, name, value):
  """An int >= 1."""
  if not is_int(value) or value < 1:
    fail(owner, name, "a positive int", value)
  return int(value)


def int_at_least(owner, name, value, minimum):
  """An int >= `minimum`."""
  if not is_int(value) or value < minimum:
    fail(owner, name, f"an int >= {minimum}", value)
  return int(value)


def positive_number(owner, name, value, what="a finite number"):
  """A finite number > 0, as a float; `what` names its unit in the error
  ("a number of seconds")."""
  if not is_number(value) or not math.isfinite(value) or value <= 0:
    fail(owner, name, f"{what} > 0", value)
  return float(value)


def number_in(owner, name, value, low, high, *, include_low=True,
              include_high=False):
  """A number between `low` and `high` (each end included or not), as a
  float."""
  if not (is_number(value) and
          (value >= low if include_low else value > low) and
          (value <= high if include_high else value < high)):
    interval = (f"{'[' if include_low else '('}{low}, "
                f"{high}{']' if include_high else ')'}")
    fail(owner, name, f"in {interval}", value)
  return float(value)


def boolean(owner, name, value):
  """A bool (NumPy's included): "no" or 0 is not taken as a yes/no."""
  if not isinstance(value, (bool, _numpy_bools())):
    fail(owner, name, "True or False", value)
  return bool(value)


def _numpy_bools():
  """NumPy's bool type where NumPy is loaded, else none (this module
  imports the standard library only)."""
  numpy = sys.modules.get("numpy")
  return (numpy.bool_,) if numpy is not None else ()


def one_of(owner, name, value, choices):
  """One of `choices`."""
  if value not in choices:
    fail(owner, name, f"one of {tuple(choices)}", value)
  return value
