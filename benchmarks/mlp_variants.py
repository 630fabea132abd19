"""A decoder layer's SwiGLU MLP three ways on a packed model's own layers, in one process,
interleaved: what a float32 model's MLP would gain fused (it loads unfused).

- ``silu pass``: :class:`fastprefill.models.packed.PackedSwiGLU` outside ``SILU_IN_PRODUCT`` (a
  float32 model fused with ``fuse_mlps``): the gate's plain packed product, torch's SiLU over it in place, the up
  product's ``mul`` post-op, then the down product.
- ``swish post-op``: the same module with SiLU inside the gate's product (oneDNN's ``swish``
  post-op, bfloat16's way).
- ``unfused``: ``down(silu(gate(x)) * up(x))`` over the same packed layers, compiled as
  ``compile_blocks`` compiles an unfused MLP (inductor fuses the element-wise passes into one):
  the float32 default.

Per model and prompt length: ``--rounds`` rounds, each timing every variant once on the same
``(1, T, D)`` input (the order rotating); per variant the median and the median of the per-round
paired ratios ``variant / silu pass`` with their range, and the largest difference from
``unfused``.

    python benchmarks/mlp_variants.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --dtype float32
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.models import load as load_model
from fastprefill.models import packed
from fastprefill.models.adapters import fuse_mlps
from fastprefill.models.packed import PackedSwiGLU
from packed_bench import machine, parser, run_all
from reporting import paired_ratios

VARIANTS = ("silu pass", "swish post-op", "unfused")


@contextlib.contextmanager
def _swish(dtype: torch.dtype) -> Iterator[None]:
    """Within, ``dtype``'s fused MLPs apply SiLU inside the gate's product."""
    before = packed.SILU_IN_PRODUCT
    packed.SILU_IN_PRODUCT = before | {dtype}
    try:
        yield
    finally:
        packed.SILU_IN_PRODUCT = before


def _variants(mlp: PackedSwiGLU, dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    unfused = torch.compile(lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)), dynamic=True)

    def swish(x: torch.Tensor) -> torch.Tensor:
        with _swish(dtype):
            return mlp(x)

    return {"silu pass": mlp, "swish post-op": swish, "unfused": unfused}


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    fuse_mlps(model)  # a float32 model loads unfused
    mlp = model.model.layers[args.layer].mlp
    if not isinstance(mlp, PackedSwiGLU) or model.dtype in packed.SILU_IN_PRODUCT:
        raise SystemExit(f"{name} in {model.dtype}: its MLPs are not fused with a separate SiLU pass here "
                         "(not packed, or a dtype whose SiLU runs inside the product): nothing to compare")
    fns, rows = _variants(mlp, model.dtype), []
    for length in args.lengths:
        x = torch.randn(1, length, model.config.hidden_size, generator=torch.Generator().manual_seed(length),
                        dtype=model.dtype)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        with torch.inference_mode():
            outs = {v: fn(x) for v, fn in fns.items()}  # warm-up (compiles the unfused one)
            for r in range(args.rounds):
                order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
                for v in order:
                    t0 = time.perf_counter()
                    fns[v](x)
                    times[v].append(time.perf_counter() - t0)
        ref = outs["unfused"]
        paired = {v: paired_ratios(times[v], times["silu pass"]) for v in VARIANTS}
        rows.append({"length": length, "times": times, "medians": {v: statistics.median(t) for v, t in times.items()},
                     "paired": {v: [p["ratio"], p["min"], p["max"]] for v, p in paired.items()},
                     "max_diff_from_unfused": {v: float((o - ref).abs().max()) for v, o in outs.items()},
                     "ref_max_abs": float(ref.abs().max())})
        print(f"{name} {length}: " + ", ".join(f"{v} {statistics.median(times[v]) * 1000:.1f} ms" for v in VARIANTS),
              flush=True)
    return {"model": name, "layer": args.layer, "rounds": args.rounds, "rows": rows,
            "environment": environment(args.threads, model)}


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# A SwiGLU MLP three ways: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. One process; layer {result['layer']}'s MLP on its packed weights, a random input; "
              f"{result['rounds']} rounds, each variant once per round (the order rotating). Paired: the per-round "
              "ratio of a variant's time over `silu pass`'s, median [min, max]."), "",
             "| T | variant | median (ms) | / silu pass (paired median) | range | max abs diff from unfused | rounds |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for v in VARIANTS:
            ratio, lo, hi = row["paired"][v]
            lines.append(f"| {row['length']} | {v} | {row['medians'][v] * 1000:.1f} | {ratio:.3f} | [{lo:.3f}, {hi:.3f}] "
                         f"| {row['max_diff_from_unfused'][v]:.2e} | {len(row['times'][v])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, repeats=1)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--layer", type=int, default=0, help="the decoder layer whose MLP is timed")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds takes at least 1")
    run_all(args, "mlp_variants", run_model, markdown,
            stem=lambda name, result: f"mlp_variants_{name}_{result['environment']['dtype']}")


if __name__ == "__main__":
    main()
