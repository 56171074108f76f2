"""A field that changed for many members travels as a byte per member
(protocol/dense_columns.py): every holder gets the same float32 numbers,
each within half its field's tolerance of what was measured."""

import math

import numpy as np
import pytest

from oscars_tf.policy import records
from oscars_tf.protocol import dense_columns
from oscars_tf.protocol import table_deltas

RATE = records.Column.RATE
LOSS = records.Column.LOSS


def _first_table(n, rates, losses=None):
  members = tuple(range(n))
  base = table_deltas.next_snapshot(table_deltas.empty(n), members, 0)
  rows = np.full((n, table_deltas.WIDTH), np.nan, np.float32)
  rows[:, RATE] = rates
  rows[:, LOSS] = 1.0 if losses is None else losses
  rows[:, records.Column.LEARNING_RATE:records.Column.SYNC_COST] = (
      0.1, 5, 1, 0)  # learning rate, steps, healthy, exhausted
  ops = table_deltas.column_ops(base, rows, members)
  base = table_deltas.apply_columns(base, members, ops)
  cells = table_deltas.changed_cells(base, rows, members,
                                     table_deltas.pending_changes(n))
  return members, base, rows, ops, cells


def test_the_scale_is_the_same_float32_products_on_every_member():
  levels = dense_columns.scale(np.float32(0.37), np.float32(1.02))
  by_hand, v = [], np.float32(0.37)
  for _ in range(dense_columns.LEVELS):
    by_hand.append(v)
    v = v * np.float32(1.02)
  assert levels.dtype == np.float32 and levels.tobytes() == np.array(
      by_hand, np.float32).tobytes()
  assert (np.diff(levels) > 0).all()


def test_a_first_table_of_1024_rates_travels_as_a_byte_each_within_tolerance():
  n = 1024
  rates = (10 * np.random.default_rng(0).lognormal(0.0, 0.5, n)).astype(
      np.float32)
  members, base, rows, ops, cells = _first_table(n, rates)
  assert len(cells) == n  # one rate cell each (the rest are columns)
  blocks, left = dense_columns.split(cells, members, table_deltas.TOLERANCE)
  assert len(left) == 0 and [b[0] for b in blocks] == [RATE]
  chief = table_deltas.apply_cells(
      dense_columns.apply(base.copy(), members, blocks), left)
  error = np.abs(chief[:, RATE] / rates - 1)
  assert error.max() <= table_deltas.TOLERANCE[RATE] / 2 + 1e-6
  assert (chief[:, RATE] == dense_columns.scale(*blocks[0][1:3])[
      blocks[0][3]]).all()
  # What members receive: a byte per member, not a 9-byte cell.
  text = table_deltas.encode(0, n, 0, (), (), left,
                             table_deltas.digest(chief), ops, blocks)
  assert len(text) < 4 / 3 * (n + 200)
  held, held_members = table_deltas.Changes(text).apply(
      table_deltas.empty(n), members)
  assert held_members == members and held.tobytes() == chief.tobytes()


def test_few_changes_nonpositive_values_and_wide_spreads_stay_cells():
  n = 64
  tol = table_deltas.TOLERANCE
  rates = np.linspace(1.0, 2.0, n).astype(np.float32)
  members, _, _, _, cells = _first_table(n, rates)
  # A few cells far apart: cheaper as cells; close together, a block of
  # their span.
  blocks, left = dense_columns.split(cells[::13], members, tol)
  assert blocks == [] and len(left) == 5
  blocks, left = dense_columns.split(cells[20:25], members, tol)
  assert len(left) == 0 and len(blocks[0][3]) == 5 and blocks[0][4] == 20
  # Zero, negative and infinite values stay cells; NaN is coded.
  odd = cells.copy()
  odd["value"][:4] = (0.0, -3.0, np.inf, np.nan)
  blocks, left = dense_columns.split(odd, members, tol)
  assert sorted(left["worker"].tolist()) == [0, 1, 2]
  codes, start = blocks[0][3:]
  assert start == 3 and codes[0] == dense_columns.NAN
  assert len(codes) == n - 3 and (codes[1:] != dense_columns.KEEP).all()
  snap = dense_columns.apply(np.zeros((n, table_deltas.WIDTH), np.float32),
                             members, blocks)
  assert math.isnan(snap[3, RATE]) and snap[0, RATE] == 0.0
  # A spread of more than (1 + 2 tolerances) ** 253 (rates 150,000x apart)
  # cannot be coded within tolerance: cells.
  wide = cells.copy()
  wide["value"][0] = 1e-6
  assert dense_columns.split(wide, members, tol)[0] == []
  # An exact field (tolerance 0) never is.
  steps = cells.copy()
  steps["field"] = records.Column.STEPS
  assert dense_columns.split(steps, members, tol)[0] == []


def test_a_block_leaves_unchanged_members_as_they_are():
  # Members without a cell in the field keep their value (KEEP), so a block
  # made for a round in which most rows moved leaves the rest exactly.
  n = 100
  members = tuple(range(n))
  snap = np.full((n, table_deltas.WIDTH), 7.0, np.float32)
  cells = np.empty(80, table_deltas._CELL)  # pylint: disable=protected-access
  cells["worker"] = np.arange(10, 90)
  cells["field"] = LOSS
  cells["value"] = np.linspace(0.5, 0.9, 80)
  blocks, left = dense_columns.split(cells, members, table_deltas.TOLERANCE)
  assert len(blocks) == 1 and len(left) == 0
  out = dense_columns.apply(snap.copy(), members, blocks)
  assert (out[:10] == 7.0).all() and (out[90:] == 7.0).all()
  assert (np.abs(out[10:90, LOSS] / cells["value"] - 1) <= 0.025 + 1e-6).all()
  assert (out[:, RATE] == 7.0).all()


def test_a_small_job_keeps_its_rows_as_measured():
  n = dense_columns.MIN_MEMBERS - 1
  members, _, _, _, cells = _first_table(n, np.linspace(1, 3, n))
  blocks, left = dense_columns.split(cells, members, table_deltas.TOLERANCE)
  assert blocks == [] and len(left) == len(cells) == n


def test_a_block_whose_span_leaves_the_members_is_refused():
  n = 100
  members, _, _, _, cells = _first_table(n, np.linspace(1, 3, n))
  blocks, _ = dense_columns.split(cells[60:], members, table_deltas.TOLERANCE)
  assert blocks[0][4] == 60 and len(blocks[0][3]) == 40
  data = dense_columns.pack(blocks)
  assert len(data) == dense_columns.size(blocks)
  assert dense_columns.unpack(data, 0, 1, n)[0][0][4] == 60
  with pytest.raises(ValueError, match="spans members 60 to 100, of 99"):
    dense_columns.unpack(data, 0, 1, n - 1)
