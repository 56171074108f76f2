"""The key-value store the workers share: TensorFlow's coordination service.

The protocol modules (membership.py, rate_table.py) take any object with
`set`, `get` and `delete`; tests and the control-plane benchmark give
them a `MemoryStore`. This module
imports TensorFlow only when a `ContextStore` is made.
"""

import math
import threading

from oscars_tf.errors import WorkerLostError


class KeyMissing(Exception):
  """`get` found no value for the key within its timeout."""


def put(store, key, value):
  """Sets a key that may exist already (the service refuses to overwrite)."""
  store.delete(key)
  store.set(key, value)


class MemoryStore:
  """An in-memory store with the coordination service's semantics: `get`
  blocks until the key exists or the timeout passes, `set` refuses to
  overwrite, `delete` removes a directory too. For one process: protocol
  tests and the control-plane benchmark."""

  def __init__(self):
    self.data = {}
    self._cv = threading.Condition()

  def set(self, key, value):
    with self._cv:
      if key in self.data:
        raise KeyError(f"{key} exists")
      self.data[key] = value
      self._cv.notify_all()

  def get(self, key, timeout_s):
    with self._cv:
      if not self._cv.wait_for(lambda: key in self.data, timeout_s):
        raise KeyMissing(key)
      return self.data[key]

  def delete(self, key):
    """Deletes `key` and, as the coordination service does, every key
    under it as a directory ("key/..."): one call clears a round."""
    with self._cv:
      self.data.pop(key, None)
      under = key + "/"
      for k in [k for k in self.data if k.startswith(under)]:
        del self.data[k]


class ContextStore:
  """TensorFlow's coordination-service key-value store."""

  def __init__(self):
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self._ctx = context.context()
    self._missing = (tf.errors.DeadlineExceededError, tf.errors.NotFoundError)
    self._gone = tf.errors.UnavailableError

  def set(self, key, value):
    try:
      self._ctx.set_config_key_value(key, value)
    except self._gone as e:
      raise _service_gone(e) from None

  def get(self, key, timeout_s):
    """The value of `key`; KeyMissing when none within `timeout_s`."""
    try:
      return self._ctx.get_config_key_value(
          key, max(1, int(math.ceil(timeout_s * 1000))))
    except self._missing:
      raise KeyMissing(key) from None
    except self._gone as e:
      raise _service_gone(e) from None

  def delete(self, key):
    """`key` and every key under it ("key/..."): the service's
    DeleteKeyValue deletes a directory (TF 2.21; control_plane_tf.py and
    tests/test_kv_store_tf.py check it on the real service)."""
    try:
      self._ctx.delete_config_key_value(key)
    except Exception:  # pylint: disable=broad-except
      pass  # absent already


def _service_gone(error):
  return WorkerLostError(
      "the coordination service (hosted by the chief, worker 0) cannot be "
      "reached: the chief has ended or died. If training ended while this "
      "worker was stalled or dropped, the chief's model and checkpoint are "
      f"the job's result. ({error.message.splitlines()[0]})")
