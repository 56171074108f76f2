"""The chief reads a round's arrivals in directory reads, the last few key
by key (protocol/arrival_reads.py): every row posted, one read for all that
are there; late rows waited for; rows that never come, or whose writer's
process is gone, left out without waiting past need; a host's rows that
its leader posts late still found; a store that cannot read directories,
or fails a read, read key by key. Threads on an in-memory store and a
fake clock (fake_clock.py: deadlines pass at once)."""

import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from oscars_tf.protocol import arrival_reads
from oscars_tf.protocol import host_arrivals
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import store_keys
from protocol_helpers import exchange
from protocol_helpers import run
from protocol_helpers import workers

ROUND = 3


def _key(j, round_=ROUND):
  return store_keys.arrival(round_, j)


class DirReads(FakeStore):
  """Counts directory reads and the arrival keys read one by one;
  `after_dir(count)` runs after each directory read (to post more)."""

  def __init__(self, after_dir=None):
    super().__init__(FakeClock())
    self.dirs = 0
    self.keys = []
    self.after_dir = after_dir or (lambda count: None)

  def read_dir(self, directory, timeout_s):
    values = super().read_dir(directory, timeout_s)
    self.dirs += 1
    self.after_dir(self.dirs)
    return values

  def get(self, key, timeout_s):
    if store_keys.arrival_of(key) is not None:
      self.keys.append(key)
    return super().get(key, timeout_s)


def _own(text, poster):
  return host_arrivals.rows_of(text, poster)


def _read(store, others, deadline_s=10.0, gone=()):
  rows = {}
  done = arrival_reads.read_by_directory(
      store, ROUND, others, rows, store.clock.monotonic() + deadline_s,
      lambda j: j in gone, _own, store.clock)
  return done, rows


def test_every_posted_row_comes_in_one_directory_read():
  store = DirReads()
  for j in range(1, 100):
    store.set(_key(j), f"row {j}")
  store.set(_key(5, 30), "another round's")
  store.set(_key(200), "not a member's")
  done, rows = _read(store, list(range(1, 100)))
  assert done and rows == {j: f"row {j}" for j in range(1, 100)}
  assert store.dirs == 1 and store.keys == []


def test_late_rows_are_waited_for():
  def post_more(count):  # each directory read lets 20 more rows in
    for j in range(20 * count, min(100, 20 * count + 20)):
      store.set(_key(j), f"row {j}")
  store = DirReads(post_more)
  for j in range(1, 20):
    store.set(_key(j), f"row {j}")
  done, rows = _read(store, list(range(1, 100)))
  assert done and rows == {j: f"row {j}" for j in range(1, 100)}
  assert 2 <= store.dirs <= 6, store.dirs


def test_the_last_few_wake_the_chief_as_they_come():
  store = DirReads(lambda count: count == 1 and posted.set())
  posted = store.clock.event()
  for j in range(1, 60):
    store.set(_key(j), f"row {j}")

  def late():  # after the chief's first look, a blocking read answers it
    assert posted.wait(10)
    store.set(_key(60), "row 60")
  t0 = store.clock.monotonic()
  out, errors = run([lambda: _read(store, list(range(1, 61))), late],
                    store.clock)
  assert errors == [None, None], errors
  done, rows = out[0]
  assert done and rows == {j: f"row {j}" for j in range(1, 61)}
  assert _key(60) in store.keys  # waited on its key, not polled
  assert store.clock.monotonic() == t0


def test_a_row_that_never_comes_is_left_out_at_the_deadline():
  store = DirReads()
  for j in range(1, 100):
    if j != 7:
      store.set(_key(j), f"row {j}")
  t0 = store.clock.monotonic()
  done, rows = _read(store, list(range(1, 100)), deadline_s=0.5)
  assert done and sorted(rows) == [j for j in range(1, 100) if j != 7]
  assert store.clock.monotonic() - t0 == pytest.approx(0.5)


def test_a_long_stall_costs_few_reads_of_the_whole_round():
  # 40 stalled members (live, so waited for to the deadline): every
  # directory read carries the whole round, so their number grows with
  # the log of the wait, not with the wait (4 s at even 0.1 s: 40).
  store = DirReads()
  for j in range(1, 60):
    store.set(_key(j), f"row {j}")
  done, rows = _read(store, list(range(1, 100)), deadline_s=4.0)
  assert done and sorted(rows) == list(range(1, 60))
  assert store.dirs <= 22, store.dirs


def test_members_whose_processes_are_gone_are_not_waited_for():
  gone = set(range(50, 100))  # a rack died: more than TAIL members
  assert len(gone) > arrival_reads.TAIL
  store = DirReads()
  for j in range(1, 50):
    store.set(_key(j), f"row {j}")
  t0 = store.clock.monotonic()
  done, rows = _read(store, list(range(1, 100)), deadline_s=60.0, gone=gone)
  assert done and sorted(rows) == list(range(1, 50))
  # Asked after PROBE_EVERY_S, not the 60 s straggler wait.
  assert store.clock.monotonic() - t0 < 1.0


def test_a_hosts_rows_its_leader_posts_late_are_found():
  # Workers 4 and 5 posted nothing (their leader, 6, acknowledged them);
  # 6 posts once the chief waits on the keys: its post brings all three,
  # though 4's and 5's own keys never come.
  class Watched(DirReads):
    def get(self, key, timeout_s):
      if key == _key(4):
        waiting.set()
      return super().get(key, timeout_s)
  store = Watched()
  waiting = store.clock.event()
  for j in (1, 2, 3, 7, 8):
    store.set(_key(j), f"row {j}")

  def leader():
    assert waiting.wait(10)
    store.set(_key(6), host_arrivals.gathered_text(
        {4: "row 4", 5: "row 5", 6: "row 6"}))
  t0 = store.clock.monotonic()
  out, errors = run([
      lambda: _read(store, list(range(1, 9)), deadline_s=30.0), leader],
      store.clock)
  assert errors == [None, None], errors
  done, rows = out[0]
  assert done and rows == {j: f"row {j}" for j in range(1, 9)}
  # At the end of the slice it waited in (PROBE_EVERY_S), not the 30 s.
  assert store.clock.monotonic() - t0 < 1.0


def test_a_store_without_directory_reads_is_read_key_by_key():
  store = FakeStore()
  store.read_dir = None
  assert _read(store, [1, 2]) == (False, {})

  class CannotSay(FakeStore):
    def read_dir(self, directory, timeout_s):
      return None  # e.g. another TensorFlow: the service lacks the call
  assert _read(CannotSay(), [1, 2]) == (False, {})


def test_a_failed_directory_read_ends_key_by_key():
  class FailsSecond(DirReads):
    def read_dir(self, directory, timeout_s):
      values = super().read_dir(directory, timeout_s)
      return values if self.dirs == 1 else None

  def post_rest(count):  # after the first read, which found 39 rows
    for j in range(40, 80) if count == 1 else ():
      store.set(_key(j), f"row {j}")
  store = FailsSecond(post_rest)
  for j in range(1, 40):
    store.set(_key(j), f"row {j}")
  done, rows = _read(store, list(range(1, 80)) + [99], deadline_s=0.5)
  assert done and rows == {j: f"row {j}" for j in range(1, 80)}
  assert store.dirs == 2 and _key(40) in store.keys


HOSTS = ("10.0.0.1",) * 3 + ("10.0.0.2",) * 3 + ("10.0.0.3",) * 3


def test_a_job_of_three_hosts_agrees_on_every_row(tmp_path):
  store = DirReads()
  ws = workers(store, len(HOSTS), 5.0, 20.0, first_round=10.0,
               relay_for=lambda i: host_relay.HostRelay(
                   HOSTS, i, str(tmp_path), grace_s=5.0, clock=store.clock))
  for r in range(4):
    out, errors = exchange(ws, r)
    assert errors == [None] * len(ws), errors
    assert len({d.to_json() for d in out}) == 1  # every member agrees
    d = out[0]
    assert d.members == tuple(range(9)) and d.dropped == ()
    assert [d.rows[j][0] for j in d.members] == [10.0 + j for j in range(9)]
  assert store.dirs >= 4
