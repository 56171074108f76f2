"""A multi-node job's rendezvous: the nodes meet, node 0 lays out the cluster.

Every node runs `oscars-launch --nnodes N --node_rank i --rendezvous
HOST:PORT`. Node 0 listens on HOST:PORT (and nowhere else), the others
connect, retrying until it answers. The protocol is one newline-terminated
JSON object each way over one TCP connection per node:

    node i -> node 0:  {"oscars_rendezvous": 1, "job_id": ..., "nnodes": N,
                        "node_rank": i, "num_workers": K, "ports": [K ints],
                        "host": "10.0.0.2" or null}
    node 0 -> node i:  {"cluster": CLUSTER}  or  {"error": "one line"}

A node proposes its workers' ports (free on that machine: only it can
check) and the address they bind ("host"; null: the address node 0 sees
its connection come from). Node 0 checks each hello against its own (same
protocol, job id and node count; a rank in 1..N-1 not yet taken), refuses
a bad one with an error line and keeps waiting; once all N nodes are in it
numbers the workers, node 0's first (worker 0, the chief, is on node 0),
then node 1's, and so on (`build_cluster`), and sends CLUSTER to every
node:

    {"job_id": ..., "workers": ["host:port", ... in global order],
     "nodes": [{"node_rank": r, "host": ..., "first_worker": g,
                "num_workers": K}, ... by rank]}

Every wait is bounded: node 0 by its timeout for the N hellos (then one
error naming the missing ranks), a node by its timeout for an answer. There
is no authentication: anyone who can reach HOST:PORT during the rendezvous
can join as a node, so run it on a private network. Imports no TensorFlow.
"""

import json
import select
import socket
import time

from oscars_tf.tools.job_layout import tf_configs

PROTOCOL = 1
MAX_LINE = 1 << 16  # bytes of one message
POLL = 0.25  # seconds between checks of `stop` while waiting
HELLO_SECONDS = 5.0  # for a connected node to send its hello


class RendezvousError(Exception):
  """The rendezvous failed; the message is one line."""


class Stopped(RendezvousError):
  """`stop()` said so (the launcher got a signal) before the end."""


def hello(job_id, nnodes, node_rank, num_workers, ports, host=None):
  """A node's hello: who it is, its workers' ports and address."""
  return {"oscars_rendezvous": PROTOCOL, "job_id": job_id, "nnodes": nnodes,
          "node_rank": node_rank, "num_workers": num_workers,
          "ports": list(ports), "host": host}


def check_hello(message, own, joined):
  """Why node 0 (hello `own`) refuses `message`, a node's hello, or None.
  `joined`: the ranks already in."""
  if not isinstance(message, dict):
    return "not a hello"
  if message.get("oscars_rendezvous") != PROTOCOL:
    return (f"rendezvous protocol {message.get('oscars_rendezvous')!r}, "
            f"node 0 speaks {PROTOCOL} (run the same oscars_tf everywhere)")
  rank, k = message.get("node_rank"), message.get("num_workers")
  if message.get("job_id") != own["job_id"]:
    return (f"node {rank} has job id {message.get('job_id')!r}, node 0 has "
            f"{own['job_id']!r} (--job_id)")
  if message.get("nnodes") != own["nnodes"]:
    return (f"node {rank} has --nnodes={message.get('nnodes')}, node 0 "
            f"has --nnodes={own['nnodes']}")
  if not isinstance(rank, int) or not 0 < rank < own["nnodes"]:
    return (f"--node_rank={rank} is not in 1..{own['nnodes'] - 1} (node 0 "
            "serves the rendezvous)")
  if rank in joined:
    return f"node {rank} has already joined"
  ports = message.get("ports")
  if (not isinstance(k, int) or k < 1 or not isinstance(ports, list) or
      len(ports) != k or
      not all(isinstance(p, int) and 0 < p < 65536 for p in ports)):
    return f"node {rank}: need num_workers >= 1 and one port per worker"
  host = message.get("host")
  if host is not None and (not isinstance(host, str) or not host):
    return f"node {rank}: bad host {host!r}"
  return None


def build_cluster(hellos):
  """The cluster from every node's hello, each with its "host" filled in.

  Workers are numbered node by node in rank order: node 0's first, so
  worker 0, the chief, is on node 0. ValueError where two workers would
  share an address.
  """
  workers, nodes = [], []
  job_ids = {h["job_id"] for h in hellos}
  for h in sorted(hellos, key=lambda h: h["node_rank"]):
    nodes.append({"node_rank": h["node_rank"], "host": h["host"],
                  "first_worker": len(workers),
                  "num_workers": h["num_workers"]})
    workers.extend(f"{h['host']}:{p}" for p in h["ports"])
  ranks = [n["node_rank"] for n in nodes]
  # A restart leaves out the nodes whose launcher is gone: node 0 (the
  # chief's) and distinct ranks are what must hold.
  if (not ranks or ranks[0] != 0 or len(set(ranks)) != len(ranks) or
      len(job_ids) != 1):
    raise ValueError(f"need one hello per node rank, node 0's among them, "
                     f"of one job; have ranks {ranks}, job ids {job_ids}")
  if len(set(workers)) != len(workers):
    twice = sorted({w for w in workers if workers.count(w) > 1})
    raise ValueError(f"two workers at {twice[0]}: give each node its own "
                     "--host, or run the nodes on different machines")
  return {"job_id": job_ids.pop(), "workers": workers, "nodes": nodes}


def node_configs(cluster, node_rank):
  """(global index of the node's first worker, one TF_CONFIG per worker of
  node `node_rank`): every worker of every node in the cluster, each task
  index global."""
  node = _node(cluster, node_rank)
  hosts, ports = zip(*(w.rsplit(":", 1) for w in cluster["workers"]))
  configs = tf_configs(len(hosts), ports=[int(p) for p in ports],
                       hosts=list(hosts))
  first = node["first_worker"]
  return first, configs[first:first + node["num_workers"]]


def _node(cluster, node_rank):
  return next(n for n in cluster["nodes"] if n["node_rank"] == node_rank)


def describe(cluster, node_rank):
  """One line: this node's workers in the cluster."""
  node = _node(cluster, node_rank)
  first, k = node["first_worker"], node["num_workers"]
  mine = f"worker {first}" if k == 1 else f"workers {first}-{first + k - 1}"
  chief = " (worker 0 is the chief)" if node_rank == 0 else ""
  return (f"node {node_rank} of {len(cluster['nodes'])}: {mine} of "
          f"{len(cluster['workers'])} at {node['host']}{chief}")


def parse_address(address):
  """(host, port) of "HOST:PORT"; ValueError, one line, if it is not one."""
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{address!r} is not HOST:PORT (e.g. node0:29400)")
  return host, int(port)


def ipv4(host):
  """The IPv4 address `host` resolves to; ValueError, one line, if none."""
  try:
    found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
  except (socket.gaierror, UnicodeError) as e:
    raise ValueError(f"{host} does not resolve to an IPv4 address "
                     f"({e})") from None
  return found[0][4][0]


def listen(host, port):
  """Node 0's listening socket, on `host`:`port` only (port 0: any)."""
  s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  try:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(64)
  except OSError as e:
    s.close()
    raise RendezvousError(f"cannot listen on {host}:{port} "
                          f"({e.strerror or e}); --rendezvous must be an "
                          "address of node 0") from None
  return s


def _send(conn, message):
  conn.sendall(json.dumps(message).encode() + b"\n")


def _read_line(conn, deadline, stop=None):
  """One message from `conn`, by `deadline` (time.monotonic()); raises
  socket.timeout past it, ConnectionError on a close, ValueError on junk,
  Stopped when `stop()`."""
  data = b""
  while b"\n" not in data:
    if stop is not None and stop():
      raise Stopped("stopped by a signal")
    left = deadline - time.monotonic()
    if left <= 0:
      raise socket.timeout("timed out")
    conn.settimeout(min(left, POLL))
    try:
      chunk = conn.recv(4096)
    except socket.timeout:
      continue
    if not chunk:
      raise ConnectionError("closed without a reply")
    data += chunk
    if len(data) > MAX_LINE:
      raise ValueError("message too long")
  return json.loads(data.split(b"\n", 1)[0])


def _take_hello(conn, peer, own, joined, stop=None):
  """Reads a connected node's hello; returns it with its host filled in,
  or the reason it is refused (the node is told)."""
  try:
    message = _read_line(conn, time.monotonic() + HELLO_SECONDS, stop)
  except (OSError, ValueError) as e:  # socket.timeout is an OSError
    return f"no hello from {peer} ({e})"
  reason = check_hello(message, own, joined)
  if reason is None:
    return dict(message, host=message["host"] or peer)
  try:
    _send(conn, {"error": reason})
  except OSError:
    pass
  return reason


def serve(listener, own, timeout, stop=None, say=None, keep=False):
  """Node 0's side: collects the other nodes' hellos on `listener` (see
  `listen`) for at most `timeout` seconds, sends them all the cluster, and
  returns it. `own`: node 0's hello, its host filled in. `say(line)`: told
  of each node refused (the node is told too). Closes `listener`.

  RendezvousError, naming the missing ranks, past `timeout`; Stopped when
  `stop()`. With `keep`, returns (cluster, {rank: connection}) instead,
  the connections open (tools/node_channel.py's Hub).
  """
  deadline = time.monotonic() + timeout
  hellos, conns = {0: own}, {}
  try:
    while True:
      for rank in [r for r, conn in conns.items() if _hung_up(conn)]:
        conns.pop(rank).close()
        del hellos[rank]
        if say is not None:
          say(f"node {rank} left before every node joined; it may join "
              "again")
      if len(hellos) == own["nnodes"]:
        break
      if stop is not None and stop():
        raise Stopped("stopped by a signal")
      left = deadline - time.monotonic()
      if left <= 0:
        missing = sorted(set(range(own["nnodes"])) - set(hellos))
        raise RendezvousError(
            f"node(s) {missing} of {own['nnodes']} did not join within "
            f"{timeout:g} s (joined: {sorted(hellos)})")
      listener.settimeout(min(left, POLL))
      try:
        conn, (peer, _) = listener.accept()
      except socket.timeout:
        continue
      taken = _take_hello(conn, peer, own, set(hellos), stop)
      if isinstance(taken, str):
        conn.close()
        if say is not None:
          say(f"refused a node from {peer}: {taken}")
        continue
      hellos[taken["node_rank"]] = taken
      conns[taken["node_rank"]] = conn
    try:
      cluster = build_cluster(list(hellos.values()))
    except ValueError as e:
      for conn in conns.values():
        _send_quietly(conn, {"error": str(e)})
      raise RendezvousError(str(e)) from None
    gone = [r for r, conn in sorted(conns.items())
            if not _send_quietly(conn, {"cluster": cluster})]
    if gone:
      raise RendezvousError(f"node(s) {gone} left before the cluster was "
                            "sent to them")
    if keep:
      kept, conns = conns, {}
      for conn in kept.values():
        keep_alive(conn)
      return cluster, kept
    return cluster
  finally:
    for conn in conns.values():
      conn.close()
    listener.close()


# A kept connection carries the job's stops and decisions for its whole
# run. A peer whose machine dies sends no FIN: TCP keepalive finds it
# within about KEEPALIVE_S (idle 30 s, then 6 probes 10 s apart) instead
# of the kernel's default of over two hours.
KEEPALIVE_S = 90


def keep_alive(conn):
  """Turns on TCP keepalive on `conn` (where the platform has it)."""
  conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
  for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10),
                      ("TCP_KEEPCNT", 6)):
    if hasattr(socket, name):
      conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
  return conn


def _hung_up(conn):
  """Whether a joined node's connection has closed (its launcher stopped,
  or gave up waiting): it sends nothing more before the cluster."""
  try:
    if not select.select([conn], [], [], 0)[0]:
      return False
    return conn.recv(1, socket.MSG_PEEK) == b""
  except OSError:
    return True


def _send_quietly(conn, message):
  """Sends `message`; whether it went."""
  try:
    conn.settimeout(HELLO_SECONDS)
    _send(conn, message)
    return True
  except OSError:
    return False


def join(address, message, timeout, stop=None, keep=False):
  """A node's side: connects to node 0 at `address` (host, port), retrying
  until it answers, sends hello `message` and returns the cluster node 0
  sends back, all within `timeout` seconds.

  RendezvousError (one line) when node 0 refuses this node, closes the
  connection or does not answer in time; Stopped when `stop()`. With
  `keep`, returns (cluster, the connection to node 0, still open).
  """
  deadline = time.monotonic() + timeout
  where = f"{address[0]}:{address[1]}"
  last = "no answer"
  while True:
    if stop is not None and stop():
      raise Stopped("stopped by a signal")
    left = deadline - time.monotonic()
    if left <= 0:
      raise RendezvousError(f"node 0 did not answer at {where} within "
                            f"{timeout:g} s (last try: {last})")
    try:
      conn = socket.create_connection(address, timeout=min(left, 2.0))
    except OSError as e:
      last = e.strerror or str(e)
      time.sleep(min(POLL * 2, max(deadline - time.monotonic(), 0)))
      continue
    try:
      cluster = _exchange(conn, message, deadline, where, timeout, stop)
    except BaseException:
      conn.close()
      raise
    if keep:
      return cluster, keep_alive(conn)
    conn.close()
    return cluster


def _exchange(conn, message, deadline, where, timeout, stop):
  """Sends the hello on `conn`, and returns node 0's cluster."""
  try:
    conn.settimeout(max(deadline - time.monotonic(), 0.01))
    _send(conn, message)
    reply = _read_line(conn, deadline, stop)
  except socket.timeout:
    raise RendezvousError(
        f"node 0 at {where} took the hello but sent no cluster within "
        f"{timeout:g} s (are all --nnodes={message['nnodes']} nodes "
        "started?)") from None
  except (OSError, ValueError) as e:
    raise RendezvousError(f"node 0 at {where}: {e}") from None
  if isinstance(reply, dict) and "error" in reply:
    raise RendezvousError(f"node 0 at {where} refused this node: "
                          f"{reply['error']}")
  if not isinstance(reply, dict) or "cluster" not in reply:
    raise RendezvousError(f"node 0 at {where} sent no cluster")
  return reply["cluster"]
