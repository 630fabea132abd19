"""``src/fastprefill`` holds only what the product uses: no function or class there that only tests
or benchmarks call.

The product is everything reachable from the package's own code: module-level code (the public
API's lazy imports, registries, ``__all__`` aside), entry points and decorated functions (routes,
fixtures of a framework) are roots, and a definition is used when its name appears in the code of a
used definition. A definition whose name no used code of the package mentions, while tests or
``benchmarks/`` do, belongs beside them: test-only helpers in ``tests/``, benchmark-only reporting in
``benchmarks/``. The reading is by name (``ast``, nothing imported), so two definitions sharing a
name count as one.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from tests import REPO

SRC = REPO / "src" / "fastprefill"

#: Names that are used without being named: methods Python or a framework calls.
CALLED_IMPLICITLY = frozenset({"forward", "main"})

#: Tolerated, each with why; one that the product uses again, or that is gone, must be removed
#: from here (the test says so). ``"path:name"``, path under ``src/fastprefill``.
KNOWN_OUTSIDE_USE: dict[str, str] = {}


def _names(nodes: Iterable[ast.AST]) -> Counter[str]:
    """Every name the nodes mention: variables, attributes, imported names, and the last part of
    a string naming a module attribute (``"fastprefill.x:y"``, the lazy imports)."""
    found: Counter[str] = Counter()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                found[node.id] += 1
            elif isinstance(node, ast.Attribute):
                found[node.attr] += 1
            elif isinstance(node, ast.alias):
                found[node.name.split(".")[-1]] += 1
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.:]+", node.value):
                found[re.split(r"[.:]", node.value)[-1]] += 1
    return found


@cache
def _outside_names() -> Counter[str]:
    paths = [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]
    return _names(ast.parse(p.read_text("utf-8")) for p in paths)


def _definitions(path: Path) -> tuple[list[tuple[str, ast.AST]], list[ast.AST]]:
    """The functions and classes of a module (nested in classes too), and its other statements
    (its roots: module-level code, decorators, bases, defaults; ``__all__`` is not a use)."""
    defs: list[tuple[str, ast.AST]] = []
    roots: list[ast.AST] = []

    def visit(body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.append((st.name, st))
                roots.extend([*st.decorator_list, *st.args.defaults, *(d for d in st.args.kw_defaults if d is not None)])
                if st.decorator_list:
                    roots.append(ast.Name(st.name))  # registered by its decorator
            elif isinstance(st, ast.ClassDef):
                defs.append((st.name, ast.Module(body=[], type_ignores=[])))
                roots.extend([*st.bases, *st.decorator_list])
                visit(st.body)
            elif not (isinstance(st, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in st.targets)):
                roots.append(st)

    visit(ast.parse(path.read_text("utf-8")).body)
    return defs, roots


def outside_only() -> dict[str, str]:
    """``"path:name"`` -> ``"tests"``, ``"benchmarks"`` or both, for every definition of the
    package that no used code of the package names while tests or benchmarks do."""
    defs: list[tuple[str, str, Counter[str]]] = []  # (key, name, names its body mentions)
    roots: Counter[str] = Counter(dict.fromkeys(CALLED_IMPLICITLY, 1))
    for path in sorted(SRC.rglob("*.py")):
        found, module_roots = _definitions(path)
        roots += _names(module_roots)
        for name, node in found:
            defs.append((f"{path.relative_to(SRC).as_posix()}:{name}", name, _names([node]) - Counter({name: 1})))
    outside = _outside_names()
    flagged: set[int] = set()
    while True:  # a definition only flagged ones use is flagged too
        used = Counter(roots)
        for i, (_, _, mentions) in enumerate(defs):
            if i not in flagged:
                used += mentions
        new = {i for i, (_, name, _) in enumerate(defs) if i not in flagged and not name.startswith("__")
               and not used[name] and outside[name]}
        if not new:
            break
        flagged |= new
    tests, benchmarks = (_names(ast.parse(p.read_text("utf-8")) for p in (REPO / d).rglob("*.py"))
                         for d in ("tests", "benchmarks"))
    return {defs[i][0]: " and ".join(w for w, c in (("tests", tests), ("benchmarks", benchmarks)) if c[defs[i][1]])
            for i in sorted(flagged)}


def test_the_reader_sees_definitions_and_uses() -> None:
    """The reader finds what it must (a reader that finds nothing passes the checks below)."""
    defs, roots = _definitions(SRC / "serve" / "requests.py")
    assert {"RequestProcessor", "process", "_conversation"} <= {name for name, _ in defs}
    assert _names(roots)["RequestProcessor"] == 0  # __all__ is not a use
    assert _outside_names()["RequestProcessor"] > 0  # a test names it


def test_nothing_in_src_is_used_only_by_tests_or_benchmarks() -> None:
    found = outside_only()
    new = {key: who for key, who in found.items() if key not in KNOWN_OUTSIDE_USE}
    assert not new, (
        "definitions in src/fastprefill that only tests or benchmarks use (move a test-only helper into tests/, "
        "benchmark-only code beside the scripts in benchmarks/, or delete it):\n"
        + "\n".join(f"{key} (used by {who})" for key, who in sorted(new.items()))
    )


def test_known_outside_uses_are_still_outside_only() -> None:
    fixed = set(KNOWN_OUTSIDE_USE) - set(outside_only())
    assert not fixed, f"used by the product again, or gone: remove from KNOWN_OUTSIDE_USE: {sorted(fixed)}"
