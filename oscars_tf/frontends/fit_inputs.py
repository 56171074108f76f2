"""Each worker's share of a `fit` input, for every input kind Keras takes.

Two ways to split an epoch between workers:

* **planned** (the Adaptive schedule, where the epoch's length is known):
  each worker draws batches from an endless stream of its own, and an epoch
  ends when the cluster as a whole has taken a data set's worth of steps
  (fast workers more of them), at the round boundary the plan sets;
* **sharded** (the Fixed schedule, or an input whose length is unknown):
  each worker reads its own shard once per epoch; when its data runs out
  it waits at the round protocol until every worker's has
  (`extended.epochs.finish`), so unequal shards cannot hang. Data that is
  each worker's own already (a dataset the strategy distributed, or one
  with `AutoShardPolicy.OFF`) is read so, whole, and not split again.

Either way the cluster sees each training sample about once per epoch.
Nothing here imports Keras: the flavour passes what it knows (its PyDataset
class, its validation split) through `Flavour`, and builds its PyDataset
shards and streams on `BatchShard` and `OwnBatchOrder`.
"""

import dataclasses
import itertools
from typing import Any
from typing import Callable
from typing import Optional
import warnings

from absl import logging
import numpy as np
import tensorflow as tf

from oscars_tf.distribute import inputs
from oscars_tf.frontends import shared_order
from oscars_tf.runtime import py_function_errors


@dataclasses.dataclass(frozen=True)
class Flavour:
  """What a Keras flavour tells the input code about itself."""
  name: str
  py_dataset_types: tuple        # keras.utils.PyDataset / Sequence
  shard_py_dataset: Callable     # (data, num_workers, index) -> PyDataset
  stream_py_dataset: Optional[Callable]  # (data, index) -> endless, or None
  split_validation: Callable     # ((x, y, sw), fraction) -> (train, val)


@dataclasses.dataclass
class FitInput:
  """A worker's training input, as `fit` will get it."""
  x: Any
  y: Any = None
  sample_weight: Any = None
  batch_size: Optional[int] = None
  steps_per_epoch: Optional[int] = None
  shuffle: Any = True
  cluster_steps: Optional[int] = None  # planned: steps per cluster epoch
  order: Any = None                    # planned arrays: a SharedOrder
  kind: str = ""                       # for the log line


def is_array_like(data):
  leaves = tf.nest.flatten(data)
  return bool(leaves) and all(
      isinstance(a, (np.ndarray, tf.Tensor)) or _is_pandas(a) for a in leaves)


def _is_pandas(a):
  return type(a).__module__.startswith("pandas")


def _to_numpy(data):
  return tf.nest.map_structure(
      lambda a: a.to_numpy() if _is_pandas(a) else a, data)


def num_samples(x):
  """Rows of an array input, batches of a dataset or PyDataset of known
  length, else None."""
  if is_array_like(x):
    return len(tf.nest.flatten(x)[0])
  if isinstance(x, tf.data.Dataset):
    card = int(x.cardinality())
    return card if card >= 0 else None
  return None


def check_has_samples(x, num_workers):
  """Empty training data would stop a worker deep inside Keras' iterator (a
  bare StopIteration) while its peers wait for it: fail clearly here."""
  n = num_samples(x)
  if n is None:
    return
  if inputs.is_workers_own(x):  # this worker's batches, not the cluster's
    num_workers = 1
  if n == 0:
    raise ValueError("oscars_tf: `fit` got no training data (0 samples or "
                     "batches); every worker needs at least one batch.")
  if n < num_workers:
    raise ValueError(f"oscars_tf: `fit` got {n} training sample(s) or "
                     f"batch(es) for {num_workers} workers; each needs at "
                     "least one.")


def split_for_worker(flavour, inp, num_workers, index, planned):
  """This worker's `FitInput` (see the module docstring).

  `planned`: the schedule plans cluster-wide epochs (Adaptive); an input
  whose epoch length is unknown is sharded all the same.
  """
  x = inp.x
  if inputs.is_workers_own(x):
    # Each worker's data is its own already: read once per epoch; an epoch
    # ends when every worker's has run out, as with an input of unknown
    # length.
    return dataclasses.replace(inp, kind=(
        "a distributed dataset, this worker's own"
        if inputs.is_worker_share(x) else
        "tf.data with AutoShardPolicy.OFF, this worker's own"))
  if is_array_like(x):
    return _arrays(inp, num_workers, index, planned)
  if isinstance(x, tf.data.Dataset):
    return _dataset(inp, num_workers, index, planned)
  if isinstance(x, flavour.py_dataset_types):
    return _py_dataset(flavour, inp, num_workers, index, planned)
  if _is_iterator(x):
    return _generator(inp, num_workers, index)
  warnings.warn(f"oscars_tf: cannot split a {type(x).__name__} between "
                "workers; each reads all of it, and each epoch ends when "
                "every worker's has run out. Give each worker its own data, "
                "e.g. chosen by strategy.worker_index.", stacklevel=3)
  return dataclasses.replace(inp, kind=f"unsplit {type(x).__name__}")


def _arrays(inp, w, i, planned):
  data = _to_numpy(tuple(a for a in (inp.x, inp.y, inp.sample_weight)
                         if a is not None))
  n = len(tf.nest.flatten(data)[0])
  batch = inp.batch_size or 32
  if planned:
    # One order per epoch shared by all workers, cut by the plan: each
    # sample once per cluster epoch, however fast each worker is.
    cluster = inp.steps_per_epoch * w if inp.steps_per_epoch else -(-n // batch)
    order = shared_order.SharedOrder(
        n, batch, shuffle=bool(inp.shuffle),
        epoch_steps=cluster if inp.steps_per_epoch else None)
    return FitInput(_planned(_ordered_batches(data, order, batch)),
                    shuffle=False, cluster_steps=cluster, order=order,
                    kind="arrays, planned (one shared order per epoch)")
  usable = n - n % w
  if n % w:
    logging.info("oscars_tf: %d of %d samples are left out of each epoch so "
                 "every worker gets the same number.", n - usable, n)
  x, y, sw = tf.nest.map_structure(
      lambda a: None if a is None else a[i:usable:w],
      _to_numpy((inp.x, inp.y, inp.sample_weight)))
  return dataclasses.replace(inp, x=x, y=y, sample_weight=sw,
                             kind="arrays, sharded")


def _dataset(inp, w, i, planned):
  ds, spe = inp.x, inp.steps_per_epoch
  card = int(ds.cardinality())
  if planned and (card >= 0 or spe):
    cluster = spe * w if spe else card
    return FitInput(_planned(ds.shard(w, i).repeat()), shuffle=False,
                    cluster_steps=cluster, kind="tf.data, planned")
  if card >= 0:  # equal shards: workers of a Fixed schedule stay in step
    ds = ds.take(card - card % w)
  return dataclasses.replace(inp, x=ds.shard(w, i), kind=(
      "tf.data, sharded" if card != tf.data.UNKNOWN_CARDINALITY else
      "tf.data of unknown length, sharded"))


def _py_dataset(flavour, inp, w, i, planned):
  data = inp.x
  if planned and flavour.stream_py_dataset is not None:
    length = len(data)
    cluster = inp.steps_per_epoch * w if inp.steps_per_epoch else length
    return FitInput(_planned(flavour.stream_py_dataset(data, i)),
                    shuffle=False,
                    cluster_steps=cluster, kind="PyDataset, planned")
  return dataclasses.replace(inp, x=flavour.shard_py_dataset(data, w, i),
                             kind="PyDataset, sharded")


class BatchShard:
  """Batches `index`, `index + n`, ... of a PyDataset or Sequence: one
  worker's shard. A mixin for the flavour's class, which sets `data`,
  `num_workers` and `index`.

  Equal shards (the last `len % n` batches are left out) keep workers of a
  Fixed schedule in step.
  """

  def __len__(self):
    return len(self.data) // self.num_workers

  def __getitem__(self, i):
    if not 0 <= i < len(self):
      raise IndexError(f"batch {i} of a shard of {len(self)}")
    return self.data[self.index + i * self.num_workers]


class OwnBatchOrder:
  """Worker `index`'s own order of a PyDataset's or Sequence's batches, pass
  after pass: a permutation per pass, seeded by the worker and the pass, so
  that streaming workers draw each batch about once per cluster epoch."""

  def __init__(self, index):
    self.index = index
    self._pass = (None, None)  # the last pass drawn, and its permutation

  def batch(self, i, length):
    """The batch (of `length`) at position `i` of this worker's stream."""
    cycle, pos = divmod(i, length)
    if self._pass[0] != cycle:
      rng = np.random.default_rng([1000 + self.index, cycle])
      self._pass = (cycle, rng.permutation(length))
    return int(self._pass[1][pos])


def _ordered_batches(data, order, batch):
  """An endless stream of `data`'s batches: step j's rows are the ones
  `order` gives for this worker's step j."""
  tensors = tf.nest.map_structure(tf.convert_to_tensor, _lists_as_tuples(data))

  def rows(step):
    indices = tf.py_function(py_function_errors.carried(order.indices),
                             [step], tf.int64)
    indices.set_shape([batch])
    return tf.nest.map_structure(lambda t: tf.gather(t, indices), tensors)
  return tf.data.Dataset.range(2**62).map(rows)


def _lists_as_tuples(data):
  """`data` with every list a tuple: tf.data stacks a list that a map
  function returns into one tensor, so a multi-input model's list of arrays
  would reach it as a single input."""
  if isinstance(data, list) or (isinstance(data, tuple) and
                                not hasattr(data, "_fields")):
    return tuple(_lists_as_tuples(d) for d in data)
  if isinstance(data, dict):
    return {k: _lists_as_tuples(v) for k, v in data.items()}
  return data


def _planned(stream):
  """Marks the endless stream whose epochs the plan ends (the flavour's
  epoch iterator looks for the mark; validation data has none)."""
  stream._oscars_planned_epochs = True  # pylint: disable=protected-access
  return stream


def _is_iterator(x):
  return hasattr(x, "__next__") and hasattr(x, "__iter__")


def _generator(inp, w, i):
  # A generator can only be split by reading it: worker i keeps elements
  # i, i + w, ... so the cluster trains on each element once.
  def own_elements():
    yield from itertools.islice(inp.x, i, None, w)
  return dataclasses.replace(inp, x=own_elements(),
                             kind="generator, every n-th element")


def rewrite_fit_args(extended, args, flavour, tensorboard_type):
  """The flavour-agnostic part of `fit`'s arguments for this worker, in
  place (`args`: fit's bound arguments); returns whether epochs are planned.

  Logs next to the user's TensorBoard callback, gives this worker its share
  of the input (keeping `validation_split`'s meaning), sets the epoch target
  of planned epochs, and leaves the progress bar to the chief.
  """
  info = extended.cluster
  if not extended.round_logs.logdir:  # log next to Keras' TensorBoard callback
    for cb in args["callbacks"] or []:
      if isinstance(cb, tensorboard_type):
        extended.round_logs.set_logdir(cb.log_dir)
  check_has_samples(args["x"], info.num_workers)
  extended.epochs.set_target(None)
  args["callbacks"] = list(args["callbacks"] or [])
  if not info.is_multi_worker:
    return False
  x, y, sw = args["x"], args["y"], args["sample_weight"]
  asked_batch_size = args["batch_size"]
  if (args["validation_split"] and args["validation_data"] is None and
      is_array_like(x)):
    (x, y, sw), args["validation_data"] = flavour.split_validation(
        (x, y, sw), args["validation_split"])
    args["validation_split"] = 0.0
  inp = split_for_worker(
      flavour, FitInput(x, y, sw, args["batch_size"], args["steps_per_epoch"],
                        args["shuffle"]),
      info.num_workers, info.worker_index, extended.epochs.plans())
  logging.info("oscars_tf: worker %d trains on %s.", info.worker_index,
               inp.kind)
  args.update(x=inp.x, y=inp.y, sample_weight=inp.sample_weight,
              batch_size=inp.batch_size, steps_per_epoch=inp.steps_per_epoch,
              shuffle=inp.shuffle)
  planned = inp.cluster_steps is not None
  if planned:
    if "validation_batch_size" in args:  # else Keras' 32 for validation
      args["validation_batch_size"] = (args["validation_batch_size"] or
                                       asked_batch_size)
    args.update(batch_size=None, steps_per_epoch=None)
    extended.epochs.set_target(inp.cluster_steps)
  extended.epochs.read_in_order(inp.order, args["initial_epoch"])
  if args["verbose"] in ("auto", 1) and not info.is_chief:
    args["verbose"] = 2  # one line per epoch; the progress bar is the chief's
  return planned
