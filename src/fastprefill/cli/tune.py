"""``fastprefill tune``: measure candidate methods on your prompts and write a profile that
``--method auto:profile=FILE`` serves (the fastest method per prompt length that keeps the fidelity target)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from fastprefill.cli.common import _load, _positive, console, err_console, model_args
from fastprefill.errors import FastprefillError


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
    model, tok = _load(args.model, args.device, args.dtype, args.compile, args.row_floor)
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

def add_parser(sub: Any) -> None:
    """The ``tune`` subcommand's parser."""
    p = sub.add_parser("tune", help="choose the fastest method per prompt length that keeps a fidelity target, "
                       "measured on your prompts; writes a profile for --method auto:profile=FILE")
    p.add_argument("--prompts", help="JSONL: one {\"prompt\": ...} or {\"messages\": [...]} per line")
    p.add_argument("--task", help="a packaged task instead of --prompts (multidoc-qa, singledoc-qa, needle, ...)")
    p.add_argument("--lengths", type=_positive, nargs="+", default=[512, 1024, 2048, 4096],
                   help="--task: prompt lengths in tokens")
    p.add_argument("--n", type=_positive, default=80, help="--task: prompts per length (half choose, half report)")
    p.add_argument("--split", choices=["dev", "test"], default="dev",
                   help="--task: the split (halves by hash, unless --report-split)")
    p.add_argument("--report-split", choices=["dev", "test"], default=None,
                   help="--task: choose on all of --split and report on --n prompts per length of this split")
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
    p.add_argument("--records", default=None,
                   help="the records file (default: --out with .jsonl); with --resume, runs already in it are "
                        "reused, so one set of runs can be tuned for several targets")
    p.add_argument("--resume", action="store_true", help="continue the records of an interrupted tune")
    model_args(p)
    p.set_defaults(func=cmd_tune)
