"""oscars-launch across nodes: its `nodes` flags, their checks, and the
rendezvous that gives this node's workers the job's whole cluster.

One command per node, no ssh, as torchrun does it:

    oscars-launch --nnodes N --node_rank i --rendezvous HOST:PORT \\
        --num_workers K -- CMD...

Node 0 serves the rendezvous on HOST:PORT (tools/rendezvous.py); every
node then starts its own K workers (K may differ between nodes) with the
global TF_CONFIG. With --nnodes=1 (the default) none of this applies.
Imports no TensorFlow.
"""

import os
import sys

from absl import app
from absl import flags

from oscars_tf.tools import job_layout
from oscars_tf.tools import netns
from oscars_tf.tools import node_channel
from oscars_tf.tools import node_decisions
from oscars_tf.tools import rendezvous

FLAG_NAMES = ("nnodes", "node_rank", "rendezvous", "job_id", "join_timeout")
# Launcher flags that do not work across nodes: (name, why).
_SINGLE_NODE_ONLY = (
    ("num_ps", "ParameterServerStrategy clusters"),
    ("coordinator", "a coordinator task"),
    ("bandwidth", "EMULATED per-worker links (--network=emulated)"),
)


def define_flags(fv):
  """SECTIONS' nodes: the launch of one job on several nodes."""
  flags.DEFINE_integer(
      "nnodes", 1, "Nodes (machines) of the job. With N > 1, run the same "
      "command once on every node, each with its own --node_rank, and "
      "--rendezvous; each node starts --num_workers workers (which may "
      "differ between nodes), and every worker's TF_CONFIG lists the "
      "workers of all nodes, node 0's first (worker 0, the chief, is on "
      "node 0). One job: a failure on any node stops every node, and node "
      "0's --restarts and --lost_peer_restarts restart them all together; "
      "a signal to any node's launcher stops the whole job. --cpu_limit "
      "lists this node's workers; --simulate_step_time indexes the job's "
      "(global) workers. Not with ps tasks, a coordinator task or "
      "--bandwidth; --network=auto means host.", lower_bound=1,
      **fv)
  flags.DEFINE_integer("node_rank", 0, "This node's rank, 0..--nnodes-1 "
                       "(Slurm: $SLURM_NODEID). Node 0 serves the "
                       "rendezvous.", lower_bound=0, **fv)
  flags.DEFINE_string(
      "rendezvous", "", "With --nnodes > 1: HOST:PORT, an address of node "
      "0 that every node reaches (IPv4). Node 0 listens there, and only "
      "there, until all nodes have joined; the others connect, retrying "
      "until it answers. Unauthenticated: anyone who reaches it may join, "
      "so use a private network. A node's workers bind --host if given, "
      "else the address its connection came from (node 0's: HOST).", **fv)
  flags.DEFINE_string(
      "job_id", "", "With --nnodes > 1: a name every node of the job "
      "gives; node 0 refuses a node with another (or another --nnodes). "
      "Empty: $SLURM_JOB_ID if set, else --rendezvous as given (then every "
      "node must spell it the same).", **fv)
  flags.DEFINE_float(
      "join_timeout", 300.0, "With --nnodes > 1: seconds node 0 waits for "
      "the other nodes to join (then it fails, naming the missing ranks), "
      "and a node for node 0's answer.", lower_bound=1e-3, **fv)


def check_flags(fv):
  """With --nnodes > 1, the (host, port) of --rendezvous; None with 1.
  app.UsageError, one line, for flags that cannot work together."""
  if fv.nnodes == 1:
    # Given on one node they would do nothing: the strategy's own
    # --join_timeout, say, belongs after `--`, with the worker's flags.
    given = ([n for n in ("node_rank", "rendezvous") if fv[n].value] +
             [n for n in ("job_id", "join_timeout") if fv[n].present])
    if given:
      raise app.UsageError(f"--{given[0]}: needs --nnodes > 1 (a worker's "
                           "flags go after `--`)")
    return None
  if not fv.rendezvous:
    raise app.UsageError(f"--nnodes={fv.nnodes}: needs --rendezvous "
                         "HOST:PORT, an address of node 0")
  if fv.node_rank >= fv.nnodes:
    raise app.UsageError(f"--node_rank={fv.node_rank}: not in 0.."
                         f"{fv.nnodes - 1} (--nnodes={fv.nnodes})")
  for name, what in _SINGLE_NODE_ONLY:
    if fv[name].value:
      raise app.UsageError(f"--{name}: {what} do not work across nodes "
                           f"(--nnodes={fv.nnodes})")
  if fv.network in ("isolated", "emulated"):
    raise app.UsageError(
        f"--network={fv.network}: the other nodes must reach this node's "
        f"workers (--nnodes={fv.nnodes}); use --network=host on a private "
        "network")
  try:
    host, port = rendezvous.parse_address(fv.rendezvous)
    address = (rendezvous.ipv4(host), port)
  except ValueError as e:
    raise app.UsageError(f"--rendezvous: {e}") from None
  if fv["host"].present:
    try:
      netns.check_listens(fv.host)  # says --host=...
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  if address[0] == "0.0.0.0":
    raise app.UsageError("--rendezvous: give node 0's address that the "
                         "other nodes reach, not 0.0.0.0")
  if address[0].startswith("127.") and host not in (address[0], "localhost"):
    # Debian-style /etc/hosts maps a machine's own name to 127.0.1.1:
    # node 0 would listen there, out of the other machines' reach.
    _say(f"WARNING: --rendezvous={fv.rendezvous} resolves to the loopback "
         f"address {address[0]} here: nodes on other machines cannot reach "
         "it. Give node 0's address on the network the nodes share.")
  if fv.network == "auto":
    _say(f"WARNING: --nnodes={fv.nnodes}: the workers run on this "
         "machine's network, where TensorFlow's unauthenticated gRPC "
         "servers listen on all interfaces (0.0.0.0), as does the "
         "rendezvous on its address. Use a private network, or pass "
         "--network=host to silence this.")
  return address


def job_id(fv, environ=None):
  """--job_id, or its default: $SLURM_JOB_ID, else --rendezvous."""
  environ = os.environ if environ is None else environ
  return fv.job_id or environ.get("SLURM_JOB_ID") or fv.rendezvous


def meet(fv, address, stop=None):
  """The rendezvous of this node (the launcher's flags `fv`): the job's
  channel, a node_channel.Hub on node 0 (its --restarts and
  --lost_peer_restarts decide for the job), a Link elsewhere, its
  `cluster` the job's. rendezvous.RendezvousError (one line) when it
  fails."""
  host = fv.host if fv["host"].present else None
  ports = job_layout.free_ports(fv.num_workers, "0.0.0.0")
  mine = rendezvous.hello(job_id(fv), fv.nnodes, fv.node_rank,
                          fv.num_workers, ports, host)
  if fv.node_rank == 0:
    listener = rendezvous.listen(*address)
    mine["host"] = host or address[0]
    _say(f"node 0 of {fv.nnodes}: waiting up to {fv.join_timeout:g} s for "
         f"the other nodes at {address[0]}:{address[1]}.")
    cluster, conns = rendezvous.serve(listener, mine, fv.join_timeout,
                                      stop=stop, say=_say, keep=True)
    channel = node_channel.Hub(
        conns, cluster, node_decisions.Budgets(fv.restarts,
                                               fv.lost_peer_restarts), _say)
  else:
    cluster, conn = rendezvous.join(address, mine, fv.join_timeout,
                                    stop=stop, keep=True)
    channel = node_channel.Link(conn, cluster, fv.node_rank, _say)
  _say(rendezvous.describe(cluster, fv.node_rank) + ".")
  return channel


def _say(line):
  print(f"oscars-launch: {line}", file=sys.stderr)
