"""What every ``fastprefill`` subcommand shares: the two consoles, argument types, model loading."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.console import Console

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


def model_args(p: argparse.ArgumentParser, default_model: bool = True, dtype: str = "auto") -> None:
    """The options of a subcommand that loads a model: ``--model`` (unless the subcommand names its
    own), ``--device``, ``--dtype``, ``--no-compile``, ``--threads``."""
    from fastprefill.host import DTYPES

    if default_model:
        p.add_argument("--model", default="smollm2-135m", help="zoo name, HF model id or local dir")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=dtype, choices=list(DTYPES),
                   help="auto: bfloat16 where the CPU (AMX-BF16, AVX512-BF16) or GPU multiplies it natively, "
                        f"float32 elsewhere (default: {dtype})")
    p.add_argument("--no-compile", dest="compile", action="store_const", const=False, default=None,
                   help="run the model uncompiled (by default each decoder layer's MLP and norms are compiled "
                        "with torch.compile on the CPU: faster prefill, a few seconds more at the first run)")
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1, help="torch threads")


def _load(model: str, device: str, dtype: str, compile: bool | None = None):
    """Load ``model`` in ``dtype`` (``"auto"``: see :func:`fastprefill.host.resolve_dtype`) for a
    command that runs it, its decoder blocks compiled unless ``compile=False`` (see
    :func:`fastprefill.models.load`); the process keeps freed memory for reuse from here on
    (:func:`fastprefill.host.keep_freed_memory`)."""
    from fastprefill.host import keep_freed_memory
    from fastprefill.models import load

    keep_freed_memory()
    with console.status(f"loading {model} ..."):
        return load(model, device=device, dtype=dtype, compile=compile)


def _print_json(data: Any) -> None:
    """One JSON document on stdout (plain print: no wrapping, no markup)."""
    print(json.dumps(data, ensure_ascii=False))
