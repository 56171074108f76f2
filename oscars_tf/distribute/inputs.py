"""Input distribution: each worker its own shard or stream.

The batch size of a dataset is the per-worker batch size; it is split across
the worker's local replicas as in `MirroredStrategy`.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import input_util


def worker_share(dataset):
  """Marks a dataset this strategy distributed to this worker (the one-CPU
  fast path returns a plain tf.data.Dataset): `fit` must not split it
  between workers again (frontends/fit_inputs.py)."""
  dataset._oscars_worker_share = True  # pylint: disable=protected-access
  return dataset


def is_worker_share(x):
  """A dataset already distributed to this worker: a tf.distribute
  DistributedDataset, or one the fast path marked."""
  return (isinstance(x, tf.distribute.DistributedDataset) or
          getattr(x, "_oscars_worker_share", False))


def sharding_off(dataset):
  """Whether `dataset`'s options turn auto-sharding off (the user gives
  each worker its data, as under TensorFlow's own strategies)."""
  return (dataset.options().experimental_distribute.auto_shard_policy ==
          tf.data.experimental.AutoShardPolicy.OFF)


def is_workers_own(x):
  """Input no one may split between workers again: a dataset this strategy
  distributed, or a tf.data.Dataset with auto-sharding off."""
  return is_worker_share(x) or (isinstance(x, tf.data.Dataset) and
                                sharding_off(x))


class WorkerInputs:
  """Mixin for the extended: shards by worker, fast path for one replica
  (the extended sets `_cluster` and `_suppress_sharding` in its
  __init__)."""

  @contextlib.contextmanager
  def unsharded(self):
    """Datasets given to the strategy inside are not split by worker (the
    Keras front ends split `fit` inputs themselves)."""
    self._suppress_sharding += 1
    try:
      yield
    finally:
      self._suppress_sharding -= 1

  def _single_cpu(self):
    return (len(self._devices) == 1 and
            tf.DeviceSpec.from_string(self._devices[0]).device_type == "CPU")

  def _experimental_distribute_dataset(self, dataset, options):
    if (self._cluster.is_multi_worker and not self._suppress_sharding and
        not sharding_off(dataset)):
      dataset = dataset.shard(self._cluster.num_workers,
                              self._cluster.worker_index)
    if self._single_cpu():
      # One CPU replica: the plain dataset is already "distributed", and
      # skipping TF's multi-device iterator saves ~0.5 ms per step (measured
      # in benchmarks/overhead.py). Elements are plain tensors, which
      # strategy.run and experimental_local_results accept for one replica.
      return worker_share(dataset.prefetch(tf.data.AUTOTUNE))
    return super()._experimental_distribute_dataset(dataset, options)

  def _distribute_datasets_from_function(self, dataset_fn, options):
    context = distribute_lib.InputContext(
        num_input_pipelines=self._cluster.num_workers,
        input_pipeline_id=self._cluster.worker_index,
        num_replicas_in_sync=self._num_replicas_in_sync)
    if self._single_cpu():
      return worker_share(dataset_fn(context).prefetch(tf.data.AUTOTUNE))
    return input_util.get_distributed_datasets_from_function(
        dataset_fn, self._input_workers_with_options(options), [context],
        self._container_strategy(), options)
