"""TensorFlow's multi-worker contract, as `MultiWorkerMirroredStrategy`'s
extended answers it.

Code written for that strategy (TF's tutorials, tf_keras' callbacks and
`distributed_file_utils`) asks the extended who is the chief, whether to
checkpoint, and for the cluster resolver; this mixin gives it the same
answers from the strategy's `ClusterInfo` (`self._cluster`).
"""

import tensorflow as tf

from oscars_tf import cluster


class MultiWorkerRoles:
  """Mixin for the extended: chief, task and resolver, as TF's MWMS (the
  extended sets `_cluster` and `_roles_resolver` in its __init__)."""

  @property
  def _cluster_resolver(self):
    """The user's `ClusterResolver`, else one built from the cluster (see
    `cluster.resolver_for`); `Strategy.cluster_resolver` returns it."""
    if self._roles_resolver is None:
      self._roles_resolver = cluster.resolver_for(self._cluster,
                                                  self.worker_devices)
    return self._roles_resolver

  @_cluster_resolver.setter
  def _cluster_resolver(self, resolver):
    self._roles_resolver = resolver

  @property
  def cluster_resolver(self):
    """The resolver TensorFlow's code reads as `_cluster_resolver`."""
    return self._cluster_resolver

  @cluster_resolver.setter
  def cluster_resolver(self, resolver):
    self._roles_resolver = resolver

  @property
  def _task_type(self):
    return self._cluster_resolver.task_type

  @property
  def _task_id(self):
    return self._cluster_resolver.task_id

  @property
  def _id_in_cluster(self):
    return self._cluster.worker_index

  @property
  def _num_workers(self):
    return self._cluster.num_workers

  @property
  def _is_chief(self):
    return self._cluster.is_chief

  def _in_multi_worker_mode(self):
    """Whether this strategy indicates working in multi-worker settings."""
    return self._cluster.is_multi_worker

  def _reduce_to(self, reduce_op, value, destinations, options):
    # In multi-worker mode TF reduces a plain (not per-replica) tensor as the
    # worker's one value, across workers: TF's distributed iterators count
    # the workers that still have data so (`input_lib`, on every worker with
    # a GPU or several devices). Reductions here are worker-local, so it is
    # the worker's own value (MirroredStrategy's rule would fail for SUM).
    from tensorflow.python.distribute import cross_device_ops
    from tensorflow.python.distribute import values
    if (self._cluster.is_multi_worker and tf.is_tensor(value) and
        not isinstance(value, values.DistributedValues)):
      cross_device_ops.validate_destinations(destinations)
      return cross_device_ops.simple_broadcast(value, destinations)
    return super()._reduce_to(reduce_op, value, destinations, options)

  @property
  def should_checkpoint(self):
    return self._cluster.is_chief

  @property
  def should_save_summary(self):
    return self._cluster.is_chief

  @property
  def experimental_should_init(self):
    return True

  @property
  def experimental_between_graph(self):
    return True
