"""The table and plot ``fastprefill bench`` writes (every figure is drawn from :func:`summarize`).

- :func:`markdown_table`: one row per (length, method) against full prefill (``<stem>.md`` of a
  task run); :func:`plot_accuracy_vs_speedup` its plot; :func:`write_report` writes both.

What only the benchmark scripts report (other tables, plots and summary files) lives beside
them in a checkout (``benchmarks/reporting.py``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastprefill.bench.records import FULL, Record, save_records
from fastprefill.bench.summary import Summary, summarize

__all__ = ["markdown_table", "percent", "plot_accuracy_vs_speedup", "pyplot", "write_report"]


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def percent(x: float | None, digits: int = 0) -> str:
    """``x`` as a percentage (``—`` for None)."""
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
        same = "—" if s.is_reference else percent(s.identical_answers)
        first = "—" if s.is_reference else percent(s.first_token_agreement)
        lines.append(
            f"| {s.length} | {s.method} | {s.n} | {s.ttft_median_s:.3f} [{s.ttft_p25_s:.3f}, {s.ttft_p75_s:.3f}] | "
            f"{s.speedup:.2f}x | {s.speedup_paired_median:.2f}x | {100 * s.score_mean:.1f} | {delta} | "
            f"{100 * s.token_layer_fraction:.0f}% | {100 * s.flops_ratio:.0f}% | {dec} | {first} | {same} | {kl} |"
        )
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_speedup(summaries: Sequence[Summary], path: Path, title: str = "") -> None:
    """Score (0-100) against TTFT speedup, one line per (length, method family)."""
    plt = pyplot()
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


def _title(header: Mapping[str, Any]) -> str:
    return f"{header.get('task')} — {header.get('model', '')}"


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
