"""Our errors raised inside tf.py_function reach the worker as themselves.

TensorFlow turns them into tf.errors.UnknownError; the round ends call the
round book through py_functions (inside a while loop the whole round end,
collective included, runs in one), and a lost peer must still save the
round state and exit 75 (tests/test_recovery.py and test_faults.py run the
multi-process cases).
"""

import pytest
import tensorflow as tf

from oscars_tf.errors import OscarsError
from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.runtime import averaging
from oscars_tf.runtime import py_function_errors


def _explained():
  return averaging.peer_errors_explained("an averaging point", 1, 3, 5.0)


def _run_in_graph(body):
  """Runs `body` through a py_function inside a tf.function."""
  @tf.function
  def step():
    return tf.py_function(body, [], tf.int64)
  return step()


def _lost_peer():
  raise WorkerLostError("worker 2 was dropped and training ended")


def test_tensorflow_alone_turns_the_error_into_unknown_error():
  # Why the carrier exists: without it the class is lost.
  with pytest.raises(tf.errors.UnknownError, match="WorkerLostError"):
    with _explained():
      _run_in_graph(_lost_peer)


def test_a_carried_protocol_error_comes_out_as_itself():
  with pytest.raises(WorkerLostError, match="training ended"):
    with _explained():
      _run_in_graph(py_function_errors.carried(_lost_peer))


def test_a_collective_error_inside_a_nested_function_is_explained():
  # A round end inside a while loop: a py_function calls a tf.function
  # whose own py_function (or collective) fails.
  def collective():
    raise tf.errors.DeadlineExceededError(None, None, "Collective ops timed "
                                          "out")

  @tf.function
  def round_end():
    return tf.py_function(py_function_errors.carried(collective), [],
                          tf.int64)

  with pytest.raises(PeerTimeoutError, match="within 5 s"):
    with _explained():
      _run_in_graph(py_function_errors.carried(lambda: round_end()))


def test_a_lost_collective_inside_py_function_is_a_lost_peer():
  def collective():
    raise tf.errors.UnavailableError(None, None, "Collective peer gone")
  with pytest.raises(WorkerLostError, match="a peer is gone"):
    with _explained():
      _run_in_graph(py_function_errors.carried(collective))


def test_other_unknown_errors_pass_unchanged():
  def users_bug():
    raise ZeroDivisionError("the user's own py_function")
  with pytest.raises(tf.errors.UnknownError, match="ZeroDivisionError"):
    with _explained():
      _run_in_graph(users_bug)  # not carried: not ours


def test_a_stale_carried_error_is_not_blamed_for_another():
  # An error we carried and that was handled elsewhere must not rename a
  # later, unrelated UnknownError.
  with pytest.raises(tf.errors.UnknownError):
    _run_in_graph(py_function_errors.carried(_lost_peer))

  def other():
    raise KeyError("something else")
  with pytest.raises(tf.errors.UnknownError, match="KeyError"):
    with _explained():
      _run_in_graph(other)


def test_errors_of_the_shared_input_order_are_ours():
  def no_round():
    raise OscarsError("no round planned this worker's step 7")
  with pytest.raises(OscarsError, match="step 7"):
    with averaging.peer_errors_explained("an averaging point", 0, 2, 5.0,
                                         collectives_only=True):
      _run_in_graph(py_function_errors.carried(no_round))
