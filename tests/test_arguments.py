"""The argument checks every public constructor uses (arguments.py)."""

import math
import re

import numpy as np
import pytest

from oscars_tf import arguments


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "2", None])
def test_positive_int_refuses_what_is_not_an_int_above_zero(value):
  with pytest.raises(ValueError, match=r"^Owner: `n` must be a positive int, "
                     rf"got {re.escape(repr(value))}\.$"):
    arguments.positive_int("Owner", "n", value)


def test_positive_int_takes_numpy_ints_as_python_ints():
  got = arguments.positive_int("Owner", "n", np.int64(3))
  assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", [0, -0.5, math.inf, math.nan, False, "1"])
def test_positive_number_refuses_what_is_not_finite_and_above_zero(value):
  with pytest.raises(ValueError, match="`t` must be a number of seconds > 0"):
    arguments.positive_number("", "t", value, "a number of seconds")


def test_an_owner_left_out_is_left_out_of_the_message():
  with pytest.raises(ValueError, match=r"^`t` must be"):
    arguments.positive_number("", "t", -1)


@pytest.mark.parametrize("value,ok", [(0, True), (0.5, True), (1, False),
                                      (-0.1, False), (True, False),
                                      ("0.5", False), (None, False)])
def test_number_in_keeps_each_end_as_asked(value, ok):
  if ok:
    assert arguments.number_in("O", "m", value, 0, 1) == value
  else:
    with pytest.raises(ValueError, match=r"`m` must be in \[0, 1\)"):
      arguments.number_in("O", "m", value, 0, 1)
  with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
    arguments.number_in("O", "m", 0, 0, 1, include_low=False,
                        include_high=True)


def test_int_at_least_and_one_of():
  assert arguments.int_at_least("O", "k", 0, 0) == 0
  with pytest.raises(ValueError, match="`k` must be an int >= 0, got -1"):
    arguments.int_at_least("O", "k", -1, 0)
  assert arguments.one_of("O", "g", "host", ("host", "speed")) == "host"
  with pytest.raises(ValueError,
                     match=r"`g` must be one of \('host', 'speed'\), got 'x'"):
    arguments.one_of("O", "g", "x", ("host", "speed"))
