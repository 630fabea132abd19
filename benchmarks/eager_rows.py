"""A decoder layer's few-row calls with their norms and MLP eager against through their compiled
graphs, on a real model in one process, timed interleaved.

:class:`fastprefill.models.fused.FusedDecoderLayer` calls the norms' and the MLP's own ``forward``
for a call of at most :data:`~fastprefill.models.fused.EAGER_ROWS` rows and their compiled graphs
(:func:`fastprefill.models.adapters.compile_blocks`) above. This measures where that line belongs:
for each row count ``T``, the model's forward over ``T`` new positions after a random
``--length``-token prompt (a prefix-cache hit's suffix, or a chunk; ``T = 1``: a decode step),
with the limit set so that every call is ``eager`` or every call is ``compiled``. Each round crops
the cache back to the prompt and times three forwards per mode, the modes' order alternating;
per cell the medians and the median of the per-round paired ratios ``compiled / eager``.

    python benchmarks/eager_rows.py --model qwen2.5-coder-0.5b --rows 1 4 18 64 128 256 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.cache import make_roomy
from fastprefill.host import DTYPES
from fastprefill.models import fused
from fastprefill.models import load as load_model
from fastprefill.models.adapters import DecoderAdapter, blocks_compiled
from packed_bench import RESULTS, machine, run_all
from reporting import paired_ratios

MODES = ("eager", "compiled")


def _forward(model: Any, cache: Any, length: int, ids: torch.Tensor) -> float:
    """The median seconds of three forwards over ``ids`` (1, T), the cache cropped back to ``length`` before each."""
    times = []
    positions = torch.arange(length, length + ids.shape[1])[None]
    for _ in range(3):
        cache.crop(-(cache.get_seq_length() - length))
        t0 = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    if not blocks_compiled(model):
        raise SystemExit(f"{name}: its blocks are not compiled here (no C++ compiler?); nothing to compare")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    limit = fused.EAGER_ROWS
    with torch.inference_mode(), DecoderAdapter(model).attention_scope():
        out = model(input_ids=torch.randint(100, 20000, (1, args.length), generator=gen), use_cache=True,
                    logits_to_keep=1)
        cache = make_roomy(out.past_key_values)
        try:
            for n in args.rows:
                ids = torch.randint(100, 20000, (1, n), generator=gen)
                for mode in MODES:  # warm-up (and the compiled graphs' first call)
                    fused.EAGER_ROWS = n if mode == "eager" else 0
                    _forward(model, cache, args.length, ids)
                for r in range(args.rounds):
                    for mode in MODES if r % 2 == 0 else MODES[::-1]:
                        fused.EAGER_ROWS = n if mode == "eager" else 0
                        rows.append({"rows": n, "round": r, "mode": mode,
                                     "seconds": _forward(model, cache, args.length, ids)})
                c = cell(rows, n)
                print(f"{name} {n} rows: eager {c['eager_ms']:.1f} ms, compiled {c['compiled_ms']:.1f} ms, "
                      f"compiled/eager {c['ratio']:.2f}", flush=True)
        finally:
            fused.EAGER_ROWS = limit
    return {"bench": "eager-rows", "model": name, "length": args.length, "rounds": args.rounds, "eager_rows": limit,
            "rows": rows, "environment": environment(args.threads, model)}


def cell(rows: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Both modes' median ms and the paired ratio ``compiled / eager`` (median, min, max) at ``n`` rows."""
    pick = sorted((r for r in rows if r["rows"] == n), key=lambda r: r["round"])
    series = {m: [r["seconds"] for r in pick if r["mode"] == m] for m in MODES}
    return {**{f"{m}_ms": statistics.median(v) * 1e3 for m, v in series.items()},
            **paired_ratios(series["compiled"], series["eager"])}


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# A few rows' norms and MLP, eager against compiled: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. The model's forward over T new positions after a {result['length']}-token prompt; "
              f"{result['rounds']} rounds, the modes alternating, each the median of three forwards. The library "
              f"runs calls of up to {result['eager_rows']} rows eager."), "",
             "| rows | eager ms | compiled ms | compiled / eager (paired median) | range | rounds |",
             "|---|---|---|---|---|---|"]
    for n in sorted({r["rows"] for r in result["rows"]}):
        c = cell(result["rows"], n)
        lines.append(f"| {n} | {c['eager_ms']:.1f} | {c['compiled_ms']:.1f} | {c['ratio']:.2f} | "
                     f"[{c['min']:.2f}, {c['max']:.2f}] | {c['n']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 18, 64, 128, 256, 512])
    p.add_argument("--length", type=int, default=2048, help="the cached prompt's tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.rounds < 1 or args.length < 1:
        p.error("--rows, --rounds and --length take positive numbers")
    run_all(args, "eager_rows", run_model, markdown,
            stem=lambda name, result: f"eager_rows_{name}_{result['environment']['dtype']}")


if __name__ == "__main__":
    main()
