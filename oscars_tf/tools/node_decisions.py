"""What node 0 decides when an attempt of a multi-node job ends.

Each node's launcher watches only its own workers (worker_processes.Job).
When its workers are done it sums up the attempt in a `report` (plain
JSON: it crosses the network), and node 0, having every live node's
report, `decide`s for the whole job: start the next attempt on every node
(a restart), or end it with one exit code and one line saying why. The
rules are the single-node launcher's (launch_attempts.py), applied to
the workers of all nodes together:

  * a launcher that got a signal ends the job with 128 + its number;
  * every node finished (a lost worker, or a gone node, is not a failure):
    exit 0;
  * node 0's --timeout: exit 124;
  * a worker killed by a signal while the others averaged with it, whose
    survivors exited 75 (on any node: the death and the 75s are often on
    different nodes), is a lost peer: restarted within
    --lost_peer_restarts, then as any failure;
  * any other failure: restarted within --restarts, else exit 1.

A restart starts all live nodes again; a node whose launcher is gone is
left out of it (its workers died with it): a failure after such a loss is
taken as a lost peer (within --lost_peer_restarts), and the job resumes
on fewer workers, as after a drop. Imports no TensorFlow.
"""

import dataclasses
from typing import Optional

from oscars_tf.errors import PEER_LOST_EXIT_CODE
from oscars_tf.tools.worker_processes import describe_exit

# A report's outcomes: how one node's attempt ended.
FINISHED = "finished"  # every worker exited 0 or was lost
FAILED = "failed"  # a worker failed: the node stopped the others
STOPPED = "stopped"  # node 0 ordered it stopped (another node failed)
TIMEOUT = "timeout"  # --timeout
SIGNAL = "signal"  # the node's launcher got a signal


@dataclasses.dataclass(frozen=True)
class Decision:
  """Node 0's word on an ended attempt: `restart` (the next attempt on
  every live node) or the job's exit `code`; `why`, one line."""
  restart: bool
  code: int
  why: str
  lost_peer: bool = False  # a restart counted in --lost_peer_restarts


def report(job, codes, failed, stopped=False):
  """One node's attempt as plain JSON: `job` (a waited worker_processes.Job
  of this node), its `wait`'s (codes, failed); `stopped`: node 0 ordered
  it (so `failed` is "signal" without a signal here)."""
  del codes
  if stopped:
    outcome = STOPPED
  else:
    outcome = {None: FINISHED, "timeout": TIMEOUT,
               "signal": SIGNAL}.get(failed, FAILED)
  # Global worker indices: exits of those that ended by themselves.
  exits = {str(job.tasks[i][1]): c for i, c in job.exited.items()}
  cause = None
  if outcome == FAILED:
    cause = f"{job.name(failed)} {describe_exit(job.exited.get(failed))}"
  return {"outcome": outcome, "exits": exits, "cause": cause,
          "lost": sorted(job.tasks[i][1] for i in job.lost)}


def unstarted(error):
  """The report of a node whose workers could not start (`error`, a
  WorkerStartError): a failure, as a worker's would be."""
  return {"outcome": FAILED, "exits": {}, "lost": [],
          "cause": str(error).rstrip(".")}


@dataclasses.dataclass
class Budgets:
  """Restarts left: node 0's --restarts and --lost_peer_restarts."""
  restarts: int
  lost_peer_restarts: int


def decide(reports, gone, budgets, signal_from=None, total=None):
  """Node 0's Decision for an attempt. `reports`: node rank -> `report`
  of every node that sent one; `gone`: ranks whose launcher is gone;
  `budgets`: a Budgets, spent here when restarting; `signal_from`: (rank,
  signal number) of a launcher that got a signal, or None; `total`: the
  workers of the job (for the message)."""
  if signal_from is not None:
    rank, number = signal_from
    return Decision(False, 128 + number,
                    f"node {rank}'s launcher got signal {number}; stopped "
                    "every node's workers.")
  outcomes = {r: rep["outcome"] for r, rep in reports.items()}
  without = _without(gone)
  # Stopped without a failure anywhere: still running after node 0's
  # chief finished (Hub's after_chief), lost as on one node.
  if all(o in (FINISHED, STOPPED) for o in outcomes.values()):
    lost = sorted(i for rep in reports.values() for i in rep["lost"])
    also = f" (lost during training: worker(s) {lost})" if lost else ""
    late = sorted(r for r, o in outcomes.items() if o == STOPPED)
    also += (f" (node(s) {late} stopped: still running after node 0 "
             "finished)" if late else "")
    workers = "all workers" if total is None else f"all {total} workers"
    return Decision(False, 0, f"{workers} of every node{without} "
                    f"finished{also}.")
  if TIMEOUT in outcomes.values():
    return Decision(False, 124, "the job ran past node 0's --timeout; "
                    "stopped every node's workers.")
  cause = _cause(reports)
  # A gone node's workers died with its launcher: a lost peer if inside a
  # collective, and the job goes on without them, as after a drop.
  if (lost_a_peer(reports) or gone) and budgets.lost_peer_restarts > 0:
    budgets.lost_peer_restarts -= 1
    return Decision(True, 0, f"{cause}: a lost peer; restarting every "
                    f"node's workers{_without(gone)} from the newest saved "
                    "state.", lost_peer=True)
  if gone:
    return Decision(False, 1, f"{cause}; no restart: node(s) "
                    f"{sorted(gone)} left the job (launcher gone).")
  if budgets.restarts > 0:
    budgets.restarts -= 1
    return Decision(True, 0, f"{cause}; restarting every node's workers.")
  return Decision(False, 1, f"{cause}; stopped every node's workers.")


def lost_a_peer(reports):
  """Whether the attempt ended only because a worker was killed by a
  signal inside a collective: some worker died (on any node), some
  survivor exited 75, and every other exit was 0 or 75 (see
  Job.lost_a_peer, the same rule on one node)."""
  exits = [c for rep in reports.values() for c in rep["exits"].values()]
  return (any(c < 0 for c in exits) and PEER_LOST_EXIT_CODE in exits and
          all(c in (0, PEER_LOST_EXIT_CODE) or c < 0 for c in exits))


def _cause(reports) -> Optional[str]:
  """The first failure, by node rank: "node 1: worker 3 exited with code
  1"; a node's "stopped" is not a cause."""
  for rank in sorted(reports):
    rep = reports[rank]
    if rep["outcome"] == FAILED:
      return f"node {rank}: {rep['cause']}"
  return "a node's attempt failed"


def _without(gone):
  return f" but node(s) {sorted(gone)} (launcher gone)" if gone else ""
