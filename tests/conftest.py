"""Test-process setup: two logical CPU devices, quiet TensorFlow logs, the
benchmarks' helper modules importable, and Keras's optional imports hidden
in this process and every process it starts (startup/sitecustomize.py).

Logical devices must be configured before TensorFlow's runtime starts, so it
happens here, before any test module runs an op.
"""

import importlib.util
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.pop("TF_CONFIG", None)

# The tests share the benchmarks' job helper (benchmarks/job_log.py) and
# import it as the benchmarks do. Last on the path: nothing of the tests'
# own is shadowed. (Under Bazel, //benchmarks:helpers puts it on the path
# too.)
sys.path.append(os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "benchmarks"))

# Before TensorFlow's import here, and (PYTHONPATH) in every child: workers,
# the launcher, examples and benchmarks.
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [STARTUP] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                  if p and p != STARTUP])


def bare_env(**extra):
  """A child's whole environment, for tests that run a script as a user
  with nothing set would: the repository and the startup hook on the path."""
  repo = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
  return {"PYTHONPATH": os.pathsep.join([repo, STARTUP]),
          "PATH": "/usr/bin:/bin", **extra}


_spec = importlib.util.spec_from_file_location(
    "oscars_test_startup", os.path.join(STARTUP, "sitecustomize.py"))
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

import tensorflow as tf  # noqa: E402  (after the start-up hooks above)

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

# Modules whose tests start real processes (workers over gRPC, the launcher,
# a browser): the `slow` tier. `pytest -m "not slow"` runs the rest (unit,
# protocol and single-process tests) as the edit-test loop.
SLOW_MODULES = frozenset({
    "test_adaptive", "test_benchmark_smoke", "test_cli_help",
    "test_control_plane_tf", "test_coordinator", "test_cpu_limit_from_ready",
    "test_cpu_limits",
    "test_faults", "test_fit_end_together", "test_forkserver", "test_frontends",
    "test_frontends_keras3", "test_launch", "test_launch_emulated",
    "test_launch_ps", "test_multi_node", "test_multiworker", "test_netns",
    "test_node_launchers", "test_observability", "test_overlap_multiworker",
    "test_poison", "test_random_faults", "test_recovery",
    "test_scale_sixteen", "test_tf_tutorials", "test_train"})


# The slow tier runs as two streams (`-n 2 --dist loadgroup`): these
# modules, whose jobs go through `oscars-launch` and mostly wait (SIMULATED
# step times, straggler and collective timeouts, shaped links, restarts),
# on one process; the other slow modules, whose jobs mostly compute, on the
# other, one test at a time each. (A module is never split: its
# module-scoped jobs run once.)
LAUNCHED_MODULES = frozenset({
    "test_cli_help", "test_control_plane_tf", "test_coordinator",
    "test_cpu_limit_from_ready", "test_cpu_limits", "test_faults",
    "test_launch", "test_launch_emulated", "test_launch_ps", "test_netns",
    "test_random_faults", "test_recovery", "test_train"})


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
  for item in items:
    name = item.module.__name__
    if name in SLOW_MODULES:
      item.add_marker(pytest.mark.slow)
      item.add_marker(pytest.mark.xdist_group(
          "launched" if name in LAUNCHED_MODULES else "jobs"))
