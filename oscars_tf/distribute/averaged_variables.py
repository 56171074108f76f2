"""What a worker averages: the tracked model's weights (and, if asked, its
optimizer's slots), or in a custom loop without `track` the variables its
steps update."""

import numpy as np
import tensorflow as tf

from oscars_tf.distribute.replicas import component_variables
from oscars_tf.distribute.replicas import is_float


def key_of(variables):
  """A set of variables' identity (round-start copies, outer state and
  started sets are kept per set)."""
  return tuple(id(component_variables(v)[0]) for v in variables)


def moving_averages(optimizer):
  """The optimizer's moving averages of the weights (`use_ema=True`, Keras 3
  and tf_keras). `fit` ends by copying them into the weights, so they are
  part of the model every worker must end with: averaged with it (a mean
  of moving averages is the moving average of the mean)."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)  # loss scaling
  if not getattr(inner, "use_ema", False):
    return []
  return list(getattr(inner, "_model_variables_moving_average", None) or [])


class AveragedVariables:
  """The model and optimizer that Keras or the user registered, and the
  variables averaged from them."""

  def __init__(self, optimizer_state):
    self.optimizer_state = optimizer_state
    self.model = None
    self.optimizer = None
    self.tracked = False

  def track(self, model, optimizer=None):
    """Average `model`'s weights (and `optimizer`'s slots if asked)."""
    self.model, self.optimizer, self.tracked = model, optimizer, True

  def learning_rate(self):
    """The tracked optimizer's learning rate now, or NaN."""
    try:
      return float(np.asarray(self.optimizer.learning_rate))
    except Exception:  # pylint: disable=broad-except
      return float("nan")

  def select(self, updated):
    """The floating-point variables to average, each once; `updated`: the
    variables a step updated (used when nothing is tracked)."""
    if not self.tracked:
      if self.optimizer_state == "average":
        raise ValueError(
            "optimizer_state='average' needs to know the optimizer: call "
            "strategy.track(model, optimizer) before the training loop (Keras "
            "fit does this by itself).")
      chosen = updated
    else:
      chosen = (list(self.model.trainable_weights) +
                list(self.model.non_trainable_weights) +
                moving_averages(self.optimizer))
      if self.optimizer_state == "average" and self.optimizer is not None:
        skip = {id(getattr(self.optimizer, "iterations", None))}
        chosen += [v for v in self.optimizer.variables if id(v) not in skip]
    out, seen = [], set()
    for v in chosen:
      key = id(component_variables(v)[0])
      if key not in seen and is_float(v):
        seen.add(key)
        out.append(v)
    return out

  def clear_nonfinite_slots(self):
    """A poisoned worker's optimizer slots may be NaN too: zero those."""
    slots = [c for v in getattr(self.optimizer, "variables", [])
             if is_float(v) for c in component_variables(v)]
    return tf.group([c.assign(tf.where(tf.math.is_finite(c), c,
                                       tf.zeros_like(c))) for c in slots])
