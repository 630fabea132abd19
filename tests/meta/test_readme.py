"""The README is for users: short, self-contained, its commands and snippets real, its figures recomputed.

1. At most :data:`MAX_LINES` lines; no references to an issue tracker (``issue 13``, ``#13``)
   and no commit hashes outside code, in the README and in ``docs/``.
2. Its two commands for a fresh machine: the test command is exactly what ``.ci/run`` runs; the
   other sets up the same way and runs the demo.
3. Every Python snippet compiles, and imports its ``fastprefill`` names from the package itself,
   each one exported and existing (imported, no model loaded); every spec string a snippet passes
   to ``make_method`` builds.
4. Every ``fastprefill`` command line in a shell block parses with the real argument parser, and
   its ``--method`` specs build.
5. The summary table: every figure recomputed from the result file its row links to
   (:func:`figures.headline.check_summary_table`), which fails on a changed figure,
   a missing row or a wrong link.

No model is loaded; the summary table re-summarizes a dozen committed result files.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex

import pytest

from fastprefill.cli import build_parser
from fastprefill.methods.registry import make_method
from figures.headline import SUMMARY_ROWS, check_summary_table, summary_table
from tests import REPO

README = REPO / "README.md"
RESULTS = REPO / "benchmarks" / "results"
MAX_LINES = 250

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INLINE = re.compile(r"`[^`\n]*`")
#: "issue 13", "issues 4 and 5", "#13" (not a heading, an HTML entity or a URL fragment)
_TRACKER = re.compile(r"\bissues?\s+#?\d+|(?<![\w&#/])#\d+\b", re.IGNORECASE)
#: 7 to 40 hex digits with at least one letter and one digit: a commit hash, short or full
_HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])")


def blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``text`` in language ``lang``."""
    return [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == lang]


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code."""
    return _INLINE.sub("", _FENCE.sub("", text))


def section(text: str, heading: str) -> str:
    """The text under the ``## heading`` up to the next ``## ``."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end > 0 else None]


def readme() -> str:
    return README.read_text("utf-8")


# --------------------------------------------------------------------------- 1. short and self-contained


def test_the_readme_is_short():
    lines = readme().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES} (results go to docs/results/)"


@pytest.mark.parametrize("text", ["see issue 13", "as issues 4 and 5 ask", "fixed in #12", "at commit 1018df3",
                                  "(commit a1ef70f)"])
def test_tracker_and_hash_patterns_find_them(text):
    assert _TRACKER.search(text) or _HASH.search(text)


@pytest.mark.parametrize("text", ["## Results", "Qwen2.5-Coder-1.5B", "sha256 of 64 hex", "1024 tokens", "decade",
                                  "docs/results/lazyllm.md#passkey", "0.5B at 2k", "2 procs"])
def test_tracker_and_hash_patterns_spare_prose(text):
    assert not _TRACKER.search(text) and not _HASH.search(text)


@pytest.mark.parametrize("path", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))])
def test_no_tracker_references_or_commit_hashes(path):
    text = prose((REPO / path).read_text("utf-8"))
    found = [m.group(0) for m in _TRACKER.finditer(text)] + [m.group(0) for m in _HASH.finditer(text)]
    assert not found, f"{path}: a reader cannot follow {found}; say what was measured or decided instead"


# --------------------------------------------------------------------------- 2. the two commands


def _ci_command() -> str:
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(("#", "set ", "cd "))][-1]


def test_the_two_commands_are_the_ones_ci_runs():
    fresh = section(readme(), "Two commands for a fresh machine")
    commands = [b.strip() for b in blocks(fresh, "bash")]
    assert len(commands) == 2, commands
    demo, tests = commands
    assert tests == _ci_command() == "bash scripts/setup.sh && .venv/bin/python -m pytest"
    setup = tests.split(" && ")[0]
    assert demo == f"{setup} && .venv/bin/fastprefill demo"
    assert build_parser().parse_args(["demo"]).command == "demo"


# --------------------------------------------------------------------------- 3. Python snippets


def _snippets() -> list[str]:
    return blocks(readme(), "python")


def test_the_readme_has_python_snippets():
    assert len(_snippets()) >= 4


@pytest.mark.parametrize("index", range(len(blocks(README.read_text("utf-8"), "python"))))
def test_python_snippet_compiles_and_its_fastprefill_names_exist(index):
    code = _snippets()[index]
    tree = ast.parse(code)
    compile(tree, f"README.md python block {index + 1}", "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastprefill":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fastprefill":
                    importlib.import_module(alias.name)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "make_method"
              and node.args and isinstance(node.args[0], ast.Constant)):
            make_method(node.args[0].value)


def test_python_snippets_import_fastprefill_names_from_the_package_itself():
    """A user imports what the README shows from ``fastprefill``, never from a submodule, and the
    package exports each of those names."""
    import fastprefill

    imported = set()
    for code in _snippets():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastprefill":
                assert node.module == "fastprefill", f"README imports from {node.module}; import from fastprefill"
                imported |= {alias.name for alias in node.names}
    assert {"generate", "load_model", "make_method", "RankPool"} <= imported
    assert imported <= set(fastprefill.__all__), sorted(imported - set(fastprefill.__all__))


# --------------------------------------------------------------------------- 4. command lines


def _command_lines() -> list[str]:
    lines = []
    for block in blocks(readme(), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if "fastprefill " in line and not line.startswith(("bash ", "torchrun")):
                lines.append(line.split("| ")[-1])
    return lines


def test_fastprefill_command_lines_parse():
    lines = _command_lines()
    assert any(ln.startswith("fastprefill serve") for ln in lines) and len(lines) >= 8
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line)[1:]
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README command does not parse: {line}")
        specs = getattr(args, "methods", None) or [getattr(args, "method", None)]
        for spec in filter(None, specs):
            if not spec.startswith("auto:"):  # needs a profile made by `fastprefill tune`
                make_method(spec)


# --------------------------------------------------------------------------- 5. the summary table


def test_every_summary_figure_is_recomputed_from_its_result_file():
    mismatches = check_summary_table(readme(), RESULTS)
    assert not mismatches, "\n".join(map(str, mismatches))
    assert len(summary_table(readme())) == len(SUMMARY_ROWS)


def _row_line(text: str, label: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(f"| {label} |"))


def test_a_changed_figure_is_found():
    text = readme()
    line = _row_line(text, "prefix cache, hit")
    speedup = re.search(r"\| (\d+\.\d+)x \|", line).group(1)
    changed = text.replace(line, line.replace(f"{speedup}x", f"{float(speedup) + 0.7:.2f}x").replace("| 18 |", "| 19 |"))
    found = {m.where for m in check_summary_table(changed, RESULTS)}
    assert found == {"summary row 'prefix cache, hit', column 'TTFT speedup'",
                     "summary row 'prefix cache, hit', column 'n'"}


def test_a_missing_row_or_a_wrong_link_is_found():
    text = readme()
    line = _row_line(text, "kvp-prefix")
    assert check_summary_table(text.replace(line + "\n", ""), RESULTS)[0].where == "summary table rows"
    wrong = text.replace(line, line.replace("kvp_prefix_singledoc-qa_1024_bfloat16.jsonl", "kvp_singledoc-qa_1024_bfloat16.jsonl"))
    assert "summary row 'kvp-prefix': result link" in {m.where for m in check_summary_table(wrong, RESULTS)}
