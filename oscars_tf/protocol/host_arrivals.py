"""The round's arrivals read once per host: the host's leader gathers them.

The chief reads every member's row from the store at each round end (in
directory reads where the service answers them, else key by key), and
over the real coordination service each key read costs the chief's process about
0.3 ms of CPU: a third of a second a round at 1,024 workers
(benchmarks/control_plane_tf.py). Every post is an RPC its process serves
too. On a job of several hosts the members of a host share its file
system, as for the decision (host_relay.py): each member writes its row to
a file in shared memory, and the host's leader (host_relay's: the
lowest-numbered member on it in the last decision) posts under its own
arrival key the rows of the host it found, its own among them, then
acknowledges them in a file. A member whose row was acknowledged posts
nothing: its row is in the store already. The chief reads one key per
host, and a member's own key only when its row was not in its leader's.

Nothing depends on the files. A member whose row no acknowledgement names
within ACK_WAIT_S (a leader gone, stalled or later than that, a row that
came after the gathering: GATHER_S after the leader's arrival) posts its
own key, which the chief reads. The leader acknowledges only after its
post returned, and the chief its own host's rows once it holds them. A
worker that found none of its host's files (a leader: rows; a member:
acknowledgements) MISSES_TO_STOP rounds in a row (no shared file system)
stops using them. The files are in the host's directory of the job's
incarnation (host_relay's), its user's alone: a file or directory another
user could have written stops their use (host_files.py). A leader removes
the rows it read, and its acknowledgements two rounds on or at the end.
Waits are the relay's clock's (clock.py). No TensorFlow.
"""

import os

from absl import logging

from oscars_tf.protocol import host_relay
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import store_keys

GATHER_S = 0.3   # how long a leader waits for its host's rows
ACK_WAIT_S = 1.0  # how long a member waits for its leader's acknowledgement
MISSES_TO_STOP = 3
_GATHERED = "g:"  # a gathered text starts so; a row's (base64) never does


def gathered_text(rows):
  """{worker: row text} as one store text."""
  return _GATHERED + ";".join(f"{j}={t}" for j, t in sorted(rows.items()))


def is_gathered(text):
  """Whether a posted text holds a leader's gathered rows (else one row)."""
  return text.startswith(_GATHERED)


def rows_of(text, sender):
  """{worker: row text} from what `sender` posted: its row, or the rows
  it gathered (its own among them)."""
  if not is_gathered(text):
    return {sender: text}
  rows = {}
  for part in text[len(_GATHERED):].split(";"):
    j, _, row = part.partition("=")
    rows[int(j)] = row
  return rows


class HostArrivals:
  """One worker's side of its host's arrival gathering."""

  def __init__(self, relay, gather_s=GATHER_S, ack_wait_s=ACK_WAIT_S):
    """`relay`: the worker's host_relay.HostRelay (hosts, the job's token,
    the directory, who leads, the clock)."""
    self.relay = relay
    self.clock = relay.clock
    self.gather_s = gather_s
    self.ack_wait_s = ack_wait_s
    # As a leader: rounds in a row without any of its host's rows.
    self.misses = _RoundsWithout("arrival file of its host",
                                 "the chief reads every row from the store")
    self.stopped = False
    self.rows_gathered = 0  # for tests and logs
    # As a member: acknowledgements that never came (not even late), and
    # the round whose acknowledgement is still to be looked for.
    self.ack_misses = _RoundsWithout(
        "acknowledgement of its row from its host's leader",
        "it posts its row to the store without waiting")
    self.waits_for_acks = True
    self._unacknowledged = None
    self.posts_saved = 0  # rounds a member posted nothing (acknowledged)
    # Every worker of this host in the job, itself too (members or not:
    # one dropped, or this one before it led, may have left a row).
    mine = relay.hosts[relay.me]
    self._on_host = tuple(j for j, h in enumerate(relay.hosts) if h == mine)

  @classmethod
  def for_member(cls, relay, straggler_timeout):
    """A member's: one not acknowledged posts its own row well within the
    chief's wait (`straggler_timeout`)."""
    return cls(relay, ack_wait_s=min(ACK_WAIT_S, straggler_timeout / 4))

  def active(self, round_):
    """Whether files are used in `round_`: the job's token is known (from
    round 1 on a member; round 0 is every worker's start), files were
    found and none was untrusted."""
    return (not self.stopped and self.relay.token is not None and
            self.relay.refused is None and round_ > 0)

  def _path(self, round_, worker):
    return f"{self.relay.path(round_)}-a-{worker}"

  def _ack_path(self, round_):
    return f"{self.relay.path(round_)}-k"

  def write(self, round_, text):
    """A member that does not lead: its row of `round_` for its leader;
    whether it was written."""
    if not self.active(round_):
      return False
    written = self._write(self._path(round_, self.relay.me), text)
    # Its row of two rounds back if no leader took it (none, or no shared
    # file system): nothing is left behind.
    host_relay.remove_file(self._path(round_ - 2, self.relay.me))
    return written

  def acknowledge(self, round_, workers):
    """A leader, its gathered rows in the store (or the chief, holding its
    host's): tells `workers` they need not post theirs. Written also when
    it names none, so that late members post at once."""
    if self.active(round_):
      self._write(self._ack_path(round_),
                  ",".join(str(j) for j in sorted(workers)))
      host_relay.remove_file(self._ack_path(round_ - 2))

  def acknowledged(self, round_):
    """A member that wrote its row: whether its leader acknowledged it
    within `ack_wait_s` (False at once if an acknowledgement without it
    came)."""
    if not self.waits_for_acks:
      return False
    path, me = self._ack_path(round_), str(self.relay.me)
    deadline = self.clock.monotonic() + self.ack_wait_s
    pause = host_relay.FILE_POLL_S[0]
    while True:
      text = self.relay.read_file(path)
      if text is not None:
        self.ack_misses.tally(True, self.relay)
        return me in text.split(",")
      if self.relay.refused is not None:
        return False
      if self.clock.monotonic() >= deadline:
        self._unacknowledged = round_
        return False
      self.clock.sleep(pause)
      pause = min(host_relay.FILE_POLL_S[1], pause * 1.5)

  def _look_back(self):
    """A member, before it writes its row: whether the acknowledgement it
    did not wait long enough for came at all (its leader removes it two
    rounds on). Only none at all MISSES_TO_STOP rounds in a row (no shared
    file system) stops the waiting; a leader slower than `ack_wait_s` is
    not that."""
    if self._unacknowledged is None:
      return
    came = os.path.exists(self._ack_path(self._unacknowledged))
    self._unacknowledged = None
    if self.ack_misses.tally(came, self.relay):
      self.waits_for_acks = False

  def mates(self, members):
    """The members on this worker's host, other than itself."""
    hosts, me = self.relay.hosts, self.relay.me
    return [j for j in members if j != me and hosts[j] == hosts[me]]

  def gather(self, round_, members):
    """A leader (or the chief): {worker: row text} of its host's other
    `members` whose files came within `gather_s` (all of them as soon as
    they are all there); the files read are removed."""
    mates = self.mates(members)
    if not mates or not self.active(round_):
      return {}
    rows, deadline = {}, self.clock.monotonic() + self.gather_s
    pause = host_relay.FILE_POLL_S[0]
    while True:
      for j in mates:
        if j not in rows:
          text = self.relay.read_file(self._path(round_, j))
          if text is not None:
            rows[j] = text
      if self.relay.refused is not None:
        return {}  # its mates post their own rows
      if len(rows) == len(mates) or self.clock.monotonic() >= deadline:
        break
      self.clock.sleep(pause)
      pause = min(host_relay.FILE_POLL_S[1], pause * 1.5)
    for j in rows:
      host_relay.remove_file(self._path(round_, j))
    # Rows of earlier rounds that came too late to be gathered, by name:
    # a listing of the directory costs O(its files), and where hosts share
    # it (emulated hosts, a shared file system) every leader would list
    # every host's files each round (1,500 at 1,024 workers here).
    for j in self._on_host:
      host_relay.remove_file(self._path(round_ - 2, j))
    self._count(len(rows))
    return rows

  def post(self, store, key, round_, text, members):
    """A worker other than the chief arrives in `round_` with `text` (its
    row) under `key`: a leader posts the rows it gathered with its own and
    acknowledges them; a member writes its row for its leader and posts it
    only if no acknowledgement names it."""
    if self.relay.leads(members):
      rows = self.gather(round_, members)
      store.set(key, gathered_text({**rows, self.relay.me: text})
                if rows else text)
      self.acknowledge(round_, rows)
      return
    self._look_back()
    if self.write(round_, text) and self.acknowledged(round_):
      self.posts_saved += 1
    else:
      store.set(key, text)

  def read_leaders(self, store, round_, others, members, rows, deadline,
                   is_gone):
    """The chief, its host's rows read (`own_host`): every other host's
    rows from its leader's arrival key into `rows`; returns the
    leaders asked (a leader not there by `deadline`, or whose process is
    gone, is left out: its host's others are then read one by one)."""
    if self.relay.token is None or round_ == 0:  # no one gathers yet
      return []
    leaders = {}
    for j in others:
      if self.relay.hosts[j] != self.relay.hosts[self.relay.me]:
        leaders.setdefault(self.relay.hosts[j], j)
    first = sorted(leaders.values())
    texts = kv_store.values_unless_gone(
        store, [store_keys.arrival(round_, j) for j in first], deadline,
        lambda i: is_gone(first[i]), self.clock)
    is_member = set(members)
    for leader, text in zip(first, texts):
      if text is not None:
        rows.update(self.posted_rows(text, leader, is_member))
    return first

  def own_host(self, round_, members):
    """The chief: {worker: row text} of its host's members, from their
    files (acknowledged: they need not post theirs)."""
    if self.relay.token is None or round_ == 0:  # no one gathers yet
      return {}
    mine = self.gather(round_, members)
    self.acknowledge(round_, mine)
    return mine

  def posted_rows(self, text, poster, is_member):
    """{worker: row text} of what `poster` posted: its own row and those
    of the members (`is_member`, a set) of its host it gathered."""
    hosts = self.relay.hosts
    return {j: t for j, t in rows_of(text, poster).items()
            if j == poster or (j in is_member and hosts[j] == hosts[poster])}

  def finish(self, round_):
    """A leader at the end: its last acknowledgements (read already)."""
    for r in (round_ - 1, round_):
      host_relay.remove_file(self._ack_path(r))

  def _write(self, path, text):
    """One of the host's files (host_relay's); whether written."""
    try:
      return self.relay.write_file(path, text)
    except OSError:
      return False  # the member's own key is read instead

  def _count(self, found):
    self.rows_gathered += found
    if self.misses.tally(found, self.relay):
      self.stopped = True


class _RoundsWithout:
  """Rounds in a row in which a worker found none of the files it looks
  for; MISSES_TO_STOP of them mean its host's workers share no file
  system."""

  def __init__(self, what, instead):
    self.count = 0
    self.what, self.instead = what, instead

  def tally(self, found, relay):
    """Counts a round; whether to stop looking (said once, with why)."""
    self.count = 0 if found else self.count + 1
    if self.count != MISSES_TO_STOP:
      return False
    logging.warning(
        "oscars_tf: worker %d found no %s in %d rounds in a row; %s (do the "
        "host's workers share %s?).", relay.me, self.what, self.count,
        self.instead, relay.directory)
    return True
