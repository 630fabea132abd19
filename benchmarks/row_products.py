"""The few-row products (``kernels/rows.cpp``) against oneDNN's, on a real model in one process,
timed interleaved: the same packed modules with :func:`fastprefill.models.packed.set_few_rows`
switched on (``kernel``) and off (``onednn``). A bfloat16 decode step's norms follow the switch
(:class:`fastprefill.models.fused.FusedDecoderLayer`: the kernel's, or eager's with it off), so
``onednn`` is the decode step with oneDNN's products and nothing else changed.

- **products alone**: each product form of a decoder layer (the merged q/k/v projections, the
  output projection, the SwiGLU MLP: gate and up with the activation, then down) and the LM head,
  for 1 to 4 input rows. One timing is the median over one call per decoder layer, every layer in
  turn (so the weights come from memory, as in a decode step; the LM head: ``--calls`` calls);
  ``GB/s`` is the weights' bytes over that time. Rows above :data:`~fastprefill.models.packed.FEW_ROWS`
  are timed with the limit raised for the run (the library sends them to oneDNN: this is why).
- **the model's decode step**: a random ``T``-token prompt prefilled once; each round crops the
  cache back to ``T`` and decodes ``--steps`` greedy steps from the same token, and the step's
  time is their median. The record says whether both backends chose the same tokens.
- **a prefix-cache hit's suffix** (``--suffix S``, float32, where a prompt's positions take the
  kernel: :data:`~fastprefill.models.packed.PROMPT_ROWS`): over the same cache, each round crops it
  back to ``T`` and runs the model's forward over the same ``S`` new positions, three times; its
  time is their median, and the record says whether both backends chose the same next token.

Each round runs both backends, their order alternating; per cell the medians and the median of
the per-round paired ratios ``onednn / kernel`` with their range.

    python benchmarks/row_products.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --lengths 2048 4096
    python benchmarks/row_products.py --model qwen2.5-coder-0.5b --dtype float32 --rows 1 4 8 16 24 32 40 48 64 --suffix 18
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.cache import make_roomy
from fastprefill.host import DTYPES
from fastprefill.kernels import row_products
from fastprefill.models import load as load_model
from fastprefill.models import packed
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.packed import few_rows_used, set_few_rows
from packed_bench import RESULTS, machine, run_all
from reporting import paired_ratios

BACKENDS = ("kernel", "onednn")
PRODUCTS = ("qkv", "o", "mlp", "lm_head")


def _products(model: Any) -> dict[str, tuple[list[Callable[[torch.Tensor], Any]], int, int]]:
    """``{form: (one call per layer, input width, weight bytes per call)}``."""
    layers = model.model.layers
    attn0, mlp0 = layers[0].self_attn, layers[0].mlp
    size = model.dtype.itemsize
    d, i = model.config.hidden_size, mlp0.gate_proj.out_features
    qkv = sum(m.weight.numel() for m in (attn0.q_proj, attn0.k_proj, attn0.v_proj)) * size
    return {"qkv": ([layer.self_attn._projections for layer in layers], d, qkv),
            "o": ([layer.self_attn.o_proj for layer in layers], d, attn0.o_proj.weight.numel() * size),
            "mlp": ([layer.mlp.forward for layer in layers], d, 3 * d * i * size),  # as a few-row layer call runs it
            "lm_head": ([model.lm_head], d, model.lm_head.weight.numel() * size)}


def _time_product(calls: list[Callable[[torch.Tensor], Any]], x: torch.Tensor, repeat: int) -> float:
    """The median seconds of one call over ``calls`` (each layer once, in turn), ``repeat`` passes."""
    times = []
    for _ in range(repeat):
        for call in calls:
            t0 = time.perf_counter()
            call(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode_round(model: Any, cache: Any, length: int, first: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    """The cache cropped back to ``length``, then ``steps`` greedy steps from ``first`` (1, 1):
    (median seconds per step, the tokens chosen)."""
    cache.crop(-(cache.get_seq_length() - length))
    token, times, chosen = first, [], []
    with DecoderAdapter(model).attention_scope():
        for s in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[length + s]]),
                        use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
            token = out.logits[:, -1:].argmax(-1)
            chosen.append(int(token))
    return statistics.median(times), chosen


def _hit_round(model: Any, cache: Any, length: int, suffix: torch.Tensor) -> tuple[float, int]:
    """The cache cropped back to ``length``, then the forward over ``suffix`` (1, S), three times:
    (median seconds, the next token chosen)."""
    times = []
    positions = torch.arange(length, length + suffix.shape[1])[None]
    with DecoderAdapter(model).attention_scope():
        for _ in range(3):
            cache.crop(-(cache.get_seq_length() - length))
            t0 = time.perf_counter()
            out = model(input_ids=suffix, past_key_values=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), int(out.logits[0, -1].argmax())


def _hit_rounds(model: Any, cache: Any, length: int, suffix: torch.Tensor, args: argparse.Namespace,
                rows: list[dict[str, Any]]) -> None:
    """Both backends on a hit's ``suffix`` over ``length`` cached positions, ``--rounds`` rounds."""
    chosen: dict[str, int] = {}
    for backend in BACKENDS:  # warm-up
        set_few_rows(model, backend == "kernel")
        _hit_round(model, cache, length, suffix)
    for r in range(args.rounds):
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            set_few_rows(model, backend == "kernel")
            seconds, chosen[backend] = _hit_round(model, cache, length, suffix)
            rows.append({"part": "step", "form": "hit suffix", "rows": suffix.shape[1], "length": length, "round": r,
                         "backend": backend, "seconds": seconds})
    rows.append({"part": "hit tokens", "length": length, "rows": suffix.shape[1],
                 "same": chosen["kernel"] == chosen["onednn"]})
    print(f"{length}: hit of {suffix.shape[1]} {_ratio(rows, 'step', 'hit suffix', suffix.shape[1], length)}", flush=True)


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    used, why = few_rows_used(model)
    if not used:
        raise SystemExit(f"{name}: the few-row kernel does not run here ({why}); nothing to compare")
    kernel = row_products(model.dtype)
    most = kernel.max_float_rows if model.dtype == torch.float32 else kernel.max_rows
    if max(args.rows) > most:
        raise SystemExit(f"{name}: the kernel takes at most {most} rows in {model.dtype}, not {max(args.rows)}")
    if args.suffix and model.dtype not in packed.PROMPT_ROWS:
        raise SystemExit(f"{name}: a prompt's positions take the kernel in {sorted(map(str, packed.PROMPT_ROWS))} "
                         f"only, not {model.dtype}: drop --suffix")
    forms = _products(model)
    rows: list[dict[str, Any]] = []
    limit = dict(packed.FEW_ROWS)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        packed.FEW_ROWS = {dtype: max(args.rows) for dtype in limit}
        try:
            for n in args.rows:
                inputs = {form: torch.randn(n, 1, width, generator=gen).to(model.dtype)  # n streams' step
                          for form, (_, width, _) in forms.items()}
                for r in range(args.rounds):
                    for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                        set_few_rows(model, backend == "kernel")
                        for form, (calls, _, size) in forms.items():
                            repeat = args.calls if form == "lm_head" else 2
                            seconds = _time_product(calls, inputs[form], repeat)
                            rows.append({"part": "product", "form": form, "rows": n, "round": r, "backend": backend,
                                         "seconds": seconds, "bytes": size})
        finally:
            packed.FEW_ROWS = limit
        print(f"{name} products: " + ", ".join(f"{f} x{n} {_ratio(rows, 'product', f, n)['ratio']:.2f}"
                                               for n in args.rows for f in PRODUCTS), flush=True)
        for length in args.lengths:
            ids = torch.randint(100, 20000, (1, length), generator=gen)
            with DecoderAdapter(model).attention_scope():
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache, first = make_roomy(out.past_key_values), out.logits[:, -1:].argmax(-1)
            tokens: dict[str, list[int]] = {}
            for backend in BACKENDS:  # warm-up
                set_few_rows(model, backend == "kernel")
                _decode_round(model, cache, length, first, 1)
            for r in range(args.rounds):
                for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                    set_few_rows(model, backend == "kernel")
                    seconds, tokens[backend] = _decode_round(model, cache, length, first, args.steps)
                    rows.append({"part": "step", "form": "decode step", "rows": 1, "length": length, "round": r,
                                 "backend": backend, "seconds": seconds})
            rows.append({"part": "tokens", "length": length, "same": tokens["kernel"] == tokens["onednn"],
                         "agree": sum(a == b for a, b in zip(tokens["kernel"], tokens["onednn"], strict=True))})
            print(f"{name} {length}: decode step {_ratio(rows, 'step', 'decode step', 1, length)}", flush=True)
            if args.suffix:
                _hit_rounds(model, cache, length, torch.randint(100, 20000, (1, args.suffix), generator=gen), args, rows)
    set_few_rows(model, True)
    return {"bench": "row-products", "model": name, "rounds": args.rounds, "calls": args.calls, "steps": args.steps,
            "few_rows": limit[model.dtype], "suffix": args.suffix, "rows": rows, "environment": environment(args.threads, model)}


def _ratio(rows: list[dict[str, Any]], part: str, form: str, n: int, length: int | None = None) -> dict[str, Any]:
    """Both backends' median seconds and GB/s, and the paired ratio ``onednn / kernel`` (median, min, max)."""
    pick = sorted((r for r in rows if r["part"] == part and r["form"] == form and r["rows"] == n
                   and r.get("length") == length), key=lambda r: r["round"])
    series = {b: [r["seconds"] for r in pick if r["backend"] == b] for b in BACKENDS}
    size = pick[0].get("bytes")
    med = {b: statistics.median(v) for b, v in series.items()}
    return {**{f"{b}_ms": med[b] * 1e3 for b in BACKENDS},
            **({f"{b}_gbs": size / med[b] / 1e9 for b in BACKENDS} if size else {}),
            **paired_ratios(series["onednn"], series["kernel"])}


def markdown(result: dict[str, Any]) -> str:
    env, rows = result["environment"], result["rows"]
    lines = [f"# Few-row products against oneDNN's: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. {result['rounds']} rounds, the backends alternating; a product's time is the median "
              f"of one call per decoder layer, each layer in turn, twice (the LM head: {result['calls']} calls); a "
              f"decode step's is the median of {result['steps']} greedy steps from the same token over the same "
              f"cache. The library sends up to {result['few_rows']} rows to the kernel."
              + (f" A hit's time is the median of three forwards over the same {result['suffix']} new positions "
                 "after the same cached prompt." if result.get("suffix") else "")), "",
             ("| rows | product | MB | kernel ms | oneDNN ms | kernel GB/s | oneDNN GB/s | oneDNN / kernel (paired median) "
             "| range | rounds |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["rows"] for r in rows if r["part"] == "product"}):
        for form in PRODUCTS:
            c = _ratio(rows, "product", form, n)
            size = next(r["bytes"] for r in rows if r["part"] == "product" and r["form"] == form)
            lines.append(f"| {n} | {form} | {size / 1e6:.1f} | {c['kernel_ms']:.3f} | {c['onednn_ms']:.3f} | "
                         f"{c['kernel_gbs']:.1f} | {c['onednn_gbs']:.1f} | {c['ratio']:.2f} | "
                         f"[{c['min']:.2f}, {c['max']:.2f}] | {c['n']} |")
    lines += ["", ("| T | setting | kernel ms | oneDNN ms | oneDNN / kernel (paired median) | range | rounds | "
                  "same tokens |"),
              "|---|---|---|---|---|---|---|---|"]
    for tok in (r for r in rows if r["part"] == "tokens"):
        c = _ratio(rows, "step", "decode step", 1, tok["length"])
        lines.append(f"| {tok['length']} | decode step | {c['kernel_ms']:.1f} | {c['onednn_ms']:.1f} | "
                     f"{c['ratio']:.2f} | [{c['min']:.2f}, {c['max']:.2f}] | {c['n']} | "
                     f"{tok['agree']}/{result['steps']} |")
    for tok in (r for r in rows if r["part"] == "hit tokens"):
        c = _ratio(rows, "step", "hit suffix", tok["rows"], tok["length"])
        lines.append(f"| {tok['length']} | hit of {tok['rows']} rows | {c['kernel_ms']:.1f} | {c['onednn_ms']:.1f} | "
                     f"{c['ratio']:.2f} | [{c['min']:.2f}, {c['max']:.2f}] | {c['n']} | "
                     f"{'yes' if tok['same'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="input rows of the products alone (1-4 in bfloat16, 1-64 in float32)")
    p.add_argument("--suffix", type=int, default=0, help="also time a hit of this many new positions (float32; 0: not)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10, help="LM head calls per timing")
    p.add_argument("--steps", type=int, default=16, help="decode steps per round")
    args = p.parse_args(argv)
    if not all(1 <= n <= 64 for n in args.rows) or min(args.rounds, args.calls, args.steps, *args.lengths) < 1:
        p.error("--rows take 1 to 64; --rounds, --calls, --steps and every length >= 1")
    if args.suffix < 0:
        p.error("--suffix takes a row count >= 0")
    run_all(args, "row_products", run_model, markdown)


if __name__ == "__main__":
    main()
