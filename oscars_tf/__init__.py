"""oscars_tf: adaptive local SGD for TensorFlow clusters of uneven speed.

The public API is exported here and only here.
"""

import importlib

from oscars_tf import schedules
from oscars_tf.errors import ClusterConfigError
from oscars_tf.errors import OscarsError
from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.errors import WorkerMismatchError
from oscars_tf.errors import WorkerStartError

# Modules the docs name as `oscars_tf.<module>.<name>`, and errors defined
# beside what raises them: imported when first asked for.
_MODULES = ("checkpoint", "cluster", "data")
_ERRORS = {"DatasetUnavailableError": "oscars_tf.data",
           "SavedStateError": "oscars_tf.distribute.saved_files"}


def __getattr__(name):
  # Lazy so that TensorFlow-free parts (the launcher, the policy) can be
  # imported without paying for, or needing, TensorFlow.
  if name in _MODULES:
    return importlib.import_module(f"oscars_tf.{name}")
  if name in _ERRORS:
    return getattr(importlib.import_module(_ERRORS[name]), name)
  if name == "OscarsStrategy":
    # pylint: disable=g-import-not-at-top
    from oscars_tf import frontends
    from oscars_tf.distribute import strategy
    if frontends.install not in strategy.CREATION_HOOKS:
      strategy.CREATION_HOOKS.append(frontends.install)
    return strategy.OscarsStrategy
  raise AttributeError(f"module 'oscars_tf' has no attribute {name!r}")

__all__ = ["OscarsStrategy", "schedules", "checkpoint", "cluster", "data",
           "OscarsError", "ClusterConfigError", "DatasetUnavailableError",
           "PeerTimeoutError", "SavedStateError", "WorkerLostError",
           "WorkerMismatchError", "WorkerStartError"]
__version__ = "0.1.0"
