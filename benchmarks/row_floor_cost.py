"""What the row floor (``--row-floor auto``, :func:`fastprefill.models.row_floor.set_row_floor`) costs:
a decode step of one stream and of a batch of streams with it and without it, in one process,
interleaved; and the floor's check at load, the first time on a machine and once its floors are
on disk.

Modes: ``off`` (the default: a step's one or two rows on fastprefill's few-row kernel where it
runs, oneDNN above) and ``auto`` (every product on oneDNN, padded to the floor found for its
shape). The model is loaded once and switched between them (``set_row_floor(model, 1)`` gives
back the default). A random ``--length``-token prompt is prefilled once into a prefix cache; each
round and mode then starts one and ``--batch`` greedy generations over it (prefix-cache hits) and
times ``--steps`` of their decode steps (after a warm-up round and two untimed steps) as the server
runs them, one :class:`fastprefill.batch.DecodeBatch` step for all of them. Per cell the medians of
the per-round median steps and the median of the per-round paired ratios ``auto / off`` with their
range; each mode's greedy tokens are compared.

Load: per round ``set_row_floor(model, "auto", cache=False)`` (a machine's first load: every
product shape checked) and ``set_row_floor(model, "auto")`` with the floor file already written
(later loads), each timed once.

    python benchmarks/row_floor_cost.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fastprefill import PrefixCache
from fastprefill.bench.records import environment
from fastprefill.engine import generate
from fastprefill.methods.full import FullPrefill
from fastprefill.models import load as load_model
from fastprefill.models import row_floor
from packed_bench import machine, run_all
from stream_rows import batch_steps, paired, steps_parser

MODES = ("off", "auto")


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, pack=True, progress=False)
    ids = torch.randint(100, 20000, (1, args.length), generator=torch.Generator().manual_seed(0))
    cache = PrefixCache(4 << 30, block_tokens=16)
    generate(model, None, ids, FullPrefill(), 1, prefix_cache=cache)  # the prompt's blocks stored
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        floors = Path(tmp) / "row_floors.json"
        original = row_floor.row_floor_cache_path
        row_floor.row_floor_cache_path = lambda: floors  # type: ignore[assignment]  # not the user's floor file
        try:
            for mode in MODES:  # warm-up: each mode's compiled blocks and kernels at both stream counts
                row_floor.set_row_floor(model, 1 if mode == "off" else "auto")
                for streams in (1, args.batch):
                    batch_steps(model, [ids] * streams, 1, cache)
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    row_floor.set_row_floor(model, 1 if mode == "off" else "auto")
                    for streams in (1, args.batch):
                        s, (toks, *_) = batch_steps(model, [ids] * streams, args.steps, cache)
                        rows.append({"round": r, "mode": mode, "streams": streams, "step_s": statistics.median(s),
                                     "steps": len(s), "tokens": toks})
                t0 = time.perf_counter()
                row_floor.set_row_floor(model, "auto", cache=False)
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                row_floor.set_row_floor(model, "auto")
                rows.append({"round": r, "mode": "load", "first_s": first, "cached_s": time.perf_counter() - t0})
                print(f"{name} round {r}: {[(x['mode'], x.get('streams'), round(1e3 * x.get('step_s', 0), 1)) for x in rows if x['round'] == r]}",
                      flush=True)
        finally:
            row_floor.row_floor_cache_path = original  # type: ignore[assignment]
            row_floor.set_row_floor(model, 1)
    return {"bench": "row-floor-cost", "model": name, "length": args.length, "batch": args.batch,
            "rounds": args.rounds, "rows": rows, "environment": environment(args.threads, model)}


def markdown(result: dict[str, Any]) -> str:
    env, rows = result["environment"], result["rows"]
    loads = [r for r in rows if r["mode"] == "load"]
    lines = [f"# What the row floor costs: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. One process, {result['rounds']} rounds, the modes alternating. `off`: the default "
              f"(one or two rows on the few-row kernel where it runs); `auto`: `set_row_floor(model, \"auto\")` (every "
              f"product on oneDNN, padded to its floor). A decode step over a {result['length']}-token prompt, "
              f"per round the median of its timed steps."), "",
             ("| streams | off (ms) | auto (ms) | auto / off (paired median) | range | rounds | same tokens |"),
             "|---|---|---|---|---|---|---|"]
    for streams in sorted({r["streams"] for r in rows if r["mode"] != "load"}):
        c = paired(rows, streams, MODES)
        lines.append(f"| {streams} | {c['ms']['off']:.1f} | {c['ms']['auto']:.1f} | {c['ratio']:.2f} | "
                     f"[{c['min']:.2f}, {c['max']:.2f}] | {c['n']} | {'yes' if c['same'] else 'no'} |")
    lines += ["", ("The floor's check at load (seconds, median over rounds): every shape checked (a machine's first "
                   "load) and read from the floor file (later loads)."), "",
              "| check | seconds (median) | range | rounds |", "|---|---|---|---|"]
    for label, key in (("first load", "first_s"), ("floors on disk", "cached_s")):
        values = [r[key] for r in loads]
        lines.append(f"| {label} | {statistics.median(values):.3f} | [{min(values):.3f}, {max(values):.3f}] | {len(values)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = steps_parser(__doc__, 1024, "prompt tokens the steps decode over")
    p.add_argument("--batch", type=int, default=4, help="streams of the batched step (>= 2)")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps, args.length) < 1 or args.batch < 2:
        p.error("--rounds, --steps and --length must be >= 1, --batch >= 2")
    run_all(args, "row_floor_cost", run_model, markdown)


if __name__ == "__main__":
    main()
