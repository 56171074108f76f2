"""The chief reads a round's arrivals: the whole round in one directory
read, polled, then the last few key by key.

Key by key the chief spends one round trip a member (a host, with host
leaders): at 1,024 workers over TensorFlow's service that was some 330
RPCs and 67 to 79 ms of the chief's CPU a round. A directory read
(kv_store's `read_dir`; the service's GetKeyValueDir) returns every row
posted so far in one. The chief reads it again while more than `TAIL`
members are still to come, after a pause of half the time it has waited
(so O(log(wait)) reads of the whole round, not one every few ms of a
long stall: at 10,000 workers a read is ~0.6 MB), then reads the last
few key by key (blocking reads: each answers the moment its row lands).
Members whose processes are gone are not waited for (asked every
PROBE_EVERY_S). Waits are `clock`'s (clock.py). No TensorFlow here.
"""

from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import host_arrivals
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import store_keys

MIN_PAUSE_S = 0.005  # the first pause between two directory reads
TAIL = 16  # members still to come that are read key by key


def read_arrivals(store, round_, others, members, rows, deadline, is_gone,
                  arrivals=None, clock=None):
  """The chief: the rows of `others` (members but itself) into `rows`. On
  a job of several hosts (`arrivals`, a host_arrivals.HostArrivals) its own
  host's from their files and every other host's from its leader's key;
  the round's keys in directory reads where the store can, else each
  leader's key, then each member's own for the rest. One not there by
  `deadline` (or whose process is gone) is left out."""
  is_member = set(members)
  if arrivals is not None:
    rows.update(arrivals.own_host(round_, members))

  def posted_rows(text, poster):
    if arrivals is not None:
      return arrivals.posted_rows(text, poster, is_member)
    # (A member that took itself for its host's leader posted many rows.)
    return {poster: host_arrivals.rows_of(text, poster)[poster]}
  if read_by_directory(store, round_, others, rows, deadline, is_gone,
                       posted_rows, clock):
    return
  first = []
  if arrivals is not None:
    first = arrivals.read_leaders(store, round_, others, members, rows,
                                  deadline, is_gone)
  rest = [j for j in others if j not in rows and j not in first]
  texts = kv_store.values_unless_gone(
      store, [store_keys.arrival(round_, j) for j in rest], deadline,
      lambda i: is_gone(rest[i]), clock)
  rows.update((j, posted_rows(t, j)[j])
              for j, t in zip(rest, texts) if t is not None)


def read_by_directory(store, round_, others, rows, deadline, is_gone,
                      posted_rows, clock=None):
  """Reads the rows of `others` into `rows` from the keys of `round_`'s
  arrivals (store_keys.arrivals); False (nothing read) if the store reads
  no directories, and the caller reads key by key.

  `posted_rows(text, poster)`: {worker: row text} of what `poster` posted
  (its row, or its host's rows as their leader); `is_gone(j)`: whether
  worker j's process is gone (such members are not waited for)."""
  read_dir = getattr(store, "read_dir", None)
  if read_dir is None:
    return False
  clock = clock_lib.real_unless(clock)
  directory = store_keys.arrivals(round_)
  wanted = set(others)
  gone, seen = set(), set()
  t0 = clock.monotonic()
  probe_at = t0 + kv_store.PROBE_EVERY_S
  posted = read_dir(directory, clock.left(deadline))
  if posted is None:
    return False
  while posted is not None:  # None: the service failed a read
    for key, text in posted.items():
      if key in seen:  # read in an earlier look: a key is written once
        continue
      seen.add(key)
      poster = store_keys.worker_of(key)
      if poster in wanted:
        if host_arrivals.is_gathered(text):
          _take(rows, posted_rows(text, poster), wanted)
        else:  # its poster's own row (most keys: no parsing)
          rows[poster] = text
    missing = [j for j in others if j not in rows and j not in gone]
    if len(missing) <= TAIL or clock.left(deadline) <= 0:
      break
    now = clock.monotonic()
    if now >= probe_at:  # a host died: drop its members now
      gone.update(j for j in missing if is_gone(j))
      probe_at = now + kv_store.PROBE_EVERY_S
    # O(log(wait)) reads a round, each of the whole round: the pause is
    # half the time waited so far (at least the first).
    clock.sleep(min(max(MIN_PAUSE_S, (now - t0) / 2), clock.left(deadline)))
    posted = read_dir(directory, clock.left(deadline))
  # The last few key by key, a slice at a time: a row that comes in its
  # host's leader's post (the leader among the missing) ends the wait for
  # it at the slice's end.
  while clock.left(deadline) > 0:
    missing = [j for j in others if j not in rows and j not in gone]
    if not missing:
      break
    texts = kv_store.values_unless_gone(
        store, [store_keys.arrival(round_, j) for j in missing],
        min(deadline, clock.monotonic() + kv_store.PROBE_EVERY_S),
        lambda i, missing=missing: is_gone(missing[i]), clock)
    for j, text in zip(missing, texts):
      if text is not None:
        _take(rows, posted_rows(text, j), wanted)
    gone.update(j for j, text in zip(missing, texts)
                if text is None and j not in rows and is_gone(j))
  return True


def _take(rows, posted, wanted):
  rows.update((j, t) for j, t in posted.items() if j in wanted)

