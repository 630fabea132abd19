"""A batched decode step whose streams' rows take the few-row kernel (``streams_as_rows``, the
library's default) against the same step with those rows on oneDNN (the path before), in one
process, interleaved.

``run_layers`` concatenates the streams' decode rows into one ``(1, R, D)`` call of each decoder
layer; inside :func:`fastprefill.models.packed.streams_as_rows` the few-row kernel counts them as
decode rows (one position per stream) and computes up to two of them, as it computes a lone
stream's row. ``oneDNN`` mode runs the same steps with that context turned off.

Each round and mode: one, two and four greedy streams over random prompts of about ``--length``
tokens (each its own length, so their caches differ as a server's do), prefilled, then
``--steps`` of their :class:`fastprefill.batch.DecodeBatch` steps timed after two untimed ones
(per round the median). Per cell the medians and the median of the per-round paired ratios
``oneDNN / kernel`` with their range; each mode's greedy tokens are compared.

    python benchmarks/stream_rows.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch

from fastprefill import PrefixCache
from fastprefill.batch import DecodeBatch
from fastprefill.bench.records import environment
from fastprefill.engine import Generation
from fastprefill.host import DTYPES
from fastprefill.methods import layer_steps
from fastprefill.methods.full import FullPrefill
from fastprefill.models import load as load_model
from packed_bench import RESULTS, machine, run_all
from reporting import paired_ratios

MODES = ("kernel", "oneDNN")
STREAMS = (1, 2, 4)


@contextlib.contextmanager
def _off(enabled: bool = True) -> Any:
    yield


def batch_steps(model: Any, prompts: list[torch.Tensor], steps: int,
                prefix_cache: PrefixCache | None = None) -> tuple[list[float], list[list[int]]]:
    """A greedy generation of each prompt ``(1, T_i)`` (over ``prefix_cache`` if given), prefilled,
    then decoded together as the server decodes them: the seconds of ``steps`` of their
    :class:`~fastprefill.batch.DecodeBatch` steps after two untimed ones, and each one's tokens."""
    gens = [Generation(model, None, ids, FullPrefill(), steps + 3, stop_at_eos=False, prefix_cache=prefix_cache)
            for ids in prompts]
    batch, seconds = DecodeBatch(model, max_batch=len(gens)), []
    try:
        for gen in gens:
            gen.prefill(None)
            gen.first_events()
        for i in range(steps + 2):
            t0 = time.perf_counter()
            batch.step(gens)
            if i >= 2:
                seconds.append(time.perf_counter() - t0)
        return seconds, [list(g.choices[0].ids) for g in gens]
    finally:
        batch.release()
        for gen in gens:
            gen.close()


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (1, args.length + 16 * i), generator=gen) for i in range(max(STREAMS))]
    real = layer_steps.streams_as_rows
    rows: list[dict[str, Any]] = []
    try:
        for r in range(-1, args.rounds):  # round -1: warm-up, not kept
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                layer_steps.streams_as_rows = real if mode == "kernel" else _off  # type: ignore[assignment]
                for streams in STREAMS:
                    s, toks = batch_steps(model, prompts[:streams], args.steps)
                    if r >= 0:
                        rows.append({"round": r, "mode": mode, "streams": streams, "step_s": statistics.median(s),
                                     "steps": len(s), "tokens": toks})
            print(f"{name} round {r}: {[(x['mode'], x['streams'], round(1e3 * x['step_s'], 1)) for x in rows if x['round'] == r]}",
                  flush=True)
    finally:
        layer_steps.streams_as_rows = real  # type: ignore[assignment]
    return {"bench": "stream-rows", "model": name, "length": args.length, "rounds": args.rounds, "rows": rows,
            "environment": environment(args.threads, model)}


def paired(rows: list[dict[str, Any]], streams: int, modes: tuple[str, str]) -> dict[str, Any]:
    """The rounds of ``streams`` streams in ``modes`` (a base, then the other): each mode's median
    step (ms), the median of the per-round ratios other / base with their range and count, and
    whether every run gave the tokens of the base's first."""
    base, other = modes
    by = {m: sorted((r for r in rows if r["mode"] == m and r.get("streams") == streams), key=lambda r: r["round"])
          for m in modes}
    return {"ms": {m: 1e3 * statistics.median(r["step_s"] for r in by[m]) for m in modes},
            **paired_ratios([r["step_s"] for r in by[other]], [r["step_s"] for r in by[base]]),
            "same": all(r["tokens"] == by[base][0]["tokens"] for m in modes for r in by[m])}


def markdown(result: dict[str, Any]) -> str:
    env, rows = result["environment"], result["rows"]
    lines = [f"# A batched decode step's rows on the few-row kernel or on oneDNN: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. One process, {result['rounds']} rounds, the modes alternating. `kernel`: the streams' "
              f"rows inside `streams_as_rows` (the default; up to two rows on the few-row kernel); `oneDNN`: the same "
              f"steps without it. Greedy streams over random prompts of {result['length']} tokens and more (16 more "
              f"per stream), per round the median of the timed `DecodeBatch` steps."), "",
             "| streams | kernel (ms) | oneDNN (ms) | oneDNN / kernel (paired median) | range | rounds | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for streams in sorted({r["streams"] for r in rows}):
        c = paired(rows, streams, MODES)
        lines.append(f"| {streams} | {c['ms']['kernel']:.1f} | {c['ms']['oneDNN']:.1f} | {c['ratio']:.2f} | "
                     f"[{c['min']:.2f}, {c['max']:.2f}] | {c['n']} | {'yes' if c['same'] else 'no'} |")
    return "\n".join(lines) + "\n"


def steps_parser(doc: str, length: int, length_help: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times :func:`batch_steps` in rounds (this one's and
    ``row_floor_cost.py``'s): models, prompt length, timed steps, rounds, threads, dtype, output."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    p.add_argument("--length", type=int, default=length, help=length_help)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per round, mode and stream count")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    return p


def main(argv: list[str] | None = None) -> None:
    p = steps_parser(__doc__, 560, "the first stream's prompt tokens (each next one 16 more)")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps, args.length) < 1:
        p.error("--rounds, --steps and --length must be >= 1")
    run_all(args, "stream_rows", run_model, markdown)


if __name__ == "__main__":
    main()
