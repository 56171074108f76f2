"""The round's decision read once per host: the host's leader passes it on.

Every member reads the round's changes from the chief (membership.py), so
what leaves the chief grows with the members, and the first table, in which
every rate is new to every member, is N² bytes: 135 MB at 10,000 workers.
Workers on one host share its file system; so on a job of several hosts,
one member per host (its *leader*: the lowest-numbered member on it in the
last decision; the chief on its own host) reads the decision from the chief
and writes it to a file in shared memory (/dev/shm where there is one), and
the host's other members read the file: bytes out of the chief divided by
the workers per host (8 a host: 17 MB for that first table).

A member never depends on the file: once the decision is out (the store's
`latest` round, checked POLL_S after its arrival, then at doubling
intervals up to POLL_MAX_S) and no file has come within GRACE_S,
it reads the decision from the chief, as without a relay (a leader that
died or stalled, a host whose workers do not share a file system). After
MISSES_TO_STOP such rounds in a row it stops waiting for files. What it
reads from a file is checked as what it reads from the chief is (the
snapshot's digest), and files are named by the job's incarnation (a token
the chief writes to the store), so a restarted job never reads an old one.
A leader deletes its host's older files as it goes, and at the end all but
the last, which the host's other members may still be reading; the first
write of a job removes files left more than STALE_S ago.
No TensorFlow.
"""

import glob
import os
import tempfile
import time
import uuid

from absl import logging

# A member looks for the round's file after 1 ms, then ever less often, up
# to every 10 ms: a round's wait for stragglers can take seconds.
FILE_POLL_S = (0.001, 0.01)
POLL_S = 0.5         # when it first asks the store whether the round is out
POLL_MAX_S = 2.0     # and then at doubling intervals up to this
GRACE_S = 0.3        # how long after that it waits for the file
MISSES_TO_STOP = 3
KEEP_ROUNDS = 2      # a leader deletes older files
STALE_S = 3600.0     # files older than this are left from earlier jobs


def new_token():
  return uuid.uuid4().hex


def shared_directory():
  """Shared memory where the system has it, else the temporary directory."""
  return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostRelay:
  """One worker's side of its host's relay."""

  def __init__(self, hosts, me, directory=None, grace_s=GRACE_S):
    """`hosts`: every worker's host (by worker index); `me`: this worker;
    `grace_s`: how long to wait for a file once the round is out."""
    self.hosts = tuple(hosts)
    self.me = me
    self.directory = directory or shared_directory()
    self.grace_s = grace_s
    self.token = None      # the job's incarnation (bind)
    self.misses = 0
    self.stopped = False
    self._swept = False
    self.files_read = self.files_written = 0  # rounds, for tests and logs

  @staticmethod
  def wanted(hosts):
    """Whether a relay saves anything: several hosts, one with several
    workers (a one-host job's members read from their own host's chief)."""
    hosts = list(hosts)
    return len(set(hosts)) > 1 and len(set(hosts)) < len(hosts)

  def bind(self, token):
    self.token = token

  def leads(self, members):
    """Whether this worker is its host's leader among `members`."""
    mine = self.hosts[self.me]
    return min((j for j in members if self.hosts[j] == mine),
               default=self.me) == self.me

  def path(self, round_):
    """The host's file of round `round_` (its prefix for the arrival
    files, host_arrivals.py)."""
    host = self.hosts[self.me].replace(":", "_").replace("/", "_")
    return os.path.join(self.directory,
                        f"oscars_tf-{self.token}-{host}-{round_}")

  def write(self, round_, text):
    """The leader: round `round_`'s decision for the host (atomically)."""
    if self.token is None:
      return
    if not self._swept:
      self._swept = True
      _remove_older_than(os.path.join(self.directory, "oscars_tf-*"),
                         time.time() - STALE_S)
    path = self.path(round_)
    try:
      with open(f"{path}.{self.me}.tmp", "w", encoding="ascii") as f:
        f.write(text)
      os.replace(f"{path}.{self.me}.tmp", path)
      self.files_written += 1
      remove_file(self.path(round_ - KEEP_ROUNDS))
    except OSError as e:  # a full or read-only file system: no relay
      logging.warning("oscars_tf: worker %d cannot write the host's "
                      "decision file (%s); the host's workers read the "
                      "chief's.", self.me, e)

  def wait(self, round_, deadline, published):
    """A member that does not lead: the decision text of `round_` from the
    host's file, or None (read the chief's) once the decision has been out
    for GRACE_S with no file, at `deadline`, or if the relay stopped.
    `published()`: whether the chief has written round `round_`'s
    decision."""
    if self.stopped or self.token is None:
      return None
    path = self.path(round_)
    # The file usually comes first: the store is asked only after POLL_S,
    # so a member that waits for the decision less than that costs the
    # chief's process no RPC, and one that waits long a few.
    out_since, asked, every = None, time.monotonic(), POLL_S
    pause = FILE_POLL_S[0]
    while time.monotonic() < deadline:
      try:
        with open(path, encoding="ascii") as f:
          text = f.read()
        self.misses = 0
        self.files_read += 1
        return text
      except FileNotFoundError:
        pass
      now = time.monotonic()
      if out_since is None and now - asked >= every:
        asked, every = now, min(2 * every, POLL_MAX_S)
        if published():
          out_since = now
      if out_since is not None and now - out_since >= self.grace_s:
        self._missed()
        return None
      time.sleep(pause)
      pause = min(FILE_POLL_S[1], pause * 1.5)
    return None

  def _missed(self):
    self.misses += 1
    if self.misses >= MISSES_TO_STOP:
      self.stopped = True
      logging.warning(
          "oscars_tf: worker %d found no decision file from its host's "
          "leader in %d rounds in a row; it reads the chief's from now on "
          "(do the host's workers share %s?).", self.me, self.misses,
          self.directory)

  def remove_files(self, last_round):
    """The leader at the end: its host's files before the last round's
    (which the host's other members may be reading still)."""
    if self.token is not None:
      for r in range(last_round - KEEP_ROUNDS, last_round):
        remove_file(self.path(r))


def _remove_older_than(pattern, when):
  for path in glob.glob(pattern):
    try:
      if os.path.getmtime(path) < when:
        os.remove(path)
    except OSError:
      pass  # another leader removed it


def remove_file(path):
  try:
    os.remove(path)
  except OSError:
    pass
