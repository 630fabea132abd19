"""KV-Runahead TTFT on this machine: 2 ranks vs one process, vs TSP, vs one process on 2 threads.

Configurations (each model, each prompt length):

- ``full-1core``: one process, one thread, pinned to one core (the scaling reference);
- ``full-2threads``: one process, two threads, unpinned (what users have today);
- ``runahead-even`` / ``runahead-searched``: KV-Runahead on 2 ranks, one thread each, each rank
  pinned to its own core, even split or the shipped searched table;
- ``tsp``: the all-gather baseline on the same 2 ranks.

Every configuration runs through the same :class:`fastprefill.distributed.pool.RankPool` machinery, so
dispatch overhead is the same for all, and TTFT is measured on the driver from prompt dispatch
to the first token id (all communication included); model loading is outside. The methods are
interleaved within each repetition on the 2-rank pool (drift hits them alike); ``--warmup``
runs per configuration are discarded; medians over ``--n`` are reported. Prompts are seeded
random in-vocabulary token ids: dense prefill's cost does not depend on the content. Every run
also records whether its first token equals the 1-core reference's. Every rank loads the model
in ``--dtype`` (default ``auto``: :func:`fastprefill.host.resolve_dtype`), recorded in each row.

Measured runs (on a quiet machine with at least 2 free cores)::

    python benchmarks/runahead_ttft.py --models smollm2-135m qwen2.5-coder-0.5b \\
        --lengths 1024 2048 4096 --n 7 --warmup 2 \\
        --out benchmarks/results/runahead_ttft.jsonl --md benchmarks/results/runahead_ttft.md

Smoke run (tiny random model, seconds)::

    python benchmarks/runahead_ttft.py --models random:llama --lengths 64 128 --n 2 --warmup 1 \\
        --out /tmp/ra.jsonl --md /tmp/ra.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fastprefill.bench.records import result_name
from fastprefill.distributed.pool import RankPool
from fastprefill.host import DTYPES, keep_freed_memory, precision_report, resolve_dtype
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.runahead import KVRunahead, SequenceParallel

RESULTS = Path(__file__).resolve().parent / "results"


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    hi = max(2, vocab - 512) if vocab > 1024 else vocab  # stay clear of special tokens at the top
    return torch.randint(1, hi, (length,), generator=g).tolist()


def _run_pool(pool: RankPool, configs: dict[str, Any], prompts: dict[int, list[int]], n: int, warmup: int,
              desc: str) -> dict[tuple[str, int], dict[str, Any]]:
    out: dict[tuple[str, int], dict[str, Any]] = {}
    total = len(prompts) * (n + warmup) * len(configs)
    with tqdm(total=total, desc=desc) as bar:
        for length, ids in prompts.items():
            rec = {name: {"ttft": [], "engine_ttft": [], "first": None, "chunks": None} for name in configs}
            for k in range(n + warmup):
                for name, method in configs.items():
                    res = pool.generate(ids, method, 1, stop_at_eos=False)
                    bar.update()
                    if k < warmup:
                        continue
                    r = rec[name]
                    r["ttft"].append(res.ttft_s)
                    r["engine_ttft"].append(res.timing["ttft_s"])
                    r["first"] = res.token_ids[0]
                    r["chunks"] = res.ranks[-1].get("chunks", [length])
            for name, r in rec.items():
                out[(name, length)] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--n", type=int, default=7, help="measured runs per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="discarded runs per configuration")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--dtype", default="auto", choices=list(DTYPES), help="the ranks' model dtype (default auto)")
    ap.add_argument("--out", default=None, help="JSON lines, appended to (default benchmarks/results/runahead_ttft"
                    ".jsonl, or runahead_ttft-runN.jsonl when that exists)")
    ap.add_argument("--md", default=None, help="markdown table (default: beside the default --out)")
    args = ap.parse_args()
    keep_freed_memory()  # as every rank does
    stem = RESULTS / result_name(RESULTS, "runahead_ttft")  # a rerun never replaces a committed file
    args.out, args.md = args.out or f"{stem}.jsonl", args.md or f"{stem}.md"
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise SystemExit("this benchmark needs 2 CPU cores (one per rank)")
    machine = {"platform": platform.platform(), "cores": cores, "torch": torch.__version__,
               **precision_report(resolve_dtype(args.dtype), requested=args.dtype)}
    rows: list[dict[str, Any]] = []
    for model in args.models:
        with RankPool(model, 1, dtype=args.dtype, threads_per_rank=1, pin=True, timeout_s=args.timeout) as pool:
            probe = pool.generate([1, 2, 3], FullPrefill(), 1, stop_at_eos=False)
            vocab = int(probe.logits.numel())
            prompts = {n: _prompt(vocab, n, seed=n) for n in args.lengths}
            res = _run_pool(pool, {"full-1core": FullPrefill()}, prompts, args.n, args.warmup, f"{model} 1 core")
        with RankPool(model, 1, dtype=args.dtype, threads_per_rank=2, pin=False, timeout_s=args.timeout) as pool:
            res.update(_run_pool(pool, {"full-2threads": FullPrefill()}, prompts, args.n, args.warmup,
                                 f"{model} 2 threads"))
        with RankPool(model, 2, dtype=args.dtype, threads_per_rank=1, pin=True, timeout_s=args.timeout) as pool:
            configs = {
                "runahead-even": KVRunahead(procs=2, timeout_s=args.timeout),
                "runahead-searched": KVRunahead(procs=2, partition="searched", timeout_s=args.timeout),
                "tsp": SequenceParallel(procs=2, timeout_s=args.timeout),
            }
            res.update(_run_pool(pool, configs, prompts, args.n, args.warmup, f"{model} 2 ranks"))
        for (name, length), r in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            rows.append({
                "benchmark": "runahead_ttft", "model": model, "length": length, "config": name,
                "median_ttft_s": statistics.median(r["ttft"]), "ttft_s": r["ttft"],
                "median_engine_ttft_s": statistics.median(r["engine_ttft"]), "n": args.n, "warmup": args.warmup,
                "chunks": r["chunks"], "first_token": r["first"],
                "first_token_matches_1core": r["first"] == res[("full-1core", length)]["first"],
                "machine": machine, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    Path(args.md).write_text(markdown(rows, args))
    print(Path(args.md).read_text())


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by = {(r["model"], r["length"], r["config"]): r for r in rows}
    lines = [
        "# KV-Runahead TTFT (measured)",
        "",
        (
            f"Median TTFT in ms over n={args.n} runs ({args.warmup} warm-up runs discarded), measured on the driver "
            "from prompt dispatch to the first token. Ranks: 1 thread each, pinned to one core each; "
            f"models in {rows[0]['machine']['dtype'] if rows else '?'}. "
            "Speedup columns divide the baseline's median by KV-Runahead (searched) median."
        ),
        "",
        (
            "| model | tokens | 1 core | 2 threads | TSP 2 ranks | runahead even | runahead searched (chunks) "
            "| vs 1 core | vs TSP | vs 2 threads | same first token |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        for length in sorted({r["length"] for r in rows if r["model"] == model}):
            g = {c: by[(model, length, c)] for c in ("full-1core", "full-2threads", "tsp", "runahead-even",
                                                     "runahead-searched")}
            ms = {c: 1e3 * r["median_ttft_s"] for c, r in g.items()}
            ra = ms["runahead-searched"]
            same = all(r["first_token_matches_1core"] for r in g.values())
            chunks = "/".join(map(str, g["runahead-searched"]["chunks"]))
            lines.append(
                f"| {model} | {length} | {ms['full-1core']:.0f} | {ms['full-2threads']:.0f} | {ms['tsp']:.0f} | "
                f"{ms['runahead-even']:.0f} | {ra:.0f} ({chunks}) | {ms['full-1core'] / ra:.2f}x | "
                f"{ms['tsp'] / ra:.2f}x | {ms['full-2threads'] / ra:.2f}x | {'yes' if same else 'NO'} |"
            )
    lines += ["", "Command: `python benchmarks/runahead_ttft.py " + " ".join(sys.argv[1:]) + "`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
