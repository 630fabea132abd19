"""What only the benchmark scripts report: tables, plots, summary files and JSON documents beyond
the ones ``fastprefill bench`` writes (those are :mod:`fastprefill.bench.report`'s).

- :func:`reference_table`: one row per method against its own reference, with the model each
  method runs on (``<stem>.md`` of a multi-model run); :func:`plot_score_vs_cost` its plot;
  :func:`method_entry` one method's ``.summary.json`` entry, :func:`references_by_model` who is
  paired with whom.
- :func:`plot_layer_errors` (and :func:`redraw_layer_plot`): per-layer relative error of predicted
  K / V from a summary header; :func:`merge_eval_summaries` and :func:`plot_score_vs_flops`:
  several KV Prediction runs on one plot.
- :func:`write_paired_rows`: the ``<stem>.summary.jsonl`` of a task run.
- :func:`prefix_overhead_table`: a prefix-cache run's own costs (the second table of its ``<stem>.md``).
- :func:`needle_by_depth`: retrieval rate per needle depth (:func:`needle_depth`: a sample's depth
  read back from its id); :func:`error_summary`: a KV
  Prediction run's per-layer errors as means.
- :func:`write_json`, :func:`write_rows`: one JSON document, or rows under a header (a
  ``.summary.jsonl``, of :func:`paired_row` s for a task run), written atomically.
- :func:`paired_ratios`: two settings timed in the same rounds, as the median of their per-round
  ratios with its range and count.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from fastprefill.bench.records import FULL, Record
from fastprefill.bench.report import percent, pyplot
from fastprefill.bench.summary import Summary
from fastprefill.errors import ConfigError


def _atomic_write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json(path: str | Path, document: Any) -> Path:
    """Write one JSON document (indented), atomically."""
    return _atomic_write(Path(path), json.dumps(document, indent=2))


def write_rows(path: str | Path, header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``{"header": header}`` then one JSON object per row (a ``.summary.jsonl``, which
    :func:`fastprefill.bench.records.read_rows` reads), atomically."""
    lines = [json.dumps({"header": dict(header)}), *(json.dumps(dict(r)) for r in rows)]
    return _atomic_write(Path(path), "".join(line + "\n" for line in lines))


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """The per-round ratios ``numerators[i] / denominators[i]`` of two settings timed in the same
    rounds (aligned by round): ``ratio`` (their median), ``min``, ``max`` and ``n``.

    Raises:
        ValueError: the two series differ in length, or are empty.
    """
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    if not ratios:
        raise ValueError("paired_ratios: no rounds to pair")
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def paired_row(s: Summary) -> dict[str, Any]:
    """A ``.summary.jsonl`` row: a method paired with its reference (keys as the LazyLLM
    result files have them; ``*_full`` names the reference's figure)."""
    return {
        "length": s.length, "method": s.method, "n": s.n,
        "score": s.score_mean, "score_full": s.reference_score_mean,
        "score_diff": s.score_diff, "score_diff_ci95": list(s.score_diff_ci95),
        "same_output_as_full": s.identical_answers,
        "first_token_agreement": s.first_token_agreement,
        "first_token_kl_median": s.first_token_kl_median,
        "ttft_s_median": s.ttft_median_s,
        "ttft_full_s_median": s.reference_ttft_median_s,
        "speedup_median": s.speedup_paired_median,
        "total_s_median": s.total_median_s,
        "total_full_s_median": s.reference_total_median_s,
        "total_speedup_median": s.total_speedup_paired_median,
        "slower_total_share": s.slower_total_share,
        "new_tokens_mean": s.new_tokens_mean,
        "token_layer_fraction": s.token_layer_fraction, "ideal_speedup": s.ideal_speedup,
        # distinct tokens revived per decode step (records before the counters were split: the old key)
        "revived_per_step_mean": s.counters.get("revived_tokens_per_step", s.counters.get("revived_per_step", 0.0)),
        "gold_kept_share_per_stage": s.gold_kept_share_per_stage,
    }


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
            f"{s['median_ttft_flops'] / 1e9:.0f} | {percent(s['first_token_agreement_with_reference'])} | "
            f"{percent(s.get('identical_answers_with_reference'))} | {'-' if kl is None else f'{kl:.3f}'} | {errs} |")
    return "\n".join(lines) + "\n"


def plot_score_vs_cost(summaries: Sequence[Summary], path: Path, title: str) -> None:
    """Two panels: score (%) against median TTFT and against median TTFT FLOPs, a point per method."""
    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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


def write_paired_rows(path: str | Path, header: Mapping[str, Any], summaries: Sequence[Summary]) -> Path:
    """Write a ``.summary.jsonl``: ``header``, then :func:`fastprefill.bench.summary.paired_row`
    of every summary that is not its own reference."""
    return write_rows(path, header, [paired_row(s) for s in summaries if not s.is_reference])


def method_entry(s: Summary, vs_full: Summary | None = None) -> dict[str, Any]:
    """A ``.summary.json`` entry: one method against its own reference (and, through ``vs_full``,
    the same cell paired with full prefill), as the KV Prediction result files have it."""
    return {
        "n": s.n,
        "reference": s.reference,
        "accuracy": s.score_mean,
        **{f"mean_{m}": v for m, v in s.metric_means.items() if m != "score"},
        "median_ttft_s": s.ttft_median_s,
        "median_speedup_vs_reference": s.speedup_paired_median,
        "median_speedup_vs_full": (vs_full or s).speedup_paired_median,
        "median_ttft_flops": s.flops_median,
        "first_token_agreement_with_reference": s.first_token_agreement,
        "identical_answers_with_reference": s.identical_answers,
        "median_first_token_kl": s.first_token_kl_median,
        "median_new_tokens": s.new_tokens_median,
    }


def references_by_model(runs_on: Mapping[str, str], plain: Collection[str], main: str = FULL) -> dict[str, str]:
    """Each method's reference when methods run on several models.

    A method that is not a plain prefill is paired with the plain prefill of the model it runs
    on; a plain prefill of another model (a smaller family member alone) with ``main``; a plain
    prefill of ``main``'s model with itself.

    Args:
        runs_on: method -> the model it runs on.
        plain: the methods that are full prefill of their model.
        main: the plain prefill every other model's plain prefill is compared with.

    Raises:
        ConfigError: ``main`` is not a plain prefill in ``runs_on``, or a model has methods but
            no plain prefill to pair them with.
    """
    if main not in runs_on or main not in plain:
        raise ConfigError(f"references: {main!r} must be one of the plain prefills {sorted(set(plain) & set(runs_on))}")
    full_on = {runs_on[name]: name for name in runs_on if name in plain}
    full_on[runs_on[main]] = main
    missing = sorted({m for n, m in runs_on.items() if n not in plain and m not in full_on})
    if missing:
        raise ConfigError(f"references: no full prefill of {missing} to pair their methods with")
    return {name: (full_on[model] if name not in plain else (main if model != runs_on[main] else name))
            for name, model in runs_on.items()}


def needle_depth(sample_id: str, depths: Sequence[float] | None = None) -> float:
    """The requested needle depth of the needle sample with id ``"<split>-<seed>-<index>"``
    (records keep only the id): sample ``i`` of a :class:`~fastprefill.data.tasks.NeedleTask`
    uses ``depths[i % len(depths)]``, the task's default depths unless ``depths`` is given."""
    from fastprefill.data.tasks import NeedleTask

    depths = NeedleTask().depths if depths is None else depths
    return depths[int(sample_id.rsplit("-", 1)[1]) % len(depths)]


def needle_by_depth(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Retrieval rate per (length, depth, method), the depth read back from each needle sample id."""
    hits: dict[tuple[Any, float, str], list[float]] = defaultdict(list)
    for r in records:
        hits[(r.length, needle_depth(r.sample_id), r.method)].append(r.score)
    return [{"length": ln, "depth": d, "method": m, "n": len(v), "retrieved": statistics.mean(v)}
            for (ln, d, m), v in sorted(hits.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))]


def error_summary(errors: dict[str, list[float]]) -> dict[str, float]:
    """Means over layers of :func:`fastprefill.methods.kv_prediction.auxiliary.fit.kv_relative_errors`' lists (``mean_k``, ``mean_v``, ``mean_r2_k``, ...)."""
    return {f"mean_{key}": sum(vals) / len(vals) for key, vals in errors.items() if vals}
