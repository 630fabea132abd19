"""The ``fastprefill`` command line.

Subcommands:

- ``models``: list the model zoo; ``models prepare NAME`` verifies and converts one.
- ``generate``: answer a prompt (argument, ``--file`` or stdin) and print its TTFT.
- ``serve``: an OpenAI-compatible HTTP server over one model (per-request method).
- ``bench``: run methods beside full prefill over a task (flags or a TOML ``--config``);
  ``bench verify`` re-summarizes committed result files and compares them with their summaries,
  and (in a checkout) the README's summary table and the tables of ``docs/`` with the results.
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
import json
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fastprefill.errors import FastprefillError

console = Console(stderr=False, soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def _threads(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("--threads must be >= 1")
    return n


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("must be an integer >= 1")
    return n


def _load(model: str, device: str, dtype: str):
    import torch

    from fastprefill.models import zoo

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    with console.status(f"loading {model} ..."):
        return zoo.load(model, device=device, dtype=torch_dtype)


def _print_json(data: Any) -> None:
    """One JSON document on stdout (plain print: no wrapping, no markup)."""
    print(json.dumps(data, ensure_ascii=False))


# --- models ------------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> int:
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
    return 0


# --- generate ----------------------------------------------------------------------------------
def _read_prompt(args: argparse.Namespace) -> bytes:
    """The prompt as bytes (the engine's prepare_prompt refuses what is not UTF-8 text)."""
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
    prompt (one new token) comes first, so the TTFT shown excludes one-time start-up costs."""
    import time

    from fastprefill.distributed.runtime import set_threads
    from fastprefill.engine import generate, stream
    from fastprefill.methods.base import DistributedMethod
    from fastprefill.methods.registry import make_method

    prompt = _read_prompt(args)
    set_threads(args.threads)
    # --procs/--partition/--timeout reach only the methods that have them (runahead, tsp)
    method = make_method(args.method, {"procs": args.procs, "partition": args.partition, "timeout_s": args.timeout})
    chat = not args.raw
    warmup_s = None
    if isinstance(method, DistributedMethod):
        from fastprefill.distributed.pool import RankPool, required_ranks

        with RankPool(args.model, required_ranks(method), threads_per_rank=args.threads_per_rank, pin=args.pin,
                      timeout_s=method.timeout_s) as pool:
            if not args.no_warmup:
                t0 = time.perf_counter()
                pool.generate(prompt, method, 1, chat=chat)
                warmup_s = time.perf_counter() - t0
            result = pool.generate(prompt, method, args.max_new_tokens, chat=chat)
        t = result.timing
        if args.json:
            _print_json({"model": args.model, "method": method.describe(), "procs": method.procs, "text": result.text,
                         "token_ids": result.token_ids, "driver_ttft_s": result.ttft_s, "warmup_s": warmup_s,
                         "timing": t})
            return 0
        console.print(result.text, highlight=False, markup=False)
        err_console.print(
            f"[dim]{method.describe()} on {method.procs} ranks: TTFT {result.ttft_s:.3f} s (driver clock, dispatch "
            f"and all communication included) for {t['prompt_tokens']} prompt tokens; {_warmup_note(warmup_s)}[/dim]"
        )
        return 0
    model, tok = _load(args.model, args.device, args.dtype)
    if not args.no_warmup:
        t0 = time.perf_counter()
        generate(model, tok, prompt, method, 1, chat=chat)
        warmup_s = time.perf_counter() - t0
    if args.json:
        res = generate(model, tok, prompt, method, args.max_new_tokens, chat=chat)
        _print_json({"model": args.model, "method": res.timing.method, "text": res.text,
                     "token_ids": res.token_ids, "warmup_s": warmup_s, "timing": res.timing.to_dict()})
        return 0
    timing = None
    for event in stream(model, tok, prompt, method, args.max_new_tokens, chat=chat):
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
        f"[dim]{timing.method}: TTFT {timing.ttft_s:.3f} s for {timing.prompt_tokens} prompt tokens "
        f"({_warmup_note(warmup_s)}), decode {dec}, token-layers computed {100 * timing.token_layer_fraction:.0f}%, "
        f"prefill {timing.prefill_flops / 1e9:.1f} GFLOP[/dim]"
    )


# --- serve -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from fastprefill.distributed.runtime import set_threads
    from fastprefill.serve import ServeConfig, create_app, run

    config = ServeConfig(model_name=args.model, method=args.method, allow_methods=tuple(args.allow_method),
                         queue_size=args.queue, timeout_s=args.timeout, max_tokens=args.max_tokens,
                         max_body_mb=args.max_body_mb, drain_timeout_s=args.drain_timeout)
    set_threads(args.threads)
    model, tok = _load(args.model, args.device, args.dtype)
    app = create_app(model, tok, config)
    with console.status("warming up ..."):
        app.state.server.warm_up()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(f"[yellow]warning:[/yellow] listening on {args.host}: the server has no authentication")
    err_console.print(f"serving {args.model} ({app.state.server.health()['method']}) at http://{args.host}:{args.port}/v1"
                      f"; queue {args.queue}, timeout {args.timeout:g} s, bodies up to {args.max_body_mb:g} MiB, "
                      f"drain {args.drain_timeout:g} s on SIGTERM, {args.threads} threads", highlight=False)
    run(app, args.host, args.port, log_level=args.log_level)
    return 0


# --- bench -------------------------------------------------------------------------------------
BENCH_KEYS = ("model", "task", "lengths", "n", "methods", "split", "seed", "threads", "warmup",
              "max_new_tokens", "out", "name", "device", "dtype")


def _bench_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": "smollm2-135m", "task": "multidoc-qa", "lengths": [1024], "n": 5, "methods": [],
        "split": "test", "seed": 0, "threads": 2, "warmup": 1, "max_new_tokens": None,
        "out": "benchmarks/results", "name": None, "device": "cpu", "dtype": "float32",
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
        return _bench_verify(args.out or "benchmarks/results")
    from fastprefill.bench.report import markdown_table
    from fastprefill.bench.runner import run_benchmark
    from fastprefill.bench.summary import summarize
    from fastprefill.methods.registry import make_method

    cfg = _bench_config(args)
    methods = {spec: make_method(spec) for spec in cfg["methods"] if spec != "full"}
    lengths = [None if str(x).lower() == "none" else int(x) for x in cfg["lengths"]]
    model, tok = _load(cfg["model"], cfg["device"], cfg["dtype"])
    records = run_benchmark(
        model, tok, cfg["task"], methods, lengths, int(cfg["n"]), split=cfg["split"], seed=int(cfg["seed"]),
        threads=int(cfg["threads"]), warmup=int(cfg["warmup"]), max_new_tokens=cfg["max_new_tokens"],
        out_dir=cfg["out"], name=cfg["name"], meta={"model": cfg["model"]}, resume=args.resume,
    )
    console.print(markdown_table(summarize(records)))
    console.print(f"results: {cfg['out']}/{cfg['name']}.jsonl (.md, .png)")
    return 0


def _bench_verify(results: str) -> int:
    from fastprefill.bench.pages import verify_pages
    from fastprefill.bench.verify import verify_results

    report = verify_results(results)
    root = Path(results).resolve().parents[1]
    if Path(results).resolve() == root / "benchmarks" / "results" and (root / "README.md").exists():
        pages = verify_pages(root)  # the figures the README and docs/ print from these results
        report.checked += pages.checked
        report.mismatches += pages.mismatches
    for name, reason in report.skipped.items():
        console.print(f"[dim]skipped {name}: {reason}[/dim]")
    for mismatch in report.mismatches:
        err_console.print(f"[red]differs[/red] {mismatch}", highlight=False)
    console.print(f"{len(report.checked)} files checked, {len(report.mismatches)} values differ")
    return 0 if report.ok else 1


# --- demo --------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from fastprefill.demo import run_demo
    from fastprefill.distributed.runtime import set_threads

    set_threads(args.threads)
    model, tok = _load(args.model, args.device, args.dtype)
    return run_demo(model, tok, args, console)


def _distill_prefix(args: argparse.Namespace) -> int:
    """``train-kvp --variant prefix --distill-from DIR``: KL distillation of calibrated maps."""
    import time

    from fastprefill.methods.kv_prediction.prefix.distill import (
        DEFAULT_HELDOUT,
        DEFAULT_TRAIN,
        PrefixDistillation,
        distill_on_dev,
        read_distill_source,
    )

    source = read_distill_source(args.distill_from, args.layer)
    cfg = PrefixDistillation(steps=args.steps, lr=args.lr, tail=args.tail)
    model, tok = _load(args.base, args.device, args.dtype)
    t0 = time.perf_counter()
    distill_on_dev(model, tok, args.distill_from, args.out, cfg, train=args.train_prompts or DEFAULT_TRAIN,
                   heldout=args.heldout_prompts or DEFAULT_HELDOUT, length=args.prompt_length, resume=args.resume)
    console.print(f"[green]distilled[/green] kvp-prefix l={source['layer']} in {time.perf_counter() - t0:.0f} s -> "
                  f"{args.out} (use: --method kvp-prefix:predictor={args.out},tail={args.tail})")
    return 0


# --- train-kvp ---------------------------------------------------------------------------------
def cmd_train_kvp(args: argparse.Namespace) -> int:
    import time

    from fastprefill.distributed.runtime import set_threads
    from fastprefill.methods.kv_prediction import AuxSpec
    from fastprefill.methods.kv_prediction.auxiliary.train import TrainConfig, train_kvp

    if args.variant == "prefix":
        args.steps = 120 if args.steps is None else args.steps
        args.lsq_tokens = args.lsq_tokens or 32_768
        args.ridge = 1e-3 if args.ridge is None else args.ridge
        return _train_prefix(args)
    if args.distill_from is not None:
        raise FastprefillError("--distill-from refines kvp-prefix maps: add --variant prefix")
    args.steps = 200 if args.steps is None else args.steps
    args.lsq_tokens = args.lsq_tokens or 100_000
    args.ridge = 1e-4 if args.ridge is None else args.ridge
    if (args.aux is None) == (args.drop_stride is None):
        raise FastprefillError("give exactly one of --aux NAME (KVP-C) or --drop-stride N (KVP-LP)")
    set_threads(args.threads)
    cfg = TrainConfig(
        lsq_tokens=args.lsq_tokens, steps=args.steps, seq_len=args.seq_len,
        lr=args.lr, l1_weight=args.l1_weight, ridge=args.ridge, checkpoint_every=args.checkpoint_every,
        train_aux=args.train_aux, task_share=args.task_share, source=args.source,
    )
    base, tok = _load(args.base, args.device, args.dtype)
    if args.aux is not None:
        aux, aux_tok = _load(args.aux, args.device, args.dtype)
        aux_arg: Any = aux
    else:
        aux_tok, aux_arg = None, AuxSpec.layer_drop(args.drop_stride)
    t0 = time.perf_counter()
    train_kvp(base, aux_arg, args.out, tokenizer=tok, aux_tokenizer=aux_tok, base_name=args.base,
              aux_name=args.aux, config=cfg, resume=args.resume)
    console.print(f"[green]trained[/green] predictor in {time.perf_counter() - t0:.0f} s -> {args.out} "
                  f"(use: --method kvp:predictor={args.out})")
    return 0


def _train_prefix(args: argparse.Namespace) -> int:
    """``train-kvp --variant prefix``: least-squares maps of kvp-prefix at ``--layer``."""
    import time

    from fastprefill.distributed.runtime import set_threads
    from fastprefill.methods.kv_prediction.prefix import PrefixCalibration, calibrate_prefix

    if args.layer is None and args.distill_from is None:
        raise FastprefillError("--variant prefix needs --layer L (the layers the base runs exactly), or "
                               "--distill-from DIR to refine a calibrated checkpoint")
    if args.aux is not None or args.drop_stride is not None:
        raise FastprefillError("--variant prefix uses no aux model: drop --aux / --drop-stride")
    set_threads(args.threads)
    if args.distill_from is not None:
        return _distill_prefix(args)
    cfg = PrefixCalibration(layer=args.layer, lsq_tokens=args.lsq_tokens, seq_len=args.seq_len, ridge=args.ridge,
                            rank=args.rank, max_mb=args.max_mb, task_share=args.task_share)
    model, tok = _load(args.base, args.device, args.dtype)
    t0 = time.perf_counter()
    calibrate_prefix(model, args.out, cfg, tokenizer=tok, model_name=args.base, resume=args.resume)
    console.print(f"[green]calibrated[/green] kvp-prefix l={args.layer} in {time.perf_counter() - t0:.0f} s -> "
                  f"{args.out} (use: --method kvp-prefix:predictor={args.out})")
    return 0


# --- main --------------------------------------------------------------------------------------
# --- tune --------------------------------------------------------------------------------------
def cmd_tune(args: argparse.Namespace) -> int:
    from fastprefill.distributed.runtime import set_threads
    from fastprefill.methods.auto import Target
    from fastprefill.methods.registry import make_method
    from fastprefill.tune import DEFAULT_CANDIDATES, load_prompts, plot_frontier, task_prompts, tune

    target = Target.parse(args.target, args.confidence)
    if (args.prompts is None) == (args.task is None):
        raise FastprefillError("give your prompts with --prompts FILE.jsonl, or a packaged task with --task NAME")
    specs = list(DEFAULT_CANDIDATES if not args.only else []) + list(args.methods or [])
    if not specs:
        raise FastprefillError("no candidates: --only needs at least one --methods SPEC")
    candidates = {spec: make_method(spec) for spec in dict.fromkeys(specs)}  # every spec builds before any run
    set_threads(args.threads)
    model, tok = _load(args.model, args.device, args.dtype)
    for spec, method in list(candidates.items()):
        if not method.supports(model.config):
            err_console.print(f"[dim]skipping {spec}: it does not support {model.config.model_type!r}[/dim]")
            del candidates[spec]
    prompts = (load_prompts(args.prompts, tok) if args.prompts
               else task_prompts(args.task, tok, args.lengths, args.n, split=args.split, seed=args.seed))
    out = Path(args.out)
    records = out.with_suffix(".jsonl")
    profile, seen = tune(model, tok, args.model, prompts, candidates, {k: k for k in candidates}, target,
                         records_path=records, threads=args.threads, resume=args.resume,
                         max_new_tokens=args.max_new_tokens, min_speedup=args.min_speedup,
                         meta={"source": args.prompts or f"{args.task} ({args.split}, lengths {args.lengths}, "
                                                          f"n={args.n})"})
    profile.save(out)
    plot = plot_frontier(seen, profile, out.with_suffix(".png"))
    table = Table(title=f"{args.model}: {target.describe()} ({target.confidence:.0%} interval)")
    for col in ("bucket", "method", "held-out TTFT ratio", f"held-out {target.measure}", "n choose / report", "why"):
        table.add_column(col)
    for b in profile.buckets:
        fid = "—" if b.fidelity is None else f"{b.fidelity:.2f} [{b.fidelity_ci[0]:.2f}, {b.fidelity_ci[1]:.2f}]"
        ratio = "—" if b.ttft_ratio is None else f"{b.ttft_ratio:.2f}x"
        table.add_row(b.label, b.method, ratio, fid, f"{b.n_choose} / {b.n_report}", b.reason)
    console.print(table)
    console.print(f"profile: {out} (serve it: --method auto:profile={out}); records: {records}; plot: {plot}")
    return 0


def _names(registry: Any) -> str:
    """The names of a registry, comma-separated, for a help text."""
    return ", ".join(registry)


def build_parser() -> argparse.ArgumentParser:
    from fastprefill import __version__
    from fastprefill.data.tasks import TASKS
    from fastprefill.methods.registry import METHODS

    parser = argparse.ArgumentParser(
        prog="fastprefill", description="Faster time to first token for Hugging Face causal LMs: LazyLLM, "
        "KV-Runahead and KV Prediction, measured against plain prefill.")
    parser.add_argument("--version", action="version", version=f"fastprefill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser, default_model: bool = True) -> None:
        if default_model:
            p.add_argument("--model", default="smollm2-135m", help="zoo name, HF model id or local dir")
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1, help="torch threads")

    p = sub.add_parser("models", help="list the model zoo, or prepare models")
    p.add_argument("action", nargs="?", choices=["list", "prepare"], default="list")
    p.add_argument("names", nargs="*", help="zoo names to prepare (default: the embedded default)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_models)

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
                   help="time the first run (by default an untimed one-token run of the same method comes first)")
    model_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over one model")
    p.add_argument("--method", default="full", help="default method spec (a request may name another in its "
                   "'fastprefill' field: full, lazyllm, static, random)")
    p.add_argument("--allow-method", action="append", default=[], metavar="SPEC",
                   help="another spec requests may name, built at start (e.g. kvp:predictor=DIR; repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (no authentication: keep it local)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--queue", type=_positive, default=16, help="requests that may wait while one generates")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request, queue wait included")
    p.add_argument("--max-tokens", type=_positive, default=256, help="tokens when a request gives no max_tokens")
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body in MiB; a larger one is refused with 413 before it is read")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: refuse new requests (503), answer waiting ones 503, let the running "
                        "generation go on for up to S seconds (then end it with an error), and exit; a second "
                        "signal exits at once")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    model_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmark methods beside full prefill, or verify committed results")
    p.add_argument("action", nargs="?", choices=["run", "verify"], default="run",
                   help="run (default) a benchmark; verify: re-summarize the result files in --out and "
                        "compare with their committed summaries (and, for a checkout's benchmarks/results, "
                        "the figures of README.md and docs/)")
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
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="one multi-document QA prompt, every method side by side")
    p.add_argument("--length", type=_positive, default=1024, help="prompt length in tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=_positive, default=24)
    p.add_argument("--procs", type=int, default=2, help="KV-Runahead ranks (0 or 1 to skip it)")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="timed runs per method after one untimed warm-up; the table shows their median and range")
    model_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train-kvp", help="train a KV Prediction predictor (least squares, then gradient steps), "
                       "or calibrate kvp-prefix maps (--variant prefix)")
    p.add_argument("--variant", choices=["aux", "prefix"], default="aux",
                   help="aux: maps from an aux model's KV (kvp); prefix: maps from the base's own layer-L hidden "
                        "state (kvp-prefix, least squares only)")
    p.add_argument("--base", "--model", dest="base", default="qwen2.5-coder-1.5b",
                   help="base model (zoo name, HF id or dir)")
    p.add_argument("--layer", type=int, help="--variant prefix: layers the base runs exactly")
    p.add_argument("--rank", type=_positive, help="--variant prefix: rank of the stored correction "
                   "(default: full rank if it fits --max-mb, else the largest that fits)")
    p.add_argument("--max-mb", type=float, default=20.0, help="--variant prefix: bound on the weights file")
    p.add_argument("--task-share", type=float, default=0.25,
                   help="share of dev-split task prompts (chat template) in the calibration text")
    p.add_argument("--source", choices=["kv", "hidden", "hidden2"], default="kv",
                   help="--variant aux: the maps read the aux layer's KV (the paper), its normalised attention "
                        "input (hidden) or two aux layers' (hidden2)")
    p.add_argument("--distill-from", metavar="DIR",
                   help="--variant prefix: refine this calibrated checkpoint by KL distillation on dev task "
                        "prompts into --out (SwiftKV's second step, the maps only)")
    p.add_argument("--tail", type=_positive, default=32,
                   help="--distill-from: prompt tokens run exactly during distillation (use the same tail=W)")
    p.add_argument("--train-prompts", action="append", metavar="TASK:N",
                   help="--distill-from: dev prompts to train on (repeatable; default "
                        "singledoc-qa:24 multidoc-qa:4 humaneval-completion:4)")
    p.add_argument("--heldout-prompts", action="append", metavar="TASK:N",
                   help="--distill-from: dev prompts the best maps are chosen on (default singledoc-qa:8)")
    p.add_argument("--prompt-length", type=_positive, default=1024, help="--distill-from: prompt tokens")
    p.add_argument("--aux", help="KVP-C: the smaller auxiliary model (same tokenizer)")
    p.add_argument("--drop-stride", type=_positive, help="KVP-LP: aux = the base keeping every N-th layer")
    p.add_argument("--out", required=True, help="checkpoint directory")
    p.add_argument("--lsq-tokens", type=_positive, default=None,
                   help="calibration tokens (default 100000; --variant prefix: 32768)")
    p.add_argument("--steps", type=_positive, default=None,
                   help="gradient steps (default 200; --variant prefix --distill-from: 120)")
    p.add_argument("--seq-len", type=_positive, default=512)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--l1-weight", type=float, default=0.1)
    p.add_argument("--ridge", type=float, default=None, help="ridge (default 1e-4; --variant prefix: 1e-3)")
    p.add_argument("--checkpoint-every", type=_positive, default=25)
    p.add_argument("--train-aux", action="store_true", help="also train the aux model (KVP-C only)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    model_args(p, default_model=False)
    p.set_defaults(func=cmd_train_kvp)

    p = sub.add_parser("tune", help="choose the fastest method per prompt length that keeps a fidelity target, "
                       "measured on your prompts; writes a profile for --method auto:profile=FILE")
    p.add_argument("--prompts", help="JSONL: one {\"prompt\": ...} or {\"messages\": [...]} per line")
    p.add_argument("--task", help="a packaged task instead of --prompts (multidoc-qa, singledoc-qa, needle, ...)")
    p.add_argument("--lengths", type=_positive, nargs="+", default=[512, 1024, 2048, 4096],
                   help="--task: prompt lengths in tokens")
    p.add_argument("--n", type=_positive, default=80, help="--task: prompts per length (half choose, half report)")
    p.add_argument("--split", choices=["dev", "test"], default="dev", help="--task: the split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="first-token=0.9",
                   help="first-token=S, identical=S (shares of prompts, lower interval end >= S) or kl=X "
                        "(mean first-token KL, upper end <= X)")
    p.add_argument("--confidence", type=float, default=0.95, help="two-sided level of the fidelity interval")
    p.add_argument("--methods", nargs="+", metavar="SPEC", help="more candidate specs (e.g. kvp-prefix:predictor=DIR)")
    p.add_argument("--only", action="store_true", help="try only --methods, not the default candidates")
    p.add_argument("--min-speedup", type=float, default=1.1,
                   help="a bucket whose best qualifying candidate is slower than this runs full prefill")
    p.add_argument("--max-new-tokens", type=_positive, default=None,
                   help="tokens per run (default: 1 for first-token and kl targets, 32 for identical)")
    p.add_argument("--out", default="tune-profile.json", help="the profile (records beside it as .jsonl, plot as .png)")
    p.add_argument("--resume", action="store_true", help="continue the records of an interrupted tune")
    model_args(p)
    p.set_defaults(func=cmd_tune)
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
