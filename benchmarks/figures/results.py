"""Every committed figure reproduces: re-summarize result files and compare with their summaries.

For each ``<stem>.jsonl`` of bench records in a results directory, the committed summaries next
to it are rebuilt from the records alone and compared:

- ``<stem>.summary.json`` (runs paired with per-method references): every committed entry key
  except the per-layer K/V errors (which need the models), and ``n_done``;
- ``<stem>.md``: every column of the committed table, cell by cell (the :func:`reference_table`
  form when a ``.summary.json`` exists, else :func:`markdown_table`), and a prefix-cache run's
  second table (:func:`prefix_overhead_table`);
- ``<stem>.summary.jsonl`` (rows paired with full prefill): every committed row key, and the
  header's ``retrieved_by_depth`` and ``selection`` when present.

Also every cache-ablation ``<stem>.json`` against its ``<stem>.md``, the ``summary`` in the
header of every selection-ceiling ``<stem>.jsonl`` against its rows, the ``.summary.jsonl``
and ``.md`` of a blending gate run and of a chunked-prefill run (``benchmarks/prefill_chunks.py``)
re-made from its rows by the script's own summary, the ``kind: summary`` row
and ``.md`` table of every ``n`` answers run (``serve_n_<model>.jsonl``) against its request
rows, the serve, soak, KV-Runahead and kvp-prefix sweep runs and the anchors' summaries by their
scripts' own summaries (:mod:`figures.families`), and, in every ``third_party_clients.json`` (in the directory or a folder of it), what the
per-sample records and the clients' saved files re-derive (:func:`client_scores.rescore_row`:
the in-process comparison's counts, scores and differences, lm-eval's aggregates, LangChain's
and guidellm's summaries); the clients' and the model's own numbers are taken as recorded.
Numbers in a table must print the same (to the committed precision); numbers in JSON agree to a
relative 1e-9. Files that are not bench records, or have no summary, are listed as skipped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastprefill.bench.records import FULL, Record, load_records, read_rows
from fastprefill.bench.report import markdown_table
from fastprefill.bench.summary import summarize
from fastprefill.errors import ConfigError
from reporting import method_entry, needle_by_depth, paired_row, prefix_overhead_table, reference_table
from research.ablation import ablation_table
from research.ceiling import ceiling_summary
from research.selection import choose_by_fidelity, choose_default

__all__ = ["Mismatch", "VerifyReport", "cell_matches", "compare_json", "compare_rows", "compare_tables",
           "paired_summary_table", "parse_table", "parse_tables", "verify_results"]

_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
#: ``kind`` in the header of a prefix-cache run (``benchmarks/prefix_bench.py``): its ``.md`` has
#: a second table, the cache's own costs.
PREFIX_KINDS = ("questions", "chat", "evict")
#: The file ``benchmarks/third_party_clients.py`` writes in its ``--out`` (a results directory or
#: a folder of one).
CLIENTS = "third_party_clients.json"
#: Entry keys of a ``.summary.json`` that are measured on the models, not derived from records.
_MODEL_KEYS = ("rel_error_k", "rel_error_v", "rel_error_prompts")


@dataclass
class Mismatch:
    """A committed value that the records do not reproduce."""

    file: str
    where: str
    committed: Any
    recomputed: Any

    def __str__(self) -> str:
        return f"{self.file}: {self.where}: committed {self.committed!r}, recomputed {self.recomputed!r}"


@dataclass
class VerifyReport:
    """What :func:`verify_results` checked, skipped (file -> reason) and found different."""

    checked: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    #: result files whose tables or figures a page quotes, recomputed there (:func:`figures.pages.verify_pages`)
    quoted: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def parse_tables(markdown: str) -> list[list[dict[str, str]]]:
    """Every markdown table of a text, in order, each as rows of column -> cell text."""
    tables: list[list[dict[str, str]]] = []
    block: list[list[str]] = []
    for ln in [*markdown.splitlines(), ""]:
        ln = ln.strip()
        if ln.startswith("|"):
            block.append([c.strip() for c in ln.strip("|").split("|")])
            continue
        if len(block) >= 2:
            head = block[0]
            tables.append([dict(zip(head, row, strict=True)) for row in block[2:]])
        block = []
    return tables


def parse_table(markdown: str) -> list[dict[str, str]]:
    """The first markdown table of a text, as rows of column -> cell text."""
    tables = parse_tables(markdown)
    return tables[0] if tables else []


def cell_matches(committed: str, recomputed: str) -> bool:
    """Whether two cells print the same text and numbers, to the precision of the less precise."""
    if _NUMBER.sub("#", committed) != _NUMBER.sub("#", recomputed):
        return False
    for a, b in zip(_NUMBER.findall(committed), _NUMBER.findall(recomputed), strict=True):
        decimals = min(len(x.split(".")[1]) if "." in x else 0 for x in (a, b))
        if abs(float(a) - float(b)) > 0.5 * 10.0 ** -decimals + 1e-12:
            return False
    return True


def compare_rows(file: str, old: list[dict[str, str]], new: list[dict[str, str]]) -> list[Mismatch]:
    """Cell-by-cell differences of the committed rows' columns (row order must agree)."""
    if len(old) != len(new):
        return [Mismatch(file, "table rows", len(old), len(new))]
    out = []
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        for col, cell in a.items():
            if col not in b:
                out.append(Mismatch(file, f"column {col!r}", cell, "(missing)"))
            elif not cell_matches(cell, b[col]):
                out.append(Mismatch(file, f"row {i + 1} column {col!r}", cell, b[col]))
    return out


def compare_tables(file: str, committed: str, recomputed: str) -> list[Mismatch]:
    """Cell-by-cell differences of the committed table's columns (row order must agree)."""
    return compare_rows(file, parse_table(committed), parse_table(recomputed))


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return all(k in b and _json_equal(v, b[k]) for k, v in a.items())
    return a == b


def compare_json(file: str, where: str, committed: Any, recomputed: Any) -> list[Mismatch]:
    """Differences of the committed value's keys (recursively; numbers to a relative 1e-9)."""
    if isinstance(committed, Mapping) and isinstance(recomputed, Mapping):
        out = []
        for k, v in committed.items():
            out += compare_json(file, f"{where}.{k}", v, recomputed.get(k, "(missing)"))
        return out
    if (isinstance(committed, list) and isinstance(recomputed, list) and len(committed) == len(recomputed)
            and any(isinstance(v, Mapping) for v in committed)):
        return [m for i, (a, b) in enumerate(zip(committed, recomputed)) for m in compare_json(file, f"{where}[{i}]", a, b)]
    return [] if _json_equal(committed, recomputed) else [Mismatch(file, where, committed, recomputed)]


def _kvp_summary(records: Sequence[Record], doc: Mapping[str, Any]) -> dict[str, Any]:
    order = list(doc["methods"])
    by_ref = summarize(records, reference=doc["references"], order=order)
    vs_full = {(s.length, s.method): s for s in summarize(records, reference=FULL, order=order)}
    return {s.method: method_entry(s, vs_full[(s.length, s.method)]) for s in by_ref}


def _check_summary_json(report: VerifyReport, path: Path, records: Sequence[Record]) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    entries = _kvp_summary(records, doc)
    for name, committed in doc["summary"].items():
        kept = {k: v for k, v in committed.items() if k not in _MODEL_KEYS}
        report.mismatches += compare_json(path.name, f"summary.{name}", kept, entries.get(name, {}))
    if "n_done" in doc:
        report.mismatches += compare_json(path.name, "n_done", doc["n_done"], {n: e["n"] for n, e in entries.items()})
    # the per-layer errors come from the models: carry the committed ones into the table
    for name, committed in doc["summary"].items():
        entries.setdefault(name, {}).update({k: committed[k] for k in _MODEL_KEYS if k in committed})
    return {**doc, "summary": entries}


def paired_summary_table(path: str | Path, records: Sequence[Record]) -> str:
    """The :func:`reference_table` of a run paired by the ``.summary.json`` at ``path``, its entries
    recomputed from ``records`` (the per-layer K/V errors, measured on the models, as committed)."""
    doc = _check_summary_json(VerifyReport(), Path(path), records)
    return reference_table(doc, doc["summary"], title="-")


def _check_summary_jsonl(report: VerifyReport, path: Path, records: Sequence[Record]) -> None:
    header, rows = read_rows(path)
    summaries = summarize(records)
    new = {(s.length, s.method): paired_row(s) for s in summaries if not s.is_reference}
    if len(rows) != len(new):
        report.mismatches.append(Mismatch(path.name, "rows", len(rows), len(new)))
    for row in rows:
        key = (row.get("length"), row.get("method"))
        report.mismatches += compare_json(path.name, f"row {key}", row, new.get(key, {}))
    if "retrieved_by_depth" in header:
        report.mismatches += compare_json(path.name, "header.retrieved_by_depth",
                                          header["retrieved_by_depth"], needle_by_depth(records))
    if "selection" in header:
        # The rule that chose is named by its own output: the fidelity rule ranks candidates.
        rule = choose_by_fidelity if "ranking" in header["selection"] else choose_default
        report.mismatches += compare_json(path.name, "header.selection", header["selection"], rule(summaries))


def _check_records(report: VerifyReport, jsonl: Path) -> None:
    stem = str(jsonl)[: -len(".jsonl")]
    md, sjson, sjsonl = Path(stem + ".md"), Path(stem + ".summary.json"), Path(stem + ".summary.jsonl")
    if not (md.exists() or sjson.exists() or sjsonl.exists()):
        report.skipped[jsonl.name] = "no committed summary"
        return
    try:
        header, records = load_records(jsonl)
    except (ConfigError, TypeError, json.JSONDecodeError) as exc:
        report.skipped[jsonl.name] = f"not bench records ({type(exc).__name__})"
        return
    doc = _check_summary_json(report, sjson, records) if sjson.exists() else None
    if md.exists():
        table = (reference_table(doc, doc["summary"], title="-") if doc is not None
                 else markdown_table(summarize(records), header))
        report.mismatches += compare_tables(md.name, md.read_text(), table)
        if header.get("kind") in PREFIX_KINDS:
            tables = parse_tables(md.read_text())
            report.mismatches += compare_rows(md.name + " (overhead table)", tables[1] if len(tables) > 1 else [],
                                              parse_table(prefix_overhead_table(records)))
    if sjsonl.exists():
        _check_summary_jsonl(report, sjsonl, records)
    report.checked += [p.name for p in (jsonl, sjson, md, sjsonl) if p.exists()]


def _check_ceiling(report: VerifyReport, path: Path, header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> None:
    """A selection-ceiling file: its header's ``summary`` re-summarized from its rows."""
    report.mismatches += compare_json(path.name, "header.summary", header.get("summary"), ceiling_summary(rows))
    report.checked.append(path.name)


def script_summary(path: Path, header: Mapping[str, Any],
                   rows: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], str] | None:
    """The summary rows and the ``.md`` text a script writes beside ``path``, re-made from its
    records by the script's own summary, for the runs whose script makes its own: a blending gate
    (``benchmarks/blend_gate.py``: the gate's table and, for a run that recorded them, the
    seams') and a chunked-prefill run (``benchmarks/prefill_chunks.py``); ``None`` for any other
    bench. ``header`` and ``rows`` are the file's as :func:`read_rows` gives them."""
    if header.get("bench") == "blend-gate":
        from blend_gate import summarize_gate, table

        gate_header, records = load_records(path)
        summary = summarize_gate(records)
        return summary, table(summary, gate_header)
    if header.get("bench") == "prefill-chunks":
        from prefill_chunks import summarize
        from prefill_chunks import table as chunk_table

        summary = summarize(rows)
        return summary, chunk_table(summary, header)
    return None


def _check_script_summary(report: VerifyReport, path: Path, rows: Sequence[Mapping[str, Any]], table: str) -> None:
    """The ``.summary.jsonl`` rows and the ``.md`` beside ``path`` against ``rows`` and every table
    of ``table`` (:func:`script_summary`); skipped when neither file is committed."""
    stem = str(path)[: -len(".jsonl")]
    sjsonl, md = Path(stem + ".summary.jsonl"), Path(stem + ".md")
    if not (sjsonl.exists() or md.exists()):
        report.skipped[path.name] = "no committed summary"
        return
    if sjsonl.exists():
        report.mismatches += compare_json(sjsonl.name, "rows", read_rows(sjsonl)[1], rows)
    if md.exists():
        committed, remade = parse_tables(md.read_text()), parse_tables(table)
        if len(committed) != len(remade):
            report.mismatches.append(Mismatch(md.name, "tables", len(committed), len(remade)))
        for i, (old, new) in enumerate(zip(committed, remade)):
            report.mismatches += compare_rows(md.name if i == 0 else f"{md.name} (table {i + 1})", old, new)
    report.checked += [p.name for p in (path, sjsonl, md) if p.exists()]


def _check_serve_n(report: VerifyReport, path: Path) -> None:
    """An ``n`` answers run (``benchmarks/serve_n.py``): its ``kind: summary`` row and ``.md``
    table re-made from its request rows by the script's own :func:`serve_n.summarize`."""
    from serve_n import summarize, table

    header, rows = read_rows(path)
    summary = summarize(rows, header["n"])
    committed = [r for r in rows if r.get("kind") == "summary"]
    if len(committed) != 1:
        report.mismatches.append(Mismatch(path.name, "summary rows", len(committed), 1))
    report.mismatches += compare_json(path.name, "summary", committed[-1] if committed else {}, summary)
    md = path.with_suffix(".md")
    if md.exists():
        report.mismatches += compare_tables(md.name, md.read_text(), table(summary, header))
    report.checked += [p.name for p in (path, md) if p.exists()]


def _common(committed: Any, recomputed: Any) -> Any:
    """``committed`` cut to what ``recomputed`` has: the keys of mappings, recursively, and lists
    of the same length item by item."""
    if isinstance(committed, Mapping) and isinstance(recomputed, Mapping):
        return {k: _common(committed[k], v) for k, v in recomputed.items() if k in committed}
    if isinstance(committed, list) and isinstance(recomputed, list) and len(committed) == len(recomputed):
        return [_common(a, b) for a, b in zip(committed, recomputed, strict=True)]
    return committed


def _check_clients(report: VerifyReport, path: Path, name: str) -> None:
    """A ``third_party_clients.json`` (``benchmarks/third_party_clients.py``): per method, what
    re-derives from its per-sample records and the clients' files beside it
    (:func:`client_scores.rescore_row`), against the committed values."""
    from client_scores import rescore_row

    doc = json.loads(path.read_text())
    for row in doc["rows"]:
        try:
            again = rescore_row(row, path.parent)
        except (KeyError, TypeError) as exc:  # records of a run that saved too little to re-derive
            report.skipped[f"{name} ({row.get('method')})"] = f"not re-derivable ({type(exc).__name__}: {exc})"
            continue
        report.mismatches += compare_json(name, f"rows[{row['method']}]", _common(row, again), again)
        if gaps := [part for part in ("gen", "ll", "langchain", "guidellm") if part in row and part not in again]:
            report.skipped[f"{name} ({row['method']})"] = f"{', '.join(gaps)}: no per-sample records or client file"
    report.checked.append(name)


def _check_ablation(report: VerifyReport, path: Path) -> None:
    md = path.with_suffix(".md")
    doc = json.loads(path.read_text())
    if not (isinstance(doc, dict) and doc.get("header", {}).get("bench") == "kvp-ablation" and md.exists()):
        return
    report.mismatches += compare_tables(md.name, md.read_text(), ablation_table(doc["header"], doc["rows"], "-"))
    report.checked += [path.name, md.name]


#: ``.json`` results whose ``.md`` a benchmark script renders: file-name prefix -> (module, function)
RENDERED = {"attention_": ("attention_bench", "markdown"), "machine_speed_": ("machine_speed", "markdown"),
            "kernel_versions_": ("kernel_versions", "markdown"), "row_products_": ("row_products", "markdown"),
            "hit_storage_": ("hit_storage", "markdown"), "row_floor_cost_": ("row_floor_cost", "markdown"),
            "stream_rows_": ("stream_rows", "markdown"), "mixed_streams_": ("mixed_streams", "markdown"),
            "fused_": ("packed_bench", "markdown"), "wide_rows_": ("packed_bench", "markdown"),
            "mlp_variants_": ("mlp_variants", "markdown"), "locked_weights_": ("locked_weights", "markdown"),
            "last_row_": ("last_row", "markdown")}


def _check_rendered(report: VerifyReport, path: Path) -> None:
    """A ``.json`` result of a script in :data:`RENDERED`: its ``.md`` rendered again from it,
    every table compared cell by cell and the prose before the tables line by line."""
    found = next(((mod, fn) for prefix, (mod, fn) in RENDERED.items() if path.name.startswith(prefix)), None)
    md = path.with_suffix(".md")
    if found is None or not md.exists():
        return
    import importlib

    render = getattr(importlib.import_module(found[0]), found[1])
    committed, remade = md.read_text(), render(json.loads(path.read_text()))
    old, new = parse_tables(committed), parse_tables(remade)
    if len(old) != len(new):
        report.mismatches.append(Mismatch(md.name, "tables", len(old), len(new)))
    for a, b in zip(old, new, strict=False):
        report.mismatches += compare_rows(md.name, a, b)
    prose = [ln for ln in committed.splitlines() if ln and not ln.startswith("|")]
    for line, again in zip(prose, [ln for ln in remade.splitlines() if ln and not ln.startswith("|")], strict=False):
        if line != again:
            report.mismatches.append(Mismatch(md.name, "text", line, again))
    report.checked += [path.name, md.name]


def verify_results(results: str | Path) -> VerifyReport:
    """Re-summarize every result file in ``results`` that has a committed summary; see the module doc."""
    results = Path(results)
    if not results.is_dir():
        raise ConfigError(f"{results}: no such results directory")
    report = VerifyReport()
    for jsonl in sorted(results.glob("*.jsonl")):
        if jsonl.name.endswith(".summary.jsonl"):
            continue
        if check_family(report, jsonl):  # serve, soak, runahead and sweep runs: their scripts' own summaries
            continue
        try:
            header, rows = read_rows(jsonl)
        except (ConfigError, json.JSONDecodeError):
            report.skipped[jsonl.name] = "no header line: not a bench result file"
            continue
        if header.get("bench") == "lazyllm-ceiling":
            _check_ceiling(report, jsonl, header, rows)
            continue
        if (remade := script_summary(jsonl, header, rows)) is not None:
            _check_script_summary(report, jsonl, *remade)
            continue
        if header.get("bench") == "serve-n" or jsonl.name.startswith("serve_n_"):  # early runs named no bench
            _check_serve_n(report, jsonl)
            continue
        _check_records(report, jsonl)
    for path in sorted(results.glob("*.json")):
        if not path.name.endswith(".summary.json") and path.name != CLIENTS:
            _check_ablation(report, path)
            _check_rendered(report, path)
    for path in sorted([*results.glob(CLIENTS), *results.glob(f"*/{CLIENTS}")]):
        _check_clients(report, path, str(path.relative_to(results)))
    check_anchors(report, results)
    return report


def check_family(report: VerifyReport, path: Path) -> bool:
    """:func:`figures.families.check_family` (imported late: it imports this module)."""
    from figures.families import check_family as check

    return check(report, path)


def check_anchors(report: VerifyReport, results: Path) -> None:
    """:func:`figures.families.check_anchors`."""
    from figures.families import check_anchors as check

    check(report, results)
