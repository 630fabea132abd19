"""``fastprefill models``: list the model zoo; ``models prepare NAME`` verifies and converts one."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from fastprefill.cli.common import _print_json, console


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

def add_parser(sub: Any) -> None:
    p = sub.add_parser("models", help="list the model zoo, or prepare models")
    p.add_argument("action", nargs="?", choices=["list", "prepare"], default="list")
    p.add_argument("names", nargs="*", help="zoo names to prepare (default: the embedded default)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_models)
