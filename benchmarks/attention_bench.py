"""What the C++ attention kernel (``fastprefill.kernels``) changes, against SDPA, in one process.

For each model and prompt length ``T``, one model, its attention backend switched between the
kernel and SDPA (``set_attention_backend``) in alternating rounds, everything else the same
(fastprefill's attention function selected for both, as full prefill selects it):

- **attention alone**, per layer shape: the kernel and SDPA on ``(1, H_q, T, d)`` random queries
  over ``(1, H_kv, N, d)`` keys, for a whole causal prefill (``N = T``), a ``--suffix``-row hit
  over ``T - suffix`` cached keys and a decode step (one row over ``T`` keys), with their FLOP
  rates beside the rate of the layer's own matrix products (``roofline.gemms_alone``: every
  linear map of one layer on ``T`` rows, summed);
- **the model**: a cold full prefill of ``T`` tokens, the hit (the last ``--suffix`` tokens over
  the cached rest) and one decode step, as in ``packed_bench.py``;

each setting a warm-up, then ``--repeats`` rounds, kernel and SDPA alternating in order. Per
setting: medians, the median of the per-round paired ratios ``sdpa / kernel`` with their range,
and whether the greedy next token agrees. ``prefill / (GEMMs + attention)``: the kernel's cold
prefill against its layers' matrix products plus its attention, each timed alone.

With ``--parts-only`` it times attention alone and the products alone, not the model (minutes
instead of an hour on a machine where a 4k prefill takes minutes); the result is
``attention_parts_<model>_<dtype>``.

    python benchmarks/attention_bench.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --lengths 2048 4096
    python benchmarks/attention_bench.py --parts-only --lengths 2048 4096
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.kernels import attention_kernel
from fastprefill.models import load as load_model
from fastprefill.models.attention import attention_backend, fastprefill_attention, set_attention_backend
from packed_bench import SETTINGS, _runs, machine, parser, run_all
from roofline import _linears, gemms_alone

BACKENDS = ("kernel", "sdpa")
SHAPES = ("prefill", "hit", "decode")


def _attention_cases(t: int, suffix: int) -> dict[str, tuple[int, int]]:
    """``{case: (queries, keys)}`` of the three attention shapes at prompt length ``t``."""
    return {"prefill": (t, t), "hit": (suffix, t), "decode": (1, t)}


def _pairs(q: int, n: int) -> float:
    """Query-key pairs of the lower-right causal mask: ``q`` rows over ``n`` keys."""
    return q * n - q * (q - 1) / 2


def attention_alone(model: Any, t: int, suffix: int, repeats: int) -> dict[str, Any]:
    """The kernel and SDPA on one layer's attention shapes, alternating: seconds per layer,
    GFLOP/s, and the paired ratios ``sdpa / kernel``."""
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    kernel = attention_kernel(model.dtype)
    assert kernel is not None, "the kernel does not run here"
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(t)
    for case, (nq, n) in _attention_cases(t, suffix).items():
        q = torch.randn(1, nq, hq, d, generator=gen).to(model.dtype).transpose(1, 2)  # (1, H_q, T, d)
        k, v = (torch.randn(1, hkv, n, d, generator=gen).to(model.dtype) for _ in range(2))
        allowed = None if nq in (1, n) else torch.arange(n)[None, :] <= torch.arange(n - nq, n)[:, None]
        causal = nq == n and nq > 1
        fns = {"kernel": lambda q=q, k=k, v=v: kernel(q, k, v, 1 / math.sqrt(d)),
               "sdpa": lambda q=q, k=k, v=v, m=allowed, c=causal: torch.nn.functional.scaled_dot_product_attention(
                   q, k, v, attn_mask=m, is_causal=c, enable_gqa=True).transpose(1, 2).contiguous()}
        times: dict[str, list[float]] = {b: [] for b in BACKENDS}
        reps = repeats * (1 if nq == n else 20)  # short calls: more of them
        for fn in fns.values():
            fn()
        for r in range(reps):
            for b in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
                t0 = time.perf_counter()
                fns[b]()
                times[b].append(time.perf_counter() - t0)
        flops = 4.0 * hq * d * _pairs(nq, n)
        ratios = [s / k for k, s in zip(times["kernel"], times["sdpa"], strict=True)]
        out[case] = {"queries": nq, "keys": n, "runs": reps,
                     "seconds": {b: statistics.median(v) for b, v in times.items()},
                     "gflops_per_s": {b: flops / statistics.median(v) / 1e9 for b, v in times.items()},
                     "sdpa_over_kernel": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
    return out


def run_model(name: str, args: Any) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    if attention_backend(model)[0] != "kernel":
        raise SystemExit(f"the kernel does not run {name} here: {attention_backend(model)[1]}")
    layers = model.config.num_hidden_layers
    rows = []
    for length in args.lengths:
        ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))
        alone = attention_alone(model, length, args.suffix, args.repeats)
        gemms = gemms_alone(model, length, args.repeats)
        gemm_seconds = sum(g["seconds"] for g in gemms.values())
        gemm_rate = sum(2.0 * length * lin.in_features * lin.out_features
                        for lin in _layer_linears(model)) / gemm_seconds / 1e9
        parts = {"length": length, "attention_alone": alone, "gemms_alone": gemms,
                 "gemm_seconds_per_layer": gemm_seconds, "gemm_gflops_per_s": gemm_rate,
                 "attention_over_gemm_rate": alone["prefill"]["gflops_per_s"]["kernel"] / gemm_rate}
        if args.parts_only:
            rows.append(parts)
            print(f"{name} {length}: kernel attention at {parts['attention_over_gemm_rate']:.2f} of the products' "
                  f"rate ({gemm_rate:.0f} GFLOP/s)", flush=True)
            continue
        with fastprefill_attention(model):
            for backend in ("auto", "sdpa"):  # warm-up (compiles on the first call)
                set_attention_backend(model, backend)
                _runs(model, ids, args.suffix)
            times: dict[str, dict[str, list[float]]] = {b: {s: [] for s in SETTINGS} for b in BACKENDS}
            tokens: dict[str, dict[str, int]] = {b: {} for b in BACKENDS}
            for r in range(args.repeats):
                for b in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
                    set_attention_backend(model, "auto" if b == "kernel" else "sdpa")
                    for setting, (seconds, token) in _runs(model, ids, args.suffix).items():
                        times[b][setting].append(seconds)
                        tokens[b][setting] = token
            set_attention_backend(model, "auto")
        med = {b: {s: statistics.median(v) for s, v in d.items()} for b, d in times.items()}
        paired = {s: [x / y for x, y in zip(times["sdpa"][s], times["kernel"][s], strict=True)] for s in SETTINGS}
        attn_layer = alone["prefill"]["seconds"]["kernel"]
        row = {**parts,
               "prefill_over_parts": med["kernel"]["cold"] / (layers * (gemm_seconds + attn_layer)),
               "times": times, "medians": med,
               "sdpa_over_kernel": {s: statistics.median(v) for s, v in paired.items()},
               "ratio_range": {s: [min(v), max(v)] for s, v in paired.items()},
               "same_token": {s: tokens["kernel"][s] == tokens["sdpa"][s] for s in SETTINGS}}
        rows.append(row)
        print(f"{name} {length}: " + ", ".join(
            f"{s} {med['kernel'][s] * 1000:.1f} ms kernel / {med['sdpa'][s] * 1000:.1f} sdpa "
            f"({row['sdpa_over_kernel'][s]:.2f}x)" for s in SETTINGS), flush=True)
    return {"model": name, "suffix": args.suffix, "repeats": args.repeats, "parts_only": args.parts_only,
            "rows": rows, "environment": environment(args.threads, model)}


def _layer_linears(model: Any) -> list[torch.nn.Linear]:
    return list(_linears(model).values())


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    n = result["repeats"]
    parts_only = result.get("parts_only", False)
    about = (f"{machine(env)}. One process, the kernel and SDPA alternating; the parts alone, not the model "
             f"(`--parts-only`). Hit: {result['suffix']} query rows over the cached rest." if parts_only else
             f"{machine(env)}. One process, the model's attention backend switched between the kernel and SDPA "
             f"in {n} alternating rounds; the ratio is the median of the per-round ratios sdpa / kernel "
             f"(their range in brackets). Hit: the last {result['suffix']} tokens over the cached rest.")
    lines = [f"# The C++ attention kernel against SDPA: {result['model']}, {env['dtype']}", "", about, "",
             "## Attention alone, one layer", "",
             "| T | case | kernel (ms) | SDPA (ms) | SDPA / kernel | kernel GFLOP/s | SDPA GFLOP/s | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        for case in SHAPES:
            a = r["attention_alone"][case]
            lo, hi = a["ratio_range"]
            lines.append(f"| {r['length']} | {case} ({a['queries']} over {a['keys']}) | {a['seconds']['kernel'] * 1000:.2f} | "
                         f"{a['seconds']['sdpa'] * 1000:.2f} | {a['sdpa_over_kernel']:.2f} [{lo:.2f}, {hi:.2f}] | "
                         f"{a['gflops_per_s']['kernel']:.0f} | {a['gflops_per_s']['sdpa']:.0f} | {a['runs']} |")
    if parts_only:
        lines += ["", "## Against the matrix products", "",
                  "| T | GEMMs GFLOP/s | kernel attention / GEMM rate |", "|---|---|---|"]
        lines += [f"| {r['length']} | {r['gemm_gflops_per_s']:.0f} | {r['attention_over_gemm_rate']:.2f} |"
                  for r in result["rows"]]
        return "\n".join(lines) + "\n"
    lines += ["", "## The model", "",
              "| T | setting | kernel (ms) | SDPA (ms) | SDPA / kernel | same next token |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        for s in SETTINGS:
            lo, hi = r["ratio_range"][s]
            lines.append(f"| {r['length']} | {s} | {r['medians']['kernel'][s] * 1000:.1f} | "
                         f"{r['medians']['sdpa'][s] * 1000:.1f} | {r['sdpa_over_kernel'][s]:.2f} [{lo:.2f}, {hi:.2f}] | "
                         f"{'yes' if r['same_token'][s] else 'no'} |")
    lines += ["", "## Against the matrix products", "",
              "| T | GEMMs GFLOP/s | kernel attention / GEMM rate | cold prefill / (GEMMs + attention) alone |",
              "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['length']} | {r['gemm_gflops_per_s']:.0f} | {r['attention_over_gemm_rate']:.2f} | "
                     f"{r['prefill_over_parts']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, repeats=5)
    p.add_argument("--parts-only", action="store_true", help="attention alone and the products alone, not the model")
    args = p.parse_args(argv)
    if min(args.lengths) <= args.suffix or args.suffix < 1 or args.repeats < 1:
        p.error("every length must exceed --suffix >= 1, and --repeats >= 1")
    stem = (lambda name, result: f"attention_parts_{name}_{result['environment']['dtype']}") if args.parts_only else None
    run_all(args, "attention", run_model, markdown, stem)


if __name__ == "__main__":
    main()
