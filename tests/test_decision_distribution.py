"""The compact decision (decision_codec.py) and its distribution as table
changes (table_deltas.py, Membership(distribution="deltas")) on an
in-memory store: round trips, agreement under deaths and rejoins, and the
bytes that leave the chief per round."""

import dataclasses
import math

import numpy as np
import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import membership
from oscars_tf.protocol import store_keys
from oscars_tf.protocol import table_deltas
from protocol_helpers import exchange
from protocol_helpers import row as _row
from protocol_helpers import run
from protocol_helpers import workers


class CountingStore(FakeStore):
  """Counts the bytes `get` returns: what leaves the chief (its host)."""

  def __init__(self):
    super().__init__()
    self.bytes_out = 0

  def get(self, key, timeout_s):
    value = super().get(key, timeout_s)
    self.bytes_out += len(value)
    return value


def test_a_decision_survives_the_compact_form_with_nan_and_missing_rows():
  d = membership.Decision(7, (0, 2, 3), (3,), (1,),
                          ((1.5, 7.0, math.nan), None, (2.25, 7.0, 0.5),
                           (4.0, 6.0, 1.0)), 123,
                          {"local_steps": [1, 2, 3, 4], "epoch": 2})
  back = membership.Decision.decode(d.encode())
  assert (back.round, back.members, back.newcomers, back.dropped,
          back.epoch_done, back.chief_plan) == (
              7, (0, 2, 3), (3,), (1,), 123, d.chief_plan)
  assert back.rows[1] is None and math.isnan(back.rows[0][2])
  assert back.rows[2] == (2.25, 7.0, 0.5)
  assert back.row_array.shape == (4, 3) and np.isnan(back.row_array[1]).all()
  # Text the coordination service can hold (its Python API decodes UTF-8).
  assert d.encode().isascii()
  # Packed: 4 bytes a cell (base64: 4/3 of that), no JSON per worker.
  n = 1000
  big = membership.Decision(1, tuple(range(n)), (), (),
                            tuple(tuple(_row(j, 1)) for j in range(n)))
  assert len(big.encode()) < 4 / 3 * (4 * 9 * n + 4 * n) + 100


def test_rows_survive_their_compact_form_exactly_into_one_table():
  row = [12.345678901234, 3.0, math.nan, 1e-9, 0.1]
  texts = {j: decision_codec.encode_row([x * j for x in row])
           for j in (1, 3)}
  table = decision_codec.rows_array(5, texts)
  back = table[1].tolist()
  assert back[0] == row[0] and math.isnan(back[2]) and back[3] == 1e-9
  assert table[3, 0] == row[0] * 3 and np.isnan(table[[0, 2, 4]]).all()
  # Rows of different widths (and a row given as floats: the chief's own)
  # are NaN-padded to the widest.
  texts[4] = decision_codec.encode_row(row[:2])
  texts[0] = decision_codec.encode_row([7.0, 8.0, 9.0, 10.0, 11.0, 12.0])
  table = decision_codec.rows_array(5, texts)
  assert table.shape == (5, 6) and table[0, 5] == 12.0
  assert table[4, :2].tolist() == row[:2] and np.isnan(table[4, 2:]).all()
  assert table[1, :5].tolist()[:2] == row[:2] and np.isnan(table[1, 5])
  # Rows of 9 fields (72 bytes: base64 without padding, as workers post
  # them) are decoded as one text; rows of 8 are padded, one at a time:
  # the same numbers either way.
  for width in (8, 9):
    rows = np.random.default_rng(width).normal(size=(6, width))
    rows[2, 3] = math.nan
    texts = {j: decision_codec.encode_row(rows[i])
             for i, j in enumerate((0, 2, 3, 5, 6, 9))}
    table = decision_codec.rows_array(10, texts)
    np.testing.assert_array_equal(table[[0, 2, 3, 5, 6, 9]], rows)
    assert np.isnan(table[[1, 4, 7, 8]]).all()


def test_changes_within_tolerance_are_not_sent_and_every_holder_agrees():
  n = 5
  prev = table_deltas.empty(n)
  members = tuple(range(n))
  rows = [tuple(_row(j, 0)) for j in range(n)]
  snap0 = table_deltas.next_snapshot(prev, members, 0)
  cells = table_deltas.changed_cells(snap0, rows, members)
  assert len(cells) == n * (table_deltas.WIDTH - 2)  # all but round, NaN
  snap0 = table_deltas.apply_cells(snap0, cells)
  # Round 1: worker 2's rate moves 1 % (kept), worker 3's 10 % (sent).
  rows = [tuple(_row(j, 1)) for j in range(n)]
  rows[2] = tuple(_row(2, 1, rate=12.0 * 1.01))
  rows[3] = tuple(_row(3, 1, rate=13.0 * 1.10))
  snap1 = table_deltas.next_snapshot(snap0, members, 1)
  cells = table_deltas.changed_cells(snap1, rows, members)
  assert [(c["worker"], c["field"]) for c in cells] == [(3, 0)]
  snap1 = table_deltas.apply_cells(snap1, cells)
  text = table_deltas.encode(1, n, 0, (), (), cells,
                             table_deltas.digest(snap1))
  held, held_members = table_deltas.Changes(text).apply(snap0, members)
  np.testing.assert_array_equal(held, snap1)
  assert held_members == members
  # A holder whose snapshot differs finds out (and reads the whole one).
  wrong = snap0.copy()
  wrong[4, 0] += 1
  assert table_deltas.Changes(text).apply(wrong, members) is None


def _held_after(snap, members, round_, rows, expected_steps=None):
  """What the chief publishes (ops, cells) and what a holder of `snap`
  makes of it: (changes, the holder's new snapshot)."""
  base = table_deltas.next_snapshot(snap, members, round_, expected_steps)
  ops = table_deltas.column_ops(base, rows, members)
  base = table_deltas.apply_columns(base, members, ops)
  cells = table_deltas.changed_cells(base, rows, members)
  chief = table_deltas.apply_cells(base, cells)
  changes = table_deltas.Changes(table_deltas.encode(
      round_, len(snap), 0, (), (), cells, table_deltas.digest(chief), ops))
  held = changes.apply(snap, members, expected_steps)
  assert held is not None  # the holder's digest matches the chief's
  np.testing.assert_array_equal(held[0], chief)
  return changes, held[0]


def test_rows_that_all_move_together_travel_as_one_number_per_field():
  # Losses all falling 10 %, rates all rising 30 % (warm-up over), the
  # learning rate decayed, every worker's data out, a new k_i for all:
  # N² cells out of the chief before; now a column operation per field.
  n = 50
  members = tuple(range(n))
  rng = np.random.default_rng(0)
  rates = rng.lognormal(0, 0.5, n) * 10
  losses = rng.uniform(1, 2, n)
  rows = [(rates[j], 0, losses[j], 0.1, 0.1, 8, 1, 0, 0.01)
          for j in range(n)]
  snap = table_deltas.apply_cells(
      table_deltas.next_snapshot(table_deltas.empty(n), members, 0),
      table_deltas.changed_cells(
          table_deltas.next_snapshot(table_deltas.empty(n), members, 0),
          rows, members))
  k = [int(3 + j % 5) for j in range(n)]
  moved = [(1.3 * rates[j], 1, 0.9 * losses[j], 0.1, 0.05, k[j], 1, 1,
            0.01) for j in range(n)]
  changes, held = _held_after(snap, members, 1, moved, expected_steps=k)
  assert len(changes.cells) == 0, changes.cells
  ops = {records_field: (int(op), float(v)) for records_field, (op, v) in
         zip(range(table_deltas.WIDTH), changes.ops.tolist()) if op}
  f = {name: i for i, name in enumerate(
      ("rate", "round", "loss", "divergence", "learning_rate", "steps",
       "healthy", "exhausted", "sync_cost"))}
  assert ops[f["rate"]][0] == table_deltas.SCALE
  assert ops[f["loss"]][0] == table_deltas.SCALE
  assert ops[f["learning_rate"]] == (table_deltas.SET, np.float32(0.05))
  assert ops[f["exhausted"]] == (table_deltas.SET, 1.0)
  assert f["steps"] not in ops  # as planned: nothing to send
  np.testing.assert_allclose(held[:, f["rate"]], 1.3 * rates, rtol=0.02)
  np.testing.assert_allclose(held[:, f["loss"]], 0.9 * losses, rtol=0.05)
  assert (held[:, f["steps"]] == k).all()
  # One worker off its plan and one rate off the common move: two cells.
  moved[3] = moved[3][:5] + (k[3] - 2,) + moved[3][6:]
  moved[7] = (2.0 * moved[7][0],) + moved[7][1:]
  changes, held = _held_after(held, members, 2, moved, expected_steps=k)
  assert sorted(changes.cells[["worker", "field"]].tolist()) == [
      (3, f["steps"]), (7, f["rate"])]
  assert held[3, f["steps"]] == k[3] - 2


def test_a_holder_with_another_plan_finds_out_by_the_digest():
  n = 4
  members = tuple(range(n))
  rows = [(10.0, 0, 1.0, 0.1, 0.1, 5, 1, 0, 0.01)] * n
  base = table_deltas.next_snapshot(table_deltas.empty(n), members, 0,
                                    [5] * n)
  cells = table_deltas.changed_cells(base, rows, members)
  snap = table_deltas.apply_cells(base, cells)
  text = table_deltas.encode(0, n, 0, (), (), cells,
                             table_deltas.digest(snap))
  assert table_deltas.Changes(text).apply(table_deltas.empty(n), members,
                                          [5] * n) is not None
  assert table_deltas.Changes(text).apply(table_deltas.empty(n), members,
                                          [6, 5, 5, 5]) is None


def _workers(store, n, straggler=0.3, distribution="deltas"):
  return workers(store, n, straggler, 5.0, distribution=distribution)


def _same(decisions):
  first = decisions[0]
  for d in decisions[1:]:
    assert (d.round, d.members, d.newcomers, d.dropped) == (
        first.round, first.members, first.newcomers, first.dropped)
    np.testing.assert_array_equal(d.row_array, first.row_array)


def test_deltas_agree_through_a_death_and_a_rejoin():
  store = FakeStore(FakeClock())
  ws = _workers(store, 4)
  out, errors = exchange(ws, 0)
  assert errors == [None] * 4
  _same(out)
  # Round 1: worker 3 is late (dropped); it rejoins at round 2.
  out, errors = exchange(ws[:3], 1)
  assert errors == [None] * 3 and out[0].dropped == (3,)
  _same(out)
  assert math.isnan(out[0].row_array[3, 0])  # a non-member has no row
  late = []

  def rejoiner():
    store.wait_for_key(store_keys.decision(1))
    late.append(ws[3].exchange(1, _row(3, 1), rate_before=20.0))
  _, errors = run([rejoiner] + [
      lambda w=w: (store.wait_for_key(store_keys.rejoin_request(3)),
                   w.exchange(2, _row(w.me, 2)))[1] for w in ws[:3]],
                  store.clock)
  assert errors == [None] * 4, errors
  assert late[0].round == 2 and late[0].newcomers == (3,)
  assert late[0].row_array[3, 0] == 20.0  # its rate from before the stall
  # Round 3: everyone, the rejoiner from the whole snapshot it read.
  out, errors = exchange(ws, 3)
  assert errors == [None] * 4
  _same(out)
  assert out[0].members == (0, 1, 2, 3) and out[3].row_array[3, 0] == 13.0
  # The rows are those of the full distribution, within the tolerance.
  full = _workers(FakeStore(FakeClock()), 4, distribution="full")
  ref, _ = exchange(full, 0, row_of=lambda j, r: _row(j, 3))
  np.testing.assert_allclose(out[0].row_array[:3, 0], ref[0].row_array[:3, 0])


@pytest.mark.parametrize("distribution,bound", [("full", None),
                                                ("deltas", 100_000)])
def test_bytes_out_of_the_chief_per_round_at_1024_workers(distribution,
                                                          bound):
  # 1,024 members whose rows stay within tolerance, then all move at once:
  # with deltas, about a header per member per round leaves the chief
  # after round 0 (where every member reads every row); the whole decision
  # (the "full" distribution) is N² numbers every round.
  n = 1024
  store = CountingStore()
  chief = membership.Membership(store, 0, n, 5.0, 5.0,
                                distribution=distribution)
  reader = membership.Membership(store, 1, n, 5.0, 5.0,
                                 distribution=distribution)
  per_round = []
  for r in range(4):
    # Round 3: every loss falls 10 % and every rate rises 5 % at once.
    moved = (lambda row: [row[0] * 1.05, row[1], 0.9, *row[3:]]) if r == 3 \
        else (lambda row: row)
    for j in range(1, n):
      store.set(store_keys.arrival(r, j),
                decision_codec.encode_row(moved(_row(j, r))))
    store.bytes_out = 0
    decision = chief.exchange(r, moved(_row(0, r)))
    arrivals = store.bytes_out
    # Every other member reads the round's decision; worker 1 for real.
    held = reader.member_side.await_decision(r, 1.0)
    reader.members = held.members
    for _ in range(2, n):
      store.get(store_keys.decision(r), 1.0)
    per_round.append(store.bytes_out - arrivals)
    assert held.members == decision.members
    np.testing.assert_array_equal(held.row_array, decision.row_array)
  if bound is None:
    assert per_round[-1] > 30e6  # O(N²): why deltas exist
  else:
    assert max(per_round[1:]) <= bound, per_round


def test_the_table_from_an_array_is_the_table_made_row_by_row():
  # records.StepRateTable.from_rows converts column by column; rows of
  # different lengths still go one at a time: the same entries either way.
  from oscars_tf.policy import records  # pylint: disable=g-import-not-at-top
  rows = [_row(j, 3) for j in range(4)]
  rows[1][1] = math.nan   # no round: -1
  rows[2][5] = 7.9        # steps truncate as int() does
  rows[3][6] = math.nan   # not healthy
  hosts = ("a", "a", "b", "b")
  whole = records.StepRateTable.from_rows(np.array(rows), hosts)
  ragged = records.StepRateTable.from_rows(rows + [[1.0, 2.0]],
                                           hosts + ("c",))
  assert list(map(repr, whole.entries)) == list(map(repr, ragged.entries[:4]))
  # Entries from the array are made without TableEntry.__init__: they must
  # be ones it would make (equal, hashable, still frozen).
  again = [records.TableEntry(**vars(e)) for e in whole.entries]
  assert list(whole.entries) == again and hash(whole.entries[0]) == hash(
      again[0])
  with pytest.raises(dataclasses.FrozenInstanceError):
    whole.entries[0].rate = 1.0
  assert [e.round for e in whole.entries] == [3, -1, 3, 3]
  assert whole.entries[2].steps == 7 and not whole.entries[3].healthy
  short = records.StepRateTable.from_rows(np.array([r[:8] for r in rows]),
                                          hosts)
  assert all(math.isnan(e.sync_cost) for e in short.entries)
  assert ragged.entries[4].round == 2 and math.isnan(
      ragged.entries[4].sync_cost)


def test_a_change_within_a_few_tolerances_travels_once_its_mean_is_seen_twice():
  # rate tolerance 2 %: a change within CONFIRM_BEYOND tolerances goes
  # through the cell's running mean (half fresh, half the mean before),
  # which must be beyond tolerance twice in the same direction; 10 % off
  # and a NaN change travel at once; a change that flips direction (noise)
  # never travels.
  n = 6
  members = tuple(range(n))
  base = table_deltas.next_snapshot(table_deltas.empty(n), members, 0)
  base = table_deltas.apply_cells(base, table_deltas.changed_cells(
      base, [tuple(_row(j, 0)) for j in range(n)], members))
  pending = table_deltas.pending_changes(n)

  def round_cells(r, rates):
    nonlocal base
    rows = [tuple(_row(j, r, rate=rates.get(j))) for j in range(n)]
    base = table_deltas.next_snapshot(base, members, r)
    cells = table_deltas.changed_cells(base, rows, members, pending)
    base = table_deltas.apply_cells(base, cells)
    return [(int(c["worker"]), int(c["field"])) for c in cells]

  # worker 1 drifts 3 % up and stays; worker 2 goes 3 % up, then down;
  # worker 3 jumps 10 %; worker 4's rate is lost (NaN); worker 5 drifts
  # 6 % up and stays.
  drifts = {1: 11 * 1.03, 3: 13 * 1.10, 4: math.nan, 5: 15 * 1.06}
  assert round_cells(1, {**drifts, 2: 12 * 1.03}) == [(3, 0), (4, 0)]
  assert base[3, 0] == np.float32(13 * 1.10)  # as measured
  assert pending.direction[5, 0] == 1 and pending.direction[1, 0] == 0
  assert round_cells(2, {**drifts, 2: 12 * 0.97}) == [(5, 0)]
  # 5's mean: 3 % then 4.5 % off; it travels as that mean.
  np.testing.assert_allclose(base[5, 0], 15 * 1.045, rtol=1e-6)
  assert pending.direction[1, 0] == 1 and pending.direction[2, 0] == 0
  assert round_cells(3, {**drifts, 2: 12 * 1.03}) == [(1, 0)]
  np.testing.assert_allclose(base[1, 0], 11 * (1 + 0.015 * 1.75),
                             rtol=1e-6)
  assert round_cells(4, {**drifts, 2: 12 * 0.97}) == []
  assert base[2, 0] == np.float32(12.0)  # noise never reached the table
  # 5's mean since it travelled: 1.4 % off, twice (its record), 3's none.
  off = 15 * 1.06 / np.float32(15 * 1.045) - 1
  np.testing.assert_allclose(pending.deviation[5, 0], 0.75 * off, rtol=1e-4)
  assert pending.deviation[3, 0] == 0 and pending.direction[5, 0] == 0
  # Without the chief's record every change beyond tolerance travels, as
  # measured.
  rows = [tuple(_row(j, 5, rate={2: 12 * 0.97}.get(j))) for j in range(n)]
  cells = table_deltas.changed_cells(base, rows, members)
  assert [(int(c["worker"]), int(c["field"])) for c in cells] == [
      (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
  assert cells["value"][1] == np.float32(12 * 0.97)


def test_rate_noise_travels_a_fraction_of_the_cells_it_would_unrecorded():
  # 1,024 members whose measured rates carry 1 % noise every round: the
  # confirmation rule sends several times fewer cells, and the table stays
  # within a few tolerances of the true rates.
  n, rounds = 1024, 12
  rng = np.random.default_rng(0)
  true_rates = 10 * rng.lognormal(0.0, 0.5, n)
  members = tuple(range(n))

  def run(pending):
    snap, sent = table_deltas.empty(n), []
    for r in range(rounds):
      rates = true_rates * rng.lognormal(0.0, 0.01, n)
      rows = [tuple(_row(j, r, rate=rates[j])) for j in range(n)]
      snap = table_deltas.next_snapshot(snap, members, r)
      cells = table_deltas.changed_cells(snap, rows, members, pending)
      snap = table_deltas.apply_cells(snap, cells)
      sent.append(int((cells["field"] == 0).sum()))
    return sum(sent[2:]), snap
  with_record, snap = run(table_deltas.pending_changes(n))
  without, _ = run(None)
  assert with_record * 3 < without, (with_record, without)
  assert np.max(np.abs(snap[:, 0] / true_rates - 1)) < 0.08


def test_a_decoded_decisions_rows_read_as_tuples_without_being_made_all():
  # Rows are made when asked for (each member decodes a 10,000-row table a
  # round); they read, compare, hash and go to JSON as the tuples would.
  rows = ((1.5, 0.0, 2.0), None, (2.25, 7.0, math.nan))
  d = membership.Decision(round=3, members=(0, 2), newcomers=(2,),
                          dropped=(1,), rows=rows)
  back = membership.Decision.decode(d.encode())
  assert isinstance(back.rows, decision_codec.RowView)
  assert len(back.rows) == 3 and back.rows[1] is None
  assert back.rows[0] == (1.5, 0.0, 2.0) and back.rows[-1][:2] == (2.25, 7.0)
  assert back.rows[0:2] == ((1.5, 0.0, 2.0), None)
  same = ((1.5, 0.0, 2.0), None, (2.25, 7.0, 0.5))
  assert back.rows != same and hash(back.rows) == hash(tuple(back.rows))
  assert (back.rows[0], back.rows[1]) == same[:2]
  again = membership.Decision.from_json(back.to_json())
  assert again.rows[0] == (1.5, 0.0, 2.0) and math.isnan(again.rows[2][2])
