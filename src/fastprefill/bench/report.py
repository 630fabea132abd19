"""Benchmark summaries: medians, ratios to full prefill, paired accuracy differences, plots.

Speedups are ratios against full prefill measured in the same run on the same prompts:
``speedup = median(full TTFT) / median(method TTFT)``; the median of the per-prompt ratios is
reported beside it. Accuracy differences are paired by sample, with a 95% percentile bootstrap
interval (seeded, 2000 resamples).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastprefill.bench.runner import FULL, Record, save_jsonl


@dataclass
class Summary:
    """Aggregate of one (length, method) cell."""

    length: int | None
    method: str
    n: int
    ttft_median_s: float
    ttft_p25_s: float
    ttft_p75_s: float
    speedup: float
    speedup_paired_median: float
    score_mean: float
    score_diff_vs_full: float
    score_diff_ci95: tuple[float, float]
    token_layer_fraction: float
    ideal_speedup: float
    realised_over_ideal: float
    flops_ratio: float
    decode_s_per_token_median: float | None
    peak_mem_mb: float


def bootstrap_ci(diffs: Sequence[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``diffs``."""
    arr = np.asarray(diffs, dtype=float)
    if arr.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return (float(lo), float(hi))


def summarize(records: Sequence[Record]) -> list[Summary]:
    """One :class:`Summary` per (length, method), full prefill first within each length."""
    cells: dict[tuple[Any, str], list[Record]] = defaultdict(list)
    for r in records:
        cells[(r.length, r.method)].append(r)
    out: list[Summary] = []
    lengths = sorted({k[0] for k in cells}, key=lambda x: (x is None, x))
    for length in lengths:
        full = {r.sample_id: r for r in cells.get((length, FULL), [])}
        methods = [m for (ln, m) in cells if ln == length]
        methods.sort(key=lambda m: (m != FULL, m))
        for m in methods:
            rs = cells[(length, m)]
            ttft = np.array([r.ttft_s for r in rs])
            paired = [(full[r.sample_id], r) for r in rs if r.sample_id in full]
            full_med = float(np.median([f.ttft_s for f, _ in paired])) if paired else float("nan")
            med = float(np.median(ttft))
            frac = float(np.mean([r.token_layer_fraction for r in rs]))
            speedup = full_med / med if med > 0 else float("nan")
            diffs = [r.score - f.score for f, r in paired]
            decode = [r.decode_s_per_token for r in rs if r.decode_s_per_token is not None]
            out.append(
                Summary(
                    length=length,
                    method=m,
                    n=len(rs),
                    ttft_median_s=med,
                    ttft_p25_s=float(np.percentile(ttft, 25)),
                    ttft_p75_s=float(np.percentile(ttft, 75)),
                    speedup=speedup,
                    speedup_paired_median=float(np.median([f.ttft_s / r.ttft_s for f, r in paired]))
                    if paired else float("nan"),
                    score_mean=float(np.mean([r.score for r in rs])),
                    score_diff_vs_full=float(np.mean(diffs)) if diffs else float("nan"),
                    score_diff_ci95=bootstrap_ci(diffs),
                    token_layer_fraction=frac,
                    ideal_speedup=1.0 / frac if frac > 0 else float("nan"),
                    realised_over_ideal=speedup * frac,
                    flops_ratio=float(np.mean([r.prefill_flops / f.prefill_flops for f, r in paired]))
                    if paired else float("nan"),
                    decode_s_per_token_median=float(np.median(decode)) if decode else None,
                    peak_mem_mb=float(max(r.peak_mem_mb for r in rs)),
                )
            )
    return out


def markdown_table(summaries: Sequence[Summary], header: Mapping[str, Any] | None = None) -> str:
    """A markdown table of the summaries (scores shown on a 0-100 scale)."""
    lines = []
    if header:
        lines.append(
            f"Task `{header.get('task')}` ({header.get('split')} split), model `{header.get('model', '?')}`, "
            f"{header.get('threads')} threads, torch {header.get('torch')}, CPU: {header.get('cpu')}. "
            f"Warm-up runs excluded: {header.get('warmup')} per method. Command: `{header.get('command')}`"
        )
        lines.append("")
    lines.append(
        "| length | method | n | median TTFT (s) [p25, p75] | speedup vs full | paired speedup | "
        "score (0-100) | Δ score vs full [95% CI] | token-layers | FLOPs vs full | decode s/token |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        ci = s.score_diff_ci95
        delta = "—" if s.method == FULL else f"{100 * s.score_diff_vs_full:+.1f} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"
        dec = f"{s.decode_s_per_token_median:.4f}" if s.decode_s_per_token_median is not None else "—"
        lines.append(
            f"| {s.length} | {s.method} | {s.n} | {s.ttft_median_s:.3f} [{s.ttft_p25_s:.3f}, {s.ttft_p75_s:.3f}] | "
            f"{s.speedup:.2f}x | {s.speedup_paired_median:.2f}x | {100 * s.score_mean:.1f} | {delta} | "
            f"{100 * s.token_layer_fraction:.0f}% | {100 * s.flops_ratio:.0f}% | {dec} |"
        )
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_speedup(summaries: Sequence[Summary], path: Path, title: str = "") -> None:
    """Scatter/line plot of score (0-100) against TTFT speedup, one series per method family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def replot(jsonl: str | Path) -> Path:
    """Redraw the plot of a result file from its records (no re-measurement)."""
    from fastprefill.bench.runner import load_jsonl

    path = Path(jsonl)
    header, records = load_jsonl(path)
    out = path.with_suffix(".png")
    plot_accuracy_vs_speedup(summarize(records), out, title=f"{header.get('task')} — {header.get('model', '')}")
    return out


def write_report(out_dir: Path, name: str, header: Mapping[str, Any], records: Sequence[Record]) -> list[Summary]:
    """Write ``name.jsonl`` (records), ``name.md`` (table) and ``name.png`` (plot) into ``out_dir``."""
    save_jsonl(out_dir / f"{name}.jsonl", header, records)
    summaries = summarize(records)
    (out_dir / f"{name}.md").write_text(markdown_table(summaries, header))
    plot_accuracy_vs_speedup(summaries, out_dir / f"{name}.png", title=f"{header.get('task')} — {header.get('model', '')}")
    return summaries
