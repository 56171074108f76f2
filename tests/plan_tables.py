"""Random step-rate tables and schedules for the policy's property tests
(hypothesis strategies)."""

import math

from hypothesis import strategies as st

from oscars_tf import schedules
from oscars_tf.policy import records

RATE = st.one_of(st.floats(0.05, 500.0), st.just(math.nan),
                 st.just(math.inf), st.just(-1.0), st.just(0.0))


@st.composite
def tables(draw, max_workers=24):
  n = draw(st.integers(1, max_workers))
  rates = draw(st.lists(RATE, min_size=n, max_size=n))
  rounds = draw(st.lists(st.integers(-1, 12), min_size=n, max_size=n))
  hosts = draw(st.lists(st.sampled_from("abc"), min_size=n, max_size=n))
  losses = draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n))
  entries = tuple(records.TableEntry(rate=r, round=k, loss=loss)
                  for r, k, loss in zip(rates, rounds, losses))
  return records.StepRateTable(entries, tuple(hosts))


CONFIGS = st.builds(
    schedules.Adaptive,
    grouping=st.sampled_from(schedules.GROUPINGS),
    max_group_size=st.one_of(st.none(), st.integers(2, 6)),
    weighting=st.sampled_from(schedules.WEIGHTINGS),
    global_every=st.integers(1, 6))
