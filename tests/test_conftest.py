"""The test tiers agree: pytest's "slow" marker and Bazel's manual tests."""

import pathlib
import re

import conftest


def test_bazel_runs_exactly_the_fast_tier():
  build = (pathlib.Path(__file__).parent / "BUILD").read_text()
  manual = re.search(r"_MANUAL = \[(.*?)\]", build, re.S).group(1)
  modules = {m[:-len(".py")] for m in re.findall(r'"(test_\w+\.py)"', manual)}
  assert modules == set(conftest.SLOW_MODULES)
