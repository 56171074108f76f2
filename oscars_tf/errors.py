"""Errors raised for user mistakes and cluster faults, with clear messages."""

# A worker process that ends on an uncaught WorkerLostError exits with this
# code (sysexits' EX_TEMPFAIL): its collectives failed because a peer was
# lost, so a restart of the job can go on (oscars-launch does it).
PEER_LOST_EXIT_CODE = 75


class OscarsError(RuntimeError):
  """Base class of the errors oscars_tf raises on purpose."""


class ClusterConfigError(OscarsError, ValueError):
  """TF_CONFIG or a cluster resolver describes an unusable cluster."""


class WorkerMismatchError(OscarsError):
  """Workers disagree on what they train (model, schedule, dtypes)."""


class WorkerLostError(OscarsError):
  """A peer died, stalled or left before a planned averaging point."""


class PeerTimeoutError(WorkerLostError):
  """A peer did not reach a planned averaging point in time."""


class WorkerStartError(OscarsError):
  """A worker's command could not be started (not found, not executable)."""
