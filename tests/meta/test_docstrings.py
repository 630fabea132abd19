"""Docstrings of ``src/fastprefill`` and of the code beside the benchmark scripts
(``benchmarks/research``, ``benchmarks/figures``, ``benchmarks/verify.py``) name only files that
exist and hold no measured figures.

"Docstrings" here are module, class and function docstrings and ``#:`` comment blocks (the
attribute docs Sphinx renders), read with :mod:`ast` and :mod:`tokenize`; nothing is imported.

1. A repository path in a docstring (``benchmarks/...``, ``docs/...``, ``src/...``,
   ``tests/...``, ``scripts/...``, or any ``*.py`` / ``*.json`` path with a slash) must name a
   file or directory that exists: from the repository root, from ``src/``, from
   ``src/fastprefill/`` or from the documented module's folder. ``*``, ``<name>`` and ``{name}``
   are wildcards (``benchmarks/results/lazyllm_sweep_*``).
2. Measured figures (a speedup ``1.66x``, ``F1 24.9``, ``n = 50``, ``0.380 vs 0.399``, an
   approximate duration ``~0.5 s``, a percentage in a sentence that reports a result) belong in
   ``docs/results/`` or ``docs/decisions.md``, not in docstrings. Inline literals (````n=5````) are
   not searched, so code examples never count.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import REPO

SRC = REPO / "src" / "fastprefill"
#: Read besides ``src/fastprefill``: the benchmarks' packages and the figure check's script.
BENCHMARK_CODE = [*sorted((REPO / "benchmarks" / "research").rglob("*.py")),
                  *sorted((REPO / "benchmarks" / "figures").rglob("*.py")), REPO / "benchmarks" / "verify.py"]

#: Docstrings that hold measured figures today, as ``"<path>:<owner>"`` (the path under
#: ``src/fastprefill``, or from the repository root for the benchmarks' code)
#: (``owner`` as :func:`docstrings` names it). Each is to move to docs/results/ or
#: docs/decisions.md, and the lead empties this set. An entry
#: that no longer offends must be removed (the test says so).
MEASURED_ALLOWED: frozenset[str] = frozenset()

# --------------------------------------------------------------------------- reading docstrings


@dataclass(frozen=True)
class Doc:
    path: Path
    owner: str  # "<module>", "Class", "Class.method", "function", or the name a #: block documents
    line: int
    text: str

    @property
    def key(self) -> str:
        base = SRC if self.path.is_relative_to(SRC) else REPO
        return f"{self.path.relative_to(base).as_posix()}:{self.owner}"


def _definitions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    yield "<module>", tree
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                stack.append((f"{name}.", child))


def _comment_blocks(source: str) -> Iterator[tuple[str, int, str]]:
    """``#:`` comment blocks as ``(documented name, first line, text)``."""
    lines = source.splitlines()
    block: list[str] = []
    start = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.string.startswith("#:"):
            if not block:
                start = token.start[0]
            block.append(token.string[2:].strip())
        elif block and token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            following = lines[token.start[0] - 1]
            match = re.match(r"\s*(\w+)", following)
            yield (match.group(1) if match else f"line {start}"), start, "\n".join(block)
            block = []


def docstrings(path: Path) -> list[Doc]:
    source = path.read_text("utf-8")
    found = []
    for owner, node in _definitions(ast.parse(source, filename=str(path))):
        text = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if text:
            found.append(Doc(path, owner, getattr(node, "lineno", 1), text))
    found.extend(Doc(path, owner, line, text) for owner, line, text in _comment_blocks(source))
    return found


def all_docstrings() -> list[Doc]:
    return [doc for path in [*sorted(SRC.rglob("*.py")), *BENCHMARK_CODE] for doc in docstrings(path)]


# --------------------------------------------------------------------------- 1. paths

_PATH = re.compile(
    r"(?<![\w/.:~-])"  # not the middle of a URL or of a longer path
    r"(?:(?:benchmarks|docs|src|tests|scripts)/[\w.*<>{}/-]*"
    r"|[\w.*<>{}-]+(?:/[\w.*<>{}-]+)+\.(?:py|json)\b)"
)


def repo_paths(text: str) -> list[str]:
    """The repository paths ``text`` names, trailing punctuation dropped."""
    return [match.group(0).rstrip(".,") for match in _PATH.finditer(text)]


def path_exists(path: str, module_dir: Path) -> bool:
    pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", path).rstrip("/")
    for base in (REPO, REPO / "src", SRC, module_dir):
        if "*" in pattern:
            if any(base.glob(pattern)):
                return True
        elif (base / pattern).exists():
            return True
    return False


def test_path_reader() -> None:
    text = (
        "See ``benchmarks/results/<stem>_layers.png`` and docs/decisions.md, "
        "data/tasks/qa.py, https://github.com/a/b/blob/main/x.py and 64/2 heads."
    )
    assert repo_paths(text) == ["benchmarks/results/<stem>_layers.png", "docs/decisions.md", "data/tasks/qa.py"]
    assert path_exists("benchmarks/results/lazyllm_sweep_*", SRC)
    assert path_exists("data/tasks/qa.py", SRC)  # from src/fastprefill
    assert path_exists("tasks/qa.py", SRC / "data")  # from the module's folder
    assert not path_exists("src/fastprefill/data/tasks.py", SRC)


def test_docstrings_name_only_existing_files() -> None:
    docs = all_docstrings()
    assert len(docs) > 300  # the reader sees the tree's docstrings
    missing = [
        f"{doc.key} (line {doc.line}): {path}"
        for doc in docs
        for path in repo_paths(doc.text)
        if not path_exists(path, doc.path.parent)
    ]
    assert not missing, "docstrings name files that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- 2. measured figures

_NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?!\w)"  # a whole number: not the 2.5 of Qwen2.5, nor 1e5
_RESULT_WORDS = re.compile(r"\b(?:measured|observed|was|were|took|gave|reached|saved)\b", re.IGNORECASE)
MEASURED_PATTERNS: dict[str, re.Pattern[str]] = {
    "speedup": re.compile(r"(?<![\w.])\d+\.\d+\s?[x×](?!\w)"),
    "metric": re.compile(
        rf"\b(?:F1|EM|pass@1|accuracy|TTFT)\s*(?:of|=|:|was|is)?\s*~?{_NUMBER}\b(?!\s*(?:tokens|layers))"
        rf"|{_NUMBER}\s*(?:F1|EM|pass@1)\b"
    ),
    "sample count": re.compile(rf"\bn\s*=\s*{_NUMBER}"),
    "comparison": re.compile(rf"{_NUMBER}\s*%?\s*vs\.?\s*{_NUMBER}"),
    "approximate value": re.compile(rf"≈\s*{_NUMBER}|~\s?{_NUMBER}\s?(?:ms|s|min|minutes|seconds)\b"),
    "compute": re.compile(rf"{_NUMBER}\s?[GT]FLOPs?\b"),
}
_PERCENT = re.compile(rf"{_NUMBER}\s?%")
_LITERAL = re.compile(r"``.*?``", re.DOTALL)


def measured_figures(text: str) -> list[str]:
    """The measured figures in ``text`` as ``"<kind>: <match>"``, inline literals skipped."""
    prose = _LITERAL.sub("``...``", text)
    found = [f"{kind}: {m.group(0)}" for kind, pattern in MEASURED_PATTERNS.items() for m in pattern.finditer(prose)]
    for sentence in re.split(r"(?<=[.;])\s+", prose):
        if _RESULT_WORDS.search(sentence):
            found.extend(f"percentage: {m.group(0)}" for m in _PERCENT.finditer(sentence))
    return found


@pytest.mark.parametrize(
    "text",
    [
        "LazyLLM gave a 1.66x speedup.",
        "Base F1 24.9 at 2k tokens.",
        "base 73.7 F1, KVP-C 0.0",
        "(n = 50 questions)",
        "0.380 vs 0.399 mean relative K error",
        "parsed once, ~0.5 s",
        "the L1 (≈ 0.5-1 each after the fit)",
        "782 GFLOPs",
        "The fewest token-layers (62% on 24 layers) among schedules whose F1 was within 1 point.",
        "TTFT was 30 % lower (measured on smollm2).",
    ],
)
def test_measured_figures_are_found(text: str) -> None:
    assert measured_figures(text)


@pytest.mark.parametrize(
    "text",
    [
        "``build(n=5)[:3] == build(n=3)``",
        "keys ``(B, H_kv, N, d)``; a 95% percentile bootstrap interval of the mean.",
        "~20 % of ids go to dev",
        "at least ``length - max(2, length // 256)`` (within 0.4 %)",
        "Token-level F1 between one prediction and one gold answer.",
        "a seeded 4-layer random model (vocab 128, GQA 4/2 heads, hidden 64)",
        "kills any that do not exit within 10 s",
        "e.g. 4000 points for 2 ranks, 15 units for 8",
        "pass@1 with one greedy completion per problem",
        "``rope_theta`` 1e6 in Qwen2.5 vs 1e5 in SmolLM2",
    ],
)
def test_api_descriptions_are_not_flagged(text: str) -> None:
    assert measured_figures(text) == []


def test_docstrings_hold_no_measured_figures() -> None:
    offenders = {doc.key: measured_figures(doc.text) for doc in all_docstrings()}
    offenders = {key: figures for key, figures in offenders.items() if figures}
    new = {key: figures for key, figures in offenders.items() if key not in MEASURED_ALLOWED}
    assert not new, (
        "measured figures in docstrings (move them to docs/results/ or docs/decisions.md):\n"
        + "\n".join(f"{key}: {figures}" for key, figures in sorted(new.items()))
    )
    fixed = MEASURED_ALLOWED - set(offenders)
    assert not fixed, f"clean now, remove from MEASURED_ALLOWED: {sorted(fixed)}"
