"""The subcommands that fit something to a model: ``train-kvp`` (KV Prediction's predictors and
kvp-prefix's maps) and ``tune`` (a method profile for ``--method auto``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from fastprefill.cli.common import _load, console, err_console
from fastprefill.errors import FastprefillError


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
    model, tok = _load(args.base, args.device, args.dtype, compile=False)
    t0 = time.perf_counter()
    distill_on_dev(model, tok, args.distill_from, args.out, cfg, train=args.train_prompts or DEFAULT_TRAIN,
                   heldout=args.heldout_prompts or DEFAULT_HELDOUT, length=args.prompt_length, resume=args.resume)
    console.print(f"[green]distilled[/green] kvp-prefix l={source['layer']} in {time.perf_counter() - t0:.0f} s -> "
                  f"{args.out} (use: --method kvp-prefix:predictor={args.out},tail={args.tail})")
    return 0


# --- train-kvp ---------------------------------------------------------------------------------
def cmd_train_kvp(args: argparse.Namespace) -> int:
    import time

    from fastprefill.host import set_threads
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
    base, tok = _load(args.base, args.device, args.dtype, compile=False)
    if args.aux is not None:
        aux, aux_tok = _load(args.aux, args.device, args.dtype, compile=False)
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

    from fastprefill.host import set_threads
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
    model, tok = _load(args.base, args.device, args.dtype, compile=False)
    t0 = time.perf_counter()
    calibrate_prefix(model, args.out, cfg, tokenizer=tok, model_name=args.base, resume=args.resume)
    console.print(f"[green]calibrated[/green] kvp-prefix l={args.layer} in {time.perf_counter() - t0:.0f} s -> "
                  f"{args.out} (use: --method kvp-prefix:predictor={args.out})")
    return 0


# --- tune --------------------------------------------------------------------------------------
def cmd_tune(args: argparse.Namespace) -> int:
    from fastprefill.host import set_threads
    from fastprefill.methods.auto import Target
    from fastprefill.methods.registry import make_method
    from fastprefill.tune import DEFAULT_CANDIDATES, load_prompts, plot_frontier, task_prompts, tune

    target = Target.parse(args.target, args.confidence)
    if args.report_split and (args.prompts or args.report_split == args.split):
        raise FastprefillError("--report-split takes a packaged --task and the split --split does not name")
    if (args.prompts is None) == (args.task is None):
        raise FastprefillError("give your prompts with --prompts FILE.jsonl, or a packaged task with --task NAME")
    specs = list(DEFAULT_CANDIDATES if not args.only else []) + list(args.methods or [])
    if not specs:
        raise FastprefillError("no candidates: --only needs at least one --methods SPEC")
    candidates = {spec: make_method(spec) for spec in dict.fromkeys(specs)}  # every spec builds before any run
    set_threads(args.threads)
    model, tok = _load(args.model, args.device, args.dtype, args.compile)
    for spec, method in list(candidates.items()):
        if not method.supports(model.config):
            err_console.print(f"[dim]skipping {spec}: it does not support {model.config.model_type!r}[/dim]")
            del candidates[spec]
    if args.prompts:
        prompts = load_prompts(args.prompts, tok)
    elif args.report_split:  # choose on one split, report on the other
        prompts = (task_prompts(args.task, tok, args.lengths, args.n, split=args.split, seed=args.seed, half="choose")
                   + task_prompts(args.task, tok, args.lengths, args.n, split=args.report_split, seed=args.seed,
                                  half="report"))
    else:
        prompts = task_prompts(args.task, tok, args.lengths, args.n, split=args.split, seed=args.seed)
    out = Path(args.out)
    records = Path(args.records) if args.records else out.with_suffix(".jsonl")
    try:
        profile, seen = tune(model, tok, args.model, prompts, candidates, {k: k for k in candidates}, target,
                             records_path=records, threads=args.threads, resume=args.resume,
                             max_new_tokens=args.max_new_tokens, min_speedup=args.min_speedup,
                             meta={"source": args.prompts or (
                                 f"{args.task} ({args.split} to choose, {args.report_split} to report, lengths "
                                 f"{args.lengths}, n={args.n} per split)" if args.report_split else
                                 f"{args.task} ({args.split}, lengths {args.lengths}, n={args.n})")})
    except KeyboardInterrupt:
        if records.exists():
            err_console.print(f"the runs so far are in {records}: the same command with --resume continues "
                              "from there", highlight=False)
        raise
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
