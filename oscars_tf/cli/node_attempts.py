"""oscars-launch's attempts on one node of a job on several nodes.

Each node runs its own workers (worker_processes.Job) and hears node 0
over the rendezvous connection (tools/node_channel.py): a failure on any
node stops every node's attempt, node 0 decides for the job (restart on
every node, or end; tools/node_decisions.py) and every node follows. A
signal to any node's launcher stops the whole job. The single-node loop
is launch_attempts.py. Imports no TensorFlow.
"""

import sys
import time

from oscars_tf.errors import WorkerStartError
from oscars_tf.tools import emulation
from oscars_tf.tools import node_decisions
from oscars_tf.tools import rendezvous
from oscars_tf.tools.job_layout import free_ports
from oscars_tf.tools.worker_processes import Job


class StopOrder:
  """Job.wait's `interrupt` on a node: this launcher's signal, or node 0's
  order to stop the attempt (its signal number)."""

  def __init__(self, signals, channel):
    self._signals, self._channel = signals, channel

  @property
  def received(self):
    if self._signals.received:
      return self._signals.received
    order = self._channel.stop_order()
    return order[0] if order else None

  @property
  def count(self):
    return self._signals.count


def run(command, env, deadline, signals, limits, channel, flag_values):
  """Runs this node's attempts of the job. `channel`: a node_channel.Hub
  on node 0, a Link elsewhere (multi_node.meet). Returns (the last
  attempt's Job, or None where its workers could not start; node 0's
  node_decisions.Decision)."""
  fv = flag_values
  while True:
    first, configs = rendezvous.node_configs(channel.cluster, fv.node_rank)
    try:
      job = Job(command, fv.num_workers, fv.host,
                env=dict(env, OSCARS_LAUNCH_ATTEMPT=str(channel.attempt)),
                configs=configs, first_worker=first,
                **emulation.job_arguments(fv.num_workers, 0, {}, limits,
                                          first_worker=first))
    except WorkerStartError as e:
      # A failure of the job, not a node leaving it: node 0 must hear it
      # (a closed connection would read as a lost node, and the job go on
      # without this one).
      _say(f"error: {e}")
      job, report = None, node_decisions.unstarted(e)
    else:
      left = (None if deadline is None else
              max(deadline - time.monotonic(), 0.01))
      codes, failed = job.wait(left, fv.grace_seconds,
                               keep_going=fv.keep_going,
                               interrupt=StopOrder(signals, channel))
      local = signals.received
      if local and fv.node_rank:
        channel.tell_signal(local)  # node 0 stops the others
        return job, None
      report = node_decisions.report(
          job, codes, failed, stopped=failed == "signal" and not local)
    decision = channel.ended(report, free_ports(fv.num_workers, "0.0.0.0"),
                             lambda: signals.received, fv.grace_seconds)
    if not decision.restart:
      return job, decision
    kind = "lost-peer restart" if decision.lost_peer else "restart"
    _say(f"{_whose(fv)}{decision.why} (attempt {channel.attempt}, a "
         f"{kind}).")


def exit_code(job, decision, signals, flag_values):
  """Says on stderr how this node's part ended; the launcher's exit code."""
  fv = flag_values
  if signals.received:
    late = (f"; SIGKILL to worker(s) {job.killed}, still running "
            f"{fv.grace_seconds:g}s after it" if job and job.killed else "")
    also = "" if fv.node_rank == 0 else "; told node 0, which stops the others"
    _say(f"got {signals.received.name}; forwarded it to this node's "
         f"workers and stopped them{late}{also}.")
    return 128 + signals.received
  spread = job.exit_spread() if job else None
  apart = "" if spread is None else f" (their exits {spread:.2f} s apart)"
  if decision.code == 0:
    _say(f"all {fv.num_workers} workers of node {fv.node_rank} "
         f"finished{apart}.")
  _say(f"{_whose(fv)}{decision.why}")
  return decision.code


def _whose(fv):
  """Node 0 decides for the job; the others say it is its word."""
  return "" if fv.node_rank == 0 else "node 0 says: "


def _say(line):
  print(f"oscars-launch: {line}", file=sys.stderr)
