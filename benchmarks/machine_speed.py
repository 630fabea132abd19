"""How steady this machine's speed is: the same matrix product timed back to back for a while.

One ``(T, D) x (D, I)`` product (the 0.5B's gate projection at 2k rows by default) in the
machine's default dtype, on ``--threads`` threads, in blocks of ``--calls`` calls; each block's
time is one sample. Reported: the samples' median, fastest and slowest, the slowest over the
fastest, and the share of samples more than 1.5x the fastest (the machine in a slow state). Run it
before a timing session, and beside one: a ratio between two runs is readable only where this is
flat, and a paired ratio (both sides in the same short window) only where states last longer than
a pair.

With ``--ceiling``, it also measures the cores' multiply-add ceiling: each of ``--threads``
threads runs twelve independent chains of vector fused multiply-adds (the widest this CPU has:
AVX-512 or AVX2), nothing read from memory (``fma_ceiling.cpp``), compiled when the benchmark
runs with the flags of this CPU's kernel build (:func:`fastprefill.kernels.compile_source`). The
products' rate over that ceiling is how much a faster matrix-product kernel could gain here at
most, in float32: it is the float32 vector ceiling, and bfloat16 products on AVX512-BF16 dot
products or AMX tiles can pass it.

    python benchmarks/machine_speed.py --samples 60
    python benchmarks/machine_speed.py --samples 30 --ceiling --tag ceiling
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fastprefill.bench.records import environment, result_name
from fastprefill.host import DTYPES, resolve_dtype, set_threads
from fastprefill.kernels import compile_source, runnable_variants
from fastprefill.models.packed import pack_linears, packable
from reporting import write_json

RESULTS = Path(__file__).resolve().parent / "results"
SLOW = 1.5  # a sample this much slower than the fastest counts as the slow state
CHAINS = 12  # independent multiply-add chains per thread: more than latency x issue width on x86 cores

PROBE = Path(__file__).with_name("fma_ceiling.cpp")  # the ceiling probe: CHAINS chains per thread


def measure(rows: int, dim: int, inner: int, dtype: torch.dtype, calls: int, samples: int,
            packed: bool = False) -> dict[str, list[float]]:
    """Seconds of each block of ``calls`` products ``(rows, dim) x (dim, inner)``: ``"plain"``
    (``F.linear`` on the plain weight) and, with ``packed``, ``"packed"`` (the weight packed for
    oneDNN as the model loader packs it, :func:`~fastprefill.models.packed.pack_linears`), the two
    alternating block by block."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    w = torch.randn(inner, dim, generator=gen).to(dtype)
    products = {"plain": lambda: torch.nn.functional.linear(x, w)}
    if packed:
        layer = torch.nn.Sequential(torch.nn.Linear(dim, inner, bias=False, dtype=dtype))
        with torch.no_grad():
            layer[0].weight.copy_(w)
        pack_linears(layer, rows)
        products["packed"] = lambda: layer(x)
    out: dict[str, list[float]] = {name: [] for name in products}
    with torch.inference_mode():
        for product in products.values():
            for _ in range(3):
                product()  # warm-up
        for _ in range(samples):
            for name, product in products.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    product()
                out[name].append(time.perf_counter() - t0)
    return out


def ceiling(threads: int, samples: int, iters: int = 50_000_000) -> dict[str, Any]:
    """The multiply-add ceiling of ``threads`` threads: ``samples`` runs of the probe, GFLOP/s of the fastest and the median.

    Raises:
        RuntimeError: the probe does not compile here (no C++ compiler, or one without the CPU's
            vector flags); the message says which.
    """
    variants = runnable_variants()
    if not variants:
        raise RuntimeError("this CPU runs neither fastprefill's AVX-512 nor its AVX2 build: no probe to build; "
                           "run without --ceiling")
    try:
        probe = compile_source(PROBE, "fastprefill_fma_ceiling", Path(tempfile.mkdtemp(prefix="fastprefill-fma-")),
                               variants[0])
    except (RuntimeError, OSError, ImportError) as exc:
        raise RuntimeError(f"the multiply-add probe did not compile ({type(exc).__name__}: {exc}); "
                           "run without --ceiling, or install a C++ compiler") from exc
    flops = 2.0 * CHAINS * probe.lanes() * iters * threads
    _, used = probe.run(iters // 10, threads)  # warm-up
    if used != threads:
        raise RuntimeError(f"the multiply-add probe ran on {used} threads, not {threads}: ATen's parallel_for "
                           "was compiled without OpenMP here, so the ceiling would be too low")
    seconds = [probe.run(iters, threads)[0] for _ in range(samples)]
    return {"threads": threads, "lanes": probe.lanes(), "chains": CHAINS, "iterations": iters, "seconds": seconds,
            "fastest_gflops_per_s": flops / min(seconds) / 1e9,
            "median_gflops_per_s": flops / statistics.median(seconds) / 1e9}


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
         f"{s['median_gflops_per_s']:.0f} |"), "", *ceiling_lines(result)])


def ceiling_lines(result: dict[str, Any]) -> list[str]:
    """The ceiling's table, where the run measured it: the probe's rate and each product's share of it
    (the plain weight's, and the packed one's where the run timed it)."""
    c = result.get("ceiling")
    if c is None:
        return []
    bits = 32 * c["lanes"]
    lines = [(f"Multiply-add ceiling: {c['threads']} threads, {c['chains']} independent chains of {bits}-bit fused "
              f"multiply-adds each, {len(c['seconds'])} samples; the products alternated block by block "
              "(plain: `F.linear` on the weight; packed: the weight packed for oneDNN, as the loader packs it)."), "",
             ("| product | GFLOP/s fastest | GFLOP/s median | ceiling GFLOP/s fastest | ceiling GFLOP/s median | "
              "product / ceiling (fastest) | product / ceiling (median) |"),
             "|---|---|---|---|---|---|---|"]
    for name, key in (("plain", "summary"), ("packed", "packed_summary")):
        if key in result:
            s = result[key]
            lines.append(f"| {name} | {s['fastest_gflops_per_s']:.0f} | {s['median_gflops_per_s']:.0f} | "
                         f"{c['fastest_gflops_per_s']:.0f} | {c['median_gflops_per_s']:.0f} | "
                         f"{s['fastest_gflops_per_s'] / c['fastest_gflops_per_s']:.2f} | "
                         f"{s['median_gflops_per_s'] / c['median_gflops_per_s']:.2f} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--dim", type=int, default=896)
    p.add_argument("--inner", type=int, default=4864)
    p.add_argument("--calls", type=int, default=10, help="products per sample")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--ceiling", action="store_true", help="also measure the cores' multiply-add ceiling")
    p.add_argument("--tag", default="", help="appended to the result name: machine_speed_<cpu>_<units>_<tag>")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if min(args.rows, args.dim, args.inner, args.calls, args.samples, args.threads) < 1:
        p.error("--rows, --dim, --inner, --calls, --samples and --threads must be >= 1")
    set_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    # the probe first: its build (tens of seconds) must not sit between the products' samples
    try:
        top = ceiling(args.threads, args.samples) if args.ceiling else None
    except RuntimeError as exc:
        p.error(str(exc))
    both = measure(args.rows, args.dim, args.inner, dtype, args.calls, args.samples,
                   packed=args.ceiling and packable("cpu", dtype))
    seconds = both["plain"]
    flops = 2.0 * args.rows * args.dim * args.inner * args.calls
    env = environment(args.threads, dtype)
    result = {"shape": f"{args.rows}x{args.dim} by {args.dim}x{args.inner}", "calls": args.calls,
              "seconds": seconds, "summary": summary(seconds, flops), "environment": env}
    if top is not None:
        result["ceiling"] = top
    if "packed" in both:
        result["packed_seconds"] = both["packed"]
        result["packed_summary"] = summary(both["packed"], flops)
    cpu = "epyc" if "EPYC" in env["cpu"] else "xeon" if "Xeon" in env["cpu"] else "cpu"
    path = str(Path(args.out) / result_name(args.out, f"machine_speed_{cpu}_{env['bf16_units']}" + (f"_{args.tag}" if args.tag else "")))
    write_json(path + ".json", result)
    Path(path + ".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
