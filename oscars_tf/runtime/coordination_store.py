"""The key-value store of TensorFlow's coordination service, for the
protocol's rounds (the protocol sees it through `protocol/kv_store.py`'s
functions, as it sees the in-memory store its tests use)."""

import math

from oscars_tf.errors import WorkerLostError
from oscars_tf.protocol.kv_store import KeyMissing
from oscars_tf.runtime import service_dir


class ContextStore:
  """TensorFlow's coordination-service key-value store."""

  # Reads in flight at once (values_unless_gone). Measured on loopback
  # (benchmarks/control_plane_tf.py): a read costs the chief 0.66 ms one at
  # a time, 0.17 ms each with 16 in flight.
  concurrent_reads = 16

  def __init__(self, service_address=None):
    """`service_address`: "host:port" of the task hosting the service,
    for `read_dir` (None: no directory reads, key by key)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    self._dir = (service_dir.DirectoryReader(service_address)
                 if service_address else None)
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

  def read_dir(self, directory, timeout_s):
    """{key: value} of every key under `directory` + "/" now, in one RPC
    (service_dir.py); None if the service cannot say."""
    return None if self._dir is None else self._dir.read(directory,
                                                         timeout_s)

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
      "the coordination service (hosted by the chief, worker 0, or by the "
      "cluster's coordinator task) cannot be reached: the chief has ended "
      "or died, or the coordinator has. If training ended while this "
      "worker was stalled or dropped, the chief's model and checkpoint are "
      f"the job's result. ({error.message.splitlines()[0]})")
