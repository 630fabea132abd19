"""The ``fastprefill`` command line.

Subcommands:

- ``models``: list the model zoo; ``models prepare NAME`` verifies and converts one.
- ``generate``: answer a prompt (argument, ``--file`` or stdin) and print its TTFT.
- ``serve``: an OpenAI-compatible HTTP server over one model (per-request method); under torchrun,
  one server over the torchrun ranks (rank 0 serves HTTP, every rank joins each prefill).
- ``bench``: run methods beside full prefill over a task (flags or a TOML ``--config``).
  Checking that committed figures reproduce needs a repository checkout: ``bench verify`` says
  so and names the script that does it (``python benchmarks/verify.py``).
- ``demo``: one multi-document QA prompt, answered by full prefill and every available method.
- ``train-kvp``: train a KV Prediction predictor (``--variant prefix``: calibrate kvp-prefix maps).
- ``tune``: measure candidate methods on your prompts and write a profile that
  ``--method auto:profile=FILE`` serves (the fastest method per prompt length that keeps the
  fidelity target).

Errors a user can cause exit with status 2 and a one-line message, never a traceback.
``models --json`` and ``generate --json`` print JSON for scripts; tables are never cut to the
terminal's width when stdout is not a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from fastprefill.cli.common import (
    _load,
    _positive,
    _print_json,
    _threads,
    console,
    err_console,
    model_args,
    sampling_args,
    sampling_params,
)
from fastprefill.cli.train import add_train_kvp_parser, add_tune_parser
from fastprefill.errors import FastprefillError


# --- models ------------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> int:
    from fastprefill.host import auto_dtype, precision_line
    from fastprefill.models import zoo

    if args.action == "prepare":
        for name in args.names or [zoo.DEFAULT_MODEL]:
            path = zoo.prepare(name)
            console.print(f"[green]ready[/green] {name} -> {path}")
        return 0
    rows = [{
        "name": entry.name, "default": entry.name == zoo.DEFAULT_MODEL, "family": entry.family,
        "packages": [f"{dist}=={version}" for dist, version in entry.packages],
        "licence": entry.licence, "prepared": zoo.is_prepared(entry.name),
    } for entry in zoo.list_models()]
    if args.json:
        _print_json(rows)
        return 0
    table = Table(title="fastprefill model zoo")
    for col in ("name", "family", "from package", "licence", "prepared"):
        table.add_column(col)
    for row in rows:
        pkgs = row["packages"]
        pkg = pkgs[0] + (f" (+{len(pkgs) - 1} parts)" if len(pkgs) > 1 else "")
        table.add_row(row["name"] + (" (default)" if row["default"] else ""), row["family"], pkg, row["licence"],
                      "yes" if row["prepared"] else "no")
    console.print(table)
    console.print("Any Hugging Face model id or local directory works too: --model ORG/NAME or --model ./dir")
    console.print(precision_line(auto_dtype("cpu"), "cpu", "auto"), highlight=False)
    return 0


# --- generate ----------------------------------------------------------------------------------
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
    model, tok = _load(args.model, args.device, args.dtype, args.compile)
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


# --- serve -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from fastprefill.host import set_threads
    from fastprefill.serve import ServeConfig, create_app, run, start_ranks
    from fastprefill.serve.backends import rank_methods
    from fastprefill.serve.config import serving_method
    from fastprefill.serve.torchrun import serve as serve_torchrun
    from fastprefill.serve.torchrun import under_torchrun

    if args.profile is not None:
        if args.method != "full":
            raise FastprefillError("give --profile FILE (which serves auto:profile=FILE) or --method SPEC, not both")
        args.method = f"auto:profile={args.profile}"
    config = ServeConfig(model_name=args.model, method=args.method, allow_methods=tuple(args.allow_method),
                         queue_size=args.queue, timeout_s=args.timeout, max_tokens=args.max_tokens,
                         max_body_mb=args.max_body_mb, drain_timeout_s=args.drain_timeout,
                         prefix_cache_mb=args.prefix_cache_mb, prefix_cache_dir=args.prefix_cache_dir,
                         scheduler=args.scheduler, prefill_chunk=args.prefill_chunk, max_running=args.max_running,
                         prefill_pauses=args.prefill_pauses, decode_interval_s=args.decode_interval)
    if under_torchrun():  # every process is a rank; rank 0 serves HTTP (docs/serving.md)
        return serve_torchrun(config, host=args.host, port=args.port, threads=args.threads_per_rank,
                              log_level=args.log_level, control_port=args.control_port, device=args.device,
                              dtype=args.dtype)
    set_threads(args.threads)
    if args.device != "cpu" and rank_methods({s: serving_method(s) for s in (args.method, *args.allow_method)}):
        raise FastprefillError("multi-rank methods serve on CPU ranks (gloo): drop --device, or run the server "
                               "under torchrun")
    model, tok = _load(args.model, args.device, args.dtype, args.compile)
    with console.status("starting the ranks ..."):
        ranks = start_ranks(config, args.model, dtype=args.dtype, threads_per_rank=args.threads_per_rank)
    app = create_app(model, tok, config, ranks)
    with console.status("warming up ..."):
        app.state.server.warm_up()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(f"[yellow]warning:[/yellow] listening on {args.host}: the server has no authentication")
    err_console.print(f"serving {args.model} ({app.state.server.health()['method']}) at http://{args.host}:{args.port}/v1"
                      f"; {args.scheduler} scheduler, queue {args.queue}, timeout {args.timeout:g} s, bodies up to {args.max_body_mb:g} MiB, "
                      f"drain {args.drain_timeout:g} s on SIGTERM, {args.threads} threads, prefix cache "
                      f"{f'{args.prefix_cache_mb:g} MiB' if args.prefix_cache_mb else 'off'}"
                      f"{f', {ranks.procs} ranks (pids {ranks.pids})' if ranks else ''}", highlight=False)
    run(app, args.host, args.port, log_level=args.log_level)
    return 0


# --- bench -------------------------------------------------------------------------------------
BENCH_KEYS = ("model", "task", "lengths", "n", "methods", "split", "seed", "threads", "warmup",
              "max_new_tokens", "out", "name", "device", "dtype")
#: What ``fastprefill bench verify`` prints: the check of committed figures reads a checkout's files.
VERIFY_HINT = ("checking that committed figures reproduce needs a repository checkout: "
               "run `python benchmarks/verify.py` there")


def _bench_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": "smollm2-135m", "task": "multidoc-qa", "lengths": [1024], "n": 5, "methods": [],
        "split": "test", "seed": 0, "threads": 2, "warmup": 1, "max_new_tokens": None,
        "out": "benchmarks/results", "name": None, "device": "cpu", "dtype": "auto",
    }
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise FastprefillError(f"--config {args.config}: no such file")
        data = tomllib.loads(path.read_text())
        unknown = set(data) - set(BENCH_KEYS)
        if unknown:
            raise FastprefillError(f"{path}: unknown keys {sorted(unknown)}; allowed: {list(BENCH_KEYS)}")
        cfg.update(data)
    for key in BENCH_KEYS:
        value = getattr(args, key, None)
        if value not in (None, []):
            cfg[key] = value
    from fastprefill.bench.records import result_name

    # a stem named by --name or the config is used as it is; the default never replaces a file
    cfg["name"] = result_name(cfg["out"], f"{cfg['model']}_{cfg['task']}", name=cfg["name"],
                              resume=getattr(args, "resume", False))
    return cfg


def cmd_bench(args: argparse.Namespace) -> int:
    if args.action == "verify":
        raise FastprefillError(VERIFY_HINT)
    from fastprefill.bench.report import markdown_table
    from fastprefill.bench.runner import run_benchmark
    from fastprefill.bench.summary import summarize
    from fastprefill.methods.registry import make_method

    cfg = _bench_config(args)
    methods = {spec: make_method(spec) for spec in cfg["methods"] if spec != "full"}
    lengths = [None if str(x).lower() == "none" else int(x) for x in cfg["lengths"]]
    model, tok = _load(cfg["model"], cfg["device"], cfg["dtype"], args.compile)
    records = run_benchmark(
        model, tok, cfg["task"], methods, lengths, int(cfg["n"]), split=cfg["split"], seed=int(cfg["seed"]),
        threads=int(cfg["threads"]), warmup=int(cfg["warmup"]), max_new_tokens=cfg["max_new_tokens"],
        out_dir=cfg["out"], name=cfg["name"], meta={"model": cfg["model"]}, resume=args.resume,
    )
    console.print(markdown_table(summarize(records)))
    console.print(f"results: {cfg['out']}/{cfg['name']}.jsonl (.md, .png)")
    return 0


# --- demo --------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from fastprefill.demo import run_demo
    from fastprefill.host import set_threads

    set_threads(args.threads)
    model, tok = _load(args.model, args.device, args.dtype, args.compile)
    return run_demo(model, tok, args, console)


def _names(registry: Any) -> str:
    """The names of a registry, comma-separated, for a help text."""
    return ", ".join(registry)


def build_parser() -> argparse.ArgumentParser:
    """The ``fastprefill`` parser: one subparser per subcommand, each added by its own function."""
    from fastprefill import __version__

    parser = argparse.ArgumentParser(
        prog="fastprefill", description="Faster time to first token for Hugging Face causal LMs: LazyLLM, "
        "KV-Runahead and KV Prediction, measured against plain prefill.")
    parser.add_argument("--version", action="version", version=f"fastprefill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_models, _add_generate, _add_serve, _add_bench, _add_demo, add_train_kvp_parser, add_tune_parser):
        add(sub)
    return parser


def _add_models(sub: Any) -> None:
    p = sub.add_parser("models", help="list the model zoo, or prepare models")
    p.add_argument("action", nargs="?", choices=["list", "prepare"], default="list")
    p.add_argument("names", nargs="*", help="zoo names to prepare (default: the embedded default)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_models)


def _add_generate(sub: Any) -> None:
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


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over one model")
    p.add_argument("--method", default="full", help="default method spec (a request may name another in its "
                   "'fastprefill' field: full, lazyllm, static, random); runahead:procs=N starts N ranks")
    p.add_argument("--allow-method", action="append", default=[], metavar="SPEC",
                   help="another spec requests may name, built at start (e.g. kvp:predictor=DIR; repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (no authentication: keep it local)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--queue", type=_positive, default=16,
                   help="requests that may wait to be admitted (beyond --max-running); more get 429")
    p.add_argument("--scheduler", choices=["interleaved", "fifo"], default="interleaved",
                   help="interleaved: requests run side by side (chunked prefill, short work first, batched "
                        "decode); fifo: one request at a time, start to end (docs/serving.md)")
    p.add_argument("--prefill-chunk", type=_positive, default=8192, metavar="TOKENS",
                   help="interleaved: the largest unit of prefill; a longer prompt (full prefill) is prefilled in "
                        "chunks of this size (set it by measurement: docs/serving.md)")
    p.add_argument("--no-prefill-pauses", dest="prefill_pauses", action="store_false",
                   help="interleaved: never pause a chunk between layers for a new short request (docs/serving.md)")
    p.add_argument("--decode-interval", type=float, default=2.0, metavar="S", help="interleaved: a chunk also "
                   "pauses for the running streams' next tokens S seconds after their last (docs/serving.md)")
    p.add_argument("--max-running", type=_positive, default=8, metavar="N",
                   help="interleaved: requests run at once (the largest decode batch)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request, queue wait included")
    p.add_argument("--max-tokens", type=_positive, default=256, help="tokens when a request gives no max_tokens")
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body in MiB; a larger one is refused with 413 before it is read")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: refuse new requests (503), answer waiting ones 503, let the running "
                        "generation go on for up to S seconds (then end it with an error), and exit; a second "
                        "signal exits at once")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="serve --method auto:profile=FILE by default: a `fastprefill tune` profile picks the "
                        "method per prompt length")
    p.add_argument("--prefix-cache-mb", type=float, default=1024.0, metavar="MB",
                   help="bound of the exact prefix cache shared by all requests (a prompt whose start was "
                        "computed before prefills only the rest); 0 turns it off")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="load the prefix cache from DIR at start (a corrupt or mismatched file is refused and "
                        "ignored) and save it there at shutdown")
    p.add_argument("--threads-per-rank", type=_threads, default=1,
                   help="torch threads in each rank of a multi-rank --method / --allow-method (runahead:procs=N); "
                        "under torchrun, of every process (rank 0's single-process methods included)")
    p.add_argument("--control-port", type=int, default=0, metavar="PORT",
                   help="under torchrun: the port rank 0 listens on for the other ranks' control connections "
                        "(default: a free one)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    model_args(p)
    p.set_defaults(func=cmd_serve)


def _add_bench(sub: Any) -> None:
    from fastprefill.data.tasks import TASKS
    from fastprefill.host import DTYPES
    from fastprefill.methods.registry import METHODS

    p = sub.add_parser("bench", help="benchmark methods beside full prefill")
    p.add_argument("action", nargs="?", choices=["run", "verify"], default="run",
                   help=f"run (default) a benchmark; verify: {VERIFY_HINT}")
    p.add_argument("--config", help="TOML file with any of: " + ", ".join(BENCH_KEYS))
    p.add_argument("--model")
    p.add_argument("--task", help=f"one of {_names(TASKS)}")
    p.add_argument("--lengths", nargs="+", help="prompt lengths in tokens")
    p.add_argument("--n", type=_positive, help="samples per length")
    p.add_argument("--method", dest="methods", action="append", default=[],
                   help=f"method spec NAME[:key=value,...], NAME one of {_names(METHODS)} (repeatable)")
    p.add_argument("--split", choices=["dev", "test"])
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=_threads)
    p.add_argument("--warmup", type=int)
    p.add_argument("--max-new-tokens", type=_positive)
    p.add_argument("--out", help="output directory (default benchmarks/results)")
    p.add_argument("--name", help="result file stem (default <model>_<task>, or <model>_<task>-runN when that "
                   "exists: a run replaces an existing file only when --name or the config names it)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run's <name>.jsonl")
    p.add_argument("--device")
    p.add_argument("--dtype", choices=list(DTYPES), help="default auto (see generate --help)")
    p.add_argument("--no-compile", dest="compile", action="store_const", const=False, default=None,
                   help="run the model as transformers builds it: not compiled, not packed (see generate --help)")
    p.set_defaults(func=cmd_bench)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="one multi-document QA prompt, every method side by side")
    p.add_argument("--length", type=_positive, default=1024, help="prompt length in tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=_positive, default=24)
    p.add_argument("--procs", type=int, default=2, help="KV-Runahead ranks (0 or 1 to skip it)")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="timed runs per method after one untimed warm-up; the table shows their median and range")
    model_args(p)
    p.set_defaults(func=cmd_demo)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not console.is_terminal:  # a pipe or a file: never cut a table's cells to 80 columns
        console.width = 1 << 16
    try:
        return int(args.func(args) or 0)
    except FastprefillError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]")
        return 130
