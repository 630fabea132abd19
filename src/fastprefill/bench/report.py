"""Tables and plots of benchmark summaries (every figure is drawn from :func:`summarize`).

- :func:`markdown_table`: one row per (length, method) against full prefill (``<stem>.md`` of a
  task run); :func:`plot_accuracy_vs_speedup` its plot.
- :func:`reference_table`: one row per method against its own reference, with the model each
  method runs on (``<stem>.md`` of a multi-model run); :func:`plot_score_vs_cost` its plot.
- :func:`plot_layer_errors`: per-layer relative error of predicted K / V from a summary header.
- :func:`write_paired_rows`: the ``<stem>.summary.jsonl`` of a task run.
- :func:`prefix_overhead_table`: a prefix-cache run's own costs (the second table of its ``<stem>.md``).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastprefill.bench.records import FULL, Record, save_records, write_rows
from fastprefill.bench.summary import Summary, paired_row, summarize
from fastprefill.errors import ConfigError

__all__ = [
    "markdown_table",
    "plot_accuracy_vs_speedup",
    "plot_layer_errors",
    "plot_score_vs_cost",
    "prefix_overhead_table",
    "redraw_layer_plot",
    "reference_table",
    "write_paired_rows",
    "write_report",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _pct(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def markdown_table(summaries: Sequence[Summary], header: Mapping[str, Any] | None = None) -> str:
    """A markdown table of the summaries (scores on a 0-100 scale), a line about the run first."""
    lines = []
    if header:
        lines.append(
            f"Task `{header.get('task')}` ({header.get('split')} split), model `{header.get('model', '?')}`, "
            f"{header.get('threads')} threads, torch {header.get('torch')}, CPU: {header.get('cpu')}. "
            f"Warm-up runs excluded: {header.get('warmup')} per method. Command: `{header.get('command')}`"
            + "".join(f"; extended from n={step.get('from_n')} by `{step.get('command')}`"
                      for step in header.get("extended", []))
        )
        lines.append("")
    lines.append(
        "| length | method | n | median TTFT (s) [p25, p75] | speedup vs full | paired speedup | "
        "score (0-100) | Δ score vs full [95% CI] | token-layers | FLOPs vs full | decode s/token | "
        "first token = full | identical answers | median first-token KL |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        ci = s.score_diff_ci95
        delta = "—" if s.is_reference else f"{100 * s.score_diff:+.1f} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"
        dec = f"{s.decode_s_per_token_median:.4f}" if s.decode_s_per_token_median is not None else "—"
        kl = f"{s.first_token_kl_median:.3f}" if s.first_token_kl_median is not None else "—"
        same = "—" if s.is_reference else _pct(s.identical_answers)
        first = "—" if s.is_reference else _pct(s.first_token_agreement)
        lines.append(
            f"| {s.length} | {s.method} | {s.n} | {s.ttft_median_s:.3f} [{s.ttft_p25_s:.3f}, {s.ttft_p75_s:.3f}] | "
            f"{s.speedup:.2f}x | {s.speedup_paired_median:.2f}x | {100 * s.score_mean:.1f} | {delta} | "
            f"{100 * s.token_layer_fraction:.0f}% | {100 * s.flops_ratio:.0f}% | {dec} | {first} | {same} | {kl} |"
        )
    return "\n".join(lines) + "\n"


def prefix_overhead_table(records: Sequence[Record]) -> str:
    """The prefix cache's own costs per (length, method): the lookup's share of TTFT (inside it)
    and the store's seconds against TTFT (after the last token, outside it), medians over runs."""
    rows = ["| length | method | n | cached tokens (median) | lookup / TTFT (median) | store / TTFT (median) |",
            "|---|---|---|---|---|---|"]
    cells: dict[tuple[int | None, str], list[Record]] = {}
    for r in records:
        if r.method != FULL:
            cells.setdefault((r.length, r.method), []).append(r)
    for (length, method), rs in sorted(cells.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        def med(values: list[float]) -> float:
            return float(statistics.median(values))
        rows.append(f"| {length} | {method} | {len(rs)} | {med([r.extra['cached_tokens'] for r in rs]):.0f} | "
                    f"{100 * med([r.extra['prefix_lookup_s'] / r.ttft_s for r in rs]):.2f}% | "
                    f"{100 * med([r.extra['prefix_store_s'] / r.ttft_s for r in rs]):.2f}% |")
    return "\n".join(rows) + "\n"


def reference_table(header: Mapping[str, Any], entries: Mapping[str, Mapping[str, Any]], title: str) -> str:
    """A markdown table of per-method entries (:func:`~fastprefill.bench.summary.method_entry`),
    each against its reference, under ``# <title>: <task> (<split> split), n=<n>``; from
    ``header``: ``task``, ``split``, ``n``, ``command``, ``threads``, ``warmup`` and ``methods``
    (name -> ``[model, spec]``)."""
    lines = [f"# {title}: {header['task']} ({header['split']} split), n={header['n']}", "",
             f"Command: `{header['command']}`", "",
             (f"Threads: {header.get('threads')}; warm-up {header['warmup']} per method, discarded; "
              "speedups are medians of paired per-prompt TTFT ratios."), "",
             ("| method | runs on | n | accuracy | median TTFT (s) | speedup vs reference (reference) | "
              "speedup vs full | TTFT GFLOPs | first-token agreement | identical answers | median first-token KL | "
              "mean rel. err K / V |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in entries.items():
        model = header["methods"][name][0]
        err = s.get("rel_error_k")
        errs = f"{statistics.mean(err):.3f} / {statistics.mean(s['rel_error_v']):.3f}" if err else "-"
        kl = s.get("median_first_token_kl")
        lines.append(
            f"| {name} | {model} | {s['n']} | {100 * s['accuracy']:.1f} | {s['median_ttft_s']:.2f} | "
            f"{s['median_speedup_vs_reference']:.2f}x ({s['reference']}) | {s['median_speedup_vs_full']:.2f}x | "
            f"{s['median_ttft_flops'] / 1e9:.0f} | {_pct(s['first_token_agreement_with_reference'])} | "
            f"{_pct(s.get('identical_answers_with_reference'))} | {'-' if kl is None else f'{kl:.3f}'} | {errs} |")
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_speedup(summaries: Sequence[Summary], path: Path, title: str = "") -> None:
    """Score (0-100) against TTFT speedup, one line per (length, method family)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    series: dict[tuple[Any, str], list[Summary]] = defaultdict(list)
    for s in summaries:
        family = re.split(r"[-@:\[]", s.method, maxsplit=1)[0]
        series[(s.length, family)].append(s)
    for (length, family), ss in sorted(series.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        ss = sorted(ss, key=lambda s: s.speedup)
        marker = "*" if family == FULL else "o"
        ax.plot([s.speedup for s in ss], [100 * s.score_mean for s in ss], marker=marker,
                label=f"{family} @ {length}" if length is not None else family)
    ax.set_xlabel("TTFT speedup vs full prefill (x)")
    ax.set_ylabel("score (0-100)")
    ax.set_title(title or "accuracy vs TTFT speedup")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_score_vs_cost(summaries: Sequence[Summary], path: Path, title: str) -> None:
    """Two panels: score (%) against median TTFT and against median TTFT FLOPs, a point per method."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in summaries:
        axes[0].scatter(s.ttft_median_s, 100 * s.score_mean, label=s.method)
        axes[1].scatter(s.flops_median, 100 * s.score_mean, label=s.method)
    axes[0].set_xlabel("median TTFT (s)")
    axes[1].set_xlabel("TTFT FLOPs")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("accuracy (%)")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layer_errors(header: Mapping[str, Any], stem: str) -> Path | None:
    """Draw ``<stem>_layers.png``: per-layer relative error of the predicted K and V (x: base
    layer) for every method of ``header["summary"]`` that carries ``rel_error_k``.

    Returns the path, or None, drawing nothing, when no method carries ``rel_error_k``.
    """
    kvp = {n: s for n, s in header["summary"].items() if s.get("rel_error_k")}
    if not kvp:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for name, s in kvp.items():
        for ax, part in zip(axes, ("k", "v"), strict=True):
            errs = s[f"rel_error_{part}"]
            ax.plot(range(len(errs)), errs, marker=".", label=f"{name} ({s['rel_error_prompts']} prompts)")
    for ax, part in zip(axes, ("K", "V"), strict=True):
        ax.set_xlabel("base layer")
        ax.set_title(f"predicted {part}: ||pred - true|| / ||true||")
        ax.axhline(1.0, color="grey", lw=0.6, ls=":")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("relative error")
    fig.suptitle(f"KV Prediction per-layer error, {header['task']} ({header['split']})")
    fig.tight_layout()
    path = Path(stem + "_layers.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def redraw_layer_plot(summary: str | Path) -> Path:
    """Redraw ``<stem>_layers.png`` from a committed ``<stem>.summary.json`` (no model needed).

    Raises:
        ConfigError: the file is not a ``.summary.json``, or no method in it has per-layer errors.
    """
    src = Path(summary)
    if not src.name.endswith(".summary.json"):
        raise ConfigError(f"{src}: expected an eval summary file ending in .summary.json")
    out = plot_layer_errors(json.loads(src.read_text()), str(src)[: -len(".summary.json")])
    if out is None:
        raise ConfigError(f"{src}: no method has per-layer errors (rel_error_k)")
    return out


def merge_eval_summaries(summaries: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Methods of several eval ``.summary.json`` files run on the same prompts, one row each.

    The files must share task, split, length, n and seed (the same prompts). A method name that
    appears in more than one file is taken from the first file that has it, so list the newest run
    first.

    Returns:
        Rows ``{"method", "model", "spec", "file", "accuracy", "median_ttft_flops",
        "median_speedup_vs_full"}``.

    Raises:
        ConfigError: a file is not a ``.summary.json`` or the files ran on different prompts.
    """
    rows: list[dict[str, Any]] = []
    key = None
    for src in map(Path, summaries):
        if not src.name.endswith(".summary.json"):
            raise ConfigError(f"{src}: expected an eval summary file ending in .summary.json")
        header = json.loads(src.read_text())
        this = tuple(header.get(k) for k in ("task", "split", "length", "n", "seed"))
        if key is None:
            key = this
        elif this != key:
            raise ConfigError(f"{src}: ran on other prompts (task, split, length, n, seed = {this}, "
                              f"not {key}); merge only evals of the same prompts")
        for name, s in header["summary"].items():
            if any(r["method"] == name for r in rows):
                continue
            model, spec = header["methods"][name]
            rows.append({"method": name, "model": model, "spec": spec, "file": src.name, "accuracy": s["accuracy"],
                         "median_ttft_flops": s["median_ttft_flops"],
                         "median_speedup_vs_full": s["median_speedup_vs_full"]})
    return rows


def label_lifts(points: Sequence[tuple[float, float]], width: float = 0.3, height: float = 4.0) -> list[float]:
    """Upward shifts (in y data units) for labels at ``points`` ``(x, y)`` so that no two labels
    starting within ``width`` of each other in x sit within ``height`` in y (greedy, lowest first)."""
    placed: list[tuple[float, float]] = []
    lifts = [0.0] * len(points)
    for i in sorted(range(len(points)), key=lambda k: (points[k][1], points[k][0])):
        x, y = points[i]
        lift = 0.0
        while any(abs(x - px) < width and abs(y + lift - py) < height for px, py in placed):
            lift += height
        lifts[i] = lift
        placed.append((x, y + lift))
    return lifts


def plot_score_vs_flops(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Score (0-100) against median TTFT FLOPs (relative to the reference ``full``), a labelled
    point per row of :func:`merge_eval_summaries`."""
    full = next((r for r in rows if r["method"] == FULL), None)
    if full is None:
        raise ConfigError("no 'full' method among the merged summaries: nothing to scale FLOPs by")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    points = [(r["median_ttft_flops"] / full["median_ttft_flops"], 100 * r["accuracy"]) for r in rows]
    for r, (x, y), lift in zip(rows, points, label_lifts(points)):
        ax.scatter(x, y, marker="*" if r["method"] == FULL else "o")
        ax.annotate(f"{r['method']} ({r['median_speedup_vs_full']:.2f}x)", (x, y), fontsize=7,
                    xytext=(4, 3 + lift / 0.3), textcoords="offset points",
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "alpha": 0.5} if lift else None)
    ax.set_xlabel("median TTFT FLOPs / full prefill of the base")
    ax.set_ylabel("score (0-100)")
    ax.set_xlim(0, 1.1)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _title(header: Mapping[str, Any]) -> str:
    return f"{header.get('task')} — {header.get('model', '')}"


def write_paired_rows(path: str | Path, header: Mapping[str, Any], summaries: Sequence[Summary]) -> Path:
    """Write a ``.summary.jsonl``: ``header``, then :func:`~fastprefill.bench.summary.paired_row`
    of every summary that is not its own reference."""
    return write_rows(path, header, [paired_row(s) for s in summaries if not s.is_reference])


def write_report(
    out_dir: Path, name: str, header: Mapping[str, Any], records: Sequence[Record], *, save: bool = True
) -> list[Summary]:
    """Write ``name.md`` (table) and ``name.png`` (plot) into ``out_dir``, and ``name.jsonl``
    (header and records) unless ``save=False`` (a :class:`~fastprefill.bench.records.RecordLog`
    already wrote it)."""
    out_dir = Path(out_dir)
    if save:
        save_records(out_dir / f"{name}.jsonl", header, records)
    summaries = summarize(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(markdown_table(summaries, header))
    plot_accuracy_vs_speedup(summaries, out_dir / f"{name}.png", title=_title(header))
    return summaries
