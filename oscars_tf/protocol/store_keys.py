"""The key-value store's key layout: every key the protocol reads or writes.

One function per kind of key, so that a key's spelling lives in one place
(the coordination service's keys are plain strings; a directory is a key's
prefix up to a "/", and deleting it deletes every key under it):

  oscars_tf/members/            round membership (membership.py)
    a/<round>/<worker>          a member's row at its round end (a host's
                                leader: its host's rows, host_arrivals.py);
                                a/<round> is the round's directory
    d/<round>                   the chief's decision (its changes: deltas)
    s/<round>                   the whole decision ("deltas" distribution)
    j/<worker>                  a dropped worker's request to rejoin
    latest                      the chief's latest decided round
    finished                    the round training ended at
    done/<worker>               a member, at its exit: the chief may go
    job                         the job's incarnation (host_relay.py files)
  oscars_tf/agree/              numbers agreed between rounds (agreement.py)
    <round>/<index>             the chief's result; its directory holds
    <round>/<index>/<worker>    each member's numbers
    exchange/<name>/<index>/<worker>   one worker's text of an exchange
    exchange/<name>/<index>/read/<worker>   it has read the others'
  oscars_tf/table/<worker>      a worker's published row (rate_table.py)

No TensorFlow here.
"""

MEMBERS = "oscars_tf/members/"
AGREE = "oscars_tf/agree/"
TABLE = "oscars_tf/table/"


# -- round membership ----------------------------------------------------

def arrivals(round_):
  """The directory of `round_`'s arrivals (one delete clears it)."""
  return f"{MEMBERS}a/{round_}"


def arrival(round_, worker):
  """Worker `worker`'s row (or its host's rows) at the end of `round_`."""
  return f"{MEMBERS}a/{round_}/{worker}"


def arrival_of(key):
  """(round, worker) of an arrival key, or None for another key."""
  head = f"{MEMBERS}a/"
  if not key.startswith(head):
    return None
  round_, _, worker = key[len(head):].partition("/")
  try:
    return int(round_), int(worker)
  except ValueError:
    return None


def worker_of(key):
  """The worker a per-worker key (arrival, request, done) ends with, or
  None where its last part is not a number."""
  try:
    return int(key.rpartition("/")[2])
  except ValueError:
    return None


def decision(round_):
  """The chief's decision of `round_` (with "deltas": its changes)."""
  return f"{MEMBERS}d/{round_}"


def decision_round(key):
  """The round of a decision key, or None for another key."""
  head = f"{MEMBERS}d/"
  if not key.startswith(head):
    return None
  try:
    return int(key[len(head):])
  except ValueError:
    return None


def snapshot(round_):
  """The whole decision of `round_` ("deltas": for newcomers, and members
  whose snapshot differs)."""
  return f"{MEMBERS}s/{round_}"


def rejoin_request(worker):
  """A dropped worker's request to rejoin (its row)."""
  return f"{MEMBERS}j/{worker}"


def latest():
  """The chief's latest decided round."""
  return f"{MEMBERS}latest"


def finished():
  """The round at which training ended (dropped workers stop waiting)."""
  return f"{MEMBERS}finished"


def done(worker):
  """A member at its exit: done with the store (the chief may go)."""
  return f"{MEMBERS}done/{worker}"


def job():
  """The job's incarnation: names the hosts' file directories."""
  return f"{MEMBERS}job"


# -- agreements ----------------------------------------------------------

def agreement(round_, index):
  """The chief's result of agreement `index` at `round_`; the directory of
  the members' numbers."""
  return f"{AGREE}{round_}/{index}"


def agreement_numbers(round_, index, worker):
  """Worker `worker`'s numbers for agreement `index` at `round_`."""
  return f"{agreement(round_, index)}/{worker}"


def exchange_text(name, index, worker):
  """Worker `worker`'s text at exchange `index` of `name`."""
  return f"{AGREE}exchange/{name}/{index}/{worker}"


def exchange_read(name, index, worker):
  """Worker `worker` has read the others' texts of exchange `index` of
  `name` (the chief, which hosts the store, leaves once all have)."""
  return f"{AGREE}exchange/{name}/{index}/read/{worker}"


# -- the published table -------------------------------------------------

def table_row(worker):
  """Worker `worker`'s published table row (rate_table.py)."""
  return f"{TABLE}{worker}"
