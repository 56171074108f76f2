"""The test setup: the tiers agree (pytest's "slow" marker and Bazel's
manual tests), and the processes the tests start skip Keras's optional
imports without losing them for code that asks itself."""

import pathlib
import re
import subprocess
import sys

import conftest


def test_bazel_runs_exactly_the_fast_tier():
  build = (pathlib.Path(__file__).parent / "BUILD").read_text()
  manual = re.search(r"_MANUAL = \[(.*?)\]", build, re.S).group(1)
  modules = {m[:-len(".py")] for m in re.findall(r'"(test_\w+\.py)"', manual)}
  assert modules == set(conftest.SLOW_MODULES)


_CHILD = """
import sys
import keras
from keras import wrappers
seen_by_keras = sorted(m for m in ("sklearn", "scipy", "IPython")
                       if m in sys.modules)
import sklearn.datasets  # code of its own still gets it
print(seen_by_keras, "sklearn" in sys.modules)
"""


def test_a_child_process_skips_keras_optional_imports_but_not_its_own():
  proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().splitlines()[-1] == "[] True", proc.stdout


def test_the_launched_stream_holds_only_slow_modules():
  # (Bazel's sandbox holds none of the slow modules' files: the BUILD test
  # above ties the names to them.)
  assert conftest.LAUNCHED_MODULES <= conftest.SLOW_MODULES
  assert conftest.LAUNCHED_MODULES != conftest.SLOW_MODULES
