"""The import graph of ``src/fastprefill``: no cycle between modules, no import upward.

The graph is read from the source with :mod:`ast`, nothing is imported. An edge ``a -> b`` is any
of, anywhere in ``a`` (module level, inside functions, under ``if TYPE_CHECKING:``):

* ``import fastprefill.b`` / ``from fastprefill import b`` / ``from . import b`` (relative
  imports are resolved); ``from fastprefill.x import name`` is an edge to the module
  ``fastprefill.x.name`` when that is a module, else to ``fastprefill.x``;
* a string constant naming a module, ``"fastprefill.b"`` or ``"fastprefill.b:attribute"``: the
  lazy imports of ``fastprefill/__init__.py`` and of the method registry.

The parent packages Python initialises on the way to a module are not edges (every module would
then depend on the root). Imports under ``if TYPE_CHECKING:`` count for the layers and for cycles:
they never run, but two modules that name each other's types are one subject split in two (a
contract both need belongs beside one of them, or below both).

To place a new module, or move one, edit :data:`LAYERS` (and nothing else).

No module may be longer than :data:`MAX_LINES` lines, except those listed in
:data:`LONG_MODULES` (being split); no function or method longer than :data:`MAX_FUNCTION_LINES`,
except those listed in :data:`LONG_FUNCTIONS`, each of which says in its docstring why it is kept
whole (a paragraph starting ``Kept whole:``).

Two boundaries around the package: no module of ``src/fastprefill`` imports from ``benchmarks/``
(its scripts, ``research``, ``figures``: they exist only in a checkout), and no test file edits
the import path or loads a module from a file path (tests import shared helpers as
``tests.<module>``; pyproject.toml's ``pythonpath`` says where from).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests import REPO

# --------------------------------------------------------------------------- the table to edit

#: The layers, lowest first. A module may import modules of its own layer or a lower one.
#: Names are relative to ``fastprefill``: ``"x.*"`` is the package ``x`` and everything under it,
#: ``"x"`` is exactly the module (or package ``__init__``) ``x``, ``"__init__"`` is
#: ``fastprefill/__init__.py`` itself. The most specific entry wins (an exact name over a
#: ``.*`` entry, a longer ``.*`` entry over a shorter one).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "text", "host", "runtime"),
    ("models.shape",),
    ("models.*", "kernels", "kernels.*", "data.*"),
    ("cache", "cache.*", "prefix_cache", "chunk_store"),
    ("methods.*",),
    ("engine", "events", "prompt", "sampling", "batch", "units"),
    ("distributed", "distributed.*"),
    ("bench.*", "tune"),
    ("launch", "serve.*", "cli", "cli.*", "demo", "__init__"),
)

#: Tolerated violations, each ``"cycle: a, b, ..."`` (the modules of one strongly connected
#: component, sorted) or ``"upward: a -> b"``. Empty: the tree has none. A violation that is gone
#: must be removed from here (the test says so).
KNOWN_VIOLATIONS: frozenset[str] = frozenset()

#: No module of ``src/fastprefill`` may have more lines than this.
MAX_LINES = 450

#: Modules over :data:`MAX_LINES` today, tolerated while they are being split (paths under
#: ``src/fastprefill``). One that is short enough must be removed from here (the test says so).
LONG_MODULES: frozenset[str] = frozenset({
})

#: No function or method of ``src/fastprefill`` may have more lines than this (``def`` to its
#: last line, docstring included).
MAX_FUNCTION_LINES = 80

#: Functions over :data:`MAX_FUNCTION_LINES` allowed to stay whole, as ``"path:qualname"`` (path
#: under ``src/fastprefill``, ``Class.method`` for a method). Each one's docstring says why, in a
#: paragraph starting :data:`KEPT_WHOLE`; one that is short enough must be removed from here.
LONG_FUNCTIONS: frozenset[str] = frozenset({
})
#: How a long function's docstring starts the paragraph that says why it is kept whole.
KEPT_WHOLE = "Kept whole:"

# --------------------------------------------------------------------------- the graph

PACKAGE = "fastprefill"
SRC = REPO / "src" / PACKAGE
BENCHMARKS = REPO / "benchmarks"
TESTS = REPO / "tests"
_MODULE_STRING = re.compile(rf"{PACKAGE}(?:\.\w+)+(?::[\w.]+)?")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    typing_only: bool

    def __str__(self) -> str:
        kind = " (TYPE_CHECKING)" if self.typing_only else ""
        return f"{short(self.source)} -> {short(self.target)} (line {self.line}{kind})"


def short(module: str) -> str:
    """``fastprefill.a.b`` -> ``a.b``; the package root -> ``__init__``."""
    return "__init__" if module == PACKAGE else module.removeprefix(f"{PACKAGE}.")


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package is named by its ``__init__.py``)."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node of ``tree`` with whether it sits under ``if TYPE_CHECKING:``."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        yield node, typing_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, True) for child in node.body)
            stack.extend((child, typing_only) for child in node.orelse)
        else:
            stack.extend((child, typing_only) for child in ast.iter_child_nodes(node))


def _targets(node: ast.AST, module: str, is_package: bool, docstrings: set[int]) -> list[str]:
    """The dotted names ``node`` imports (not yet checked against the package's modules)."""
    known = modules()
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            anchor = module.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        else:
            base = node.module or ""
        return [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
        ]
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and _MODULE_STRING.fullmatch(node.value)
        and node.value.partition(":")[0] in known  # exactly a module: not "fastprefill.json"
    ):
        return [node.value.partition(":")[0]]
    return []


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to: itself, or its longest prefix that is a module."""
    known = modules()
    parts = name.split(".")
    while parts and parts[0] == PACKAGE:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


@cache
def edges() -> tuple[Edge, ...]:
    found = set()
    for module, path in modules().items():
        tree = ast.parse(path.read_text("utf-8"), filename=str(path))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node, typing_only in _nodes(tree):
            for name in _targets(node, module, path.name == "__init__.py", docstrings):
                target = _resolve(name)
                if target is not None and target != module:
                    found.add(Edge(module, target, getattr(node, "lineno", 0), typing_only))
    return tuple(sorted(found, key=lambda e: (e.source, e.target, e.line)))


# --------------------------------------------------------------------------- layers and cycles


def _layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the most specific entry matching ``module``."""
    name = short(module)
    best: tuple[int, int] | None = None  # (specificity, layer)
    for layer, entries in enumerate(LAYERS):
        for entry in entries:
            if entry.endswith(".*"):
                prefix = entry[:-2]
                if name == prefix or name.startswith(prefix + "."):
                    rank = (len(prefix), layer)
                    best = max(best, rank) if best else rank
            elif entry == name:
                return layer
    return None if best is None else best[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(graph: Sequence[Edge]) -> dict[str, list[Edge]]:
    """Every cycle and upward import of ``graph``, each with the edges that make it."""
    imports: dict[str, set[str]] = {}
    for edge in graph:
        imports.setdefault(edge.source, set()).add(edge.target)
    found: dict[str, list[Edge]] = {}
    for component in _cycles(imports):
        members = set(component)
        key = "cycle: " + ", ".join(short(m) for m in component)
        found[key] = [e for e in graph if e.source in members and e.target in members]
    for edge in graph:
        source, target = _layer_of(edge.source), _layer_of(edge.target)
        if source is not None and target is not None and target > source:
            found.setdefault(f"upward: {short(edge.source)} -> {short(edge.target)}", []).append(edge)
    return found


def _describe(found: dict[str, list[Edge]], keys: set[str]) -> str:
    return "\n".join(f"{key}\n    " + "\n    ".join(map(str, found[key])) for key in sorted(keys))


# --------------------------------------------------------------------------- tests


def test_the_graph_is_read() -> None:
    """The reader finds the imports it must find (a reader that finds nothing passes the rest)."""
    graph = {(e.source, e.target) for e in edges()}
    assert (f"{PACKAGE}.prompt", f"{PACKAGE}.errors") in graph  # from fastprefill.errors import ...
    assert (f"{PACKAGE}.data.tasks", f"{PACKAGE}.data.tasks.qa") in graph  # package re-export
    assert (f"{PACKAGE}.data.tasks.qa", f"{PACKAGE}.data.sources") in graph  # from fastprefill.data import sources
    assert (PACKAGE, f"{PACKAGE}.methods.lazyllm") in graph  # lazy import by name
    assert (f"{PACKAGE}.cli.bench", f"{PACKAGE}.data.tasks") in graph  # inside a function


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(short(m) for m in modules() if _layer_of(m) is None)
    assert not unplaced, (
        f"modules not in the layer table: {unplaced}; place each in LAYERS at the top of "
        f"{Path(__file__).name} (the layer whose modules it may import)"
    )


def test_no_cycle_and_no_upward_import() -> None:
    found = violations(edges())
    new = set(found) - KNOWN_VIOLATIONS
    assert not new, (
        "import cycles or upward imports (LAYERS in this file is lowest first):\n"
        + _describe(found, new)
    )


def test_known_violations_are_still_there() -> None:
    fixed = KNOWN_VIOLATIONS - set(violations(edges()))
    assert not fixed, f"fixed, remove from KNOWN_VIOLATIONS: {sorted(fixed)}"


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert _cycles(graph) == expected


def test_layer_lookup_prefers_the_most_specific_entry() -> None:
    assert _layer_of(f"{PACKAGE}.models.shape") == 1
    assert _layer_of(f"{PACKAGE}.models.adapters") == 2
    assert _layer_of(PACKAGE) == len(LAYERS) - 1
    assert _layer_of(f"{PACKAGE}.nowhere") is None


def test_violations_name_cycles_and_upward_imports() -> None:
    def edge(source: str, target: str, typing_only: bool = False) -> Edge:
        return Edge(f"{PACKAGE}.{source}", f"{PACKAGE}.{target}", 1, typing_only)

    assert violations([edge("engine", "errors"), edge("methods.full", "cache")]) == {}
    down_and_up = [edge("engine", "errors"), edge("errors", "engine")]
    assert set(violations(down_and_up)) == {"cycle: engine, errors", "upward: errors -> engine"}
    # a TYPE_CHECKING import never runs, but is still upward, and still closes a cycle
    assert set(violations([edge("engine", "errors"), edge("errors", "engine", True)])) == {
        "cycle: engine, errors", "upward: errors -> engine"
    }
    # same layer: allowed both ways, but not in a cycle
    assert set(violations([edge("data.sources", "models.zoo"), edge("models.zoo", "data.sources")])) == {
        "cycle: data.sources, models.zoo"
    }


# --------------------------------------------------------------------------- module length


def long_modules() -> dict[str, int]:
    """Modules over :data:`MAX_LINES` lines: path under ``src/fastprefill`` -> line count."""
    counts = {path.relative_to(SRC).as_posix(): len(path.read_text("utf-8").splitlines())
              for path in modules().values()}
    assert counts and max(counts.values()) > 100  # the counter sees the tree's modules
    return {path: n for path, n in counts.items() if n > MAX_LINES}


def test_no_module_is_over_the_line_limit() -> None:
    new = {path: n for path, n in long_modules().items() if path not in LONG_MODULES}
    assert not new, (
        f"modules over {MAX_LINES} lines (split them by responsibility): "
        + ", ".join(f"{path} ({n})" for path, n in sorted(new.items()))
    )


def test_long_module_exceptions_are_still_long() -> None:
    fixed = LONG_MODULES - set(long_modules())
    assert not fixed, f"no longer over {MAX_LINES} lines, remove from LONG_MODULES: {sorted(fixed)}"


# --------------------------------------------------------------------------- function length


@dataclass(frozen=True)
class Function:
    key: str  # "path:qualname"
    lines: int
    docstring: str


def functions(source: str, path: str) -> list[Function]:
    """Every function and method of ``source`` (nested ones too), with its length in lines."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append(Function(f"{path}:{name}", child.end_lineno - child.lineno + 1,
                                      ast.get_docstring(child) or ""))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def long_functions() -> dict[str, Function]:
    """Functions over :data:`MAX_FUNCTION_LINES` lines, by ``"path:qualname"``."""
    every = [f for path in modules().values()
             for f in functions(path.read_text("utf-8"), path.relative_to(SRC).as_posix())]
    assert len(every) > 500 and max(f.lines for f in every) > 40  # the reader sees the tree's functions
    return {f.key: f for f in every if f.lines > MAX_FUNCTION_LINES}


def test_the_function_reader_measures_methods_and_nested_functions():
    source = "class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n\n\ndef f():\n    pass\n"
    got = {f.key: f.lines for f in functions(source, "x.py")}
    assert got == {"x.py:A.m": 4, "x.py:A.m.inner": 2, "x.py:f": 2}


def test_no_function_is_over_the_line_limit():
    new = {key: f.lines for key, f in long_functions().items() if key not in LONG_FUNCTIONS}
    assert not new, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them where a reader would want a name, or list one "
        f"in LONG_FUNCTIONS with a '{KEPT_WHOLE}' paragraph in its docstring): "
        + ", ".join(f"{key} ({n})" for key, n in sorted(new.items()))
    )


def test_long_functions_say_why_and_are_still_long():
    found = long_functions()
    fixed = LONG_FUNCTIONS - set(found)
    assert not fixed, f"no longer over {MAX_FUNCTION_LINES} lines, remove from LONG_FUNCTIONS: {sorted(fixed)}"
    silent = sorted(key for key in LONG_FUNCTIONS if KEPT_WHOLE not in found[key].docstring)
    assert not silent, f"long functions whose docstring does not say why they are kept whole ({KEPT_WHOLE!r}): {silent}"


# --------------------------------------------------------------------------- boundaries

#: Text no test file may hold: editing the import path, or importing a module from a file path
#: (written in two parts so that this file does not hold it either).
FORBIDDEN_IN_TESTS = ("sys" + ".path", "syspath" + "_prepend", "spec_from_file" + "_location")


def benchmark_modules() -> set[str]:
    """The top-level names importable from ``benchmarks/``: its scripts and packages."""
    names = {p.stem for p in BENCHMARKS.glob("*.py")} | {p.parent.name for p in BENCHMARKS.glob("*/__init__.py")}
    return names | {"benchmarks"}


def imported_roots(path: Path) -> set[str]:
    """The top-level names a file imports anywhere: ``import``, ``from ... import`` (absolute) and
    ``importlib.import_module`` / ``__import__`` with a literal name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in
                   ("import_module", "__import__"))):
            found.add(node.args[0].value.split(".")[0])
    return found


def test_the_boundary_readers_see_imports() -> None:
    """The readers find what they must (a reader that finds nothing passes the checks below)."""
    assert {"research", "figures", "verify", "kvp_bench"} <= benchmark_modules()
    assert {"figures", "fastprefill"} <= imported_roots(BENCHMARKS / "verify.py")
    assert "research" in imported_roots(BENCHMARKS / "lazyllm_bench.py")


def test_the_package_imports_nothing_from_benchmarks() -> None:
    outside = benchmark_modules()
    found = {f"{path.relative_to(REPO)}: {name}" for path in modules().values()
             for name in imported_roots(path) & outside}
    assert not found, (
        "src/ imports from benchmarks/, which an installed package does not have (move the code into "
        "the package, or keep it beside the scripts):\n" + "\n".join(sorted(found))
    )


def test_no_test_edits_the_import_path() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert Path(__file__).resolve() in files and len(files) > 10
    found = [f"{path.relative_to(REPO)}: {text}" for path in files for text in FORBIDDEN_IN_TESTS
             if text in path.read_text("utf-8")]
    assert not found, (
        "tests edit the import path or load modules from files; import shared helpers as tests.<module> "
        "(a module of the tests package) and benchmark code as research.*, figures.* or the script's name:\n"
        + "\n".join(found)
    )


# --------------------------------------------------------------------------- dispatch on methods


def class_checks(source: str, where: str) -> list[str]:
    """The ``isinstance(x, C)`` / ``issubclass(x, C)`` of ``source`` whose ``C`` is a method class (a
    :class:`~fastprefill.methods.base.Method` subclass imported from ``fastprefill.methods``), as
    ``"where:line: C"``. (``isinstance(x, Method)``, checking that an argument is a method at all,
    is not dispatch.)"""
    import importlib

    from fastprefill.methods.base import Method

    tree = ast.parse(source)
    imported: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"{PACKAGE}.methods"):
            imported.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass")
                and len(node.args) == 2):
            continue
        for cls in node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]:
            if isinstance(cls, ast.Name) and cls.id in imported:
                source_module, name = imported[cls.id]
                obj = getattr(importlib.import_module(source_module), name, None)
                if isinstance(obj, type) and issubclass(obj, Method) and obj is not Method:
                    found.append(f"{where}:{node.lineno}: {cls.id}")
    return found


def test_the_dispatch_reader_sees_class_checks() -> None:
    """The reader finds what it must (a reader that finds nothing passes the check below)."""
    source = ("from fastprefill.methods.base import DistributedMethod, Method\n"
              "from fastprefill.methods.lazyllm import LazyLLM as L\n"
              "isinstance(m, DistributedMethod)\nisinstance(m, (int, L))\nisinstance(m, Method)\n")
    assert class_checks(source, "x.py") == ["x.py:3: DistributedMethod", "x.py:4: L"]


def test_no_dispatch_on_method_classes_outside_the_methods() -> None:
    """A method says what a caller needs to know (``on_ranks``, ``ranks``, ``served_name``,
    ``metric_label``, ...): outside ``methods/`` callers ask it instead of testing its class."""
    found = [hit for module, path in modules().items() if not short(module).startswith("methods")
             for hit in class_checks(path.read_text("utf-8"), path.relative_to(SRC).as_posix())]
    assert not found, (
        "code outside methods/ tests a method's class; ask the method instead (Method.on_ranks, .ranks, "
        ".served_name(), .metric_label(), or a new query on Method):\n" + "\n".join(found)
    )
