"""Timing skews of the membership protocol (issue 43, item 11): the chief's
wait against the members' give-up, a rejoiner reading `latest` while the
chief rewrites it, a rejoiner whose round's decision was deleted.

Workers are threads on the in-memory store and a fake clock, as in
test_membership.py: the skews are orderings of waits, exact here.
"""

import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from oscars_tf.protocol import membership_chief
from oscars_tf.protocol import store_keys
from protocol_helpers import Hooks
from protocol_helpers import exchange
from protocol_helpers import row
from protocol_helpers import run
from protocol_helpers import workers

LATEST = store_keys.latest()


def _workers(store, n, straggler, decision, asked_to_rejoin=None):
  return workers(store, n, straggler, decision,
                 hooks=Hooks(asked_to_rejoin) if asked_to_rejoin else None)


def test_a_chief_out_of_data_decides_before_the_members_give_up():
  # 11a: the chief waited min(expected_s, decision_timeout) +
  # straggler_timeout (2.3 s here) while a member that arrived with it gave
  # up after decision_timeout (2 s) with PeerTimeoutError.
  store = FakeStore(FakeClock())
  ws = _workers(store, 3, straggler=0.3, decision=2.0)
  _, errors = exchange(ws, 0)
  assert errors == [None] * 3
  # Round 1: the chief's data ran out (the others are due in 100 s);
  # worker 1 arrives with it, worker 2 never does.
  start = store.clock.monotonic()
  out, errors = run([
      lambda: ws[0].exchange(1, row(0), expected_s=100.0),
      lambda: ws[1].exchange(1, row(1))], store.clock)
  assert errors == [None, None], errors
  assert out[0].to_json() == out[1].to_json()
  assert out[1].members == (0, 1) and out[1].dropped == (2,)
  # The chief decided within the members' wait, less its margin.
  assert store.clock.monotonic() - start == pytest.approx(
      2.0 - membership_chief.publish_margin(2.0))


class _LatestGap(FakeStore):
  """Holds the chief inside its delete-then-set of `latest` (once armed)
  until a reader's get of `latest` has returned, or for 1 s while one
  waits through the gap; records the rounds of the decisions read."""

  def __init__(self):
    super().__init__(FakeClock())
    self.armed = False
    self.gap_open = self.clock.event()
    self.latest_read = self.clock.event()
    self.decisions_read = []

  def delete(self, key):
    super().delete(key)
    if key == LATEST and self.armed:
      self.armed = False
      self.gap_open.set()
      self.latest_read.wait(1.0)

  def get(self, key, timeout_s):
    round_ = store_keys.decision_round(key)
    if round_ is not None:
      self.decisions_read.append(round_)
    try:
      return super().get(key, timeout_s)
    finally:
      if key == LATEST and self.gap_open.is_set():
        self.latest_read.set()


def test_a_rejoiner_reading_latest_in_the_chiefs_rewrite_skips_old_rounds():
  # 11b: a rejoiner that read `latest` between the chief's delete and set
  # took its own round instead, and read the decisions of every round
  # since (one RPC each; past KEEP_ROUNDS a deleted key, until timeout).
  store = _LatestGap()
  ws = _workers(store, 2, straggler=0.2, decision=10.0)
  exchange(ws, 0)
  for r in range(1, 6):  # worker 1 stalled: dropped at round 1
    ws[0].exchange(r, row(0))
  store.armed = True

  def chief():
    ws[0].exchange(6, row(0))  # `latest` goes from 5 to 6 through a gap
    store.wait_for_key(store_keys.rejoin_request(1))
    return ws[0].exchange(7, row(0))

  def rejoiner():  # back at its round 1 while the chief rewrites `latest`
    assert store.gap_open.wait(10)
    return ws[1].exchange(1, row(1))
  out, errors = run([chief, rejoiner], store.clock)
  assert errors == [None, None], errors
  assert out[1].round == 7 and out[1].newcomers == (1,)
  stale = [r for r in store.decisions_read if 1 < r <= 6]
  assert not stale, f"the rejoiner read decisions of rounds over: {stale}"


def test_a_rejoiner_whose_rounds_decision_was_deleted_asks_again(
    monkeypatch):
  # 11c: a rejoiner held up past KEEP_ROUNDS rounds (let in, then dropped
  # again, while it was away) polled its round's deleted decision until
  # decision_timeout.
  monkeypatch.setattr(membership_chief, "KEEP_ROUNDS", 2)
  store = FakeStore(FakeClock())
  clock = store.clock
  asked, resume = clock.event(), clock.event()

  def held_once_asked():  # as fault_injection.asked_to_rejoin does
    if not asked.is_set():
      asked.set()
      assert resume.wait(10)
  ws = _workers(store, 2, straggler=0.2, decision=10.0,
                asked_to_rejoin=held_once_asked)
  exchange(ws, 0)
  ws[0].exchange(1, row(0))  # worker 1 dropped at round 1
  released = []

  def chief():
    assert asked.wait(10)
    assert ws[0].exchange(2, row(0)).newcomers == (1,)
    assert ws[0].exchange(3, row(0)).dropped == (1,)  # it never came
    for r in range(4, 7):  # d/2 is deleted at round 4
      ws[0].exchange(r, row(0))
    assert store_keys.decision(2) not in store.data
    released.append(clock.monotonic())
    resume.set()
    store.wait_for_key(store_keys.rejoin_request(1), 10)  # asked again
    return ws[0].exchange(7, row(0))

  def rejoiner():
    decision = ws[1].exchange(1, row(1))
    return decision, clock.monotonic()
  out, errors = run([chief, rejoiner], clock, timeout=30)
  assert errors == [None, None], errors
  (back, at) = out[1]
  assert back.round == 7 and back.newcomers == (1,)
  assert at - released[0] < 5.0  # not its 10 s decision timeout
