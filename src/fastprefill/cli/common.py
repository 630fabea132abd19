"""What every ``fastprefill`` subcommand shares: the two consoles, argument types, model loading."""

from __future__ import annotations

import argparse
import json
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
