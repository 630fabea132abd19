"""``fastprefill demo``: one multi-document QA prompt, answered by full prefill and every available method."""

from __future__ import annotations

import argparse
from typing import Any

from fastprefill.cli.common import _load, _positive, console, model_args


def cmd_demo(args: argparse.Namespace) -> int:
    from fastprefill.demo import run_demo
    from fastprefill.host import set_threads

    set_threads(args.threads)
    model, tok = _load(args.model, args.device, args.dtype, args.compile, args.row_floor)
    return run_demo(model, tok, args, console)

def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="one multi-document QA prompt, every method side by side")
    p.add_argument("--length", type=_positive, default=1024, help="prompt length in tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=_positive, default=24)
    p.add_argument("--procs", type=int, default=2, help="KV-Runahead ranks (0 or 1 to skip it)")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="timed runs per method after one untimed warm-up; the table shows their median and range")
    model_args(p)
    p.set_defaults(func=cmd_demo)
