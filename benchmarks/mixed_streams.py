"""Concurrent streams on the server's scheduler with and without mixed batches (``--mixed-chunk``):
output tokens per second of one stream and of ``--streams`` streams, in one process, interleaved.

guidellm's ``concurrent`` profile in miniature, without HTTP: each stream sends a request (random
``--prompt``-token ids, never a prefix-cache hit, ``--output`` tokens with ``ignore_eos``), and the
next as soon as its previous one has ended, ``--requests`` each. The server's
:class:`~fastprefill.serve.scheduler.Scheduler`, :class:`~fastprefill.serve.executor.ModelExecutor`
and :class:`~fastprefill.serve.backends.LocalBackend` run them as ``fastprefill serve`` does (its
defaults: the interleaved scheduler, chunks of 8192, pauses, decode interval 2 s), driven by
``run_once`` on this thread. Modes: ``off`` (the default server) and ``mixed:N`` (``--mixed-chunk
N``: while streams decode, prefills run in chunks of N tokens that carry their next token).

Per round (the order of the modes alternating) one stream runs once (no other request to mix with:
the modes run the same units) and ``--streams`` streams once per mode; a run's rate is its output
tokens over its wall time from the first submission to the last token. Reported per mode: the
median rate, the median of the per-round ratios against ``off`` and against one stream's rate of
the same round, with their ranges, the median TTFT and the mean time between two tokens of a request.

    python benchmarks/mixed_streams.py --model qwen2.5-coder-0.5b --chunks 128 256
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.host import DTYPES
from fastprefill.methods.full import FullPrefill
from fastprefill.models import load as load_model
from fastprefill.sampling import SamplingParams
from fastprefill.serve.backends import LocalBackend
from fastprefill.serve.executor import ModelExecutor
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.policies import ShortFirstPolicy
from fastprefill.serve.scheduler import Scheduler
from fastprefill.serve.worker import Job
from packed_bench import RESULTS, machine, run_all
from reporting import paired_ratios


def streams_run(model: Any, streams: int, args: argparse.Namespace, chunk: int, seed: int) -> dict[str, Any]:
    """``streams`` closed-loop streams of ``args.requests`` requests each (see the module docstring)
    with ``mixed_chunk=chunk``; the run's rate, TTFTs and inter-token times."""
    metrics, loop = ServeMetrics(), asyncio.new_event_loop()
    backend = LocalBackend(model, None, None)
    sched = Scheduler(ModelExecutor(model, None, 8), metrics, 64, ShortFirstPolicy(mixed_chunk=chunk))
    gen = torch.Generator().manual_seed(seed)
    left = [args.requests] * streams
    current: list[tuple[Job, float, list[float]] | None] = [None] * streams
    ttft, gaps, tokens = [], [], 0
    start = time.perf_counter()
    try:
        while True:
            for s in range(streams):
                if current[s] is None and left[s]:
                    ids = torch.randint(100, 20000, (1, args.prompt), generator=gen)
                    job = Job(ids, FullPrefill(), backend, "full", "full", args.output, SamplingParams(ignore_eos=True),
                              True, time.monotonic(), time.monotonic() + 3600, metrics, loop)
                    sched.submit(job)
                    current[s], left[s] = (job, time.perf_counter(), []), left[s] - 1
            if not any(current):
                break
            sched.run_once()
            now = time.perf_counter()
            for s, cur in enumerate(current):
                if cur is None:
                    continue
                job, sent, seen = cur
                run = next((r for r in sched.running if r.job is job), None)
                count = run.collected.count if run is not None else args.output
                seen += [now] * (count - len(seen))
                if job.outcome is not None:
                    if job.outcome != "ok":
                        raise RuntimeError(f"a request ended {job.outcome}")
                    ttft.append(seen[0] - sent)
                    gaps.append((seen[-1] - seen[0]) / max(1, len(seen) - 1))
                    tokens += len(seen)
                    current[s] = None
    finally:
        sched.executor.release()  # the pause points off the model's layers
        loop.close()
    seconds = time.perf_counter() - start
    mixed = sum(s.value for f in metrics.registry.collect() for s in f.samples if s.name == "fastprefill_mixed_steps_total")
    return {"streams": streams, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_p50_s": statistics.median(ttft), "gap_mean_s": statistics.mean(gaps), "mixed_steps": mixed}


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    modes = [("off", 0)] + [(f"mixed:{c}", c) for c in args.chunks]
    rows: list[dict[str, Any]] = []
    streams_run(model, 2, argparse.Namespace(**{**vars(args), "requests": 1, "output": 4}), max(args.chunks), 0)  # warm-up
    for r in range(args.rounds):
        one = streams_run(model, 1, args, 0, 1000 * r)
        rows.append({"round": r, "mode": "one stream", **one})
        for mode, chunk in modes if r % 2 == 0 else modes[::-1]:
            rows.append({"round": r, "mode": mode, **streams_run(model, args.streams, args, chunk, 1000 * r + 1)})
        print(f"{name} round {r}: " + ", ".join(f"{x['mode']} {x['tokens_per_s']:.2f} tok/s"
                                                 for x in rows if x["round"] == r), flush=True)
    return {"bench": "mixed-streams", "model": name, "prompt": args.prompt, "output": args.output,
            "requests": args.requests, "streams": args.streams, "rounds": args.rounds, "modes": [m for m, _ in modes],
            "rows": rows, "environment": environment(args.threads, model)}


def _series(rows: list[dict[str, Any]], mode: str, key: str) -> list[float]:
    return [r[key] for r in sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["round"])]


def markdown(result: dict[str, Any]) -> str:
    env, rows, k = result["environment"], result["rows"], result["streams"]
    lines = [f"# {k} concurrent streams with and without mixed batches: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. One process, {result['rounds']} rounds, the modes alternating. Each stream sends "
              f"{result['requests']} requests one after the other: {result['prompt']} random prompt tokens, "
              f"{result['output']} output tokens (ignore_eos), no prefix-cache hits; the server's scheduler with its "
              f"defaults (`off`) or `--mixed-chunk N` (`mixed:N`). Rate: output tokens over the run's wall time."), "",
             ("| mode | streams | output tokens/s (median) | / off (paired median) | / off [min, max] "
              "| / one stream (paired median) | / one stream [min, max] | TTFT p50 (s) | time between tokens (ms) "
              "| steps mixed | rounds |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    one = _series(rows, "one stream", "tokens_per_s")
    off = _series(rows, "off", "tokens_per_s")
    for mode in ["one stream", *result["modes"]]:
        rate = _series(rows, mode, "tokens_per_s")
        vs_off = paired_ratios(rate, off)
        vs_one = paired_ratios(rate, one)
        sub = [r for r in rows if r["mode"] == mode]
        lines.append(
            f"| {mode} | {sub[0]['streams']} | {statistics.median(rate):.2f} | {vs_off['ratio']:.2f} | "
            f"[{vs_off['min']:.2f}, {vs_off['max']:.2f}] | {vs_one['ratio']:.2f} | [{vs_one['min']:.2f}, {vs_one['max']:.2f}] | "
            f"{statistics.median(r['ttft_p50_s'] for r in sub):.2f} | {1e3 * statistics.median(r['gap_mean_s'] for r in sub):.0f} | "
            f"{statistics.median(r['mixed_steps'] for r in sub):.0f} | {len(sub)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b"])
    p.add_argument("--chunks", nargs="+", type=int, default=[128, 256], help="the mixed modes' --mixed-chunk")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams (beside the one-stream run)")
    p.add_argument("--requests", type=int, default=2, help="requests per stream")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=64, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if min(args.rounds, args.requests, args.prompt, args.output) < 1 or args.streams < 2 or min(args.chunks) < 16:
        p.error("--rounds, --requests, --prompt and --output must be >= 1, --streams >= 2, --chunks >= 16")
    run_all(args, "mixed_streams", run_model, markdown)


if __name__ == "__main__":
    main()
