"""The house rules that keep specjax easy to change, checked on the source itself (no imports run):

- dependencies point down: no import circle between specjax's modules, counting imports made
  inside functions too (a function-level import hides a circle, it does not remove it), and
  counting a package's __init__ as imported by whoever imports one of its modules from outside
  it (Python runs the package first: `from specjax.drafters import layouts` runs
  specjax/drafters/__init__.py);
- no function in specjax/ over 80 lines, argparse declarations excepted (a long `add_argument`
  list is a table, not logic);
- no Python file in specjax/ over 600 lines (split it by job);
- no file in tests/ imports a test file or conftest.py: what tests share lives in tests/helpers/.
"""

from __future__ import annotations

import ast
import os

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(TESTS, "..", "specjax")
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
ARGPARSE_CALLS = {"add_argument", "add_parser", "add_subparsers", "set_defaults",
                  "add_argument_group", "add_mutually_exclusive_group"}


def _modules(root: str = ROOT) -> dict[str, str]:
  """Dotted module name -> file path for every .py under root (packages by their __init__)."""
  out = {}
  base = os.path.dirname(os.path.abspath(root))
  for d, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(d, f), base)[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
  return out


def _resolve(name: str, modules) -> str | None:
  """The longest prefix of a dotted name that is one of our modules."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name or None


def _imports(module: str, path: str, modules) -> set[str]:
  """The modules of ours that `module` imports anywhere in its file (functions included)."""
  tree = ast.parse(open(path).read(), path)
  is_pkg = path.endswith("__init__.py")
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: from . import x / from .x import y
        parts = module.split(".")
        anchor = parts if is_pkg else parts[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        prefix = ".".join(anchor + ([node.module] if node.module else []))
      else:
        prefix = node.module or ""
      # `from P import x`: the module P.x if x is one, else P itself (x is a name in P).
      names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix
               for a in node.names]
    else:
      continue
    for n in names:
      target = _resolve(n, modules)
      if target and target != module:
        out.add(target)
        out.update(_packages_run(module, target, modules))
  return out


def _packages_run(module: str, target: str, modules) -> set[str]:
  """The packages above `target` that importing it runs first, less those `module` is inside
  (Python has already run those)."""
  out = set()
  pkg = target.rpartition(".")[0]
  while pkg:
    if pkg in modules and not (module == pkg or module.startswith(pkg + ".")):
      out.add(pkg)
    pkg = pkg.rpartition(".")[0]
  return out


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
  modules = _modules(root)
  return {m: _imports(m, p, modules) for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def _argparse_lines(fn: ast.AST) -> set[int]:
  lines = set()
  for node in ast.walk(fn):
    if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in ARGPARSE_CALLS):
      lines.update(range(node.lineno, node.end_lineno + 1))
  return lines


def long_functions(root: str = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
  out = []
  for path in sorted(_modules(root).values()):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1 - len(_argparse_lines(node))
        if n > limit:
          out.append(f"{os.path.relpath(path, os.path.dirname(root))}:{node.lineno} "
                     f"{node.name}: {n} lines")
  return out


def imports_of_tests(root: str = TESTS) -> list[str]:
  """Every import, anywhere in a file under root, of a test module (test_*.py) or of conftest:
  "file:line name" each."""
  out = []
  for d, _, files in sorted(os.walk(root)):
    for f in sorted(files):
      if not f.endswith(".py"):
        continue
      path = os.path.join(d, f)
      for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
          names = [".".join(filter(None, [node.module, a.name])) for a in node.names]
        else:
          continue
        out += [f"{os.path.relpath(path, root)}:{node.lineno} {n}" for n in names
                if any(p == "conftest" or p.startswith("test_") for p in n.split("."))]
  return out


def test_the_checks_see_a_circle_and_a_long_function(tmp_path):
  pkg = tmp_path / "specjax"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from specjax import b\n")
  (pkg / "b.py").write_text("def f():\n  from specjax.sub import c\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "c.py").write_text("from .. import a\n")
  (pkg / "e.py").write_text("def f():\n  from specjax.pkg import low\n")
  (pkg / "pkg").mkdir()
  (pkg / "pkg" / "__init__.py").write_text("from specjax import e\nfrom specjax.pkg import low\n")
  (pkg / "pkg" / "low.py").write_text("")
  (pkg / "d.py").write_text("def g():\n" + "  x = 1\n" * 81
                            + "def h(p):\n" + "  p.add_argument('--x')\n" * 90 + "  return p\n")
  graph = import_graph(str(pkg))
  assert graph["specjax.b"] == {"specjax.sub", "specjax.sub.c"}  # a function-level import counts
  assert graph["specjax.e"] == {"specjax.pkg", "specjax.pkg.low"}  # the package's __init__ runs
  assert graph["specjax.pkg"] == {"specjax.e", "specjax.pkg.low"}  # (inside it: no self-edge)
  assert circles(graph) == [["specjax.a", "specjax.b", "specjax.sub.c"],
                            ["specjax.e", "specjax.pkg"]]
  assert [s.split(" ")[1] for s in long_functions(str(pkg))] == ["g:"]


def test_the_check_sees_imports_of_tests_and_conftest(tmp_path):
  tests = tmp_path / "tests"
  (tests / "sub").mkdir(parents=True)
  (tests / "helpers.py").write_text("import json\n")
  (tests / "test_a.py").write_text("from tests.helpers import x\nimport conftest\n")
  (tests / "sub" / "test_b.py").write_text("def f():\n  from test_a import y\n"
                                          "  from tests.sub import test_c\n")
  assert imports_of_tests(str(tests)) == [
      "test_a.py:2 conftest", "sub/test_b.py:2 test_a.y", "sub/test_b.py:3 tests.sub.test_c"]


def test_no_import_circles():
  assert circles(import_graph()) == []


def test_no_function_over_80_lines():
  assert long_functions() == []


def test_no_test_imports_another_test_or_conftest():
  """Tests share code through tests/helpers/ alone: a test file imported as a module runs its
  module-level code (fixtures, parametrize tables) a second time, under another name."""
  assert imports_of_tests() == []


def test_no_file_over_600_lines():
  long = {os.path.relpath(p, os.path.dirname(ROOT)): n for p in _modules().values()
          if (n := len(open(p).read().splitlines())) > MAX_FILE_LINES}
  assert long == {}


@pytest.mark.parametrize("low,high", [("specjax.kernels", "specjax.model"),
                                      ("specjax.cache", "specjax.decode"),
                                      ("specjax.sharding", "specjax.decode"),
                                      ("specjax.decode", "specjax.methods")])
def test_dependencies_point_down(low, high):
  """The ground never imports what stands on it (directly or through others)."""
  graph = import_graph()
  seen, todo = set(), [m for m in graph if m == low or m.startswith(low + ".")]
  while todo:
    m = todo.pop()
    if m in seen:
      continue
    seen.add(m)
    todo.extend(graph.get(m, ()))
  assert not any(m == high or m.startswith(high + ".") for m in seen), f"{low} reaches {high}"
