"""``fastprefill generate``: answer a prompt (argument, ``--file`` or stdin) and print its TTFT."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fastprefill.cli.common import (
    _load,
    _names,
    _positive,
    _print_json,
    _threads,
    console,
    err_console,
    model_args,
    sampling_args,
    sampling_params,
)
from fastprefill.errors import FastprefillError


def _read_prompt(args: argparse.Namespace) -> bytes:
    """The prompt as bytes (fastprefill.prompt.prepare_request refuses what is not UTF-8 text)."""
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            raise FastprefillError(f"--file {args.file}: no such file")
        return path.read_bytes()
    if args.prompt and args.prompt != "-":
        return os.fsencode(args.prompt)  # the argument's bytes as given
    if args.prompt == "-" or not sys.stdin.isatty():
        return sys.stdin.buffer.read()
    raise FastprefillError("give a prompt: as an argument, with --file PATH, or on stdin")

def cmd_generate(args: argparse.Namespace) -> int:
    """Answer one prompt. Unless ``--no-warmup``, one untimed run of the same method on the same
    prompt (two new tokens: a prefill and a decode step) comes first, so the TTFT and decode times
    shown exclude one-time start-up costs (first calls, compiling)."""
    import dataclasses
    import time

    from fastprefill.engine import generate, stream
    from fastprefill.host import device_clock, set_threads
    from fastprefill.methods.registry import make_method
    from fastprefill.serve.backends import Backends

    prompt = _read_prompt(args)
    set_threads(args.threads)
    # --procs/--partition/--timeout reach only the methods that have them (runahead, tsp)
    method = make_method(args.method, {"procs": args.procs, "partition": args.partition, "timeout_s": args.timeout})
    sampling = sampling_params(args)
    chat = not args.raw
    warmup_s = None
    if Backends.on_ranks(method):  # the server's choice of backend too
        from fastprefill.distributed.pool import RankPool

        with RankPool(args.model, method.ranks, threads_per_rank=args.threads_per_rank, pin=args.pin,
                      timeout_s=args.timeout) as pool:
            if not args.no_warmup:
                t0 = time.perf_counter()
                pool.generate(prompt, method, 1, chat=chat)
                warmup_s = time.perf_counter() - t0
            result = pool.generate(prompt, method, args.max_new_tokens, chat=chat, sampling=sampling)
        t = result.timing
        if args.json:
            _print_json({"model": args.model, "method": method.describe(), "procs": method.ranks, "text": result.text,
                         "token_ids": result.token_ids, "driver_ttft_s": result.ttft_s, "warmup_s": warmup_s,
                         "timing": t})
            return 0
        console.print(result.text, highlight=False, markup=False)
        err_console.print(
            f"[dim]{method.describe()} on {method.ranks} ranks: TTFT {result.ttft_s:.3f} s (driver clock, dispatch "
            f"and all communication included) for {t['prompt_tokens']} prompt tokens; {_warmup_note(warmup_s)}[/dim]"
        )
        return 0
    model, tok = _load(args.model, args.device, args.dtype, args.compile, args.row_floor)
    if args.verbose:
        from fastprefill.host import precision_line
        from fastprefill.models.packed import linears_packed
        packed = "; linear weights packed for oneDNN" if linears_packed(model) else ""
        err_console.print(f"[dim]{precision_line(model.dtype, args.device, args.dtype)}{packed}[/dim]", highlight=False)
    if not args.no_warmup:
        t0 = device_clock(model.device)
        generate(model, tok, prompt, method, 2, chat=chat)
        warmup_s = device_clock(model.device) - t0
    if args.json:
        res = generate(model, tok, prompt, method, args.max_new_tokens, chat=chat, sampling=sampling)
        logprobs = None if res.answers[0].logprobs is None else [dataclasses.asdict(e) for e in res.answers[0].logprobs]
        _print_json({"model": args.model, "method": res.timing.method, "text": res.text,
                     "token_ids": res.token_ids, "finish_reason": res.answers[0].finish_reason, "logprobs": logprobs,
                     "warmup_s": warmup_s, "timing": res.timing.to_dict()})
        return 0
    timing = None
    for event in stream(model, tok, prompt, method, args.max_new_tokens, chat=chat, sampling=sampling):
        console.print(event.text, end="", soft_wrap=True, highlight=False, markup=False)
        timing = event.timing
    console.print()
    _print_timing(timing, warmup_s)
    return 0

def _warmup_note(warmup_s: float | None) -> str:
    if warmup_s is None:
        return "no warm-up (--no-warmup): the TTFT includes one-time start-up costs"
    return f"excludes an untimed warm-up run of {warmup_s:.2f} s"

def _print_timing(timing: Any, warmup_s: float | None) -> None:
    dec = f"{1000 * timing.decode_s_per_token:.1f} ms/token" if timing.decode_s_per_token else "—"
    err_console.print(
        f"[dim]{timing.method}: TTFT {timing.ttft_s:.3f} s for {timing.prompt_tokens} prompt tokens in {timing.dtype} "
        f"({_warmup_note(warmup_s)}), decode {dec}, token-layers computed {100 * timing.stats.fraction:.0f}%, "
        f"prefill {timing.stats.flops / 1e9:.1f} GFLOP[/dim]"
    )

def add_parser(sub: Any) -> None:
    from fastprefill.methods.registry import METHODS

    p = sub.add_parser("generate", help="answer a prompt and print its TTFT")
    p.add_argument("prompt", nargs="?", help="the prompt text ('-' or omitted: stdin)")
    p.add_argument("--file", help="read the prompt from this file")
    p.add_argument("--method", default="full",
                   help=f"a method spec NAME[:key=value,...]; NAME is one of {_names(METHODS)} (e.g. "
                   "lazyllm:preset=default, static:keep=0.5, kvp-prefix:layer=20, kvp:predictor=DIR)")
    p.add_argument("--max-new-tokens", type=_positive, default=64)
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--procs", type=_positive, default=2, help="ranks for --method runahead / tsp")
    p.add_argument("--partition", default="searched",
                   help="runahead partition: even, searched (shipped table) or chunk sizes like 600/424")
    p.add_argument("--threads-per-rank", type=_threads, default=1, help="torch threads per rank (runahead/tsp)")
    p.add_argument("--pin", action="store_true", help="pin each rank to its own core (runahead/tsp)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a silent rank is an error")
    p.add_argument("--json", action="store_true", help="print the answer, token ids and timing as one JSON object")
    p.add_argument("--no-warmup", action="store_true",
                   help="time the first run (by default an untimed two-token run of the same method comes first)")
    p.add_argument("--verbose", action="store_true",
                   help="also print the dtype the model runs in, why, and the CPU's bfloat16 units")
    sampling_args(p)
    model_args(p)
    p.set_defaults(func=cmd_generate)
