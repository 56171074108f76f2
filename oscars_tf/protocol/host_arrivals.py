"""The round's arrivals read once per host: the host's leader gathers them.

The chief reads every member's row from the store at each round end, one
key at a time (TensorFlow's Python API has no directory read), and over
the real coordination service each read costs the chief's process about
0.3 ms of CPU: a third of a second a round at 1,024 workers
(benchmarks/control_plane_tf.py). On a job of several hosts the members of
a host share its file system, as for the decision (host_relay.py): each
member writes its row to a file in shared memory as well, and the host's
leader (host_relay's: the lowest-numbered member on it in the last
decision) posts under its own arrival key the rows of the host it found,
its own among them. The chief reads one key per host, and a member's own
key only when its row was not in its leader's.

Nothing depends on the files. Every member still posts its own row to the
store; the leader's key holds its own row whatever else it holds, so the
chief waits for it as it would for the leader's row alone; a row a leader
did not gather in time (GATHER_S after its own arrival), or that a leader
who died or stalled never posted, is read from its member's key. A leader
that found none of its host's files MISSES_TO_STOP rounds in a row (no
shared file system) stops looking. The files carry the job's incarnation
(host_relay's token), and a leader removes those it read.
No TensorFlow.
"""

import glob
import os
import time

from absl import logging

from oscars_tf.protocol import host_relay
from oscars_tf.protocol import kv_store

GATHER_S = 0.3   # how long a leader waits for its host's rows
MISSES_TO_STOP = 3
_GATHERED = "g:"  # a gathered text starts so; a row's (base64) never does


def gathered_text(rows):
  """{worker: row text} as one store text."""
  return _GATHERED + ";".join(f"{j}={t}" for j, t in sorted(rows.items()))


def rows_of(text, sender):
  """{worker: row text} from what `sender` posted: its row, or the rows
  it gathered (its own among them)."""
  if not text.startswith(_GATHERED):
    return {sender: text}
  rows = {}
  for part in text[len(_GATHERED):].split(";"):
    j, _, row = part.partition("=")
    rows[int(j)] = row
  return rows


class HostArrivals:
  """One worker's side of its host's arrival gathering."""

  def __init__(self, relay, gather_s=GATHER_S):
    """`relay`: the worker's host_relay.HostRelay (hosts, the job's token,
    the directory, who leads)."""
    self.relay = relay
    self.gather_s = gather_s
    self.misses = 0
    self.stopped = False
    self.rows_gathered = 0  # for tests and logs

  def active(self, round_):
    """Whether files are used in `round_`: the job's token is known (from
    round 1 on a member; round 0 is every worker's start) and files were
    found."""
    return (not self.stopped and self.relay.token is not None and
            round_ > 0)

  def _path(self, round_, worker):
    return f"{self.relay.path(round_)}-a-{worker}"

  def write(self, round_, text):
    """A member that does not lead: its row of `round_` for its leader."""
    if not self.active(round_):
      return
    path = self._path(round_, self.relay.me)
    try:
      with open(f"{path}.tmp", "w", encoding="ascii") as f:
        f.write(text)
      os.replace(f"{path}.tmp", path)
    except OSError:
      pass  # the chief reads the member's key
    # Its row of two rounds back if no leader took it (none, or no shared
    # file system): nothing is left behind.
    host_relay.remove_file(self._path(round_ - 2, self.relay.me))

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
    rows, deadline = {}, time.monotonic() + self.gather_s
    pause = host_relay.FILE_POLL_S[0]
    while True:
      for j in mates:
        if j not in rows:
          try:
            with open(self._path(round_, j), encoding="ascii") as f:
              rows[j] = f.read()
          except FileNotFoundError:
            pass
      if len(rows) == len(mates) or time.monotonic() >= deadline:
        break
      time.sleep(pause)
      pause = min(host_relay.FILE_POLL_S[1], pause * 1.5)
    for j in rows:
      host_relay.remove_file(self._path(round_, j))
    # Rows of earlier rounds that came too late to be gathered.
    for path in glob.glob(f"{self.relay.path(round_ - 2)}-a-*"):
      host_relay.remove_file(path)
    self._count(len(rows))
    return rows

  def arrival_text(self, round_, text, members):
    """What a worker other than the chief posts as its arrival (`text`,
    its row): its row, after writing it to its file; a leader the rows it
    gathered with its own."""
    if not self.relay.leads(members):
      self.write(round_, text)
      return text
    rows = self.gather(round_, members)
    if not rows:
      return text
    rows[self.relay.me] = text
    return gathered_text(rows)

  def read_leaders(self, store, prefix, round_, others, members, rows,
                   deadline, is_gone):
    """The chief: its host's rows from their files and every other host's
    from its leader's key (`prefix` + worker) into `rows`; returns the
    leaders asked (a leader not there by `deadline`, or whose process is
    gone, is left out: its host's others are then read one by one)."""
    if not self.active(round_):
      return []
    hosts, is_member = self.relay.hosts, set(members)
    rows.update(self.gather(round_, members))
    leaders = {}
    for j in others:
      if hosts[j] != hosts[self.relay.me]:
        leaders.setdefault(hosts[j], j)
    first = sorted(leaders.values())
    texts = kv_store.values_unless_gone(
        store, [f"{prefix}{j}" for j in first], deadline,
        lambda i: is_gone(first[i]))
    for leader, text in zip(first, texts):
      if text is not None:
        rows.update((j, t) for j, t in rows_of(text, leader).items()
                    if j == leader or (j in is_member and
                                       hosts[j] == hosts[leader]))
    return first

  def _count(self, found):
    self.rows_gathered += found
    self.misses = 0 if found else self.misses + 1
    if self.misses >= MISSES_TO_STOP:
      self.stopped = True
      logging.warning(
          "oscars_tf: worker %d found none of its host's arrival files in "
          "%d rounds in a row; the chief reads every row from the store "
          "(do the host's workers share %s?).", self.relay.me, self.misses,
          self.relay.directory)
