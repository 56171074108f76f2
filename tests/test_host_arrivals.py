"""Each host's leader gathers its host's rows through files and posts them
under its own arrival key, so the chief reads one key per host, and the
members whose rows it acknowledged post none (protocol/host_arrivals.py);
nothing depends on the files: a leader that is gone, a row that came late
and a host without a shared file system all end in the member posting and
the chief reading its own key, with the same decision.

Workers are threads on an in-memory store and a fake clock (fake_clock.py:
a gathering's or a member's wait passes at once, in the order the waits
say); a "host's" file directory is a pytest tmp_path."""

import glob
import os
import pathlib
import stat
import uuid

import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from fake_store import give_to_another_user
from oscars_tf.protocol import host_arrivals
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import store_keys
from protocol_helpers import row
from protocol_helpers import run
from protocol_helpers import workers

HOSTS = ("10.0.0.1",) * 3 + ("10.0.0.2",) * 3 + ("10.0.0.3",) * 3


class ArrivalReads(FakeStore):
  """Whose arrival keys the chief asked for (only the chief reads them) and
  which were posted, by round; `on_post(worker)` after each post. It reads
  no directories: the chief reads key by key, as on a store without them
  (test_arrival_reads.py tests the directory reads)."""

  read_dir = None

  def __init__(self, on_post=None):
    super().__init__(FakeClock())
    self.asked = {}  # round -> {worker whose key}
    self.posted = {}  # round -> {worker whose key}
    self.on_post = on_post or (lambda worker: None)

  def get(self, key, timeout_s):
    arrival = store_keys.arrival_of(key)
    if arrival is not None:
      round_, worker = arrival
      self.asked.setdefault(round_, set()).add(worker)
    return super().get(key, timeout_s)

  def set(self, key, value):
    super().set(key, value)
    arrival = store_keys.arrival_of(key)
    if arrival is not None:
      round_, worker = arrival
      self.posted.setdefault(round_, set()).add(worker)
      self.on_post(worker)


def _job(store, directories, straggler=1.0, gather_s=5.0, gone=(),
         relay_grace_s=5.0):
  """`relay_grace_s`: how long a member waits for its leader's decision
  file (the whole of it, every round, where the host shares no files)."""
  ws = workers(store, len(HOSTS), straggler, 20.0, first_round=5.0,
               is_gone=lambda j: j in gone,
               relay_for=lambda i: host_relay.HostRelay(
                   HOSTS, i, directories[i], grace_s=relay_grace_s,
                   clock=store.clock))
  for w in ws:
    w.arrivals.gather_s = gather_s
  return ws


def _round(ws, r, who=None, late=None, late_s=0.0):
  def one(w):
    if w.me == late:
      w.clock.sleep(late_s)
    return w.exchange(r, row(w.me, r))
  out, errors = run([lambda w=w: one(w) for w in ws
                     if who is None or w.me in who], ws[0].clock)
  assert errors == [None] * len(out), errors
  assert len({d.to_json() for d in out}) == 1  # every member agrees
  return out[0]


def _rates(decision):
  return [decision.rows[j][0] for j in decision.members]


def test_the_chief_reads_one_key_per_other_host(tmp_path):
  store = ArrivalReads()
  ws = _job(store, [str(tmp_path)] * len(HOSTS))
  d = _round(ws, 0)  # the job's token is not yet known: every key read
  assert sorted(store.asked[0]) == list(range(1, 9))
  for r in (1, 2, 3):
    d = _round(ws, r)
    # Host 1's leader is the chief (its mates' rows from files); hosts 2
    # and 3 are read through their leaders 3 and 6.
    assert sorted(store.asked[r]) == [3, 6], store.asked
    # Only the leaders post (and the chief, its own row): the others'
    # rows were acknowledged, in the store under their leader's key.
    assert sorted(store.posted[r]) == [0, 3, 6], store.posted
    assert d.members == tuple(range(9)) and d.dropped == ()
    assert _rates(d) == [10.0 + j for j in range(9)]
  assert sorted(store.posted[0]) == list(range(9))
  assert ws[0].arrivals.rows_gathered == 2 * 3  # workers 1 and 2, 3 rounds
  assert ws[3].arrivals.rows_gathered == ws[6].arrivals.rows_gathered == 6
  assert [w.arrivals.posts_saved for w in ws] == [0, 3, 3, 0, 3, 3, 0, 3, 3]
  for w in ws[::3]:  # the leaders remove their rows and acknowledgements
    w.finish(3)
  assert not [p for p in tmp_path.glob("*/*")
              if "-a-" in p.name or p.name.endswith("-k")]
  for w in ws:  # and the last of each host to finish, its directory
    w.finish(3)
  assert not list(tmp_path.iterdir())


def test_a_gone_leaders_host_is_read_member_by_member(tmp_path):
  store = ArrivalReads()
  gone = set()
  ws = _job(store, [str(tmp_path)] * len(HOSTS), gone=gone)
  _round(ws, 0)
  _round(ws, 1)
  gone.add(3)  # host 2's leader dies before round 2
  d = _round(ws, 2, who=[j for j in range(9) if j != 3])
  assert d.dropped == (3,) and d.members == (0, 1, 2, 4, 5, 6, 7, 8)
  assert sorted(store.asked[2]) == [3, 4, 5, 6]
  assert _rates(d) == [10.0 + j for j in d.members]
  # Worker 4 leads host 2 from the next round on.
  d = _round(ws, 3, who=d.members)
  assert sorted(store.asked[3]) == [4, 6]
  assert d.members == (0, 1, 2, 4, 5, 6, 7, 8)


def test_rows_acknowledged_by_a_leader_that_then_dies_are_kept(tmp_path):
  gone = set()
  store = ArrivalReads(on_post=lambda j: gone.add(j) if j == 3 else None)
  ws = _job(store, [str(tmp_path)] * len(HOSTS), gone=gone)
  _round(ws, 0)
  gone.clear()
  _round(ws, 1)
  gone.clear()
  # Host 2's leader dies right after its post: its rows are in the store,
  # so workers 4 and 5, which posted nothing, are still in the round.
  d = _round(ws, 2)
  assert 3 in gone and sorted(store.posted[2]) == [0, 3, 6]
  assert d.members == tuple(range(9)) and d.dropped == ()
  assert _rates(d) == [10.0 + j for j in range(9)]


def test_a_row_later_than_the_gathering_is_read_from_its_own_key(tmp_path):
  store = ArrivalReads()
  # The gathering is long enough for threads on a loaded machine (worker 8
  # must reach its leader's files in it), and worker 7 far later.
  ws = _job(store, [str(tmp_path)] * len(HOSTS), straggler=10.0,
            gather_s=0.3)
  _round(ws, 0)
  _round(ws, 1)
  # Worker 7 arrives well after its leader (6) stopped gathering.
  saved = ws[7].arrivals.posts_saved
  d = _round(ws, 2, late=7, late_s=1.2)
  assert d.members == tuple(range(9)) and d.dropped == ()
  assert sorted(store.asked[2]) == [3, 6, 7]
  # The acknowledgement it found did not name it: it posted its own.
  assert 7 in store.posted[2] and ws[7].arrivals.posts_saved == saved
  assert _rates(d) == [10.0 + j for j in range(9)]


def test_without_a_shared_file_system_leaders_stop_looking(tmp_path):
  store = ArrivalReads()
  dirs = []
  for j in range(len(HOSTS)):
    (tmp_path / str(j)).mkdir()
    dirs.append(str(tmp_path / str(j)))
  ws = _job(store, dirs, gather_s=0.05, relay_grace_s=1.0)
  rounds = 2 + host_arrivals.MISSES_TO_STOP
  for r in range(rounds):
    d = _round(ws, r)
    assert d.members == tuple(range(9))
    assert sorted(store.asked[r]) == list(range(1, 9))
    assert sorted(store.posted[r]) == list(range(9))
  assert ws[0].arrivals.stopped and ws[3].arrivals.stopped
  # Members found no acknowledgement either: they post without waiting.
  assert not ws[1].arrivals.waits_for_acks
  assert not ws[4].arrivals.waits_for_acks
  # Each member removes its own unread rows: two rounds at most are left.
  for j in (1, 4):
    left = [p.name for p in (tmp_path / str(j)).glob("*/*-a-*")]
    assert len(left) <= 2, left


def test_a_leader_slower_than_the_wait_is_not_a_missing_file_system(
    tmp_path):
  store = ArrivalReads()
  ws = _job(store, [str(tmp_path)] * len(HOSTS), straggler=2.0)
  _round(ws, 0)
  for r in range(1, 2 + host_arrivals.MISSES_TO_STOP):
    # Host 2's leader arrives after its members stopped waiting for it:
    # they post their own rows, and its acknowledgement comes late.
    d = _round(ws, r, late=3, late_s=1.0)
    assert d.members == tuple(range(9)) and d.dropped == ()
    assert {4, 5} <= store.posted[r] and not {7, 8} & store.posted[r]
  assert ws[4].arrivals.waits_for_acks and ws[4].arrivals.ack_misses.count == 0
  assert ws[3].arrivals.rows_gathered > 0


def test_a_chief_without_its_hosts_files_reads_the_other_hosts_rows(
    tmp_path):
  store = ArrivalReads()
  (tmp_path / "shared").mkdir()
  dirs = []
  for j in range(len(HOSTS)):  # the chief's host shares no file system
    if j < 3:
      (tmp_path / str(j)).mkdir()
    dirs.append(str(tmp_path / (str(j) if j < 3 else "shared")))
  # Long enough that each leader's mates reach its files on a loaded
  # machine (with 0.05 s one could miss and post its own key).
  ws = _job(store, dirs, gather_s=0.5, relay_grace_s=1.0)
  rounds = 2 + host_arrivals.MISSES_TO_STOP
  for r in range(rounds):
    d = _round(ws, r)
    assert _rates(d) == [10.0 + j for j in range(9)]
  assert ws[0].arrivals.stopped and not ws[3].arrivals.stopped
  # Its own host's rows from their keys; the others' from their leaders'
  # keys, which hold gathered rows.
  assert sorted(store.asked[rounds - 1]) == [1, 2, 3, 6]


def test_gathered_text_round_trip():
  rows = {4: "AAAA", 12: "QUJD", 5: "+/=="}
  text = host_arrivals.gathered_text(rows)
  assert host_arrivals.rows_of(text, 4) == rows
  assert host_arrivals.rows_of("AAAAAA==", 7) == {7: "AAAAAA=="}


def test_a_leader_removes_its_hosts_late_rows_without_listing_the_directory(
    tmp_path, monkeypatch):
  # Hosts that share a directory (emulated hosts, a shared file system):
  # a leader listing it every round would cost O(every host's files) each.
  store = ArrivalReads()
  ws = _job(store, [str(tmp_path)] * len(HOSTS), gather_s=0.3)
  for r in range(4):
    _round(ws, r)
  # Worker 8's row of round 2 came after its leader (6) gathered, and
  # worker 8 then left: only its leader can remove it. A row of the same
  # round on another host is that host's leader's to remove.
  late = pathlib.Path(ws[6].arrivals._path(2, 8))  # pylint: disable=protected-access
  late.write_text("row", encoding="ascii")

  def no_listing(*args, **kwargs):
    raise AssertionError(f"the directory was listed: {args}")
  for module, name in ((glob, "glob"), (glob, "iglob"), (os, "listdir"),
                       (os, "scandir")):
    monkeypatch.setattr(module, name, no_listing)
  d = _round(ws, 4, who=range(8))
  assert d.dropped == (8,) and not late.exists()


def _arrivals(directory, me, token):
  relay = host_relay.HostRelay(HOSTS, me, str(directory))
  relay.bind(token)
  return host_arrivals.HostArrivals(relay, gather_s=0.5, ack_wait_s=0.5)


def test_rows_and_acknowledgements_are_private_to_the_jobs_user(tmp_path):
  """Issue 43, item 10: 0600 files in a 0700 directory of the job's."""
  token = uuid.uuid4().hex
  leader, member = _arrivals(tmp_path, 0, token), _arrivals(tmp_path, 1, token)
  assert member.write(1, "row")
  row = member._path(1, 1)  # pylint: disable=protected-access
  assert leader.gather(1, [0, 1]) == {1: "row"}
  leader.acknowledge(1, [1])
  ack = leader._ack_path(1)  # pylint: disable=protected-access
  assert os.path.dirname(row) != str(tmp_path)
  assert [stat.S_IMODE(os.stat(p).st_mode)
          for p in (os.path.dirname(row), ack)] == [0o700, 0o600]
  member.write(2, "row")
  assert stat.S_IMODE(os.stat(member._path(2, 1)).st_mode) == 0o600  # pylint: disable=protected-access


def test_a_row_another_user_wrote_is_not_gathered(tmp_path, caplog):
  """A forged row of worker 2 in the job's directory (only root could put
  it there: the directory is the job's user's alone). Before: the leader
  gathered it, and the chief took worker 2 as arrived."""
  if os.geteuid() != 0:
    pytest.skip("giving a file to another user needs root")
  token = uuid.uuid4().hex
  leader, member = _arrivals(tmp_path, 0, token), _arrivals(tmp_path, 1, token)
  assert member.write(1, "row")
  forged = leader._path(1, 2)  # pylint: disable=protected-access
  with open(forged, "w", encoding="ascii") as f:
    f.write("forged")
  give_to_another_user(forged)
  assert 2 not in leader.gather(1, [0, 1, 2])
  assert "owned by uid 65534" in caplog.text
