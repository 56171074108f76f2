"""The round book over an in-memory store: the whole Python side of a round
(arrival, membership, this worker's part, the next plan) with no TensorFlow
and no processes: one thread per simulated worker."""

import math
import types

import pytest

from fake_store import FakeStore
from fake_store import run_threads
from oscars_tf import schedules
from oscars_tf.policy import records
from oscars_tf.protocol import membership
from oscars_tf.protocol import plan_log
from oscars_tf.protocol import round_book
from oscars_tf.protocol import round_history
from oscars_tf.protocol import round_parts
from oscars_tf.protocol import store_keys


def _info(me, hosts):
  workers = [("worker", j, f"{h}:{2000 + j}") for j, h in enumerate(hosts)]
  return types.SimpleNamespace(worker_index=me, num_workers=len(hosts),
                               workers=workers, is_multi_worker=True)


def _books(hosts, schedule=None):
  store = FakeStore()
  n = len(hosts)
  return [round_book.RoundBook(
      _info(i, hosts), schedule or schedules.Adaptive(),
      membership=membership.Membership(store, i, n, 5.0, 10.0))
          for i in range(n)]


def _arrive_and_average(book, steps, finite=True):
  """One round on `book`: arrive, then averaged; (part, next round)."""
  book.mark_round_start()
  start = book.last_sync_step
  part = book.arrive(start + steps, 1.0 + book.me, finite)
  return part, book.averaged(part.table, 0.01, start + steps, 1000)


def _round(books, steps, finite=None):
  """One round on every book. Returns the parts and next rounds."""
  finite = finite or [True] * len(books)
  out, errors = run_threads([
      lambda i=i: _arrive_and_average(books[i], steps[i], finite[i])
      for i in range(len(books))])
  assert errors == [None] * len(books)
  return [o[0] for o in out], [o[1] for o in out]


def _received(parts, models):
  """What each worker holds after the round's averaging of scalar
  `models`, summed as the graph sums them (distribute/rounds.py, and
  runtime/averaging.py host by host, one rack): a worker that takes the
  model sends zeros, and one alone in its group keeps what it sends."""
  sent = [0.0 if p.takes_model else m for p, m in zip(parts, models)]

  def sums(key, weight):
    out = {}
    for p, s in zip(parts, sent):
      out[key(p)] = out.get(key(p), 0.0) + weight(p) * s
    return out
  if not parts[0].is_global or parts[0].host_key == 0:  # a flat group
    groups = sums(lambda p: p.group_key, lambda p: p.weight)
    return [groups[p.group_key] if p.group_size > 1 else s
            for p, s in zip(parts, sent)]
  hosts = sums(lambda p: p.host_key, lambda p: p.weight_in_host)
  total = sum(p.host_share * hosts[p.host_key] for p in parts if p.is_leader)
  return [total] * len(parts)


def _group_weights(parts):
  """Sum of the members' weights per group (each should be 1)."""
  sums = {}
  for p in parts:
    sums[p.group_key] = sums.get(p.group_key, 0.0) + p.weight
  return sums


@pytest.mark.parametrize("hosts", [("a",) * 3, ("a", "a", "b")],
                         ids=["one_host", "two_hosts"])
def test_every_member_holds_the_same_table_and_plans_alike(hosts):
  books = _books(hosts)
  for r in range(4):
    parts, nexts = _round(books, steps=[12, 8, 4])
    assert len({p.table.tobytes() for p in parts}) == 1
    assert len({b.plan.digest() for b in books}) == 1
    for s in _group_weights(parts).values():
      assert s == pytest.approx(1.0)
    for b, p, nxt in zip(books, parts, nexts):
      assert b.round == r + 1
      assert nxt.next_sync == b.last_sync_step + b.plan.local_steps[b.me]
      assert not p.takes_model
      assert p.group_size == len(b.history[-1].group)
      assert p.is_global == b.history[-1].global_sync
  # Every member's measured rate is in the table, and planned from.
  rates = books[0].history[-1].table_rates
  assert all(math.isfinite(r) and r > 0 for r in rates)
  assert books[0].plan.rates == pytest.approx(rates)
  assert [e.members for e in books[1].history] == [[0, 1, 2]] * 4


def test_two_hosts_give_each_worker_its_place_in_a_global_sync():
  books = _books(("a", "a", "b"))
  parts, _ = _round(books, steps=[8, 8, 8])
  # Host a's leader is worker 0, host b's is worker 2; host a's members
  # split its share, and the leaders' shares add up to one.
  assert [p.is_leader for p in parts] == [True, False, True]
  assert parts[0].host_key == parts[1].host_key != parts[2].host_key
  assert parts[0].host_size == 2 and parts[2].host_size == 1
  assert parts[0].weight_in_host + parts[1].weight_in_host == (
      pytest.approx(1.0))
  assert parts[0].host_share + parts[2].host_share == pytest.approx(1.0)
  assert parts[0].leaders_key == parts[2].leaders_key


def test_a_member_with_non_finite_weights_adds_nothing_and_takes_the_model():
  books = _books(("a",) * 3, schedules.Fixed(4))
  parts, _ = _round(books, steps=[4, 4, 4], finite=[True, False, True])
  assert [p.takes_model for p in parts] == [False, True, False]
  assert parts[1].weight == 0.0
  assert parts[0].weight + parts[2].weight == pytest.approx(1.0)
  assert books[0].history[-1].poisoned == [1]


def test_a_poisoned_worker_alone_in_its_group_takes_the_sound_model():
  # Issue 43: the only worker of host b, so alone in its group, kept its
  # NaN weights (and slots) until a global sync came.
  books = _books(("a", "a", "b"), schedules.Adaptive(grouping="host"))
  assert books[0].plan.groups == ((0, 1), (2,))
  parts, _ = _round(books, steps=[4, 4, 4], finite=[True, True, False])
  assert _received(parts, [1.0, 3.0, math.nan]) == pytest.approx([2.0] * 3)
  assert [p.takes_model for p in parts] == [False, False, True]
  assert books[2].history[-1].poisoned == [2]
  # The repair changed this round only: the plan is host by host again.
  assert books[0].plan.groups == ((0, 1), (2,))


def test_a_newcomer_among_poisoned_members_keeps_its_own_model():
  # Issue 43: a rejoining worker takes the model, but when every other
  # member is poisoned there is none to take: it got their NaN average.
  books = _books(("a",) * 3, schedules.Fixed(4))
  _round(books, steps=[4, 4, 4])
  chief = books[0].membership
  chief.straggler_timeout = 0.05  # worker 2 is late: dropped at round 1
  run_threads([lambda i=i: _arrive_and_average(books[i], 4) for i in (0, 1)])
  assert books[0].history[-1].dropped == [2]
  chief.straggler_timeout = 5.0

  def chief_once_2_asks_back():
    chief.store.wait_for_key(store_keys.rejoin_request(2))
    return _arrive_and_average(books[0], 4, finite=False)
  out, errors = run_threads([
      chief_once_2_asks_back,
      lambda: _arrive_and_average(books[1], 4, finite=False),
      lambda: _arrive_and_average(books[2], 4)])
  assert errors == [None] * 3
  parts = [o[0] for o in out]
  assert books[2].history[-1].rejoined == [2]
  assert _received(parts, [math.nan, math.nan, 5.0]) == (
      pytest.approx([5.0] * 3))
  assert [p.takes_model for p in parts] == [True, True, False]


def test_a_round_that_meets_new_collectives_reports_no_averaging_cost():
  # TensorFlow resolves a group the first time it meets it: 0.68 s on a
  # loaded CI machine against 0.01-0.05 s an averaging after. Counted, it
  # stretched CostAware's rounds to whole epochs for the next 4 rounds.
  books = _books(("a", "a", "b"), schedules.Fixed(4))
  cost = records.Column.SYNC_COST
  costs = []
  for _ in range(3):
    parts, _ = _round(books, steps=[4, 4, 4])
    assert all(p.is_global for p in parts)
    costs.append(parts[0].table.reshape(3, -1)[:, cost])
  assert all(math.isnan(c) for c in costs[0])  # nothing averaged before
  assert all(math.isnan(c) for c in costs[1])  # round 0 met its groups
  assert all(math.isfinite(c) and c >= 0 for c in costs[2])  # met again


@pytest.mark.parametrize("hosts", [("a", "a", "b"), ("a", "b"),
                                   ("a", "a", "a")])
def test_another_cut_or_grouping_is_a_new_collective(hosts):
  met = round_parts.MetCollectives()
  parts, _ = _round(_books(hosts, schedules.Fixed(4)), steps=[4] * len(hosts))
  assert round_parts.collectives_of(parts[0])  # it averages with someone
  assert met.first_meeting(parts[0]) and not met.first_meeting(parts[0])
  # Hosts of 3 and 2 cut the model otherwise (sixths), or group
  # otherwise, under the same first keys: TensorFlow meets new instances.
  other, _ = _round(_books(("a",) * 3 + ("b",) * 2, schedules.Fixed(4)),
                    steps=[4] * 5)
  assert met.first_meeting(other[0])


def test_collectives_of_follow_what_the_graph_launches():
  parts, _ = _round(_books(("a", "b"), schedules.Fixed(4)), steps=[4, 4])
  part = parts[0]._replace(sharded=False, host_size=1, is_leader=True,
                           is_rack_leader=True, racks_size=1)
  # A host of one leader still runs its leaders' ring (averaging.py).
  assert round_parts.collectives_of(part) == {(part.leaders_key,)}
  # A rejoin round also sums the shared state over the flat group.
  rejoin = part._replace(rejoining=True)
  assert round_parts.collectives_of(rejoin) == {
      (part.leaders_key,), (part.group_key, "shared")}
  met = round_parts.MetCollectives()
  assert met.first_meeting(part) and not met.first_meeting(part)
  assert met.first_meeting(rejoin)


def test_one_worker_needs_no_store_and_averages_alone():
  info = types.SimpleNamespace(worker_index=0, num_workers=1,
                               workers=[("worker", 0, "a:1")],
                               is_multi_worker=False)
  book = round_book.RoundBook(info, schedules.Fixed(5))
  book.mark_round_start()
  part = book.arrive(5, 0.5, True)
  assert (part.group_size, part.weight, part.takes_model) == (1, 1.0, False)
  nxt = book.averaged(part.table, 0.0, 5, 0)
  assert nxt.next_sync == 10 and math.isfinite(nxt.scale)
  assert book.history[-1].loss == 0.5


def test_an_epoch_target_ends_the_epoch_on_every_member_at_once():
  books = _books(("a",) * 2, schedules.Fixed(4))
  for b in books:
    b.begin_epoch(0, target_steps=20)
  rounds = 0
  while not books[0].epoch_over:
    ks = [b.plan.local_steps[b.me] for b in books]
    _round(books, steps=ks)
    rounds += 1
    assert rounds < 10
  assert books[1].epoch_over
  assert books[0].epoch_done == books[1].epoch_done == 20


def test_the_history_keeps_cluster_lists_for_the_newest_rounds_only(
    monkeypatch):
  monkeypatch.setattr(round_history, "HISTORY_CLUSTER_CELLS", 0)  # 100 rounds
  books = _books(("a",) * 2, schedules.Fixed(1))
  assert books[0].history.full_rounds == 100
  for _ in range(130):
    _round(books, steps=[1, 1])
  history = list(books[1].history)
  assert len(history) == 130
  full = [all(getattr(e, f) is not None for f in round_history.CLUSTER_FIELDS)
          for e in history]
  assert full == [False] * 30 + [True] * 100
  assert all(e.plan and e.group for e in history)  # its own fields stay
  # As users read it (OscarsStrategy.round_history): dicts without the
  # cluster lists let go.
  dicts = [e.as_dict() for e in history]
  assert [all(f in d for f in round_history.CLUSTER_FIELDS)
          for d in dicts] == full
  assert all("rate" in d and "plan" in d for d in dicts)


def test_plan_changes_are_logged_once_each(caplog):
  log = plan_log.PlanChangeLog(me=2)
  plan = types.SimpleNamespace(imputed=(5,), state=types.SimpleNamespace(
      period=4.0))
  with caplog.at_level("INFO"):
    for round_ in (2, 3, 4):
      log.log(round_, plan, members=(0, 2, 5))
    plan.state.period = 8.0
    log.log(5, plan, members=(0, 2))  # 5 left: no longer planned so
  lines = [r.getMessage() for r in caplog.records]
  assert [m for m in lines if "no usable rate" in m] == [
      "oscars_tf: worker 2 round 2: no usable rate from worker(s) [5]; "
      "planning them at the median rate."]
  assert [m for m in lines if "period" in m] == [
      "oscars_tf: worker 2 round 5: period 4 -> 8 steps of the fastest "
      "worker."]
