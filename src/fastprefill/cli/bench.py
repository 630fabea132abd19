"""``fastprefill bench``: run methods beside full prefill over a task (flags or a TOML ``--config``).

Checking that committed figures reproduce needs a repository checkout: ``bench verify`` says so
and names the script that does it (``python benchmarks/verify.py``)."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from fastprefill.cli.common import _load, _names, _positive, _threads, console
from fastprefill.errors import FastprefillError

BENCH_KEYS = ("model", "task", "lengths", "n", "methods", "split", "seed", "threads", "warmup",
              "max_new_tokens", "out", "name", "device", "dtype")

#: What ``fastprefill bench verify`` prints: the check of committed figures reads a checkout's files.
VERIFY_HINT = ("checking that committed figures reproduce needs a repository checkout: "
               "run `python benchmarks/verify.py` there")

def bench_config(args: argparse.Namespace) -> dict[str, Any]:
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

    cfg = bench_config(args)
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

def add_parser(sub: Any) -> None:
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
