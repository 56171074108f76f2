"""The layers of docs/ARCHITECTURE.md, checked from the source: a module
imports only from its own layer or the layers below it."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "oscars_tf"

# Lowest first. A public top-level module sits in the layer it belongs to.
LAYERS = (
    ("errors", {"errors", "exit_notes", "arguments"}),
    ("policy", {"policy", "schedules", "simulate"}),
    ("protocol", {"protocol"}),
    ("runtime", {"runtime", "cluster"}),
    ("observability", {"observability"}),
    ("strategy glue", {"distribute", "checkpoint"}),
    ("front ends and tools", {"frontends", "tools", "launch", "coordinator",
                              "flags", "data", "__init__"}),
)


def _layer(parts):
  """Layer index of a module given its path parts below oscars_tf."""
  head = parts[0].removesuffix(".py")
  for i, (_, names) in enumerate(LAYERS):
    if head in names:
      return i
  raise AssertionError(f"oscars_tf/{'/'.join(parts)} is in no layer: add it "
                       "to LAYERS here and to docs/ARCHITECTURE.md")


def _imported(tree):
  """oscars_tf modules a module imports, as path parts below oscars_tf."""
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.split(".")[0] == "oscars_tf"):
      parts = node.module.split(".")[1:]
      if parts:
        yield parts
      else:  # from oscars_tf import x
        for alias in node.names:
          yield [alias.name]
    elif isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        if parts[0] == "oscars_tf" and len(parts) > 1:
          yield parts[1:]


MODULES = sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_layer():
  assert len(MODULES) > 30
  for m in MODULES:
    _layer(m.parts)


@pytest.mark.parametrize("module", MODULES, ids=str)
def test_imports_point_down(module):
  mine = _layer(module.parts)
  tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
  up = [".".join(p) for p in _imported(tree) if _layer(p) > mine]
  assert not up, (f"{module} ({LAYERS[mine][0]}) imports from a higher "
                  f"layer: {up}")
