"""The layers of docs/ARCHITECTURE.md, checked from the source: a module
imports only from its own layer or the layers below it."""

import ast
import pathlib
import re
import subprocess
import sys

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
    ("front ends and tools", {"frontends", "tools", "cli", "data",
                              "__init__"}),
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


ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"


def _documented_layers():
  """{layer name: module paths below oscars_tf} from the layers table of
  docs/ARCHITECTURE.md. In a row's last cell, `pkg/` names a subpackage
  and the `name.py` after it are its modules; `name.py` before any package
  is a top-level module."""
  text = ARCHITECTURE.read_text(encoding="utf-8")
  section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
  layers = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
      continue
    package, modules = "", set()
    for token in re.findall(r"`([\w/.]+)`", cells[2]):
      if token.endswith("/"):
        package = token
      elif token.endswith(".py"):
        modules.add(token if "/" in token else package + token)
    layers[cells[0]] = modules
  return layers


def test_architecture_names_the_layers_of_this_test_top_down():
  assert list(_documented_layers()) == [name for name, _ in LAYERS[::-1]]


def test_architecture_places_every_module_where_its_layer_is():
  documented = _documented_layers()
  for name, _ in LAYERS:
    tree = {str(m) for m in MODULES if LAYERS[_layer(m.parts)][0] == name
            and not (len(m.parts) > 1 and m.name == "__init__.py")}
    assert documented[name] == tree, (
        f"layer {name!r}: docs/ARCHITECTURE.md names "
        f"{sorted(documented[name] - tree)} that are not in it, and misses "
        f"{sorted(tree - documented[name])}")


def test_no_import_cycle():
  graph = {}
  for module in MODULES:
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    graph[str(module)] = {t for p in _imported_modules(tree)
                          if (t := _module_path(p)) and t != str(module)}
  done, path = set(), []

  def visit(node):
    if node in path:
      raise AssertionError("import cycle: " + " -> ".join(
          path[path.index(node):] + [node]))
    if node in done:
      return
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      visit(nxt)
    path.pop()
    done.add(node)

  for node in sorted(graph):
    visit(node)


def _imported_modules(tree):
  """Path parts of every oscars_tf module or name a module imports; for
  `from oscars_tf.pkg import name`, both pkg and pkg/name."""
  yield from _imported(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.split(".")[0] == "oscars_tf"):
      for alias in node.names:
        yield node.module.split(".")[1:] + [alias.name]


def _module_path(parts):
  """The module file that import path parts name (a name imported from a
  module names that module), or None."""
  for n in (len(parts), len(parts) - 1):
    candidate = "/".join(parts[:n]) + ".py"
    if n > 0 and (PACKAGE / candidate).is_file():
      return candidate
  return None


def test_what_the_docs_name_is_reachable_from_import_oscars_tf():
  """docs/reference.md names `oscars_tf.checkpoint.save`,
  `oscars_tf.data.DatasetUnavailableError` and the errors: after a bare
  `import oscars_tf` they were AttributeErrors (nothing imported the
  submodules), in a fresh process, as a user's script is."""
  code = ("import oscars_tf as o\n"
          "names = [n for n in o.__all__ if not hasattr(o, n)]\n"
          "assert not names, names\n"
          "assert callable(o.checkpoint.save) and o.cluster.from_tf_config\n"
          "assert o.data.DatasetUnavailableError is o.DatasetUnavailableError\n"
          "assert all(issubclass(getattr(o, n), o.OscarsError) for n in\n"
          "           o.__all__ if n.endswith('Error'))\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
