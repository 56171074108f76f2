"""The outer optimizer (SlowMo / DiLoCo): its state and its step.

At a global sync the averaged model takes one momentum step from the model
of the previous global sync, its `start` (see `schedules.OuterMomentum`).
Three rules keep that state sound:

* Only the model's trainable weights take the outer step and have state.
  Statistics (BatchNormalization's moving mean and variance) and optimizer
  slots take the plain average: extrapolating them by momentum would push a
  shrinking non-negative one, such as Adam's second moment, below zero.
* Every sound member holds the same state. A worker that rejoins after it
  was dropped holds a stale one, so at a round with newcomers the state is
  averaged too, the newcomers with weight 0 (see `rounds.round_end_ops`):
  every member then takes the same outer step.
* It is part of a checkpoint (`checkpoint.save(..., strategy=)`); restored
  before the state exists (it is created at the first step), it waits and is
  used when it is; each worker restores its own, so the chief's is then
  broadcast to all (extended.py, as the initial model is).
"""

import numpy as np
import tensorflow as tf

from oscars_tf.distribute.replicas import component_variables


def takes_outer_step(variables, model=None):
  """Which of `variables` take the outer step: `model`'s trainable weights
  (given a tracked model), else those marked trainable."""
  if model is None:
    return [bool(getattr(v, "trainable", True)) for v in variables]
  ids = {id(component_variables(v)[0]) for v in model.trainable_weights}
  return [id(component_variables(v)[0]) in ids for v in variables]


class OuterState:
  """Start and momentum of the trainable variables of one averaged set.

  Args:
    optimizer: the `schedules.OuterMomentum`.
    trainable: per averaged variable, whether it takes the outer step.
    values: the averaged variables' values now (the first start).
    saved: (starts, momenta) arrays from a checkpoint, or None.
  """

  def __init__(self, optimizer, trainable, values, saved=None):
    self._optimizer = optimizer
    self.indices = [i for i, t in enumerate(trainable) if t]
    chosen = [values[i] for i in self.indices]
    starts = chosen
    momenta = [tf.zeros_like(v) for v in chosen]
    if saved is not None:
      _check_shapes(saved, chosen)
      starts = [tf.cast(a, v.dtype) for a, v in zip(saved[0], chosen)]
      momenta = [tf.cast(a, v.dtype) for a, v in zip(saved[1], chosen)]
    self.starts = [tf.Variable(v, trainable=False) for v in starts]
    self.momenta = [tf.Variable(v, trainable=False) for v in momenta]

  @property
  def variables(self):
    """What a rejoining worker must take from the others."""
    return self.starts + self.momenta

  def assign(self, values):
    """Assigns `values` to `variables` (eager), e.g. the chief's."""
    for v, value in zip(self.variables, values):
      v.assign(value)

  def step(self, averaged):
    """`averaged` with its trainable variables moved by the outer step."""
    o = self._optimizer
    out, updates = list(averaged), []
    for i, start, m in zip(self.indices, self.starts, self.momenta):
      delta = start - averaged[i]  # the outer "gradient"
      m_new = o.momentum * m + delta
      step = delta + o.momentum * m_new if o.nesterov else m_new
      new = start - o.learning_rate * step
      updates += [m.assign(m_new), start.assign(new)]
      out[i] = new
    with tf.control_dependencies(updates):
      return [tf.identity(v) for v in out]

  def arrays(self):
    """(starts, momenta) as NumPy arrays (eager)."""
    return ([_savable(v.numpy()) for v in self.starts],
            [_savable(v.numpy()) for v in self.momenta])

  def load(self, saved):
    """Assigns (starts, momenta) arrays, e.g. from a checkpoint (eager)."""
    _check_shapes(saved, self.starts)
    for variables, arrays in zip((self.starts, self.momenta), saved):
      for v, a in zip(variables, arrays):
        v.assign(tf.cast(a, v.dtype))


class OuterStates:
  """The outer optimizer's state of each averaged variable set, in the order
  the sets were created (a Keras model has one), and saved states waiting
  for their set."""

  def __init__(self, optimizer):
    self.optimizer = optimizer  # None: no outer optimizer
    self._states = {}
    self._saved = []

  def create(self, key, trainable, values):
    """Creates and returns the state of the set `key`, from a restored
    checkpoint if one is waiting for it, else starting at `values` with
    zero momentum."""
    position = len(self._states)
    saved = self._saved[position] if position < len(self._saved) else None
    self._states[key] = OuterState(self.optimizer, trainable, values, saved)
    return self._states[key]

  def get(self, key):
    return self._states.get(key)

  def arrays(self):
    """[(starts, momenta)] per set as NumPy arrays; saved states not yet
    used come after the created ones (a checkpoint taken before the first
    step keeps them)."""
    created = [s.arrays() for s in self._states.values()]
    return created + self._saved[len(created):]

  def load(self, sets):
    """Takes [(starts, momenta)] per set: assigned to the sets that exist,
    kept for those created later."""
    self._saved = [(list(s), list(m)) for s, m in sets]
    for state, saved in zip(self._states.values(), self._saved):
      state.load(saved)


def _savable(array):
  # bfloat16 has no NumPy file format: kept as float32 (exact), cast back
  # on load.
  return array if array.dtype.kind == "f" else array.astype(np.float32)


def _check_shapes(saved, like):
  starts, momenta = saved
  want = [tuple(v.shape) for v in like]
  for name, arrays in (("start", starts), ("momentum", momenta)):
    got = [tuple(np.shape(a)) for a in arrays]
    if got != want:
      raise ValueError(
          f"outer optimizer state: the saved {name} values have shapes "
          f"{got}, but the model's trainable variables have shapes {want}. "
          "The checkpoint is of another model.")
