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
snapshot's digest), and the host's files are in a directory named by the
job's incarnation (a token the chief writes to the store), so a restarted
job never reads an old one. The directory and its files are the job's
user's alone (host_files.py): one another user made, or could have
written, stops the relay. A leader deletes its host's older files as it
goes, and at the end all but the last, which the host's other members may
still be reading; the last of the host's members to finish removes the
directory, and the first write of a job removes what earlier jobs left
more than STALE_S ago (a worker that died before the end leaves it).
Waits are `clock`'s (clock.py). No TensorFlow.
"""

import os
import tempfile
import time
import uuid

from absl import logging

from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import host_files

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

  def __init__(self, hosts, me, directory=None, grace_s=GRACE_S,
               clock=None):
    """`hosts`: every worker's host (by worker index); `me`: this worker;
    `grace_s`: how long to wait for a file once the round is out; `clock`
    (clock.py): whose time the waits are (None: the real one)."""
    self.hosts = tuple(hosts)
    self.me = me
    self.directory = directory or shared_directory()
    self.grace_s = grace_s
    self.clock = clock_lib.real_unless(clock)
    self.token = None      # the job's incarnation (bind)
    self.job_directory = None  # the host's files, the job's user's alone
    self._directory_checked = False
    self.refused = None    # why the host's files are not used, if so
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
    host = self.hosts[self.me].replace(":", "_").replace("/", "_")
    self.job_directory = os.path.join(self.directory,
                                      f"oscars_tf-{token}-{host}")

  def leads(self, members):
    """Whether this worker is its host's leader among `members`."""
    mine = self.hosts[self.me]
    return min((j for j in members if self.hosts[j] == mine),
               default=self.me) == self.me

  def path(self, round_):
    """The host's file of round `round_` (its prefix for the arrival
    files, host_arrivals.py)."""
    return os.path.join(self.job_directory, str(round_))

  def write(self, round_, text):
    """The leader: round `round_`'s decision for the host (atomically)."""
    if self.token is None:
      return
    if not self._swept:
      self._swept = True
      host_files.remove_older_than(
          os.path.join(self.directory, "oscars_tf-*"), time.time() - STALE_S)
    try:
      if self.write_file(self.path(round_), text):
        self.files_written += 1
        remove_file(self.path(round_ - KEEP_ROUNDS))
    except OSError as e:  # a full or read-only file system: no relay
      logging.warning("oscars_tf: worker %d cannot write the host's "
                      "decision file (%s); the host's workers read the "
                      "chief's.", self.me, e)

  def write_file(self, path, text):
    """One of the host's files, 0600, atomically; whether written (not
    where the job's directory is refused). OSError where the file system
    refuses."""
    if not self._directory_usable(create=True):
      return False
    host_files.write(path, text, f"{path}.{self.me}.tmp")
    return True

  def read_file(self, path):
    """The text of one of the host's files, or None: not there (yet), or
    not to be trusted (then the relay stops, saying why)."""
    if not self._directory_usable(create=False):
      return None
    try:
      return host_files.read(path)
    except FileNotFoundError:
      return None
    except host_files.Untrusted as e:
      self._refuse(e)
      return None

  def _directory_usable(self, create):
    """Whether the job's directory is there (made if `create`) and its
    user's alone; checked once."""
    if self.refused is not None:
      return False
    if not self._directory_checked:
      try:
        if create:
          host_files.make_directory(self.job_directory)
        else:
          host_files.check_directory(self.job_directory)
      except FileNotFoundError:
        return False
      except host_files.Untrusted as e:
        self._refuse(e)
        return False
      self._directory_checked = True
    return True

  def _refuse(self, why):
    self.refused = str(why)
    self.stopped = True
    logging.warning(
        "oscars_tf: worker %d does not trust its host's files (%s); it "
        "reads the chief's decision and posts its own row from now on.",
        self.me, why)

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
    out_since, asked, every = None, self.clock.monotonic(), POLL_S
    pause = FILE_POLL_S[0]
    while self.clock.monotonic() < deadline:
      text = self.read_file(path)
      if text is not None:
        self.misses = 0
        self.files_read += 1
        return text
      if self.refused is not None:
        return None
      now = self.clock.monotonic()
      if out_since is None and now - asked >= every:
        asked, every = now, min(2 * every, POLL_MAX_S)
        if published():
          out_since = now
      if out_since is not None and now - out_since >= self.grace_s:
        self._missed()
        return None
      self.clock.sleep(pause)
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

  def leave(self, members):
    """Every worker at the end of training: says it is done with the
    host's files; the last of the host's `members` to say so removes the
    job's directory (each says so before it looks, so the last sees all)."""
    if self.token is None or not self._directory_usable(create=False):
      return
    def done(j):
      return os.path.join(self.job_directory, f"done-{j}")
    try:
      self.write_file(done(self.me), "")
    except OSError:
      return
    mine = self.hosts[self.me]
    if all(os.path.exists(done(j)) for j in members if self.hosts[j] == mine):
      host_files.remove_directory(self.job_directory)


def remove_file(path):
  try:
    os.remove(path)
  except OSError:
    pass
