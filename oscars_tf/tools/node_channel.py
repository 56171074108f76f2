"""The nodes of a multi-node job after the rendezvous: one job, not N.

Each node keeps its rendezvous connection to node 0 open for the whole
job, and node 0 (the `Hub`) speaks for the job on it; the other nodes
hold a `Link`. Messages are newline-terminated JSON objects, as in the
rendezvous (tools/rendezvous.py):

    node i -> node 0:  {"ended": A, "report": R, "ports": [K ints]}
                         its workers of attempt A are all done (R:
                         node_decisions.report), and its ports for the next
                       {"signal": S}
                         its launcher got signal S (then it leaves)
    node 0 -> node i:  {"stop": A, "signal": S, "why": "..."}
                         stop your workers of attempt A with signal S
                       {"next": A + 1, "cluster": C, "why": "...",
                        "lost_peer": true or false}
                         start attempt A + 1 with cluster C
                       {"end": CODE, "why": "..."}
                         the job is over: exit with CODE

A node's attempt that fails (or a launcher that gets a signal) makes node 0
stop every node's attempt; once every live node has said "ended", node 0
decides (node_decisions.decide) and tells them all. A closed connection is
a gone launcher (killed by SIGKILL, or its machine lost): node 0 goes on
without that node (its workers died with their launcher, and the others
drop them as any lost worker); a node that loses node 0 stops its workers
and exits 1, since the chief is on node 0. Every wait is bounded or ends
with a signal or a closed connection. Imports no TensorFlow.
"""

import json
import signal
import socket
import threading
import time

from oscars_tf.tools import node_decisions
from oscars_tf.tools import rendezvous

MAX_LINE = 1 << 20  # bytes: a cluster of thousands of workers fits
POLL = 0.1  # seconds between looks at a local signal while waiting
_NODE_0_GONE = "node 0's launcher is gone (the chief with it)"


def _send(conn, lock, message):
  """Sends `message`; whether it went (a gone peer is not an error)."""
  try:
    with lock:
      conn.sendall(json.dumps(message).encode() + b"\n")
    return True
  except OSError:
    return False


def _read_messages(conn, on_message, on_close):
  """Calls on_message(dict) per line of `conn` until it closes (or sends
  junk), then on_close(). Runs on a thread of its own."""
  data = b""
  try:  # a connection closed before this thread ran: EBADF, an end too
    conn.settimeout(None)
    while True:
      chunk = conn.recv(65536)
      if not chunk:
        break
      data += chunk
      while b"\n" in data:
        line, data = data.split(b"\n", 1)
        on_message(json.loads(line))
      if len(data) > MAX_LINE:
        break
  except (OSError, ValueError):
    pass
  on_close()


def _start(target, *args):
  t = threading.Thread(target=target, args=args, daemon=True)
  t.start()
  return t


class Link:
  """Node i's side (i > 0): reads node 0's orders on a thread, answers."""

  def __init__(self, conn, cluster, node_rank, say):
    self.cluster, self.node_rank, self._say = cluster, node_rank, say
    self._conn, self._lock = conn, threading.Lock()
    self._cv = threading.Condition()
    self.attempt = 0
    self._stop = None  # (signal, why) for the current attempt
    self._word = None  # node 0's "next" or "end" for the current attempt
    self._gone = False  # node 0's connection closed
    self._thread = _start(_read_messages, conn, self._take, self._closed)

  def _take(self, message):
    with self._cv:
      if "next" in message:  # a stop of the next attempt may follow
        self.attempt, self._stop = message["next"], None
        self.cluster = message["cluster"]
        self._word = message
      elif "end" in message:
        self._word = message
      elif message.get("stop") == self.attempt and self._stop is None:
        self._stop = (message["signal"], message["why"])
      self._cv.notify_all()

  def _closed(self):
    with self._cv:
      self._gone = True
      self._stop = self._stop or (int(signal.SIGTERM), _NODE_0_GONE)
      self._cv.notify_all()

  def stop_order(self):
    """(signal number, why) once node 0 ordered this attempt stopped."""
    with self._cv:
      return self._stop

  def tell_signal(self, number):
    """This launcher got signal `number`: node 0 stops the job."""
    _send(self._conn, self._lock, {"signal": int(number)})

  def ended(self, report, ports, local_signal, grace=None):
    """Tells node 0 this attempt is over here and waits for its word:
    a node_decisions.Decision; a restart's cluster is then `cluster`.
    `local_signal()`: a signal this launcher got while waiting (then it
    tells node 0, and ends at once). `grace`: node 0's business."""
    del grace
    _send(self._conn, self._lock, {"ended": self.attempt, "report": report,
                                   "ports": list(ports)})
    with self._cv:
      while self._word is None and not self._gone and not local_signal():
        self._cv.wait(POLL)
      word, self._word = self._word, None
    if word is None and self._gone:
      return node_decisions.Decision(False, 1, f"{_NODE_0_GONE}; stopped "
                                     "this node's workers.")
    if word is None:
      sig = int(local_signal())
      self.tell_signal(sig)
      return node_decisions.Decision(False, 128 + sig, "")
    if "next" in word:
      return node_decisions.Decision(True, 0, word["why"],
                                     word.get("lost_peer", False))
    return node_decisions.Decision(False, word["end"], word["why"])

  def close(self):
    _close(self._conn)


class Hub:
  """Node 0's side: one reader thread per node; stops, gathers and
  decides for the job (node_decisions)."""

  def __init__(self, conns, cluster, budgets, say, after_chief=60.0):
    self.cluster, self._say, self._budgets = cluster, say, budgets
    self._after_chief = after_chief
    self._conns = dict(conns)  # rank -> socket, of nodes 1..N-1
    self._lock = threading.Lock()  # one sender at a time
    self._cv = threading.Condition()
    self.attempt = 0
    self.gone = set()  # every node whose launcher left, for the job
    self._gone_now = set()  # of them, those that left in this attempt
    self._reports, self._ports = {}, {}
    self._stop = None  # (signal, why), once this attempt is to stop
    self._signal_from = None  # (rank, signal) of a launcher's signal
    self._ended = False  # the job's end told: the nodes close, as they may
    for rank, conn in self._conns.items():
      _start(_read_messages, conn,
             lambda m, r=rank: self._take(r, m),
             lambda r=rank: self._closed(r))

  def _take(self, rank, message):
    with self._cv:
      if message.get("ended") == self.attempt and "report" in message:
        self._reports[rank] = message["report"]
        self._ports[rank] = message.get("ports")
        if message["report"]["outcome"] != node_decisions.FINISHED:
          self._order_stop(int(signal.SIGTERM),
                           f"node {rank}'s attempt "
                           f"{message['report']['outcome']}")
      elif "signal" in message:
        self._signal_from = self._signal_from or (rank, message["signal"])
        self._leave(rank)
        self._order_stop(message["signal"], f"node {rank}'s launcher got "
                         f"signal {message['signal']}")
      self._cv.notify_all()

  def _closed(self, rank):
    with self._cv:
      if rank not in self.gone and not self._ended:
        self._leave(rank)
        self._say(f"node {rank}'s launcher is gone (its connection "
                  "closed): its workers are lost; the others go on.")
      self._cv.notify_all()

  def _leave(self, rank):
    """Under the lock: node `rank`'s launcher left the job. Only this
    attempt's departures decide it (a lost peer's restart); a node gone
    in an earlier one is out of the job, not the cause of this end."""
    self.gone.add(rank)
    self._gone_now.add(rank)

  def _order_stop(self, number, why):
    """Under the lock: stop every node's attempt (once per attempt)."""
    if self._stop is not None:
      return
    self._stop = (number, why)
    self._say(f"{why}: stopping every node's workers.")
    for rank, conn in self._conns.items():
      if rank not in self.gone:
        _send(conn, self._lock, {"stop": self.attempt, "signal": number,
                                 "why": why})

  def stop_order(self):
    with self._cv:
      return self._stop

  def tell_signal(self, number):
    with self._cv:
      self._signal_from = self._signal_from or (0, int(number))
      self._order_stop(int(number), f"node 0's launcher got signal {number}")

  def ended(self, report, ports, local_signal, grace):
    """Node 0's attempt is over: stops the others if it failed, gathers
    every live node's report (bounded), decides and tells every node.
    Returns the node_decisions.Decision; `cluster` is the next one's."""
    with self._cv:
      self._reports[0], self._ports[0] = report, list(ports)
      if report["outcome"] == node_decisions.SIGNAL and local_signal():
        self._signal_from = self._signal_from or (0, int(local_signal()))
      if report["outcome"] != node_decisions.FINISHED:
        self._order_stop(*(self._stop or (
            int(local_signal() or signal.SIGTERM),
            f"node 0's attempt {report['outcome']}")))
      self._gather(local_signal, grace)
      decision = node_decisions.decide(
          dict(self._reports), set(self._gone_now), self._budgets,
          self._signal_from, total=len(self.cluster["workers"]))
      self._tell(decision)
      return decision

  def _gather(self, local_signal, grace):
    """Under the lock: waits for a report from every live node. Once
    stopping, they come within `grace` (+ a margin), else a node is
    counted gone; a finished chief waits `after_chief` s, then stops the
    rest (as Job.wait does on one node)."""
    started = time.monotonic()
    while True:
      missing = set(self._conns) - set(self._reports) - self.gone
      if not missing:
        return
      if local_signal() and self._signal_from is None:
        self._signal_from = (0, int(local_signal()))
        self._order_stop(int(local_signal()), "node 0's launcher got "
                         f"signal {int(local_signal())}")
      waited = time.monotonic() - started
      if self._stop is None and waited > self._after_chief:
        self._order_stop(int(signal.SIGTERM),
                         f"node(s) {sorted(missing)} still ran "
                         f"{self._after_chief:g} s after node 0 finished")
        started = time.monotonic()
      elif self._stop is not None and waited > grace + 30:
        self._say(f"node(s) {sorted(missing)} did not report within "
                  f"{grace + 30:g} s of the stop; counted as gone.")
        for rank in missing:
          self._leave(rank)
        return
      self._cv.wait(POLL)

  def _tell(self, decision):
    """Under the lock: sends the decision to every live node; a restart's
    cluster is laid out from the ports each node gave."""
    live = [r for r in sorted(self._conns) if r not in self.gone]
    if decision.restart:
      hellos = [dict(node, ports=self._ports[node["node_rank"]])
                for node in self.cluster["nodes"]
                if node["node_rank"] == 0 or node["node_rank"] in live]
      self.cluster = rendezvous.build_cluster(
          [dict(h, job_id=self.cluster["job_id"]) for h in hellos])
      self.attempt += 1
      message = {"next": self.attempt, "cluster": self.cluster,
                 "why": decision.why, "lost_peer": decision.lost_peer}
    else:
      message = {"end": decision.code, "why": decision.why}
      self._ended = True
    for rank in live:
      _send(self._conns[rank], self._lock, message)
    self._reports, self._ports, self._stop = {}, {}, None
    self._gone_now = set()

  def close(self):
    for conn in self._conns.values():
      _close(conn)


def _close(conn):
  """Closes `conn` so that its reader thread's recv returns (a bare close
  would not wake it) and the peer sees the end."""
  try:
    conn.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  conn.close()

