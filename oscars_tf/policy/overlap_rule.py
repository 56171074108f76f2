"""When an averaging is worth running beside the next round (overlap=True).
No TensorFlow.

Overlap hides an averaging's cost at a price: its average is taken one
round late, to a model that has moved on (distribute/overlap.py). Where
the network is free there is nothing to hide and only the price is left:
on an even cluster on loopback, a language model's averaging took 1.7 %
of a round, and overlapping it still cost 2.9 % in validation bits per
byte at the end (benchmarks/README.md). So a worker waits for its
averaging, as a blocking round would, while the averaging costs at most
`share` of the round's compute, and lets it run beside the next round
only past that.

The cost is each averaging's measured seconds, start to end, the median
of the last few (one slow averaging, a pause, does not turn overlap on).
An averaging that ran beside compute measures longer than it would alone
(the steps take the cores); the rule counts it as it is, so a network that
costs about `share` may switch now and then, where the two choices cost
about the same. With no measurement yet the worker waits: the first
averagings measure the network without compute beside them. (The caller
leaves out an averaging that met its group for the first time, TensorFlow
resolves the group then, and one that sent nothing, a member alone in its
group: neither says what the next ones cost.)
"""

import collections
import statistics

# The share of a round's compute above which an averaging overlaps: what
# overlapping could save at most is about this share of the time.
DEFAULT_SHARE = 0.1
_WINDOW = 3  # averagings the cost is the median of


class OverlapRule:
  """One averaged set's choice, round by round: overlap or wait.

  Args:
    share: the averaging's cost, as a share of the round's compute, above
      which it overlaps; 0: always overlap.
  """

  def __init__(self, share=DEFAULT_SHARE):
    if not 0 <= share < 1:
      raise ValueError(f"OverlapRule: share must be in [0, 1), got {share}")
    self.share = share
    self._costs = collections.deque(maxlen=_WINDOW)

  def measured(self, seconds):
    """An averaging of the set took `seconds`, start to end."""
    if seconds is not None and seconds >= 0:
      self._costs.append(float(seconds))

  @property
  def cost_s(self):
    """The averaging's cost the rule goes by, or None before a measure."""
    return statistics.median(self._costs) if self._costs else None

  def overlaps(self, round_compute_s):
    """Whether the averaging that ends a round of `round_compute_s`
    seconds of compute runs beside the next round."""
    if self.share == 0:
      return True
    cost = self.cost_s
    return cost is not None and cost > self.share * max(round_compute_s, 0.0)
