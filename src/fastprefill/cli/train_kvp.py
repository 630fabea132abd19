"""``fastprefill train-kvp``: train a KV Prediction predictor (``--variant prefix``: calibrate kvp-prefix maps)."""

from __future__ import annotations

import argparse
from typing import Any

from fastprefill.cli.common import _load, _positive, console, model_args
from fastprefill.errors import FastprefillError


def _distill_prefix(args: argparse.Namespace) -> int:
    """``train-kvp --variant prefix --distill-from DIR``: KL distillation of calibrated maps."""
    import time

    from fastprefill.methods.kv_prediction.prefix.distill import (
        PrefixDistillation,
        distill_on_dev,
        read_distill_source,
    )
    from fastprefill.methods.kv_prediction.prefix.distill_prompts import DEFAULT_HELDOUT, DEFAULT_TRAIN

    source = read_distill_source(args.distill_from, args.layer)
    cfg = PrefixDistillation(steps=args.steps, lr=args.lr, tail=args.tail)
    model, tok = _load(args.base, args.device, args.dtype, compile=False)
    t0 = time.perf_counter()
    distill_on_dev(model, tok, args.distill_from, args.out, cfg, train=args.train_prompts or DEFAULT_TRAIN,
                   heldout=args.heldout_prompts or DEFAULT_HELDOUT, length=args.prompt_length, resume=args.resume)
    console.print(f"[green]distilled[/green] kvp-prefix l={source['layer']} in {time.perf_counter() - t0:.0f} s -> "
                  f"{args.out} (use: --method kvp-prefix:predictor={args.out},tail={args.tail})")
    return 0

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

def add_parser(sub: Any) -> None:
    """The ``train-kvp`` subcommand's parser."""
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
    model_args(p, default_model=False, dtype="float32", row_floor=False)  # maps are fitted in float32; they apply in any dtype
    p.set_defaults(func=cmd_train_kvp)
