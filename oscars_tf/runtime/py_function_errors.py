"""Exceptions raised inside `tf.py_function`, given back their own class.

TensorFlow turns any Python exception raised in a `tf.py_function` body
into `tf.errors.UnknownError` (TF 2.21, in a graph and eagerly alike). The
round ends call the round book through py_functions, and inside a while
loop (Keras' steps_per_execution > 1) the whole round end, collective
included, runs as one. A WorkerLostError of the protocol, or a
collective's DeadlineExceededError, would then lose its class, and with it
the round-state save and exit code 75 that let the job go on. Bodies
wrapped with `carried` keep what they raise; `original` gives it back for
the UnknownError that reached the caller.
"""

import functools
import threading

import tensorflow as tf

_lock = threading.Lock()
_raised = [None]  # the last exception a carried body raised, not yet taken


def carried(body):
  """`body` (a py_function's), remembering the exception it raises."""
  @functools.wraps(body)
  def wrapped(*args, **kwargs):
    try:
      return body(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      # A body that calls a function holding another carried body (a round
      # end run through py_function) keeps the innermost exception.
      inner = original(e)
      with _lock:
        _raised[0] = inner
      raise
  return wrapped


def original(error):
  """The exception a `carried` body raised that reached the caller as
  `error` (a tf.errors.UnknownError naming its class), else `error`."""
  if not isinstance(error, tf.errors.UnknownError):
    return error
  with _lock:
    raised, _raised[0] = _raised[0], None
  if raised is None or f"{type(raised).__name__}: " not in str(error):
    return error
  return raised
