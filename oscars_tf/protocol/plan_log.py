"""The changes of a worker's plan worth a log line, each said once (the
plan itself is logged at --v=1). No TensorFlow."""

from absl import logging


class PlanChangeLog:
  """Says when the members planned at the median rate (no usable rate of
  theirs) change, and when the averaging period changes."""

  def __init__(self, me):
    self.me = me
    self._imputed = frozenset()
    self._period = None

  def log(self, round_, plan, members):
    """`plan`, made for round `round_` among `members`: what changed."""
    imputed = frozenset(plan.imputed) & frozenset(members)
    if round_ > 1 and imputed != self._imputed:
      if imputed:
        logging.warning("oscars_tf: worker %d round %d: no usable rate from "
                        "worker(s) %s; planning them at the median rate.",
                        self.me, round_, sorted(imputed))
      self._imputed = imputed
    period = getattr(plan.state, "period", None)
    if period != self._period:
      if self._period is not None:
        logging.info("oscars_tf: worker %d round %d: period %.3g -> %.3g "
                     "steps of the fastest worker.", self.me, round_,
                     self._period, period)
      self._period = period
