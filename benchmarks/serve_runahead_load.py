"""Server TTFT of KV-Runahead on a warm rank pool against the one-process server with full prefill.

Two servers, one after the other (never both under load), each ``fastprefill serve`` in a
subprocess on 127.0.0.1 without a prefix cache (the cells resend their prompts):

- **runahead**: ``--method runahead:procs=P`` (``--procs``, default 2): P rank processes with
  ``--threads-per-rank`` torch threads each hold the model and run every prefill; the last rank
  decodes and streams the tokens to the server process.
- **full**: ``--method full`` with ``--threads`` torch threads, the model in the server's process.

For each prompt length (multidoc-qa test prompts of exactly that many tokens) and each server,
the cells of ``serve_load.py`` (whose code this reuses): at 1 client, prompt by prompt, the
server and the same method in this process, alternating which goes first; at each
``--concurrency`` above 1, that many clients sending the prompts as fast as answers come. The
in-process side of runahead is a :class:`~fastprefill.distributed.pool.RankPool` of the same
ranks started by this process (TTFT on its driver: dispatch through the first token), of full
prefill :func:`fastprefill.engine.generate` with ``--threads`` threads. Server TTFT is the
client's clock (request sent -> first token's chunk). The table gives TTFT p50 per cell and,
at 1 client, server / in-process TTFT; ``same answers`` compares the server's text with the
in-process one (runahead's with runahead's; runahead is exact, so both equal full's). Every
process (servers, their ranks, this one and its pool) loads the model in ``--dtype`` (default
``auto``: :func:`fastprefill.host.resolve_dtype`).

Measured run (the lead schedules it, alone on the machine)::

    python benchmarks/serve_runahead_load.py --model qwen2.5-coder-0.5b --lengths 2048 4096 \\
        --concurrency 1 4 --requests 4 --max-tokens 8

Smoke run::

    python benchmarks/serve_runahead_load.py --model smollm2-135m --lengths 256 --requests 2 \\
        --max-tokens 2 --concurrency 1 2 --out /tmp/serve_runahead_load
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastprefill.bench.records import environment, result_name
from fastprefill.distributed.pool import RankPool
from fastprefill.errors import FastprefillError
from fastprefill.host import DTYPES, keep_freed_memory, resolve_dtype, set_threads
from reporting import write_json, write_rows
from serve_load import markdown, run_model, summarize


def _pool_inproc(pool: RankPool) -> Any:
    """The in-process side of runahead cells: one generation on ``pool``, shaped as ``generate``'s result."""

    def run(ids: Any, method: Any, max_tokens: int) -> Any:
        t0 = time.perf_counter()
        res = pool.generate(list(ids), method, max_tokens, stop_at_eos=False)
        total = time.perf_counter() - t0
        timing = SimpleNamespace(prompt_tokens=len(ids), ttft_s=res.ttft_s, total_s=total)
        return SimpleNamespace(text=res.text, token_ids=res.token_ids, timing=timing)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    p.add_argument("--requests", type=int, default=4, help="prompts per cell (each sent once per concurrency)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--procs", type=int, default=2, help="ranks of the runahead server")
    p.add_argument("--partition", default="searched", help="runahead partition: even, searched or sizes like 600/424")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the full-prefill server and in-process")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="the model's dtype in the servers, their ranks and in-process (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file stem (default serve_runahead_load_<model>)")
    args = p.parse_args(argv)
    if 1 not in args.concurrency:
        p.error("--concurrency must include 1 (server / in-process TTFT is measured there)")
    if args.requests < 1 or args.max_tokens < 1 or min(args.concurrency) < 1 or args.procs < 2:
        p.error("--requests, --max-tokens and --concurrency must be >= 1, --procs >= 2")
    keep_freed_memory()
    set_threads(args.threads)
    runahead = f"runahead:procs={args.procs},partition={args.partition}"
    header = {**environment(args.threads, resolve_dtype(args.dtype)), "model": args.model,
              "lengths": args.lengths, "methods": ["full", runahead], "concurrency": args.concurrency,
              "requests": args.requests,
              "max_tokens": args.max_tokens, "procs": args.procs, "threads_per_rank": args.threads_per_rank,
              "task": "multidoc-qa", "split": "test", "seed": args.seed}
    try:
        records = run_model(args.model, SimpleNamespace(**{**vars(args), "methods": ["full"]}),
                            server_args=["--method", "full"])
        with RankPool(args.model, args.procs, dtype=args.dtype, threads_per_rank=args.threads_per_rank) as pool:
            records += run_model(args.model, SimpleNamespace(**{**vars(args), "methods": [runahead]}),
                                 server_args=["--method", runahead, "--threads-per-rank", str(args.threads_per_rank)],
                                 inproc=_pool_inproc(pool))
    except FastprefillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    stem = result_name(out, f"serve_runahead_load_{args.model}", name=args.name)
    write_rows(out / f"{stem}.jsonl", header, [dataclasses.asdict(r) for r in records])
    rows = summarize(records)
    write_json(out / f"{stem}.summary.json", rows)
    table = markdown(rows, header) + (
        f"\nRunahead: {args.procs} ranks with {args.threads_per_rank} torch thread(s) each, behind the server and "
        "in-process (a RankPool); the runahead server's own process only parses, validates and streams.\n")
    (out / f"{stem}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
