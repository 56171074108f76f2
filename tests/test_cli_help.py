"""Every command the package installs answers --help and -h.

The commands are found, not listed: the distribution's console scripts and
the oscars_tf modules with a top-level `if __name__ == "__main__":`. Each
must print a `usage:` line naming the command, a short description, and
every flag its module defines (a module's `define_flags(flag_values)`, and
flags it defines at import), each with its default, under a section header.
"""

import ast
import importlib
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys

from absl import flags
import pytest

import oscars_tf

PACKAGE = pathlib.Path(oscars_tf.__file__).parent


def _console_scripts():
  """(name, module) of each console script of the installed package."""
  try:
    dist = importlib.metadata.distribution("oscars_tf")
  except importlib.metadata.PackageNotFoundError:
    return []
  return [(ep.name, ep.module) for ep in dist.entry_points
          if ep.group == "console_scripts"]


def _main_modules():
  """oscars_tf modules that run as `python -m`."""
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text())
    if any(isinstance(node, ast.If) and
           ast.unparse(node.test).replace("'", '"') ==
           '__name__ == "__main__"' for node in tree.body):
      parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
      found.append(".".join(p for p in parts if p != "__main__"))
  return found


def _commands():
  commands = []
  for name, module in _console_scripts():
    commands.append(pytest.param(name, module, id=name))
  for module in _main_modules():
    commands.append(pytest.param(None, module, id=f"-m {module}"))
  return commands


def _argv(script, module):
  if script is None:
    return [sys.executable, "-m", module]
  bindir = os.path.dirname(sys.executable)
  path = shutil.which(script, path=bindir + os.pathsep +
                      os.environ.get("PATH", ""))
  if path is None:
    pytest.skip(f"console script {script} is not on PATH (not installed "
                "with pip install -e .)")
  return [path]


def _defined_flags(module_name):
  """name -> Flag, for every flag the module defines."""
  module = importlib.import_module(module_name)
  found = {}
  if hasattr(module, "define_flags"):
    fresh = flags.FlagValues()
    module.define_flags(fresh)
    for module_flags in fresh.flags_by_module_dict().values():
      found.update((f.name, f) for f in module_flags)
  by_module = flags.FLAGS.flags_by_module_dict()
  found.update((f.name, f) for f in by_module.get(module_name, []))
  return found


def _flag_blocks(text):
  """flag name -> (section header, the flag's help lines)."""
  blocks, header, current = {}, None, None
  for line in text.splitlines():
    flag = re.match(r"  --(?:\[no\])?(\w+)\b", line)  # continuations: 4
    if re.fullmatch(r"[a-z][\w ]*:", line):
      header, current = line[:-1], None
    elif flag:
      current = flag.group(1)
      blocks[current] = (header, [line])
    elif current and line.startswith(" "):
      blocks[current][1].append(line)
    else:
      current = None
  return blocks


@pytest.mark.parametrize("script, module", _commands())
@pytest.mark.parametrize("help_arg", ["--help", "-h"])
def test_help_shows_usage_and_every_flag_with_its_default(script, module,
                                                          help_arg):
  argv = _argv(script, module)
  proc = subprocess.run(argv + [help_arg], capture_output=True, text=True,
                        timeout=180, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  usage = re.search(r"^usage: (.+)$", out, re.MULTILINE)
  assert usage, out
  names = {s for s, m in _console_scripts() if m == module}
  names.add(script or f"python -m {module}")
  assert any(usage.group(1).startswith(n + " ") for n in names), (
      usage.group(1), names)
  paragraphs = out[usage.end():].strip().split("\n\n")
  description = paragraphs[0].splitlines()
  assert 1 <= len(description) <= 3, out
  assert not any(line.startswith((" ", "--")) for line in description), out
  blocks = _flag_blocks(out)
  for name, flag in _defined_flags(module).items():
    assert name in blocks, f"--{name} missing from {help_arg}:\n{out}"
    header, lines = blocks[name]
    assert header, f"--{name} is under no section header:\n{out}"
    assert f"default: {flag.default_as_str}" in " ".join(lines), (
        f"--{name}'s default {flag.default_as_str} missing:\n{out}")


def test_the_launcher_lists_its_flags_by_section():
  # Its sections, in order, each non-empty; every flag in exactly one.
  from oscars_tf.cli import launch  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, "-m", "oscars_tf.cli.launch", "-h"],
                        capture_output=True, text=True, timeout=60,
                        check=False)
  blocks = _flag_blocks(proc.stdout)
  for title, names in launch.SECTIONS:
    assert names and all(blocks.get(n, (None,))[0] == title
                        for n in names), (title, proc.stdout)
  listed = [n for _, names in launch.SECTIONS for n in names]
  assert sorted(listed) == sorted(_defined_flags("oscars_tf.cli.launch"))


def test_help_after_the_separator_belongs_to_the_worker():
  proc = subprocess.run(
      [sys.executable, "-m", "oscars_tf.cli.launch", "--num_workers=1",
       "--network=host", "--", sys.executable, "-c",
       "import sys; print('argv', sys.argv[1:])", "-h", "--help"],
      capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "[0] argv ['-h', '--help']" in proc.stdout
