"""The ``fastprefill`` command line.

Subcommands:

One module per subcommand, each with its ``cmd_*`` function and its ``add_parser``:

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
- ``calibrate-runahead``: time this machine for the KV-Runahead cost model and write a partition
  table.

Errors a user can cause exit with status 2 and a one-line message, never a traceback.
``models --json`` and ``generate --json`` print JSON for scripts; tables are never cut to the
terminal's width when stdout is not a terminal.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fastprefill.cli import bench, calibrate, demo, generate, models, serve, train_kvp, tune
from fastprefill.cli.common import console, err_console
from fastprefill.errors import FastprefillError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``fastprefill`` parser: one subparser per subcommand, each added by its own function."""
    from fastprefill import __version__

    parser = argparse.ArgumentParser(
        prog="fastprefill", description="Faster time to first token for Hugging Face causal LMs: LazyLLM, "
        "KV-Runahead and KV Prediction, measured against plain prefill.")
    parser.add_argument("--version", action="version", version=f"fastprefill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (models, generate, serve, bench, demo, train_kvp, tune, calibrate):
        command.add_parser(sub)
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
