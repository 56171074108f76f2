"""Tests for oscars_tf.protocol.rate_table: the rate meter and the
published rows (pure Python)."""

import dataclasses
import math
import types

import pytest

from fake_store import FakeStore
from oscars_tf.policy import records
from oscars_tf.protocol import rate_table
from oscars_tf.protocol.rate_table import RateMeter


def test_first_sample_seeds_then_moving_average():
  m = RateMeter(alpha=0.5)
  assert math.isnan(m.rate)
  assert m.add(10, 1.0) == 10.0
  assert m.add(12, 1.0) == pytest.approx(11.0)


def test_a_real_change_of_speed_is_taken_at_once():
  m = RateMeter(alpha=0.5, change=1.5)
  m.add(40, 1.0)
  assert m.add(10, 1.0) == 10.0   # 4x slower: no averaging with the past
  assert m.add(40, 1.0) == 40.0   # and back


def test_empty_or_broken_samples_are_ignored():
  m = RateMeter()
  m.add(10, 1.0)
  for steps, seconds in ((0, 1.0), (5, 0.0), (5, float("nan")), (5, -1.0)):
    assert m.add(steps, seconds) == 10.0


@pytest.mark.parametrize("kwargs", [{"alpha": 0}, {"alpha": 1.5},
                                    {"change": 1.0}])
def test_bad_arguments(kwargs):
  with pytest.raises(ValueError):
    RateMeter(**kwargs)


class _Plan:
  """A plan whose digest counts how often it was made (costly at scale)."""

  def __init__(self):
    self.digests = 0

  def digest(self):
    self.digests += 1
    return f"d{self.digests}"


def test_a_row_is_published_at_most_once_a_period():
  store, plan = FakeStore(), _Plan()
  publisher = rate_table.RowPublisher(3, every_s=1.0)
  entry = records.TableEntry(rate=5.0, round=1)
  publisher.maybe_publish(store, entry, plan, now=10.0)
  assert rate_table.read_all(store, 4, timeout_s=0.01)[3]["plan"] == "d1"
  # The store refuses to overwrite (as the service does): the publisher
  # replaces the row, once the period is over, and only then makes a digest.
  publisher.maybe_publish(store, entry, plan, now=10.5)
  assert plan.digests == 1
  publisher.maybe_publish(store, records.TableEntry(rate=7.0, round=2),
                          plan, now=11.0)
  row = rate_table.read_all(store, 4, timeout_s=0.01)[3]
  assert (row["rate"], row["round"], row["plan"]) == (7.0, 2, "d2")


def test_a_failed_publication_does_not_stop_training():
  broken = types.SimpleNamespace(set=_raise, get=_raise, delete=_raise)
  publisher = rate_table.RowPublisher(0)
  publisher.maybe_publish(broken, records.TableEntry(), _Plan(), now=0.0)


def _raise(*args):
  raise RuntimeError("service gone")


def test_a_row_goes_on_the_wire_in_the_entry_s_field_order():
  assert records.FIELDS == tuple(
      f.name for f in dataclasses.fields(records.TableEntry))
  entry = records.TableEntry(rate=2.5, round=3, loss=0.5, divergence=0.1,
                             learning_rate=0.01, steps=7, healthy=False,
                             exhausted=True, sync_cost=0.2)
  values = entry.to_values()
  assert values == [2.5, 3.0, 0.5, 0.1, 0.01, 7.0, 0.0, 1.0, 0.2]
  assert values[records.Column.STEPS] == 7.0
  assert records.TableEntry.from_values(values) == entry
  table = records.StepRateTable.from_rows([values, values], ("a", "b"))
  assert table.entries == (entry, entry)


def test_a_short_row_reads_as_one_from_before_its_last_fields():
  entry = records.TableEntry.from_values([4.0, math.nan, 1.0])
  assert (entry.rate, entry.round, entry.loss, entry.steps) == (
      4.0, -1, 1.0, 0)
  assert entry.healthy is False and math.isnan(entry.sync_cost)
  ragged = records.StepRateTable.from_rows([[4.0, math.nan, 1.0],
                                            [1.0] * 9], ("a", "a"))
  assert ragged.entries[0] == entry
