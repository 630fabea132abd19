"""How steady this machine's speed is: the same matrix product timed back to back for a while.

One ``(T, D) x (D, I)`` product (the 0.5B's gate projection at 2k rows by default) in the
machine's default dtype, on ``--threads`` threads, in blocks of ``--calls`` calls; each block's
time is one sample. Reported: the samples' median, fastest and slowest, the slowest over the
fastest, and the share of samples more than 1.5x the fastest (the machine in a slow state). Run it
before a timing session, and beside one: a ratio between two runs is readable only where this is
flat, and a paired ratio (both sides in the same short window) only where states last longer than
a pair.

    python benchmarks/machine_speed.py --samples 60
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fastprefill.bench.records import environment, result_name
from fastprefill.host import DTYPES, resolve_dtype, set_threads
from reporting import write_json

RESULTS = Path(__file__).resolve().parent / "results"
SLOW = 1.5  # a sample this much slower than the fastest counts as the slow state


def measure(rows: int, dim: int, inner: int, dtype: torch.dtype, calls: int, samples: int) -> list[float]:
    """Seconds of each block of ``calls`` products ``(rows, dim) x (dim, inner)``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    w = torch.randn(inner, dim, generator=gen).to(dtype)
    with torch.inference_mode():
        for _ in range(3):
            torch.nn.functional.linear(x, w)  # warm-up
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.nn.functional.linear(x, w)
            out.append(time.perf_counter() - t0)
    return out


def summary(seconds: list[float], flops: float) -> dict[str, Any]:
    fastest = min(seconds)
    return {"samples": len(seconds), "median_s": statistics.median(seconds), "fastest_s": fastest,
            "slowest_s": max(seconds), "slowest_over_fastest": max(seconds) / fastest,
            "slow_share": sum(s > SLOW * fastest for s in seconds) / len(seconds),
            "fastest_gflops_per_s": flops / fastest / 1e9, "median_gflops_per_s": flops / statistics.median(seconds) / 1e9}


def markdown(result: dict[str, Any]) -> str:
    env, s = result["environment"], result["summary"]
    return "\n".join([
        f"# Machine speed: {env['cpu']}, {env['dtype']}", "",
        (f"{env['threads']} threads, bfloat16 units: {env['bf16_units']}, torch {env['torch']}. "
         f"{result['calls']} products {result['shape']} per sample, back to back."), "",
        ("| samples | median (s) | fastest (s) | slowest (s) | slowest / fastest | share > 1.5x fastest | "
        "GFLOP/s fastest | GFLOP/s median |"),
        "|---|---|---|---|---|---|---|---|",
        (f"| {s['samples']} | {s['median_s']:.3f} | {s['fastest_s']:.3f} | {s['slowest_s']:.3f} | "
         f"{s['slowest_over_fastest']:.2f} | {100 * s['slow_share']:.0f}% | {s['fastest_gflops_per_s']:.0f} | "
         f"{s['median_gflops_per_s']:.0f} |"), ""])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--dim", type=int, default=896)
    p.add_argument("--inner", type=int, default=4864)
    p.add_argument("--calls", type=int, default=10, help="products per sample")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if min(args.rows, args.dim, args.inner, args.calls, args.samples, args.threads) < 1:
        p.error("--rows, --dim, --inner, --calls, --samples and --threads must be >= 1")
    set_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    seconds = measure(args.rows, args.dim, args.inner, dtype, args.calls, args.samples)
    flops = 2.0 * args.rows * args.dim * args.inner * args.calls
    env = environment(args.threads, dtype)
    result = {"shape": f"{args.rows}x{args.dim} by {args.dim}x{args.inner}", "calls": args.calls,
              "seconds": seconds, "summary": summary(seconds, flops), "environment": env}
    cpu = "epyc" if "EPYC" in env["cpu"] else "xeon" if "Xeon" in env["cpu"] else "cpu"
    path = str(Path(args.out) / result_name(args.out, f"machine_speed_{cpu}_{env['bf16_units']}"))
    write_json(path + ".json", result)
    Path(path + ".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
