"""Time per input row of each linear map of a model at prompt-sized row counts, as the loader
runs it (packed where it packs), beside ``torch.nn.functional.linear`` on the plain weight.

A matrix product's time should grow in proportion to its rows; oneDNN picks a kernel per shape,
and for some shapes and row counts it picks a slow one, which then shows up as a prompt length
(or a prefill chunk size) that costs more per token than its neighbours. For each of a decoder
layer's seven maps (q, k, v, o, gate, up, down) and each row count ``M``: the median time of
``--repeats`` calls on a random ``(M, D_in)`` input, in microseconds per row.

    python benchmarks/gemm_rows.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.models import load as load_model
from packed_bench import machine, parser, run_all
from roofline import _linears, _median_time

ROWS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)


def _us_per_row(fn: Any, rows: int, repeats: int) -> float:
    return _median_time(fn, repeats) * 1e6 / rows


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    rows_out = []
    with torch.inference_mode():
        for key, layer in _linears(model).items():
            weight = layer.weight
            for m in args.lengths:
                x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m)).to(weight.dtype)
                rows_out.append({"map": key, "shape": [layer.in_features, layer.out_features], "rows": m,
                                 "model_us_per_row": _us_per_row(lambda lin=layer, x=x: lin(x), m, args.repeats),
                                 "plain_us_per_row": _us_per_row(
                                     lambda lin=layer, x=x: torch.nn.functional.linear(x, lin.weight, lin.bias),
                                     m, args.repeats)})
    return {"model": name, "repeats": args.repeats, "rows": rows_out, "environment": environment(args.threads, model)}


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    maps = list(dict.fromkeys(r["map"] for r in result["rows"]))
    counts = sorted({r["rows"] for r in result["rows"]})
    cell = {(r["map"], r["rows"]): r for r in result["rows"]}
    lines = [f"# Time per row of each linear map: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}, linear weights packed: {env['packed']}. Microseconds per input row, median of "
              f"{result['repeats']} calls; as the model runs it (plain `F.linear` in brackets)."), "",
             "| rows | " + " | ".join(f"{k} ({'x'.join(map(str, cell[(k, counts[0])]['shape']))})" for k in maps) + " |",
             "|---|" + "---|" * len(maps)]
    for m in counts:
        lines.append(f"| {m} | " + " | ".join(
            f"{cell[(k, m)]['model_us_per_row']:.2f} ({cell[(k, m)]['plain_us_per_row']:.2f})" for k in maps) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, repeats=7)
    p.set_defaults(lengths=list(ROWS))
    args = p.parse_args(argv)
    if min(args.lengths) < 1 or args.repeats < 1:
        p.error("row counts (--lengths) >= 1 and --repeats >= 1")
    run_all(args, "gemm_rows", run_model, markdown)


if __name__ == "__main__":
    main()
