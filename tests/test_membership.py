"""The round-membership protocol (membership.py) on an in-memory store.

Workers are threads here, most on a fake clock (fake_clock.py: timeouts
pass at once, and a test's timings are exact); the real store (TensorFlow's
coordination service) is exercised by test_faults.py and the multi-process
tests.
"""

import math
import threading

import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.protocol import distributions
from oscars_tf.protocol import membership
from oscars_tf.protocol import membership_chief
from oscars_tf.protocol import store_keys
from protocol_helpers import exchange
from protocol_helpers import row
from protocol_helpers import run
from protocol_helpers import workers


def _store():
  return FakeStore(FakeClock())


def test_every_member_gets_the_same_decision_with_every_row():
  # The real clock: a FakeStore on it reads several keys at once, as the
  # real service does (kv_store's reader threads).
  store = FakeStore()
  ws = workers(store, 3)
  out, errors = exchange(ws, 0)
  assert errors == [None] * 3
  assert out[0].to_json() == out[1].to_json() == out[2].to_json()
  assert out[0].members == (0, 1, 2) and out[0].dropped == ()
  assert out[0].rows[2][0] == 12.0


def test_a_worker_that_does_not_arrive_is_dropped_after_the_timeout():
  store = _store()
  clock = store.clock
  ws = workers(store, 3, straggler=0.3)
  exchange(ws, 0)
  start = clock.monotonic()
  out, errors = exchange(ws[:2], 1)
  waited = clock.monotonic() - start
  assert errors == [None, None]
  assert out[0].to_json() == out[1].to_json()
  assert out[0].members == (0, 1) and out[0].dropped == (2,)
  assert out[0].rows[2] is None
  assert waited == pytest.approx(0.3)
  assert ws[0].events[0][:3] == (1, "dropped", 2)
  assert ws[0].events[0][3] == pytest.approx(0.3)
  # Round 2: the chief does not wait for the dropped worker again.
  start = clock.monotonic()
  out, _ = exchange(ws[:2], 2)
  assert out[0].members == (0, 1) and clock.monotonic() == start


def test_a_late_worker_rejoins_at_a_later_round_with_its_rate_before():
  store = _store()
  ws = workers(store, 3, straggler=0.3)
  exchange(ws, 0)
  exchange(ws[:2], 1)  # 2 dropped

  def late():  # back from its stall, still at its round 1
    return ws[2].exchange(1, row(2, rate=0.01), rate_before=7.5)

  def others(i):
    if i == 0:  # the chief decides once worker 2 asked to rejoin
      store.wait_for_key(store_keys.rejoin_request(2))
    got = []
    for r in range(2, 5):  # the next round lets it back in
      got.append(ws[i].exchange(r, row(i, r)))
      if 2 in got[-1].members:
        return got
    return got
  out, errors = run([late, lambda: others(0), lambda: others(1)],
                    store.clock)
  assert errors == [None, None, None]
  back, history = out[:2]
  assert back.round > 1 and back.newcomers == (2,)
  assert history[-1].to_json() == back.to_json() and back.members == (0, 1, 2)
  # Its stall is not its speed: it is planned at the rate it had before
  # (issue 19: NaN planned it at the median, a drop/rejoin loop if slower).
  assert back.rows[2][0] == 7.5
  assert ws[2].members == (0, 1, 2)
  assert ws[2].events[-1][:3] == (back.round, "rejoined", 2)


def test_round_zero_waits_longer_since_it_holds_start_up():
  store = _store()
  ws = workers(store, 2, straggler=0.1, first_round=2.0)

  def slow_start():
    store.clock.sleep(0.5)  # tracing, say: longer than the straggler timeout
    return ws[1].exchange(0, row(1))
  out, errors = run([lambda: ws[0].exchange(0, row(0)), slow_start],
                    store.clock)
  assert errors == [None, None]
  assert out[0].members == (0, 1)


def test_newcomers_get_the_chiefs_plan_context():
  store = _store()
  ws = workers(store, 2, straggler=0.2)
  exchange(ws[:1], 0)  # worker 1 dropped at round 0
  context = {"epoch": 3, "epoch_end": False, "state": {"period": 4.0}}
  def chief_round_1():
    store.wait_for_key(store_keys.rejoin_request(1))  # worker 1 asked
    return ws[0].exchange(1, row(0), 17, context)
  out, errors = run([lambda: ws[1].exchange(0, row(1)), chief_round_1],
                    store.clock)
  assert errors == [None, None]
  assert out[0].to_json() == out[1].to_json()
  assert out[0].chief_plan == context and out[0].epoch_done == 17


def test_a_worker_waits_for_a_missing_chief_only_until_the_timeout():
  store = _store()
  ws = workers(store, 2, decision=0.6)
  start = store.clock.monotonic()
  with pytest.raises(PeerTimeoutError, match="chief .* decided no membership"):
    ws[1].exchange(3, row(1))
  # The timeout, and two checks of `latest` (1 ms each).
  assert 0.6 <= store.clock.monotonic() - start < 0.7


def test_a_long_wait_for_the_decision_costs_few_requests():
  class DecisionGets(FakeStore):
    gets = 0

    def get(self, key, timeout_s):
      if store_keys.decision_round(key) is not None:
        self.gets += 1
      return super().get(key, timeout_s)
  store = DecisionGets(FakeClock())
  ws = workers(store, 2, decision=3.4)
  with pytest.raises(PeerTimeoutError):
    ws[1].exchange(3, row(1))
  # Long polls of 0.5, 1 and 2 s (not one every 0.5 s: 7): each request
  # is one the chief's process serves.
  assert store.gets <= 3, store.gets


def test_a_dropped_worker_stops_waiting_when_training_ended():
  store = _store()
  ws = workers(store, 2, straggler=0.2)
  ws[0].exchange(0, row(0))  # worker 1 is dropped
  ws[0].finish(0)
  start = store.clock.monotonic()
  with pytest.raises(WorkerLostError, match="training ended before"):
    ws[1].exchange(0, row(1))
  assert store.clock.monotonic() - start < 1.0  # its first look


def test_a_decision_deleted_while_a_worker_slept_means_it_was_dropped():
  store = _store()
  ws = workers(store, 2, straggler=0.1)
  ws[0].exchange(0, row(0))  # worker 1 dropped at round 0
  ws[0].exchange(1, row(0))
  store.delete(store_keys.decision(0))  # as KEEP_ROUNDS later rounds do

  def chief_round_2():
    store.wait_for_key(store_keys.rejoin_request(1))  # worker 1 asked
    return ws[0].exchange(2, row(0))
  out, errors = run([lambda: ws[1].exchange(0, row(1)), chief_round_2],
                    store.clock)
  assert errors == [None, None]
  assert out[0].round == 2 and out[0].newcomers == (1,)


def test_decisions_survive_json_with_nan_and_missing_rows():
  d = membership.Decision(4, (0, 2), (2,), (1,),
                          ((1.0, math.nan), None, (2.0, 3.0)), 9,
                          {"epoch": 1})
  back = membership.Decision.from_json(d.to_json())
  assert back.rows[1] is None and math.isnan(back.rows[0][1])
  assert (back.round, back.members, back.newcomers, back.dropped,
          back.epoch_done, back.chief_plan) == (4, (0, 2), (2,), (1,), 9,
                                                {"epoch": 1})


def test_bad_timeouts_are_refused():
  with pytest.raises(ValueError, match="timeouts must be > 0"):
    membership.Membership(FakeStore(), 0, 2, 0, 5)


def test_a_chief_out_of_data_waits_for_the_others_round_before_dropping():
  """A chief whose data ran out arrives early; it gives the others the
  rest of their round (`expected_s`) before its straggler timeout runs."""
  store = _store()
  ws = workers(store, 2, straggler=0.2)
  exchange(ws, 0)
  arrived = store.clock.event()

  def late_worker():
    assert arrived.wait(5)  # the chief is already waiting
    store.clock.sleep(0.5)  # the rest of its round: longer than the timeout
    return ws[1].exchange(1, row(1))

  def chief():
    arrived.set()
    return ws[0].exchange(1, row(0), expected_s=1.0)
  out, errors = run([chief, late_worker], store.clock)
  assert errors == [None, None]
  assert out[0].members == (0, 1) and out[0].dropped == ()


def test_the_store_stays_bounded_over_many_rounds_with_drops(monkeypatch):
  # Issue 19: the chief's own arrival key and a late worker's were never
  # deleted, one key per round for ever.
  monkeypatch.setattr(membership_chief, "KEEP_ROUNDS", 20)
  store = _store()
  ws = workers(store, 2, straggler=5.0)
  for r in range(600):
    if r % 50 == 7:  # worker 1 is late: dropped, then back at a later round
      ws[0].straggler_timeout = 0.05
      exchange(ws[:1], r)
      ws[0].straggler_timeout = 5.0
      late, errs = run([lambda r=r: ws[1].exchange(r, row(1)),
                        lambda r=r: _rejoin_round(ws[0], store, r + 1)],
                       store.clock)
      assert errs == [None, None] and late[0].round == r + 1, errs
    elif r % 50 != 8:
      _, errs = exchange(ws, r)
      assert errs == [None, None], errs
  keys = sorted(store.data)
  # Decisions and snapshots kept, `latest`, rows.
  assert len(keys) <= 20 + distributions.KEEP_SNAPSHOTS + 3, keys


def _rejoin_round(chief, store, r):
  store.wait_for_key(store_keys.rejoin_request(1))
  return chief.exchange(r, row(0))


def test_a_member_whose_process_is_gone_is_dropped_at_once():
  # Issue 19: a kill -9 cost the others the whole straggler timeout. A
  # process that is gone (its server refuses connections) is not waited for.
  store = _store()
  gone = threading.Event()
  chief = membership.Membership(store, 0, 3, 30.0, 60.0, 1.0,
                                is_gone=lambda j: j == 2 and gone.is_set(),
                                clock=store.clock)
  ws = [chief] + workers(store, 3)[1:]
  exchange(ws, 0)
  gone.set()
  start = store.clock.monotonic()
  out, errors = exchange(ws[:2], 1)
  assert errors == [None, None]
  assert out[0].dropped == (2,) and out[1].members == (0, 1)
  # Not the 30 s straggler timeout: its process is asked every 0.5 s.
  assert store.clock.monotonic() - start <= 0.5


def test_a_long_run_keeps_the_store_bounded():
  # A soak of many rounds (two workers, each in its own thread for the
  # whole run) on the real clock: decisions past KEEP_ROUNDS are deleted,
  # nothing else grows.
  rounds = 100_000  # the bound: 100,000 rounds
  store = FakeStore()
  ws = workers(store, 2, straggler=5.0)
  sizes, done = [], [0, 0]  # rounds each worker finished
  errors = [None, None]

  def worker(w):
    try:
      for r in range(rounds):
        w.exchange(r, row(w.me))
        done[w.me] = r + 1
        if w.me == 0 and r % 25_000 == 24_999:
          # Worker 1 may have posted its next arrival already (a race the
          # count must not depend on): that key is not a leak.
          nxt = store_keys.arrivals(r + 1) + "/"
          sizes.append(sum(not k.startswith(nxt) for k in list(store.data)))
    except BaseException as e:  # pylint: disable=broad-except
      errors[w.me] = e
  threads = [threading.Thread(target=worker, args=(w,), daemon=True)
             for w in ws]
  for t in threads:
    t.start()
  # ~90 s alone on 2 cores; a loaded machine may take several times that.
  # A hang is no round finished in 30 s (the whole run stays bounded by
  # pytest's timeout), not a total time that only an idle machine meets.
  before = None
  while any(t.is_alive() for t in threads):
    next(t for t in threads if t.is_alive()).join(30)
    assert done != before or not any(t.is_alive() for t in threads), (
        f"no round finished in 30 s: {done}")
    before = list(done)
  assert errors == [None, None]
  assert max(sizes) <= (membership_chief.KEEP_ROUNDS +
                        distributions.KEEP_SNAPSHOTS + 3), sizes
  assert sizes[-1] == sizes[0], sizes  # flat, not growing


def test_the_chief_leaves_after_the_members_are_done_or_gone():
  store = _store()
  gone = {2}
  chief = membership.Membership(store, 0, 3, 1.0, 5.0,
                                is_gone=lambda j: j in gone,
                                clock=store.clock)
  one = membership.Membership(store, 1, 3, 1.0, 5.0, clock=store.clock)

  def says_done_later():
    store.clock.sleep(0.5)
    one.say_done()

  def chief_waits(timeout):
    start = store.clock.monotonic()
    chief.wait_until_done(timeout=timeout)
    return store.clock.monotonic() - start
  out, errors = run([lambda: chief_waits(10.0), says_done_later],
                    store.clock)
  assert errors == [None, None]
  assert store_keys.done(1) in store.data
  # Waited for 1 (0.5 s), then for the gone 2 until its process was asked
  # (0.5 s), not for the 10 s.
  assert out[0] == pytest.approx(1.0)
  gone.clear()
  store.delete(store_keys.done(1))
  # Bounded when no one says anything.
  assert chief_waits(0.5) == pytest.approx(0.5)


def test_a_rejoiner_whose_process_is_gone_is_not_let_in():
  # Issue 43: a rejoiner killed while it waited left its request; the chief
  # made it a newcomer, and every member then waited for it in the round's
  # (global) collective until collective_timeout.
  store = _store()
  gone = threading.Event()
  chief = membership.Membership(store, 0, 3, 0.3, 5.0, 0.3,
                                is_gone=lambda j: j == 2 and gone.is_set(),
                                clock=store.clock)
  ws = [chief] + workers(store, 3, straggler=0.3)[1:]
  exchange(ws, 0)
  exchange(ws[:2], 1)  # 2 dropped
  store.set(store_keys.rejoin_request(2),
            membership._dump(row(2)))  # asked...  # pylint: disable=protected-access
  gone.set()  # ...and was killed before the next decision
  out, errors = exchange(ws[:2], 2)
  assert errors == [None, None]
  assert out[0].members == out[1].members == (0, 1)
  assert out[0].newcomers == ()
  # Its request is withdrawn, not read again at every round.
  assert store_keys.rejoin_request(2) not in store.data


def test_a_rejoiner_that_gives_up_withdraws_its_request():
  store = _store()
  ws = workers(store, 2, straggler=0.2, decision=0.5)
  exchange(ws[:1], 0)  # worker 1 dropped at round 0
  # No chief decides again: worker 1 gives up after the decision timeout.
  with pytest.raises(PeerTimeoutError, match="not let back in"):
    ws[1].exchange(0, row(1))
  assert store_keys.rejoin_request(1) not in store.data
