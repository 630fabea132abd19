"""``fastprefill demo``: one multi-document QA prompt, full prefill beside every method, then
the exact win of the prefix cache: a follow-up question over a cached document.

Each method runs once untimed (warm-up), then ``--repeats`` times, the methods interleaved within
each repetition so that load on a shared machine hits them alike; the table shows the median
TTFT with its range and the median of the per-run TTFT ratios to full prefill. The answer shown
is the first timed run's (the others generate one token).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["demo_methods", "demo_prefix_layer", "follow_up_table", "run_demo", "spread"]


def demo_prefix_layer(num_layers: int) -> int:
    """The demo's kvp-prefix depth: two thirds of the layers run exactly, rounded up. The demo's
    choice, so that it runs with no file; not a measured optimum (``benchmarks/kvp_bench.py
    l-sweep`` measures the trade-off)."""
    return -(-2 * num_layers // 3)


def demo_methods(model: Any, prompt_len: int) -> list[tuple[str, Any]]:
    """(label, method) pairs the demo runs beside full prefill, the baselines at LazyLLM's budget."""
    from fastprefill.methods.baselines import matched_baselines
    from fastprefill.methods.lazyllm import LazyLLM
    from fastprefill.models.shape import ModelShape

    lazy = LazyLLM(preset="default")
    baselines = matched_baselines(lazy, ModelShape.from_config(model.config).num_layers, prompt_len)
    from fastprefill.methods.kv_prediction.prefix import KVPrefix

    layers = ModelShape.from_config(model.config).num_layers
    return [
        (f"KV Prediction, kvp-prefix zero-shot, l={demo_prefix_layer(layers)} of {layers}",
         KVPrefix(layer=demo_prefix_layer(layers))),
        ("LazyLLM (default preset)", lazy),
        ("static pruning, same budget", baselines["static"]),
        ("random drop, same budget", baselines["random"]),
        ("GemFilter, same budget", baselines["gemfilter"]),
    ]


def spread(values: Sequence[float], digits: int = 3, unit: str = "") -> str:
    """``median<unit> [min, max]`` of repeated measurements, as the demo prints them."""
    return f"{statistics.median(values):.{digits}f}{unit} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def run_demo(model: Any, tok: Any, args: argparse.Namespace, console: Console) -> int:
    """The ``fastprefill demo`` command on a loaded model: one multidoc-qa test prompt of
    ``args.length`` tokens, every method of :func:`demo_methods` beside full prefill (and
    KV-Runahead on ``args.procs`` ranks), ``args.repeats`` timed runs each after one untimed
    warm-up run, printed as a table on ``console``."""
    from fastprefill.data.tasks import get_task
    from fastprefill.engine import generate
    from fastprefill.host import precision_line
    from fastprefill.methods.full import FullPrefill

    task = get_task("multidoc-qa")
    sample = task.build(tok, args.length, 1, split="test", seed=args.seed)[0]
    n = len(sample.input_ids)
    console.print(f"[bold]Multi-document QA[/bold]: {n} prompt tokens, model {args.model}, {args.threads} threads, "
                  f"{precision_line(model.dtype, args.device, args.dtype)}", highlight=False)
    console.print(f"Question: {sample.meta.get('question', '?')}   Gold answer: {' | '.join(sample.answers)}")
    runs: list[tuple[str, Any]] = [("full prefill (reference)", FullPrefill()), *demo_methods(model, n)]
    title = (f"same prompt, greedy, same answer budget; TTFT: median and range of {args.repeats} runs after one "
             "untimed warm-up run per method; speedup: median and range of the per-run ratios to full prefill")
    table = Table(title=title)
    for col in ("method", "answer", "F1", "TTFT (s)", "speedup", "token-layers"):
        table.add_column(col)
    for _, method in runs:  # warm-up, not shown
        generate(model, tok, sample.input_ids, method, max_new_tokens=1)
    ttfts: dict[str, list[float]] = {label: [] for label, _ in runs}
    answers: dict[str, Any] = {}
    with console.status(f"{len(runs)} methods x {args.repeats} runs ..."):
        for rep in range(args.repeats):  # methods interleaved, so load on the machine hits them alike
            for label, method in runs:
                res = generate(model, tok, sample.input_ids, method,
                               max_new_tokens=args.max_new_tokens if rep == 0 else 1)
                ttfts[label].append(res.timing.ttft_s)
                answers.setdefault(label, res)
    base = ttfts[runs[0][0]]
    for label, _ in runs:
        res = answers[label]
        ratios = [b / t for b, t in zip(base, ttfts[label], strict=True)]
        table.add_row(label, " ".join(res.text.split())[:60], f"{100 * task.score(sample, res.text)['score']:.0f}",
                      spread(ttfts[label]), spread(ratios, 2, "x"),
                      f"{100 * res.timing.stats.fraction:.0f}%")
    notes: list[str] = []
    if args.procs > 1:
        from fastprefill.distributed.pool import RankPool
        from fastprefill.methods.registry import make_method

        ra_method = make_method(f"runahead:procs={args.procs},partition=searched")
        with (console.status(f"KV-Runahead: starting {args.procs} ranks (model loading is not timed) ..."),
              RankPool(args.model, args.procs, dtype=args.dtype,
                       threads_per_rank=max(1, args.threads // args.procs)) as pool):
            pool.generate(sample.input_ids, ra_method, 1)  # warm-up, not shown
            ra_runs = [pool.generate(sample.input_ids, ra_method, args.max_new_tokens if rep == 0 else 1)
                       for rep in range(args.repeats)]
        ra = ra_runs[0]
        ra_ttft = [r.ttft_s for r in ra_runs]
        ratios = [b / t for b, t in zip(base, ra_ttft, strict=True)]
        table.add_row(f"KV-Runahead ({args.procs} ranks)", " ".join(ra.text.split())[:60],
                      f"{100 * task.score(sample, ra.text)['score']:.0f}", spread(ra_ttft),
                      spread(ratios, 2, "x"), "100%")
        notes.append("KV-Runahead's TTFT is the driver's clock: dispatch and all communication included; its runs "
                     "follow the others', so its ratios pair runs made at different moments.")
    console.print(table)
    console.print(follow_up_table(model, tok, args.length, args.repeats, args.max_new_tokens, args.seed))
    notes.append("KV Prediction here is kvp-prefix with zero-shot maps at the demo's choice of l (not a measured "
                 "optimum); calibrated maps: `fastprefill train-kvp --variant prefix --model NAME --layer L --out DIR`, "
                 "the aux-model variant: `fastprefill train-kvp --help`, then --method kvp:predictor=DIR.")
    for note in notes:
        console.print(f"[dim]{note}[/dim]")
    console.print("[dim]One prompt: medians over many prompts, with intervals, are in docs/results/ and "
                  "benchmarks/results/.[/dim]")
    return 0


def follow_up_table(model: Any, tok: Any, length: int, repeats: int, max_new_tokens: int, seed: int = 0) -> Table:
    """The prefix cache's exact win: a SQuAD document of about ``length`` tokens with two
    questions. The first question runs through a :class:`~fastprefill.prefix_cache.PrefixCache`
    (which stores the document's K/V); the second is then asked ``repeats`` times with the cache
    (a hit: only the question is prefilled) and without it, interleaved, each after one untimed
    warm-up run. The table shows both TTFTs (median and range), their ratio and both answers."""
    from fastprefill.data.tasks.sessions import document_sessions, question_prompt
    from fastprefill.engine import generate
    from fastprefill.prefix_cache import PrefixCache

    session = document_sessions(tok, length, 1, 2, split="test", seed=seed)[0]
    first, follow_up = (question_prompt(session, i) for i in (0, 1))
    cache = PrefixCache(max_bytes=1 << 30)
    generate(model, tok, first, max_new_tokens=1, chat=True, prefix_cache=cache)  # the document is now cached
    runs: dict[str, list[Any]] = {"full prefill": [], "prefix cache hit": []}
    for rep in range(repeats + 1):  # the first of each is the untimed warm-up
        budget = max_new_tokens if rep == 1 else 1
        runs["full prefill"].append(generate(model, tok, follow_up, max_new_tokens=budget, chat=True))
        runs["prefix cache hit"].append(generate(model, tok, follow_up, max_new_tokens=budget, chat=True,
                                                 prefix_cache=cache))
    full = [r.timing.ttft_s for r in runs["full prefill"][1:]]
    table = Table(title=f"A follow-up question over the cached document ({runs['full prefill'][1].timing.prompt_tokens} "
                        f"prompt tokens): exact, so the same answer")
    for col in ("prefill", "answer", "TTFT (s)", "speedup", "prompt tokens computed"):
        table.add_column(col)
    for label, results in runs.items():
        timed = [r.timing.ttft_s for r in results[1:]]
        shown = results[1]
        table.add_row(label, " ".join(shown.text.split())[:60], spread(timed),
                      spread([b / t for b, t in zip(full, timed, strict=True)], 2, "x"),
                      str(shown.timing.prompt_tokens - shown.timing.cached_tokens))
    return table
