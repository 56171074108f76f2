"""Every module, class and function small enough to read in one sitting:
no module over 400 lines in all, no class over 200 lines of code and no
function over 60 (docstrings, comments and blank lines not counted)."""

import ast
import io
import pathlib
import tokenize

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "oscars_tf"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES, MAX_CLASS_CODE, MAX_FUNCTION_CODE = 400, 200, 60
_NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
             tokenize.DEDENT, tokenize.ENDMARKER)


def code_lines(source):
  """The numbers of the lines that hold code: not blank, not only a
  comment, not part of a docstring."""
  lines = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type not in _NOT_CODE:
      lines.update(range(token.start[0], token.end[0] + 1))
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if (isinstance(first, ast.Expr) and
          isinstance(first.value, ast.Constant) and
          isinstance(first.value.value, str)):
        lines.difference_update(range(first.lineno, first.end_lineno + 1))
  return lines


def oversized(source):
  """(kind, name, size, limit) of each class or function over its limit."""
  lines = code_lines(source)
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ClassDef):
      kind, limit = "class", MAX_CLASS_CODE
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      kind, limit = "function", MAX_FUNCTION_CODE
    else:
      continue
    size = sum(node.lineno <= n <= node.end_lineno for n in lines)
    if size > limit:
      yield kind, node.name, size, limit


def test_the_counter_leaves_out_docstrings_comments_and_blanks():
  source = ('def f():\n  """Doc\n  string."""\n  # why\n\n  x = (1,\n'
            '       2)\n  return x\n')
  assert sorted(code_lines(source)) == [1, 6, 7, 8]
  long = "def g():\n" + "  x = 1\n" * (MAX_FUNCTION_CODE + 1)
  assert list(oversized(long)) == [("function", "g", MAX_FUNCTION_CODE + 2,
                                    MAX_FUNCTION_CODE)]


@pytest.mark.parametrize("module", MODULES,
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_classes_and_functions_fit_their_bounds(module):
  source = module.read_text(encoding="utf-8")
  assert len(source.splitlines()) <= MAX_MODULE_LINES
  assert not list(oversized(source))
