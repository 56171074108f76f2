"""One sample order per epoch shared by every worker, cut by the plan.

Under planned (cluster-wide) epochs a fast worker takes more steps than a
slow one, so equal shards would not do; and workers shuffling on their own
see about 30 % of the samples not at all in an epoch of 4 workers and
others twice. Instead every worker draws the same permutation of the
samples for each epoch (seeded by the epoch alone), and reads its batches
from the part of it the round's plan gives it: the plan, identical on every
member, says how many steps each worker takes in the round, so in a round
that starts after `done` cluster steps of the epoch, worker i reads batches
done + k_0 + ... + k_{i-1} onwards, k_i of them. No communication; each
sample is trained on once per epoch (the epoch's last batch tops up from
its start). Steps of a worker that was dropped before its round ended are
not counted, and their samples come again.

`Rounds` tells `SharedOrder.add_slice` each round's part as the plan is
fixed; the input pipeline asks `indices(step)` for each training step and
waits for the part of a round not planned yet (its prefetch runs ahead of
training). No TensorFlow here.
"""

import bisect
import math
import threading
import time

import numpy as np

from oscars_tf.errors import OscarsError

SEED = 0x05CA25  # the same on every worker: one order per epoch


class SharedOrder:
  """This worker's batches of each epoch's shared sample order."""

  def __init__(self, num_samples, batch_size, shuffle=True, timeout=None,
               epoch_steps=None):
    """`timeout`: seconds a read waits for its round's plan (None: until
    the plan comes or `close`). `epoch_steps`: the cluster's steps per
    epoch where `fit` was given `steps_per_epoch`; unshuffled, epoch e then
    reads on from where epoch e - 1 stopped (as Keras does), not from the
    first sample again."""
    if num_samples < 1 or batch_size < 1:
      raise ValueError(f"SharedOrder needs samples and a batch size, got "
                       f"{num_samples} and {batch_size}.")
    self._n, self._batch = int(num_samples), int(batch_size)
    self._shuffle = shuffle
    self._timeout = timeout
    self._epoch_steps = 0 if shuffle or not epoch_steps else int(epoch_steps)
    # This worker's parts in `fit`, in order: (its first step in them,
    # epoch, first batch of the epoch's order, batches).
    self._slices = []
    self._told = 0  # batches told so far
    self._order = (None, None)  # (epoch, permutation)
    self._closed = False
    self._cond = threading.Condition()

  def add_slice(self, epoch, first_batch, batches):
    """This worker's next part: `batches` batches of epoch `epoch`'s order,
    from its batch `first_batch` on."""
    if batches <= 0:
      return
    with self._cond:
      self._slices.append((self._told, int(epoch), int(first_batch),
                           int(batches)))
      self._told += int(batches)
      self._cond.notify_all()

  def close(self):
    """`fit` is over: a read still waiting returns at once (its batch is
    never trained on)."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def indices(self, step):
    """Sample indices of this worker's training step `step` of the `fit`
    (0, 1, ...; a read ahead waits for the round that plans it). Reads are
    by step, not in turn: Keras may open the stream twice, or read ahead
    and throw the batches away."""
    step = int(step)
    with self._cond:
      deadline = (None if self._timeout is None else
                  time.monotonic() + self._timeout)
      while step >= self._told:
        if self._closed:  # a read ahead after the end: never trained on
          return np.arange(self._batch, dtype=np.int64) % self._n
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise OscarsError(
              f"oscars_tf: no round planned this worker's step {step} "
              f"within {self._timeout:.0f} s.")
        self._cond.wait(left)
      at = bisect.bisect_right(self._slices, (step, math.inf)) - 1
      begin, epoch, first, _ = self._slices[at]
      order = self._order_of(epoch)
    position = first + step - begin + epoch * self._epoch_steps
    return order[(np.arange(self._batch) + position * self._batch) % self._n]

  def _order_of(self, epoch):
    if self._order[0] != epoch:
      order = (np.random.default_rng([SEED, epoch]).permutation(self._n)
               if self._shuffle else np.arange(self._n))
      self._order = (epoch, order.astype(np.int64))
    return self._order[1]
