"""Runs one pytest module as a Bazel test: `pytest_runner.py tests/test_x.py`.

The tests are pytest modules; each py_test in tests/BUILD runs one of them
through this script, which exits with pytest's exit code. Outside Bazel, run
them with `python -m pytest tests` instead.
"""

import os
import sys

import pytest


def main(argv):
  # The workspace root in the runfiles tree (the working directory of a test
  # under `bazel test`; pytest.ini is there).
  srcdir, workspace = os.environ.get("TEST_SRCDIR"), os.environ.get(
      "TEST_WORKSPACE")
  root = (os.path.join(srcdir, workspace) if srcdir and workspace
          else os.getcwd())
  # The tests start worker processes (`sys.executable worker_programs.py`,
  # `python -m oscars_tf.cli.launch`, TensorBoard with the oscars plugin) that
  # import oscars_tf: from the runfiles, not from an installed copy.
  path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  os.environ["PYTHONPATH"] = os.pathsep.join([root] + path)
  sys.path.insert(0, root)
  # No bytecode written next to the (symlinked) sources, nor a home directory
  # outside the test's own temporary directory.
  os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
  sys.dont_write_bytecode = True
  tmpdir = os.environ.get("TEST_TMPDIR")
  if tmpdir:
    os.environ.setdefault("HOME", tmpdir)
  args = [os.path.join(root, module) for module in argv[1:]]
  args += ["-q", "-p", "no:cacheprovider", "--rootdir", root,
           "-c", os.path.join(root, "pytest.ini")]
  if os.environ.get("XML_OUTPUT_FILE"):  # per-test-case results for Bazel
    args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
  return int(pytest.main(args))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
