"""One member per host reads the round's changes from the chief and passes
them on through a file (protocol/host_relay.py); the others never depend
on it: a leader that is gone, a host without a shared file system and a
file of an earlier job all end in reading the chief's.

Workers are threads on an in-memory store and a fake clock (fake_clock.py:
a grace or a poll passes at once); each host's file directory is a pytest
tmp_path (two "hosts" may share one, as on one machine)."""

import os
import stat
import threading
import time
import uuid

import pytest

from fake_clock import FakeClock
from fake_store import FakeStore
from fake_store import give_to_another_user
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import store_keys
from protocol_helpers import row
from protocol_helpers import run
from protocol_helpers import workers

HOSTS = ("10.0.0.1",) * 2 + ("10.0.0.2",) * 2  # workers 0, 1 | 2, 3


class CountingStore(FakeStore):
  """Which worker read each round's changes from the chief (by thread)."""

  def __init__(self):
    super().__init__(FakeClock())
    self.changes_read = []  # (reader, key)
    self.reader = {}        # thread id -> worker

  def get(self, key, timeout_s):
    value = super().get(key, timeout_s)
    if store_keys.decision_round(key) is not None:
      self.changes_read.append((self.reader.get(threading.get_ident()),
                                key))
    return value


def _job(store, directories, straggler=0.5, grace_s=host_relay.GRACE_S):
  return workers(store, len(HOSTS), straggler, 10.0,
                 relay_for=lambda i: host_relay.HostRelay(
                     HOSTS, i, directories[i], grace_s, clock=store.clock))


def _round(store, ws, r, who=None):
  def one(w):
    store.reader[threading.get_ident()] = w.me
    return w.exchange(r, row(w.me))
  out, errors = run([lambda w=w: one(w) for w in ws
                     if who is None or w.me in who], store.clock)
  assert errors == [None] * len(out), errors
  return out


def test_only_one_member_per_host_reads_the_changes_from_the_chief(tmp_path):
  assert host_relay.HostRelay.wanted(HOSTS)
  assert not host_relay.HostRelay.wanted(("a",) * 4)  # one host
  assert not host_relay.HostRelay.wanted(("a", "b", "c"))  # one a host
  store = CountingStore()
  # A long grace: the leaders' files always come, however loaded the
  # machine (the grace itself is the next test's).
  ws = _job(store, [str(tmp_path)] * 4, grace_s=5.0)
  for r in range(4):
    out = _round(store, ws, r)
    assert len({d.to_json() for d in out}) == 1  # every member agrees
    assert out[0].members == (0, 1, 2, 3)
  # The chief writes them (it leads its host); worker 2 reads them for
  # host 2; workers 1 and 3 read files.
  assert {w for w, _ in store.changes_read} == {2}
  assert len(store.changes_read) == 4
  # The leaders leave only the last round's files (and that they are
  # done with them: test_the_job_directory_goes_with_the_last_worker...).
  ws[0].finish(3)
  ws[2].finish(3)
  assert sorted(p.name for p in tmp_path.glob("*/*")) == [
      "3", "3", "done-0", "done-2"]


def test_a_host_whose_leader_is_gone_reads_the_chiefs(tmp_path):
  store = CountingStore()
  ws = _job(store, [str(tmp_path)] * 4, straggler=0.3)
  _round(store, ws, 0)
  # Worker 2, host 2's leader, stops: worker 3 finds no file, reads the
  # chief's decision after the grace, and leads its host from then on.
  out = _round(store, ws, 1, who=(0, 1, 3))
  assert out[0].dropped == (2,) and len({d.to_json() for d in out}) == 1
  assert (3, store_keys.decision(1)) in store.changes_read
  assert ws[3].relay.misses >= 1
  _round(store, ws, 2, who=(0, 1, 3))
  assert (3, store_keys.decision(2)) in store.changes_read


def test_members_that_share_no_file_system_stop_waiting_for_files(tmp_path):
  store = CountingStore()
  dirs = [str(tmp_path / f"w{i}") for i in range(4)]
  for d in dirs:
    os.makedirs(d)
  ws = _job(store, dirs)
  for r in range(host_relay.MISSES_TO_STOP + 2):
    out = _round(store, ws, r)
    assert len({d.to_json() for d in out}) == 1
  assert ws[1].relay.stopped and ws[3].relay.stopped
  assert not ws[2].relay.stopped  # a leader never waits for files
  # Once stopped, they read from the chief at once every round.
  last = host_relay.MISSES_TO_STOP + 1
  assert {w for w, k in store.changes_read
          if k == store_keys.decision(last)} == {1, 2, 3}


def test_a_member_asks_the_store_late_and_ever_less_often(tmp_path):
  clock = FakeClock()
  relay = host_relay.HostRelay(HOSTS, 1, str(tmp_path), clock=clock)
  relay.bind("job")
  asked = []
  # The file is there: the store is never asked.
  leader = host_relay.HostRelay(HOSTS, 0, str(tmp_path), clock=clock)
  leader.bind("job")
  leader.write(1, "changes")
  assert relay.wait(1, clock.monotonic() + 5, lambda: asked.append(1)) == (
      "changes")
  assert not asked
  # No file and no decision for 2.5 s: asked at 0.5 and 1.5 s only (once
  # every POLL_S, as before: 5 times, each an RPC of the chief's process).
  assert relay.wait(2, clock.monotonic() + 2.5,
                    lambda: asked.append(1)) is None
  assert len(asked) == 2, asked


def test_a_file_of_an_earlier_job_is_never_read(tmp_path):
  store = CountingStore()
  old = host_relay.HostRelay(HOSTS, 0, str(tmp_path))
  old.bind("earlier")
  old.write(0, "not a decision")  # the same round and host, another job
  ws = _job(store, [str(tmp_path)] * 4, grace_s=5.0)
  out = _round(store, ws, 0)
  assert len({d.to_json() for d in out}) == 1 and ws[1].relay.misses == 0


def test_files_left_by_jobs_long_gone_are_swept(tmp_path):
  stale = tmp_path / "oscars_tf-gone-10.0.0.1-7"
  stale.write_text("x")
  os.utime(stale, (1, 1))
  fresh = tmp_path / "oscars_tf-running-10.0.0.1-7"
  fresh.write_text("x")
  relay = host_relay.HostRelay(HOSTS, 0, str(tmp_path))
  relay.bind("new")
  relay.write(0, "text")
  assert not stale.exists() and fresh.exists()


# Issue 43, item 10: the host's files are the job's user's alone, and what
# another user could have written is not trusted.

OTHER_UID = 65534  # nobody


def _needs_root():
  if os.geteuid() != 0:
    pytest.skip("giving a file to another user needs root")


def _bound(directory, me, token):
  relay = host_relay.HostRelay(HOSTS, me, str(directory))
  relay.bind(token)
  return relay


def _mode(path):
  return stat.S_IMODE(os.stat(path).st_mode)


def test_host_files_are_private_to_the_jobs_user(tmp_path):
  leader = _bound(tmp_path, 0, uuid.uuid4().hex)
  leader.write(1, "changes")
  path = leader.path(1)
  directory = os.path.dirname(path)
  assert directory != str(tmp_path)  # the job's own directory
  assert (_mode(directory), _mode(path)) == (0o700, 0o600)
  assert os.stat(path).st_uid == os.stat(directory).st_uid == os.geteuid()


def test_a_file_another_user_wrote_is_not_trusted(tmp_path, caplog):
  """Before: the member read the forged decision of round 1."""
  _needs_root()
  token = uuid.uuid4().hex
  leader, member = _bound(tmp_path, 0, token), _bound(tmp_path, 1, token)
  leader.write(0, "changes")
  forged = leader.path(1)
  with open(forged, "w", encoding="ascii") as f:
    f.write("forged")
  give_to_another_user(forged, OTHER_UID)
  assert member.wait(1, time.monotonic() + 5, lambda: True) is None
  assert f"owned by uid {OTHER_UID}" in caplog.text


@pytest.mark.parametrize("how", ["another user's", "open to others"])
def test_a_job_directory_made_by_someone_else_is_refused(tmp_path, caplog,
                                                         how):
  """Before: the leader wrote its decision into it, the member read it."""
  token = uuid.uuid4().hex
  leader, member = _bound(tmp_path, 0, token), _bound(tmp_path, 1, token)
  directory = os.path.dirname(leader.path(0))
  os.makedirs(directory, exist_ok=True)
  if how == "another user's":
    _needs_root()
    give_to_another_user(directory, OTHER_UID)
    says = f"owned by uid {OTHER_UID}"
  else:
    os.chmod(directory, 0o777)
    says = "mode 0777"
  leader.write(0, "changes")
  assert leader.files_written == 0
  assert member.wait(0, time.monotonic() + 5, lambda: True) is None
  assert says in caplog.text and "reads the chief's" in caplog.text


def test_the_job_directory_goes_with_the_last_worker_to_finish(tmp_path):
  """Before: each host's last decision file was left behind (for a later
  job's sweep, an hour on)."""
  store = CountingStore()
  ws = _job(store, [str(tmp_path)] * 4, grace_s=5.0)
  for r in range(3):
    _round(store, ws, r)
  for w in ws:
    w.finish(2)
  assert not list(tmp_path.iterdir())


def test_job_directories_left_long_ago_are_swept_if_the_users_own(tmp_path):
  """A directory of a job that died before its end goes an hour on; one
  of another user's is not this job's to remove."""
  stale, fresh, others = (tmp_path / f"oscars_tf-{name}-10.0.0.1"
                          for name in ("gone", "running", "others"))
  for directory in (stale, fresh, others):
    directory.mkdir(mode=0o700)
    (directory / "7").write_text("x")
  os.utime(stale, (1, 1))
  os.utime(others, (1, 1))
  if os.geteuid() == 0:
    give_to_another_user(others, OTHER_UID)
  _bound(tmp_path, 0, "new").write(0, "text")
  assert not stale.exists() and fresh.exists()
  assert others.exists() or os.geteuid() != 0
