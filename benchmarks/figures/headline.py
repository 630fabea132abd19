"""One method's headline figures, recomputed from a committed result file, and the README's summary.

The README's summary table shows, per method and operating point: the median TTFT of full
prefill and of the method, the TTFT speedup over full prefill, first-token agreement, identical
answers and the paired score difference with its 95% interval. :func:`headline` computes them
from a file of bench records (:mod:`fastprefill.bench.records`), pairing the method with the
reference its file names (``references`` in the header of a multi-model run) or with full
prefill; :func:`runahead_headline` from a KV-Runahead TTFT file (rows of repeated timings on
random prompts, no answers to score); :func:`headline_cells` prints them as the table does.

:data:`SUMMARY_ROWS` says which file, method and prompt length each row of the table is
computed from (a row is named by its first cell); :func:`check_summary_table` recomputes every
cell of the table in a README text and returns the cells that differ.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fastprefill.bench.records import FULL, load_records
from fastprefill.bench.summary import summarize
from fastprefill.errors import ConfigError
from figures.results import Mismatch, cell_matches, parse_tables

__all__ = ["SUMMARY_COLUMNS", "SUMMARY_ROWS", "Headline", "SummaryRow", "check_summary_table", "headline",
           "headline_cells", "row_cells", "runahead_headline", "summary_table"]


@dataclass(frozen=True)
class Headline:
    """A method against its reference over the paired prompts of one result file.

    Attributes:
        n: prompts (or, for KV-Runahead, timed runs) of the method.
        ttft_s, reference_ttft_s: median TTFT of the method and of its reference (over the
            prompts paired with the method's).
        speedup: the median of the per-prompt TTFT ratios reference / method (KV-Runahead: the
            reference's median TTFT over the method's, as its table divides them).
        first_token: share of prompts whose first generated token equals the reference's
            (``None``: the file did not record first tokens).
        identical: share of answers identical to the reference's (``None``: not scored).
        score_diff, score_ci: the mean paired score difference (0-1 scale) and its 95%
            bootstrap interval (``None``: not scored).
        reference: the method is its own reference (full prefill): only ``n`` and ``ttft_s`` mean
            anything.
    """

    n: int
    ttft_s: float
    reference_ttft_s: float
    speedup: float
    first_token: float | None
    identical: float | None
    score_diff: float | None
    score_ci: tuple[float, float] | None
    reference: bool = False


def headline(path: str | Path, method: str, length: int | None = None) -> Headline:
    """``method``'s figures in the bench records at ``path`` (at prompt ``length``; ``None``
    for a file of one length or of an unsized task).

    Raises:
        ConfigError: the file has no such method (at that length).
    """
    header, records = load_records(path)
    reference: str | Mapping[str, str] = header.get("references", FULL)
    cells = [s for s in summarize(records, reference=reference)
             if s.method == method and (length is None or s.length == length)]
    if len(cells) != 1:
        raise ConfigError(f"{path}: {len(cells)} cells of method {method!r} at length {length}; name one length")
    s = cells[0]
    return Headline(n=s.n, ttft_s=s.ttft_median_s, reference_ttft_s=s.reference_ttft_median_s,
                    speedup=s.speedup_paired_median, first_token=s.first_token_agreement,
                    identical=s.identical_answers, score_diff=s.score_diff, score_ci=s.score_diff_ci95,
                    reference=s.is_reference)


def runahead_headline(path: str | Path, model: str, length: int, method: str = "runahead-searched",
                      reference: str = "full-2threads") -> Headline:
    """KV-Runahead's figures in a ``runahead_ttft`` file: the ``reference`` configuration's
    median TTFT over ``method``'s, and the share of ``method``'s rows whose first token equals
    the one-core reference's (``first_token_matches_1core``).

    Raises:
        ConfigError: the file has no row of ``method`` or ``reference`` for ``model`` at ``length``.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    of = {r["config"]: r for r in rows if r["model"] == model and r["length"] == length}
    missing = [c for c in (method, reference) if c not in of]
    if missing:
        raise ConfigError(f"{path}: no {missing} rows for {model} at {length} tokens")
    ttft, ref = statistics.median(of[method]["ttft_s"]), statistics.median(of[reference]["ttft_s"])
    return Headline(n=len(of[method]["ttft_s"]), ttft_s=ttft, reference_ttft_s=ref, speedup=ref / ttft,
                    first_token=float(of[method]["first_token_matches_1core"]), identical=None,
                    score_diff=None, score_ci=None)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def headline_cells(h: Headline) -> dict[str, str]:
    """The table's cells: ``n``; ``ttft`` (``20.47 → 1.22``, seconds, full prefill's first; a
    reference alone: ``12.08``); ``speedup`` (``1.66x``); ``first token`` and ``identical``
    (``64%``); ``score`` (``-6.0 [-16.6, +3.5]`` on a 0-100 scale). ``—`` where nothing applies."""
    if h.reference:
        return {"n": str(h.n), "ttft": f"{h.ttft_s:.2f}", "speedup": "1.00x", "first token": "—",
                "identical": "—", "score": "—"}
    score = "—"
    if h.score_diff is not None and h.score_ci is not None:
        lo, hi = h.score_ci
        score = f"{100 * h.score_diff:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    return {"n": str(h.n), "ttft": f"{h.reference_ttft_s:.2f} → {h.ttft_s:.2f}", "speedup": f"{h.speedup:.2f}x",
            "first token": _pct(h.first_token), "identical": _pct(h.identical), "score": score}


# --------------------------------------------------------------------------- the README's summary


@dataclass(frozen=True)
class SummaryRow:
    """Where one row of the summary table comes from.

    Attributes:
        label: the row's first cell, as the README prints it.
        file: the result file under ``benchmarks/results`` (the row links to it).
        method: the method key in the file (a KV-Runahead file: the configuration, ``runahead-searched``).
        length: the prompt length (or turn) of the cell; ``None`` for a file of one length.
        model: a KV-Runahead file's model (its rows hold several).
        reference: a KV-Runahead file's reference configuration (``full-2threads``: one process on
            the same two cores; ``full-1core``).
    """

    label: str
    file: str
    method: str
    length: int | None = None
    model: str | None = None
    reference: str = "full-2threads"

    def headline(self, results: str | Path) -> Headline:
        path = Path(results) / self.file
        if self.model is not None:
            assert self.length is not None
            return runahead_headline(path, self.model, self.length, self.method, self.reference)
        return headline(path, self.method, self.length)


#: The summary table's rows, in the README's order.
SUMMARY_ROWS: tuple[SummaryRow, ...] = (
    SummaryRow("bfloat16, full prefill", "precision_qwen2.5-coder-0.5b_multidoc-qa_2048.jsonl", "bfloat16", 2048),
    SummaryRow("bfloat16, full prefill (1.5B)", "precision_qwen2.5-coder-1.5b_multidoc-qa_2048.jsonl",
               "bfloat16", 2048),
    SummaryRow("prefix cache, hit", "prefix_questions_qwen2.5-coder-1.5b_bfloat16.jsonl", "cache-hit", 2048),
    SummaryRow("prefix cache, miss", "prefix_questions_qwen2.5-coder-1.5b_bfloat16.jsonl", "cache-miss", 2048),
    SummaryRow("KV-Runahead, 2 procs (vs 2 threads)", "runahead_ttft_bfloat16.jsonl", "runahead-searched", 2048,
               model="qwen2.5-coder-0.5b"),
    SummaryRow("KV-Runahead, 2 procs (vs 1 core)", "runahead_ttft_bfloat16.jsonl", "runahead-searched", 2048,
               model="qwen2.5-coder-0.5b", reference="full-1core"),
    SummaryRow("LazyLLM, paper's rule", "lazyllm_curve_default_qwen2.5-coder-0.5b_2048_bfloat16.jsonl",
               "lazyllm-four-stage", 2048),
    SummaryRow("LazyLLM, late cut", "lazyllm_curve_fidelity_qwen2.5-coder-0.5b_2048_bfloat16.jsonl",
               "lazyllm-cut30k20+snap", 2048),
    SummaryRow("LazyLLM, late cut (1.5B)", "lazyllm_curve_fidelity_qwen2.5-coder-1.5b_2048_bfloat16.jsonl",
               "lazyllm-cut30k20+snap", 2048),
    SummaryRow("LazyLLM, late cut (needle)", "lazyllm_needle_qwen2.5-coder-0.5b_2048-4096_bfloat16.jsonl",
               "lazyllm-cut30k20+snap", 2048),
    SummaryRow("kvp-prefix", "kvp_prefix_singledoc-qa_1024_bfloat16.jsonl", "kvp-prefix-l14-t32", 1024),
    SummaryRow("KV Prediction (KVP-C)", "kvp_singledoc-qa_1024_bfloat16.jsonl", "kvp-c", 1024),
    SummaryRow("smaller model alone", "kvp_singledoc-qa_1024_bfloat16.jsonl", "qwen-0.5b", 1024),
)

#: The summary table's columns that hold figures, by the :func:`headline_cells` key they print.
SUMMARY_COLUMNS: dict[str, str] = {
    "n": "n",
    "median TTFT (s), full → method": "ttft",
    "TTFT speedup": "speedup",
    "first token = full": "first token",
    "identical answers": "identical",
    "score change [95% CI]": "score",
}

_RESULT_LINK = re.compile(r"\]\((?:\.\./)*benchmarks/results/([^)#\s]+)\)")


def row_cells(row: SummaryRow, results: str | Path) -> dict[str, str]:
    """The figures ``row`` prints, by column name of :data:`SUMMARY_COLUMNS`."""
    cells = headline_cells(row.headline(results))
    return {column: cells[key] for column, key in SUMMARY_COLUMNS.items()}


def summary_table(text: str) -> list[dict[str, str]]:
    """The summary table of a README text: the first table with every column of :data:`SUMMARY_COLUMNS`.

    Raises:
        ConfigError: there is none.
    """
    for table in parse_tables(text):
        if table and set(SUMMARY_COLUMNS) <= set(table[0]):
            return table
    raise ConfigError(f"no table with the columns {list(SUMMARY_COLUMNS)}")


def check_summary_table(text: str, results: str | Path, file: str = "README.md") -> list[Mismatch]:
    """Every row of the summary table in ``text`` recomputed from its result file in ``results``.

    A row must be one of :data:`SUMMARY_ROWS` (by its first cell), in that order, none missing;
    it must link to that row's result file; each figure must print as recomputed (to the
    precision it is printed with).
    """
    table = summary_table(text)
    first = next(iter(table[0]))
    labels = [r[first].strip("* ") for r in table]
    expected = [row.label for row in SUMMARY_ROWS]
    if labels != expected:
        return [Mismatch(file, "summary table rows", labels, expected)]
    out = []
    for cells, row in zip(table, SUMMARY_ROWS, strict=True):
        links = {m.group(1) for cell in cells.values() for m in _RESULT_LINK.finditer(cell)}
        if links != {row.file}:
            out.append(Mismatch(file, f"summary row {row.label!r}: result link", sorted(links), [row.file]))
        for column, value in row_cells(row, results).items():
            if not cell_matches(cells[column], value):
                out.append(Mismatch(file, f"summary row {row.label!r}, column {column!r}", cells[column], value))
    return out
