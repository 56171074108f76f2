"""Errors raised for user mistakes and cluster faults, with clear messages."""


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
