"""Ends an all-to-all whose peer is gone, as TensorFlow ends an all-reduce.

When a member dies, TensorFlow 2.21's ring all-reduce and all-gather fail
at once on the others (UnavailableError: the dead member's server refuses
the connection), but `CollectiveAllToAllV2` does not notice: measured with
two workers, the survivor waited out the whole collective timeout (30 s
there, 300 s by default). So while an all-to-all is in flight a thread
checks the round's peers; when one's address refuses connections (its
process is gone) it aborts this process's collectives with UnavailableError,
as a failed all-reduce does, and the worker recovers as from any lost peer
(it saves its round state and exits for a restart: round_state.py). A
stopped or unreachable peer is not "gone"; the collective timeout covers it.

Example:
  watch = PeerWatch(lambda: ["10.0.0.2:2222"])
  watch.start()   # right before the all-to-all (a py_function)
  ...
  watch.stop()    # right after it
"""

import threading

from oscars_tf import cluster

CHECK_EVERY_S = 0.25


def abort_collectives(message):
  """Aborts this process's collectives (the ones running fail with
  UnavailableError; later ones too: the process must restart)."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  from tensorflow.python.framework import errors  # pylint: disable=g-import-not-at-top
  context.context().abort_collective_ops(errors.UNAVAILABLE, message)


class PeerWatch:
  """Checks `peers()` (addresses) every CHECK_EVERY_S between `start` and
  `stop`; calls `abort(message)` once if one is gone.

  Args:
    peers: () -> the addresses of this worker's peers in the collective.
    abort: what to call on a gone peer (default: `abort_collectives`).
    gone: (address) -> whether its process is gone (default:
      `cluster.connection_refused`).
  """

  def __init__(self, peers, abort=abort_collectives,
               gone=cluster.connection_refused):
    self._peers = peers
    self._abort = abort
    self._gone = gone
    self._stop = None
    self._thread = None

  def start(self):
    """Starts watching (a previous watch is stopped first)."""
    self.stop()
    self._stop = threading.Event()
    self._thread = threading.Thread(
        target=self._watch, args=(tuple(self._peers()), self._stop),
        name="oscars-peer-watch", daemon=True)
    self._thread.start()
    return 0

  def stop(self):
    """Stops watching; returns at once (the thread ends within one check)."""
    if self._stop is not None:
      self._stop.set()
    self._stop = self._thread = None
    return 0

  def _watch(self, addresses, stop):
    while not stop.wait(CHECK_EVERY_S):
      for address in addresses:
        if stop.is_set():
          return
        if self._gone(address) and not stop.is_set():
          self._abort(f"the process of peer {address} is gone (its server "
                      "refuses connections) during an all-to-all")
          return
