"""The fidelity frontier of one model: first-token agreement against TTFT ratio for every method
in every committed result file of a task at one prompt length.

Each point is one (file, method) cell of :func:`fastprefill.bench.summary.summarize`: x is the
median over prompts of full prefill's TTFT over the method's on the same prompt (paired), y the
share of prompts whose first generated token equals full prefill's, with its 95% Wilson interval
as an error bar; dev-split files are drawn hollow, test-split ones filled. Files of other
models, tasks or lengths, and summaries (``.summary.jsonl``), are skipped. Writes
``frontier_<model>_<task>_<length>.{png,md}`` (the md lists every point with its file).

    python benchmarks/frontier.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fastprefill.bench.records import FULL, command_line, load_records
from fastprefill.bench.summary import summarize
from fastprefill.errors import ConfigError
from fastprefill.tune import wilson

RESULTS = Path(__file__).resolve().parent / "results"


def frontier_points(results: Path, model: str, task: str, length: int) -> list[dict[str, Any]]:
    """Every (file, method) cell of ``model`` on ``task`` at ``length`` with first tokens recorded."""
    points = []
    for path in sorted(results.glob("*.jsonl")):
        if path.name.endswith(".summary.jsonl"):
            continue
        try:
            header = json.loads(path.open(encoding="utf-8").readline()).get("header")
        except (json.JSONDecodeError, AttributeError):
            continue
        if not isinstance(header, dict) or header.get("model") != model or task not in str(header.get("task")):
            continue
        try:
            _, records = load_records(path)
        except (ConfigError, TypeError):
            continue
        records = [r for r in records if r.length == length]
        if not any(r.method == FULL for r in records):
            continue
        for s in summarize(records):
            if s.method == FULL or s.first_token_agreement is None or not s.n_paired:
                continue
            hits = round(s.first_token_agreement * s.n_paired)
            low, high = wilson(hits, s.n_paired)
            points.append({"file": path.name, "split": header.get("split"), "method": s.method, "n": s.n_paired,
                           "ttft_ratio": s.speedup_paired_median, "first_token": s.first_token_agreement,
                           "ci": [low, high], "token_layers": s.token_layer_fraction})
    return points


def family(method: str) -> str:
    """The legend group of a method cell: the method's name, with a fill policy named apart."""
    for fill in ("calibrated", "zero-shot"):
        if method.endswith("/" + fill):
            return f"lazyllm + {fill} fill"
    return method.split("-")[0].split(":")[0]


def plot(points: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    families = sorted({family(p["method"]) for p in points})
    colours = dict(zip(families, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4, strict=False))
    for p in points:
        fam = family(p["method"])
        err = [[p["first_token"] - p["ci"][0]], [p["ci"][1] - p["first_token"]]]
        filled = p["split"] != "dev"
        ax.errorbar(p["ttft_ratio"], p["first_token"], yerr=err, fmt="o", ms=5, capsize=2, alpha=0.8,
                    color=colours[fam], mfc=colours[fam] if filled else "none")
    for fam in families:
        ax.plot([], [], "o", color=colours[fam], label=fam)
    ax.plot([], [], "o", color="grey", mfc="none", label="dev split (hollow)")
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("TTFT ratio, full prefill / method (paired median)")
    ax.set_ylabel("first token = full prefill (95% Wilson interval)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="multidoc-qa")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--results", default=str(RESULTS), help="where the result files are (and the outputs go)")
    args = ap.parse_args()
    results = Path(args.results)
    points = frontier_points(results, args.model, args.task, args.length)
    if not points:
        raise SystemExit(f"error: no result file in {results} has {args.model} on {args.task} at {args.length} "
                         "with first tokens recorded")
    stem = str(results / f"frontier_{args.model}_{args.task}_{args.length}")  # names hold dots: no with_suffix
    plot(points, f"{args.model}, {args.task} {args.length} tokens: {len(points)} method cells", Path(stem + ".png"))
    lines = [f"Command: `{command_line()}`", "",
             "| file | split | method | n | TTFT ratio (paired) | first token = full [95% CI] | token-layers |",
             "|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (-p["ttft_ratio"], p["file"])):
        lines.append(f"| {p['file']} | {p['split']} | {p['method']} | {p['n']} | {p['ttft_ratio']:.2f}x | "
                     f"{p['first_token']:.0%} [{p['ci'][0]:.0%}, {p['ci'][1]:.0%}] | {p['token_layers']:.0%} |")
    Path(stem + ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(points)} points -> {stem}.png, {stem}.md")


if __name__ == "__main__":
    main()
