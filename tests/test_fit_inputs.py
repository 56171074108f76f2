"""Which `fit` inputs a worker splits with the others, and which are its own
already (frontends/fit_inputs.py). The multi-process check, every worker
reading all of its own data every epoch with one worker slow, is in
test_frontends_keras3.py and test_frontends.py."""

import numpy as np
import pytest
import tensorflow as tf

import oscars_tf
from oscars_tf.distribute import inputs
from oscars_tf.frontends import fit_inputs
from oscars_tf.frontends import keras3_inputs


def _batches(n=6):
  x = np.arange(n * 4, dtype="float32").reshape(n * 2, 2)
  return tf.data.Dataset.from_tensor_slices(x).batch(2)


def _sharding_off(ds):
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  return ds.with_options(options)


def _split(x, planned=True):
  return fit_inputs.split_for_worker(
      keras3_inputs.FLAVOUR, fit_inputs.FitInput(x), num_workers=2, index=1,
      planned=planned)


def test_a_dataset_is_split_between_workers():
  ds = _batches()
  planned = _split(ds)
  assert planned.x is not ds and planned.cluster_steps == 6
  sharded = _split(ds, planned=False)
  assert len(list(sharded.x)) == 3  # every other batch


@pytest.mark.parametrize("planned", [True, False])
def test_a_dataset_with_sharding_off_is_the_workers_own(planned):
  ds = _sharding_off(_batches())
  own = _split(ds, planned)
  assert own.x is ds and own.cluster_steps is None
  assert "AutoShardPolicy.OFF" in own.kind


def test_a_dataset_the_strategy_distributed_is_the_workers_own():
  # One CPU replica: the strategy hands back a plain tf.data.Dataset, which
  # it marks as this worker's.
  strategy = oscars_tf.OscarsStrategy(devices=["/cpu:0"])
  for distributed in (
      strategy.experimental_distribute_dataset(_batches()),
      strategy.distribute_datasets_from_function(lambda ctx: _batches())):
    assert isinstance(distributed, tf.data.Dataset)
    assert inputs.is_worker_share(distributed)
    own = _split(distributed)
    assert own.x is distributed and own.cluster_steps is None
  # Several replicas: TensorFlow's DistributedDataset, the worker's too.
  two = oscars_tf.OscarsStrategy(devices=["/cpu:0", "/cpu:1"])
  distributed = two.experimental_distribute_dataset(_batches())
  assert isinstance(distributed, tf.distribute.DistributedDataset)
  assert _split(distributed).x is distributed
  # A dataset made from one is not marked.
  assert not inputs.is_worker_share(_batches().map(lambda v: v))


def test_a_worker_needs_only_one_batch_of_its_own():
  # One batch each is enough when the batches are the worker's own, not a
  # share of the cluster's.
  fit_inputs.check_has_samples(_sharding_off(_batches(1)), num_workers=2)
  with pytest.raises(ValueError, match="1 training sample"):
    fit_inputs.check_has_samples(_batches(1), num_workers=2)
  with pytest.raises(ValueError, match="no training data"):
    fit_inputs.check_has_samples(_sharding_off(_batches(0)), num_workers=2)


class _Planned:
  """The parts of an extended `rewrite_fit_args` reads: worker 1 of 2,
  planned epochs."""

  def __init__(self):
    import types  # pylint: disable=g-import-not-at-top
    self.cluster = types.SimpleNamespace(num_workers=2, worker_index=1,
                                         is_multi_worker=True, is_chief=False)
    self.round_logs = types.SimpleNamespace(logdir="unused")
    self.targets, self.orders = [], []
    self.epochs = types.SimpleNamespace(
        plans=lambda: True, set_target=self.targets.append,
        read_in_order=lambda order, epoch: self.orders.append(order))


@pytest.mark.parametrize("validation_batch_size, expected", [(None, 16),
                                                             (4, 4)])
def test_planned_arrays_validate_in_fits_batch_size(validation_batch_size,
                                                    expected):
  # The worker's share becomes a batched input (batch_size=None), which
  # would leave Keras validating in batches of 32: a model of a fixed batch
  # size fails there, and any model validates at another size than asked.
  x = np.zeros((64, 2), np.float32)
  args = dict(x=x, y=np.zeros(64), sample_weight=None, batch_size=16,
              steps_per_epoch=None, shuffle=True, validation_split=0.0,
              validation_data=(x, np.zeros(64)), initial_epoch=0,
              validation_batch_size=validation_batch_size, callbacks=[],
              verbose=0)
  extended = _Planned()
  assert fit_inputs.rewrite_fit_args(extended, args, keras3_inputs.FLAVOUR,
                                     type(None))
  assert args["batch_size"] is None and extended.targets[-1] == 4
  assert args["validation_batch_size"] == expected
