"""MODEL PROJECTION (not a measurement): KV-Runahead vs TSP on 8 ranks for a Llama-7B shape.

The paper (arXiv 2405.05329) reports, on 8xA100 for Llama 7B / Falcon 7B in fp16, more than
1.4x (NVLink, 300 GB/s) and more than 1.6x (10 GB/s) faster TTFT than TSP. This script evaluates
our :class:`~fastprefill.methods.runahead.search.CostModel` (the same simulator the partition
search uses) for that setting: FLOP-derived compute times at a sustained ``--tflops`` (default
125 TFLOP/s, ~40% of an A100's fp16 peak), fp16 KV (2 bytes), the given link bandwidths and
``--latency-us`` per message. TSP is a ring all-gather per layer with attention of every rank's
queries over all keys; KV-Runahead is the chain with even and with searched partitions. Nothing
here ran on a GPU: it shows what the cost model predicts, beside what the paper measured.

Command::

    python benchmarks/runahead_projection.py --md benchmarks/results/runahead_projection.md \\
        --out benchmarks/results/runahead_projection.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastprefill.bench.records import result_name
from fastprefill.methods.runahead import CostModel, PartitionPlan, search_partition
from fastprefill.models.shape import ModelShape

LLAMA_7B = ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
                      intermediate_size=11008, vocab_size=32000, max_positions=16384)
PAPER = {300e9: ">1.4x", 10e9: ">1.6x"}
RESULTS = Path(__file__).resolve().parent / "results"


def single_s(cost: CostModel, total: int) -> float:
    """Predicted TTFT of one rank's plain causal prefill of ``total`` tokens (a chain of one)."""
    return cost.runahead_s([total])


def tsp_s(cost: CostModel, total: int, procs: int) -> float:
    """Predicted TTFT of the all-gather baseline, TSP (even chunks, padded to the largest).

    Every layer: own linear work, a ring all-gather of ``(P-1)`` chunks of KV, attention of the
    own queries over all ``T`` keys (a masked kernel computes the whole rectangle), and all ranks
    move in lockstep. One rank is plain prefill.
    """
    if procs == 1:
        return single_s(cost, total)
    c = -(-total // procs)
    per_layer = (cost.layer_overhead_s + cost.linear_s_per_token * c + (procs - 1) * cost.transfer_s(c)
                 + cost.attn_s_per_pair * c * total)
    return cost.num_layers * per_layer + cost.head_s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--bandwidths-gbs", type=float, nargs="+", default=[300.0, 10.0])
    ap.add_argument("--tflops", type=float, default=125.0, help="sustained fp16 TFLOP/s per GPU")
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--md", default=None, help="markdown table (default: beside the default --out)")
    ap.add_argument("--out", default=None, help="JSON lines, appended to (default benchmarks/results/"
                    "runahead_projection.jsonl, or runahead_projection-runN.jsonl when that exists)")
    args = ap.parse_args(argv)
    stem = RESULTS / result_name(RESULTS, "runahead_projection")  # a rerun never replaces a committed file
    args.out, args.md = args.out or f"{stem}.jsonl", args.md or f"{stem}.md"
    rows = []
    for bw in args.bandwidths_gbs:
        cost = CostModel.from_flops(LLAMA_7B, args.tflops * 1e12, bw * 1e9, latency_s=args.latency_us * 1e-6)
        for n in args.lengths:
            plan = search_partition(n, args.procs, cost)
            r = {
                "benchmark": "runahead_projection", "kind": "MODEL PROJECTION", "model_shape": "llama-7b",
                "procs": args.procs, "bandwidth_gbs": bw, "length": n, "tflops": args.tflops,
                "single_s": single_s(cost, n), "tsp_s": tsp_s(cost, n, args.procs),
                "runahead_even_s": cost.runahead_s(PartitionPlan.even(n, args.procs).chunks),
                "runahead_searched_s": cost.runahead_s(plan.chunks), "searched_chunks": list(plan.chunks),
                "paper_vs_tsp": PAPER.get(bw * 1e9, "n/a"),
            }
            rows.append(r)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = [
        f"# KV-Runahead vs TSP: cost-model projection (NOT measured), Llama-7B shape, {args.procs} ranks",
        "",
        (
            f"Compute at {args.tflops:.0f} sustained TFLOP/s per rank, fp16 KV, {args.latency_us:.0f} us per message. "
            "TTFT in ms predicted by `CostModel` (fastprefill.methods.runahead.search)."
        ),
        "",
        (
            "| link GB/s | tokens | 1 rank | TSP | runahead even | runahead searched | TSP / searched (model) "
            "| paper, measured vs TSP |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['bandwidth_gbs']:.0f} | {r['length']} | {1e3 * r['single_s']:.1f} | {1e3 * r['tsp_s']:.1f} | "
            f"{1e3 * r['runahead_even_s']:.1f} | {1e3 * r['runahead_searched_s']:.1f} | "
            f"{r['tsp_s'] / r['runahead_searched_s']:.2f}x | {r['paper_vs_tsp']} |"
        )
    lines += ["", "Command: `python benchmarks/runahead_projection.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`", ""]
    Path(args.md).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
