"""How close a prefill runs to this machine's matrix-product limit.

For each model and prompt length, in one process and with the same threads:

- **GEMMs alone**: every linear map of a decoder layer (q, k, v, o, gate, up, down: the model's
  own modules, packed where the loader packed them, on a ``(T, D_in)`` input in the model's
  dtype; where packed, ``torch.nn.functional.linear`` on the plain weight beside it) timed alone, after the prefill runs, median of twice ``--repeats``; their rate per shape, and their sum over the layers:
  the time the model's matrix products take with nothing else.
- **attention alone**: causal attention on ``(1, H_q, T, d)`` queries over ``(1, H_kv, T, d)``
  keys (GQA), times the layers, on what the model's prefill runs: fastprefill's attention kernel
  where it runs (records since it did: the table says ``(kernel)``), else SDPA (records before:
  SDPA always, the table says nothing).
- **prefill**: full prefill as fastprefill loads the model (compiled blocks unless
  ``--no-compile``, linear weights packed where the loader packs them), the same model
  uncompiled and, where packed, unpacked (neither with ``--loaded-only``), and LazyLLM at
  keep-all (the layer loop at its lossless setting); runs interleaved, warm-up excluded, medians.

Results: ``benchmarks/results/roofline_<model>.json`` (every run) and ``.md`` (the table).
Achieved FLOP/s uses the FLOP model of ``fastprefill.models.shape`` (linear maps plus causal
attention, one LM-head row).

    python benchmarks/roofline.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --lengths 512 2048 4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.engine import generate
from fastprefill.host import DTYPES, dtype_name
from fastprefill.kernels import attention_kernel
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.models import load as load_model
from fastprefill.models.attention import attention_backend
from fastprefill.models.packed import PackedLinear, linears_packed
from fastprefill.models.shape import ModelShape, causal_pairs
from packed_bench import run_all

RESULTS = Path(__file__).resolve().parent / "results"


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _linears(model: Any) -> dict[str, torch.nn.Linear]:
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
            "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}


def gemms_alone(model: Any, length: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Each linear map of one layer timed alone on ``length`` rows, as the model calls it (its
    packed weight where the loader packed it): seconds and GFLOP/s; where packed, also the plain
    ``F.linear`` on the same weight (``plain_*``)."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, lin in _linears(model).items():
            x = torch.randn(length, lin.in_features, generator=gen).to(lin.weight.dtype)
            flops = 2.0 * length * lin.in_features * lin.out_features
            seconds = _median_time(lambda x=x, lin=lin: lin(x), repeats)
            out[name] = {"shape": f"{length}x{lin.in_features} by {lin.in_features}x{lin.out_features}",
                         "seconds": seconds, "gflops_per_s": flops / seconds / 1e9}
            if isinstance(lin, PackedLinear):
                plain = _median_time(lambda x=x, lin=lin: torch.nn.functional.linear(x, lin.weight, lin.bias), repeats)
                out[name] |= {"plain_seconds": plain, "plain_gflops_per_s": flops / plain / 1e9}
    return out


def attention_alone(shape: ModelShape, dtype: torch.dtype, length: int, repeats: int,
                    kernel: Any = None) -> float:
    """Seconds of one layer's causal attention at ``length`` tokens: ``kernel`` (fastprefill's
    attention kernel, :func:`fastprefill.kernels.attention_kernel`) where given, else SDPA."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, shape.num_heads, length, shape.head_dim, generator=gen).to(dtype)
    k = torch.randn(1, shape.num_kv_heads, length, shape.head_dim, generator=gen).to(dtype)
    v = torch.randn(1, shape.num_kv_heads, length, shape.head_dim, generator=gen).to(dtype)
    with torch.inference_mode():
        if kernel is not None:
            return _median_time(lambda: kernel(q, k, v, shape.head_dim ** -0.5), repeats)
        return _median_time(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=shape.num_heads != shape.num_kv_heads), repeats)


def prefill_runs(models: dict[str, Any], tok: Any, length: int, repeats: int) -> dict[str, list[float]]:
    """TTFTs of full prefill on each model (and LazyLLM keep-all on the first), interleaved."""
    ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))
    first = next(iter(models))
    runs = {**{f"full:{k}": (m, None) for k, m in models.items()},
            f"lazyllm-keep-all:{first}": (models[first], LazyLLM(preset="keep-all"))}
    for model, method in runs.values():
        generate(model, tok, ids, method, max_new_tokens=1)  # warm-up (compiles on the first call)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for key, (model, method) in runs.items():
            times[key].append(generate(model, tok, ids, method, max_new_tokens=1).timing.ttft_s)
    return times


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    compiled, tok = load_model(name, dtype=args.dtype, compile=not args.no_compile)
    models = {"as loaded": compiled}
    if not args.no_compile and not args.loaded_only:
        models["uncompiled"], _ = load_model(name, dtype=args.dtype, compile=False)  # the same weights
    if linears_packed(compiled) and not args.loaded_only:
        models["unpacked"], _ = load_model(name, dtype=args.dtype, compile=not args.no_compile, pack=False)
    shape = ModelShape.from_config(compiled.config)
    # attention alone as the prefill runs it: the kernel where the model's causal attention takes it
    kernel = attention_kernel(compiled.dtype) if attention_backend(compiled)[0] == "kernel" else None
    rows = []
    for length in args.lengths:
        runs = prefill_runs(models, tok, length, args.repeats)  # first: it also warms the process up
        gemms = gemms_alone(compiled, length, 2 * args.repeats)
        gemm_s = shape.num_layers * sum(g["seconds"] for g in gemms.values())
        attn_s = shape.num_layers * attention_alone(shape, compiled.dtype, length, 2 * args.repeats, kernel)
        flops = shape.causal_prefill_flops(length)
        linear_flops = shape.num_layers * shape.linear_flops_per_token() * length
        attention_flops = shape.num_layers * shape.attention_flops(causal_pairs(length))
        medians = {k: statistics.median(v) for k, v in runs.items()}
        full = medians["full:as loaded"]
        row = {
            "length": length, "gemms": gemms, "gemm_s": gemm_s, "attention_s": attn_s,
            "attention_alone_on": "kernel" if kernel is not None else "sdpa",
            "gemm_tflops_per_s": linear_flops / gemm_s / 1e12, "attention_tflops_per_s": attention_flops / attn_s / 1e12,
            "prefill_flops": flops, "runs": runs, "medians": medians,
            "prefill_tflops_per_s": flops / full / 1e12,
            "prefill_over_gemms": full / gemm_s, "prefill_over_gemms_and_attention": full / (gemm_s + attn_s),
            "layer_loop_over_forward": statistics.median(
                [b / a for a, b in zip(runs["full:as loaded"], runs["lazyllm-keep-all:as loaded"], strict=True)]),
        }
        for other, key in (("uncompiled", "compiled_speedup"), ("unpacked", "packed_speedup")):
            if f"full:{other}" in runs:
                row[key] = statistics.median(
                    [b / a for a, b in zip(runs["full:as loaded"], runs[f"full:{other}"], strict=True)])
        rows.append(row)
        print(f"{name} {length}: prefill {full:.3f} s ({row['prefill_tflops_per_s']:.2f} TFLOP/s), GEMMs alone "
              f"{gemm_s:.3f} s ({row['gemm_tflops_per_s']:.2f} TFLOP/s), attention alone {attn_s:.3f} s; "
              f"prefill / GEMMs {row['prefill_over_gemms']:.2f}, layer loop / forward "
              f"{row['layer_loop_over_forward']:.3f}", flush=True)
    return {"model": name, "dtype": dtype_name(compiled.dtype), "shape": shape.to_json(), "rows": rows,
            "environment": environment(args.threads, compiled)}


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    about = (f"{env['threads']} threads, CPU {env['cpu']} (bfloat16 units: {env['bf16_units']}), torch "
             f"{env['torch']}, blocks compiled: {env['compiled']}. Medians of the runs in the JSON file.")
    packed = any("packed_speedup" in r for r in result["rows"])  # recorded since weights are packed
    if env.get("packed") is not None:
        about = about.replace(". Medians", f", linear weights packed: {env['packed']}. Medians")
    head = ("| T | prefill (s) | TFLOP/s | GEMMs alone (s) | TFLOP/s | attention alone (s) | prefill / GEMMs | "
            "prefill / (GEMMs + attention) | uncompiled / compiled | " + ("unpacked / packed | " if packed else "")
            + "layer loop / forward |")
    lines = [f"# Prefill against the matrix-product limit: {result['model']}, {result['dtype']}", "", about, "",
             head, "|---" * (11 if packed else 10) + "|"]
    for r in result["rows"]:
        lines.append(f"| {r['length']} | {r['medians']['full:as loaded']:.3f} | {r['prefill_tflops_per_s']:.2f} | "
                     f"{r['gemm_s']:.3f} | {r['gemm_tflops_per_s']:.2f} | {r['attention_s']:.3f}"
                     + (f" ({r['attention_alone_on']})" if "attention_alone_on" in r else "") + " | "
                     + f"{r['prefill_over_gemms']:.2f} | {r['prefill_over_gemms_and_attention']:.2f} | "
                     + (f"{r['compiled_speedup']:.3f} | " if "compiled_speedup" in r else "- | ")
                     + (f"{r.get('packed_speedup', float('nan')):.3f} | " if packed else "")
                     + f"{r['layer_loop_over_forward']:.3f} |")
    lines += ["", "GEMM rates per shape (GFLOP/s, one layer's maps timed alone):", "",
              "| T | " + " | ".join(result["rows"][0]["gemms"]) + " |", "|---" * (1 + len(result["rows"][0]["gemms"])) + "|"]
    for r in result["rows"]:
        lines.append(f"| {r['length']} | " + " | ".join(
            f"{g['gflops_per_s']:.0f}" + (f" (plain {g['plain_gflops_per_s']:.0f})" if "plain_gflops_per_s" in g else "")
            + f" ({g['shape'].split(' by ')[1]})" for g in r["gemms"].values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--no-compile", action="store_true", help="time the uncompiled model only")
    p.add_argument("--loaded-only", action="store_true",
                   help="time the model only as the loader loads it, without its uncompiled and unpacked copies "
                        "(for a model whose three copies do not fit in memory: the 1.5B in float32 in 24 GiB)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--tag", default="", help="appended to the result name: roofline_<model>_<dtype>_<tag>")
    args = p.parse_args(argv)
    run_all(args, "roofline", run_model, markdown,
            stem=lambda name, result: f"roofline_{name}_{result['dtype']}" + (f"_{args.tag}" if args.tag else ""))


if __name__ == "__main__":
    main()
