"""``fastprefill calibrate-runahead``: time this machine for the KV-Runahead cost model and write a
partition table.

The loopback's communication coefficients come from a gloo ping-pong between two local processes
(:func:`fastprefill.distributed.loopback.measure_loopback`), the compute coefficients from timing
one decoder layer (:func:`fastprefill.methods.runahead.calibrate.calibrate`); every (ranks, length)
is then searched on the fitted model and written as a
:class:`~fastprefill.methods.runahead.tables.PartitionTable` (``--method runahead:table=PATH``
reads it)::

    fastprefill calibrate-runahead --model NAME --out PATH
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from fastprefill.cli.common import _positive, console

COMMAND = "fastprefill calibrate-runahead"


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Calibrate on this machine and write a partition table (see the module docstring)."""
    import torch

    from fastprefill.distributed.loopback import measure_loopback
    from fastprefill.host import set_threads
    from fastprefill.methods.runahead.calibrate import calibrate
    from fastprefill.methods.runahead.tables import PartitionTable
    from fastprefill.models import load
    from fastprefill.models.shape import ModelShape

    set_threads(args.threads)
    model, _ = load(args.model)
    bandwidth, latency = measure_loopback()
    cost = calibrate(model, bandwidth_bytes_s=bandwidth, latency_s=latency, repeats=args.repeats)
    command = (f"{COMMAND} --model {args.model} --out {args.out} --threads {args.threads} --ranks "
               f"{' '.join(map(str, args.ranks))} --lengths {' '.join(map(str, args.lengths))} --repeats {args.repeats}")
    machine = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
               "threads": args.threads, "built": time.strftime("%Y-%m-%d %H:%M:%S")}
    table = PartitionTable.build(args.model, ModelShape.from_config(model.config), cost, args.ranks, args.lengths,
                                 command=command, machine=machine)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    console.print(f"wrote {out}: {json.dumps({p: table.entries[p] for p in table.entries if p == 2})}",
                  highlight=False, markup=False)
    return 0


def add_parser(sub: Any) -> None:
    from fastprefill.methods.runahead.tables import TABLE_LENGTHS, TABLE_RANKS

    p = sub.add_parser("calibrate-runahead", help="time this machine for KV-Runahead and write a partition table")
    p.add_argument("--model", required=True, help="zoo name, local model folder or random:llama")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--threads", type=_positive, default=1, help="torch threads while timing (one rank's setting)")
    p.add_argument("--ranks", type=_positive, nargs="+", default=list(TABLE_RANKS))
    p.add_argument("--lengths", type=_positive, nargs="+", default=list(TABLE_LENGTHS))
    p.add_argument("--repeats", type=_positive, default=3)
    p.set_defaults(func=cmd_calibrate)
