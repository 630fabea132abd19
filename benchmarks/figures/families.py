"""The result families that are not bench records, each re-derived from its rows by its own script.

- ``serve_mixed_<model>[_<label>].jsonl`` (``benchmarks/serve_load_mixed.py``): the ``.md`` table
  from :func:`serve_load_mixed.summarize`, and every ``_budget.md`` beside it from
  :func:`serve_mixed_budget.budget`;
- ``serve_soak_*.jsonl`` (``benchmarks/serve_soak.py``): the ``.summary.json`` and the ``.md``;
- ``serve_load_*.jsonl`` and ``serve_runahead_load_*.jsonl`` (``benchmarks/serve_load.py``): the
  ``.summary.json`` and the ``.md`` table;
- ``runahead_ttft*.jsonl`` (``benchmarks/runahead_ttft.py``): the ``.md`` table from the rows'
  medians, and each row's median from its runs; ``runahead_projection.jsonl``: its ``.md`` table;
- ``kvp_lsweep_*.jsonl``: the ``.md`` from :func:`research.kvp.lsweep_table`;
- ``lazyllm_equivalence.jsonl``: each row's TTFT ratio from its two TTFTs;
- ``serve_shared_doc_*.jsonl`` (``benchmarks/serve_shared_doc.py``): its ``kind: summary`` rows
  and the ``.md`` from :func:`serve_shared_doc.summarize` of its request and cell rows;
- ``serve_health_*.jsonl`` (``benchmarks/serve_health.py``): its ``kind: summary`` row and the
  ``.md`` from :func:`serve_health.summarize` of its trial rows;
- ``answer_variance_*.jsonl`` (``benchmarks/answer_variance.py``): the ``.summary.json`` and the
  ``.md`` from :func:`answer_variance.summarize`;
- ``row_invariance*.jsonl`` (``benchmarks/row_invariance.py``): the ``.md`` from its rows, and
  each row's ``bitwise_equal`` against its ``max_abs_diff``;
- ``anchors/<dir>/summary.md``: re-made from the ``run-*.jsonl`` beside it by
  ``benchmarks/anchors/summarize.py`` (every table cell and the machine line).

:func:`check_family` returns whether it knew the file (and adds what it checked or found).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastprefill.bench.records import read_rows
from figures.results import Mismatch, VerifyReport, compare_json, compare_rows, parse_tables

__all__ = ["FAMILIES", "anchors_summarize", "check_anchors", "check_family"]

#: file-name prefixes of the families handled here
FAMILIES = ("serve_mixed_", "serve_soak_", "serve_load_", "serve_runahead_load_", "runahead_ttft", "runahead_projection",
            "kvp_lsweep_", "lazyllm_equivalence", "answer_variance_", "row_invariance", "serve_shared_doc_",
            "serve_health_")


def _compare_md(report: VerifyReport, md: Path, remade: str, label: str | None = None) -> None:
    committed, new = parse_tables(md.read_text()), parse_tables(remade)
    name = label or md.name
    if len(committed) != len(new):
        report.mismatches.append(Mismatch(name, "tables", len(committed), len(new)))
    for i, (old, fresh) in enumerate(zip(committed, new)):
        report.mismatches += compare_rows(name if i == 0 else f"{name} (table {i + 1})", old, fresh)
    report.checked.append(name)


def _serve_mixed(report: VerifyReport, path: Path) -> None:
    from serve_load_mixed import markdown, summarize
    from serve_mixed_budget import budget
    from serve_mixed_budget import markdown as budget_md

    header, rows = read_rows(path)
    md = path.with_suffix(".md")
    if md.exists():
        _compare_md(report, md, markdown(summarize(rows, header["schedulers"]), header))
    extra = path.with_name(f"{path.stem}_budget.md")
    if extra.exists():
        _compare_md(report, extra, budget_md(path, header, budget(header, rows)))
    report.checked.append(path.name)


def _summary_and_table(report: VerifyReport, path: Path, summary: Any, table: Callable[[Any], str]) -> None:
    """A run's committed ``.summary.json`` against ``summary`` (re-made from its rows) and its ``.md``
    tables against ``table(summary)``."""
    summary = json.loads(json.dumps(summary))
    sjson = path.with_name(path.name.removesuffix(".jsonl") + ".summary.json")
    if sjson.exists():
        report.mismatches += compare_json(sjson.name, "summary", json.loads(sjson.read_text()), summary)
        report.checked.append(sjson.name)
    md = path.with_suffix(".md")
    if md.exists():
        _compare_md(report, md, table(summary))
    report.checked.append(path.name)


def _serve_soak(report: VerifyReport, path: Path) -> None:
    import serve_soak as soak

    header, rows = read_rows(path)
    png = path.name.removesuffix(".jsonl") + ".png"
    _summary_and_table(report, path, soak.summarize(header, rows), lambda s: soak.markdown(s, header, png))


def _serve_load(report: VerifyReport, path: Path) -> None:
    import serve_load as bench

    header, rows = read_rows(path)
    _summary_and_table(report, path, bench.summarize([bench.LoadRecord(**row) for row in rows]),
                       lambda s: bench.markdown(s, header))


def _summary_rows(report: VerifyReport, path: Path,
                  remake: Callable[[dict[str, Any], list[dict[str, Any]]], tuple[list[dict[str, Any]], str]]) -> None:
    """The committed ``kind: summary`` rows and the ``.md`` against ``remake(header, rows)``: the
    summary rows and the table re-made from the run's other rows."""
    header, rows = read_rows(path)
    summary, table = remake(header, rows)
    report.mismatches += compare_json(path.name, "summary", [r for r in rows if r.get("kind") == "summary"],
                                      json.loads(json.dumps(summary)))
    md = path.with_suffix(".md")
    if md.exists():
        _compare_md(report, md, table)
    report.checked.append(path.name)


def _serve_shared_doc(report: VerifyReport, path: Path) -> None:
    """The summary rows and the ``.md`` from the request and cell rows."""
    import serve_shared_doc as bench

    def remake(header: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        summary = bench.summarize(rows)
        return summary, bench.markdown(summary, header)

    _summary_rows(report, path, remake)


def _serve_health(report: VerifyReport, path: Path) -> None:
    """The summary row and the ``.md`` from the trial rows."""
    import serve_health as bench

    def remake(header: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        summary = bench.summarize(rows)
        return [summary], bench.markdown(rows, summary, header)

    _summary_rows(report, path, remake)


def _plain_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _runahead_ttft(report: VerifyReport, path: Path) -> None:
    from runahead_ttft import markdown

    rows = _plain_rows(path)
    for i, r in enumerate(rows):  # each row's median from its runs
        if r.get("ttft_s"):
            report.mismatches += compare_json(path.name, f"row {i + 1}.median_ttft_s", r["median_ttft_s"],
                                              statistics.median(r["ttft_s"]))
    md = path.with_suffix(".md")
    if md.exists() and rows:
        args = SimpleNamespace(n=rows[0].get("n"), warmup=rows[0].get("warmup"))
        rows = [{**r, "machine": {"dtype": "?", **r.get("machine", {})}} for r in rows]
        _compare_md(report, md, markdown(rows, args))
    report.checked.append(path.name)


def _runahead_projection(report: VerifyReport, path: Path) -> None:
    rows = _plain_rows(path)
    head = ("| link GB/s | tokens | 1 rank | TSP | runahead even | runahead searched | TSP / searched (model) "
            "| paper, measured vs TSP |")
    table = [head, "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['bandwidth_gbs']:.0f} | {r['length']} | {1e3 * r['single_s']:.1f} | {1e3 * r['tsp_s']:.1f} | "
              f"{1e3 * r['runahead_even_s']:.1f} | {1e3 * r['runahead_searched_s']:.1f} | "
              f"{r['tsp_s'] / r['runahead_searched_s']:.2f}x | {r['paper_vs_tsp']} |" for r in rows]
    md = path.with_suffix(".md")
    if md.exists():
        _compare_md(report, md, "\n".join(table) + "\n")
    report.checked.append(path.name)


def _kvp_lsweep(report: VerifyReport, path: Path) -> None:
    from research.kvp import lsweep_table

    header, rows = read_rows(path)
    md = path.with_suffix(".md")
    if md.exists():
        remade = lsweep_table(header, rows)
        if remade != md.read_text():
            _compare_md(report, md, remade)
            if not report.mismatches or report.mismatches[-1].file != md.name:  # same tables, other text
                report.mismatches.append(Mismatch(md.name, "text", "(committed)", "(differs outside its tables)"))
        else:
            report.checked.append(md.name)
    report.checked.append(path.name)


def _lazyllm_equivalence(report: VerifyReport, path: Path) -> None:
    """Each row's TTFT ratio from its two TTFTs (its logit difference and tokens are as measured)."""
    _, rows = read_rows(path)
    for i, r in enumerate(rows):
        report.mismatches += compare_json(path.name, f"row {i + 1}.ttft_ratio_lazy_over_full",
                                          r["ttft_ratio_lazy_over_full"], r["ttft_lazy_s"] / r["ttft_full_s"])
    report.checked.append(path.name)


def _answer_variance(report: VerifyReport, path: Path) -> None:
    import answer_variance as bench

    header, rows = read_rows(path)
    _summary_and_table(report, path, bench.summarize(header, rows), lambda s: bench.markdown(s, header))


def _row_invariance(report: VerifyReport, path: Path) -> None:
    """The table from the rows; a row equal bit for bit has no difference, and one that is not has one."""
    from row_invariance import markdown

    header, rows = read_rows(path)
    for i, r in enumerate(rows):
        if "bitwise_equal" in r and r["bitwise_equal"] != (r["max_abs_diff"] == 0):  # a check (a cost row has none)
            report.mismatches.append(Mismatch(path.name, f"row {i + 1}.bitwise_equal", r["bitwise_equal"],
                                              r["max_abs_diff"] == 0))
    md = path.with_suffix(".md")
    if md.exists():
        _compare_md(report, md, markdown(header, rows))
    report.checked.append(path.name)


_HANDLERS = {"serve_mixed_": _serve_mixed, "serve_soak_": _serve_soak, "serve_load_": _serve_load,
             "serve_runahead_load_": _serve_load, "runahead_ttft": _runahead_ttft,
             "runahead_projection": _runahead_projection, "kvp_lsweep_": _kvp_lsweep,
             "lazyllm_equivalence": _lazyllm_equivalence, "answer_variance_": _answer_variance,
             "row_invariance": _row_invariance, "serve_shared_doc_": _serve_shared_doc,
             "serve_health_": _serve_health}


def check_family(report: VerifyReport, path: Path) -> bool:
    """Check ``path`` if it belongs to one of :data:`FAMILIES`; whether it did."""
    for prefix, handler in _HANDLERS.items():
        if path.name.startswith(prefix):
            handler(report, path)
            return True
    return False


def anchors_summarize() -> Any:
    """``benchmarks/anchors/summarize.py`` as a module (the anchors folder is not a package: its
    scripts run in each peer's own venv)."""
    folder = str(Path(__file__).resolve().parents[1] / "anchors")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import summarize

    return summarize


def check_anchors(report: VerifyReport, results: Path) -> None:
    """Every ``anchors/<dir>/summary.md`` re-made from the ``run-*.jsonl`` beside it: each table
    cell and the machine and design lines."""
    summarize = anchors_summarize()
    for md in sorted(results.glob("anchors/*/summary.md")):
        runs = sorted(str(p) for p in md.parent.glob("run-*.jsonl"))
        name = str(md.relative_to(results))
        if not runs:
            report.mismatches.append(Mismatch(name, "runs", "(a summary)", "(no run-*.jsonl beside it)"))
            continue
        headers, rows = summarize.load(runs)
        remade = summarize.report(headers, rows)
        _compare_md(report, md, remade, name)
        committed_lines = _prose_lines(md.read_text())
        for line in _prose_lines(remade):
            if line not in committed_lines:
                report.mismatches.append(Mismatch(name, "text", "(missing)", line[:120]))
        report.checked += [str(Path(r).relative_to(results)) for r in runs]


def _prose_lines(text: str) -> set[str]:
    """The lines of a summary outside its table and its list of commands (whose paths vary by checkout)."""
    return {ln for ln in text.splitlines() if ln.startswith(("Machine:", "One round", *[f"{n} rounds" for n in range(2, 100)]))}

