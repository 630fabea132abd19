"""The documentation's figures, paths and commands checked against the committed result files.

:func:`verify_pages` reads the README and every page under ``docs/`` of a repository and checks:

- the README's summary table, recomputed row by row (:func:`~figures.headline.check_summary_table`);
- every table of a page that is preceded by a line ``<!-- from: benchmarks/results/<file> -->``
  quotes that result: each of its columns is a column of the table recomputed from the file (for
  bench records :func:`markdown_table` plus the columns of :data:`EXTRA_COLUMNS` and, for a
  prefix-cache run, :func:`prefix_overhead_table`'s, for a tune run its figures per length, half
  and candidate; for a run paired by a ``.summary.json``
  :func:`reference_table`; for a selection-ceiling run its rows re-summarized; for any other
  result the committed ``.md``'s tables), and each of
  its rows is the recomputed row with the same key cells (:data:`KEY_COLUMNS`; without any, the
  rows in order). A cell must print as recomputed, to the precision it is printed with. The
  comment may rename columns for the reader: ``(turn = length)`` after the file name;
- every figure in prose that a ``<!-- src: ... -->`` comment sources, recomputed
  (:func:`~figures.prose.check_prose`);
- every ``benchmarks/results/...`` path named exists (``{a,b}`` and ``*`` expand), and every
  relative link points at a file;
- every benchmark command quoted inline (```python benchmarks/...``` or ```fastprefill bench
  --...```) is one that a result file or checkpoint records as the command that made it (the
  path of the ``fastprefill`` executable aside).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastprefill.bench.records import FULL, load_records, read_rows
from fastprefill.bench.report import markdown_table
from fastprefill.bench.summary import Summary, summarize
from fastprefill.errors import ConfigError
from figures.headline import check_summary_table
from figures.prose import check_prose, namespace
from figures.results import (
    PREFIX_KINDS,
    Mismatch,
    VerifyReport,
    cell_matches,
    paired_summary_table,
    parse_table,
    parse_tables,
    script_summary,
)
from reporting import prefix_overhead_table
from research.ceiling import ceiling_summary

__all__ = ["EXTRA_COLUMNS", "KEY_COLUMNS", "page_sources", "recorded_commands", "result_tables", "verify_pages"]

#: Columns a page may quote from bench records beyond :func:`markdown_table`'s, by name.
EXTRA_COLUMNS: dict[str, Any] = {
    "median total (s)": lambda s: f"{s.total_median_s:.2f}",
    "paired total speedup": lambda s: "—" if s.is_reference else f"{s.total_speedup_paired_median:.2f}x",
    "slower in total": lambda s: "—" if s.is_reference else f"{100 * s.slower_total_share:.1f}%",
    "answer tokens (mean)": lambda s: f"{s.new_tokens_mean:.1f}",
    "gold tokens kept at the cut": lambda s: ("—" if s.gold_kept_share_per_stage is None
                                              else " / ".join(f"{100 * x:.0f}%" for x in s.gold_kept_share_per_stage)),
}

#: Cells that name a row (matched as text) rather than measure it.
KEY_COLUMNS = ("length", "method", "model", "tokens", "prompt", "clients", "l", "maps", "link GB/s",
               "cache the base reads", "selection", "half", "candidate", "system", "kind")

_SOURCE = re.compile(r"^<!--\s*from:\s*(?:\.\./)*benchmarks/results/([^\s()]+)\s*(?:\(([^)]*)\))?\s*-->", re.MULTILINE)
_RESULT_PATH = re.compile(r"benchmarks/results/[\w.*{},+-]+")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"^(?:python benchmarks/|\S*fastprefill bench --)")


def _extra(summaries: list[Summary]) -> list[dict[str, str]]:
    return [{name: fn(s) for name, fn in EXTRA_COLUMNS.items()} for s in summaries]


def _ceiling_table(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"length": str(r["length"]), "selection": r["selection"], "n": str(r["n"]),
             "first token = full": f"{100 * r['first_token_agreement']:.0f}%",
             "median first-token KL": f"{r['median_first_token_kl']:.2f}",
             "gold tokens kept": f"{100 * r['gold_kept_share_mean']:.0f}%",
             "token-layers": f"{100 * r['token_layer_fraction_mean']:.0f}%"} for r in ceiling_summary(rows)]


def _tune_table(records: list[Any]) -> list[dict[str, str]]:
    """A tune run's figures per prompt length, half and candidate (what its chooser saw), on
    first-token agreement with a 95% Wilson interval: ``<split>:<id>@<length>`` prompt ids; with
    both splits the dev half chooses and the test half reports, else the halves go by hash."""
    from fastprefill.methods.auto import Target
    from fastprefill.tune import measure, split_of_prompt

    ids = {r.sample_id for r in records}
    by_split = {i.split(":", 1)[0] for i in ids} >= {"dev", "test"}

    def half(sample_id: str) -> str:
        if by_split:
            return "dev (choose)" if sample_id.startswith("dev:") else "test (report)"
        return split_of_prompt(sample_id)

    target = Target("first-token", 0.5)  # the interval does not depend on the target's value
    methods = list(dict.fromkeys(r.method for r in records if r.method != FULL))
    groups: dict[tuple[int, str], list[Any]] = {}
    for r in records:
        groups.setdefault((int(r.sample_id.rsplit("@", 1)[1]), half(r.sample_id)), []).append(r)
    rows = []
    for (length, h), group in sorted(groups.items()):
        for method in methods:
            if (c := measure(group, method, target)) is not None:
                rows.append({"length": str(length), "half": h, "candidate": method.split("preset=")[-1],
                             "n": str(c.n), "paired TTFT ratio": f"{c.ttft_ratio:.2f}x",
                             "first token = full [95% CI]": f"{c.fidelity:.2f} [{c.low:.2f}, {c.high:.2f}]"})
    return rows


def result_tables(results: Path, name: str) -> list[list[dict[str, str]]]:
    """The tables a page may quote from result ``name`` (see the module docstring).

    Raises:
        ConfigError: no such result file.
    """
    path = results / name
    if not path.exists():
        raise ConfigError(f"no result file benchmarks/results/{name}")
    stem = str(path)[: -len(path.suffix)]
    md = Path(stem + ".md")
    if path.suffix == ".jsonl":
        header, rows = read_rows(path) if path.read_text().startswith('{"header"') else ({}, [])
        if header.get("bench") == "lazyllm-ceiling":
            return [_ceiling_table(rows)]
        if (remade := script_summary(path, header, rows)) is not None:  # the script's own tables
            return parse_tables(remade[1])
        try:
            header, records = load_records(path)
        except (ConfigError, TypeError, KeyError, json.JSONDecodeError):
            records = []
        if records:
            sjson = Path(stem + ".summary.json")
            if sjson.exists():
                return [parse_table(paired_summary_table(sjson, records))]
            summaries = summarize(records, reference=header.get("references", FULL))
            rows = [{**row, **extra} for row, extra in zip(parse_table(markdown_table(summaries)), _extra(summaries),
                                                          strict=True)]
            tables = [rows]
            if header.get("kind") in PREFIX_KINDS:
                tables.append(parse_table(prefix_overhead_table(records)))
            if header.get("task") == "tune":
                tables.append(_tune_table(records))
            return tables
    if not md.exists():
        raise ConfigError(f"benchmarks/results/{name}: neither bench records nor a committed .md table")
    return parse_tables(md.read_text())


def _key(row: dict[str, str]) -> tuple[str, ...]:
    return tuple(row[c] for c in KEY_COLUMNS if c in row)


def _match_rows(page: str, source: str, rows: list[dict[str, str]], tables: list[list[dict[str, str]]]) -> list[Mismatch]:
    columns = set(rows[0]) if rows else set()
    candidates = [t for t in tables if t and columns <= set(t[0])]
    if not candidates:
        return [Mismatch(page, f"table from {source}", sorted(columns), "(no recomputed table has these columns)")]
    table = candidates[0]
    keyed = any(c in columns for c in KEY_COLUMNS)
    if not keyed and len(rows) != len(table):
        return [Mismatch(page, f"table from {source}: rows", len(rows), len(table))]
    out = []
    for i, row in enumerate(rows):
        if keyed:
            found = [t for t in table if _key({c: t[c] for c in row}) == _key(row)]
            if len(found) != 1:
                out.append(Mismatch(page, f"table from {source}, row {_key(row)}", "1 row", f"{len(found)} rows"))
                continue
            new = found[0]
        else:
            new = table[i]
        for col, cell in row.items():
            if not cell_matches(cell, new[col]):
                out.append(Mismatch(page, f"table from {source}, row {i + 1} column {col!r}", cell, new[col]))
    return out


def page_sources(text: str) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """``(result file name, the table after the comment)`` for every ``<!-- from: ... -->`` of a
    page, the table's columns renamed back to the result's as the comment says
    (``<!-- from: benchmarks/results/<file> (turn = length) -->``: the page's ``turn`` is ``length``)."""
    for match in _SOURCE.finditer(text):
        renames = dict(tuple(part.strip() for part in item.split("=", 1))
                       for item in (match.group(2) or "").split(",") if "=" in item)
        tables = parse_tables(text[match.end():])
        rows = [{renames.get(k, k): v for k, v in row.items()} for row in (tables[0] if tables else [])]
        yield match.group(1), rows


def _walk_commands(value: Any, found: set[str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "command" and isinstance(v, str):
                found.add(v)
            else:
                _walk_commands(v, found)
    elif isinstance(value, list):
        for v in value:
            _walk_commands(v, found)


def _normal(command: str) -> str:
    return re.sub(r"^\S*/fastprefill ", "fastprefill ", " ".join(command.split()))


def recorded_commands(benchmarks: Path) -> set[str]:
    """Every command a result file or checkpoint under ``benchmarks`` records (whitespace and the
    ``fastprefill`` executable's path normalised)."""
    found: set[str] = set()
    for path in benchmarks.rglob("*.json*"):
        try:
            if path.suffix == ".jsonl":
                _walk_commands(read_rows(path)[0], found)
            else:
                _walk_commands(json.loads(path.read_text()), found)
        except (ConfigError, json.JSONDecodeError, UnicodeDecodeError, IndexError):
            continue
    for path in benchmarks.rglob("*.md"):
        found.update(m.group(1) for m in _CODE.finditer(path.read_text()) if _COMMAND.match(m.group(1)))
    return {_normal(c) for c in found}


def _expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [p for alt in match.group(1).split(",")
            for p in _expand(pattern[: match.start()] + alt + pattern[match.end():])]


def _check_paths(report: VerifyReport, root: Path, page: Path, text: str, commands: set[str]) -> None:
    name = str(page.relative_to(root))
    for match in _RESULT_PATH.finditer(text):
        for path in _expand(match.group(0).rstrip(".,")):
            if not (any(root.glob(path)) if "*" in path else (root / path).exists()):
                report.mismatches.append(Mismatch(name, "path", path, "(no such file)"))
    for match in _LINK.finditer(text):
        target = match.group(1).split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
            report.mismatches.append(Mismatch(name, "link", match.group(1), "(no such file)"))
    for match in _CODE.finditer(text):
        code = match.group(1)
        if _COMMAND.match(code) and _normal(code) not in commands:
            report.mismatches.append(Mismatch(name, "command", code, "(no result file records it)"))


def verify_pages(root: str | Path) -> VerifyReport:
    """Check the README and ``docs/**/*.md`` of the repository at ``root``; see the module docstring.

    Raises:
        ConfigError: ``root`` has no README.md or no ``benchmarks/results``.
    """
    root = Path(root)
    readme, results = root / "README.md", root / "benchmarks" / "results"
    if not readme.exists() or not results.is_dir():
        raise ConfigError(f"{root}: not a fastprefill checkout (README.md and benchmarks/results needed)")
    report = VerifyReport()
    commands = recorded_commands(root / "benchmarks")
    text = readme.read_text()
    report.mismatches += check_summary_table(text, results)
    pages = [readme, *sorted((root / "docs").rglob("*.md"))]
    ns = namespace(results)
    for page in pages:
        text = page.read_text()
        _check_paths(report, root, page, text, commands)
        report.mismatches += check_prose(str(page.relative_to(root)), text, results, ns)[0]
        for source, rows in page_sources(text):
            report.quoted.add(source)
            try:
                tables = result_tables(results, source)
            except ConfigError as exc:
                report.mismatches.append(Mismatch(str(page.relative_to(root)), "source", source, str(exc)))
                continue
            report.mismatches += _match_rows(str(page.relative_to(root)), source, rows, tables)
        report.checked.append(str(page.relative_to(root)))
    return report
