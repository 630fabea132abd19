"""KV-Runahead partition lookup tables: searched chunk fractions per (ranks, context length).

As in the paper, the best partition is searched offline per context length and interpolated at
run time. A :class:`PartitionTable` holds them for one model shape, with the calibrated
:class:`~fastprefill.methods.runahead.search.CostModel` the search used. Shipped tables live in
``tables/`` next to this file (:data:`TABLES_DIR`) and are rebuilt by::

    fastprefill calibrate-runahead --model smollm2-135m \\
        --out src/fastprefill/methods/runahead/tables/smollm2-135m.json
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastprefill.errors import ConfigError
from fastprefill.methods.runahead.plan import PartitionPlan, check_procs
from fastprefill.methods.runahead.search import CostModel, search_partition
from fastprefill.models.shape import ModelShape

__all__ = ["TABLES_DIR", "TABLE_LENGTHS", "TABLE_RANKS", "PartitionTable", "find_table"]

TABLES_DIR = Path(__file__).with_name("tables")
#: Context lengths of the shipped tables (interpolated in log2 of the length in between).
TABLE_LENGTHS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
TABLE_RANKS: tuple[int, ...] = (2, 3, 4, 8)


def _shape_key(shape: ModelShape) -> dict[str, int]:
    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
    }


@dataclass(frozen=True)
class PartitionTable:
    """Searched chunk fractions per (ranks, context length) for one model shape.

    Attributes:
        model: the model's name (informational).
        shape: the :class:`ModelShape` fields the table applies to.
        entries: ``{procs: {length: fractions}}``.
        cost_model: the calibrated :class:`CostModel` the search used (as a dict).
        command: the command that rebuilds the table.
    """

    model: str
    shape: dict[str, int]
    entries: dict[int, dict[int, tuple[float, ...]]]
    cost_model: dict[str, Any]
    command: str = ""
    machine: dict[str, Any] = field(default_factory=dict)

    def matches(self, shape: ModelShape) -> bool:
        return self.shape == _shape_key(shape)

    def plan(self, total: int, procs: int) -> PartitionPlan:
        """Chunk sizes for ``total`` tokens on ``procs`` ranks.

        Fractions are interpolated linearly in ``log2(length)`` between the two nearest
        table lengths (clamped outside the table) and rounded to integers summing to ``total``.
        When ``procs`` is not in the table, the search runs on the stored cost model.
        """
        check_procs(procs, total)
        if procs == 1:
            return PartitionPlan((total,), total)
        rows = self.entries.get(procs)
        if not rows:
            return search_partition(total, procs, CostModel.from_dict(self.cost_model))
        lengths = sorted(rows)
        x = math.log2(total)
        if total <= lengths[0]:
            fr = rows[lengths[0]]
        elif total >= lengths[-1]:
            fr = rows[lengths[-1]]
        else:
            hi = next(k for k, n in enumerate(lengths) if n >= total)
            n0, n1 = lengths[hi - 1], lengths[hi]
            w = (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            fr = tuple((1 - w) * a + w * b for a, b in zip(rows[n0], rows[n1], strict=True))
        return PartitionPlan.from_fractions(total, fr)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "shape": self.shape,
            "command": self.command,
            "machine": self.machine,
            "cost_model": self.cost_model,
            "entries": {str(p): {str(n): list(f) for n, f in rows.items()} for p, rows in self.entries.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartitionTable:
        entries = {int(p): {int(n): tuple(f) for n, f in rows.items()} for p, rows in d["entries"].items()}
        return cls(d["model"], dict(d["shape"]), entries, dict(d["cost_model"]), d.get("command", ""), d.get("machine", {}))

    @classmethod
    def load(cls, path: str | Path) -> PartitionTable:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"partition table {path}: cannot read it ({exc})") from exc

    @classmethod
    def build(
        cls,
        model_name: str,
        shape: ModelShape,
        cost: CostModel,
        ranks: Sequence[int] = TABLE_RANKS,
        lengths: Sequence[int] = TABLE_LENGTHS,
        command: str = "",
        machine: dict[str, Any] | None = None,
    ) -> PartitionTable:
        """Search every (ranks, length) and store the chunk fractions."""
        entries: dict[int, dict[int, tuple[float, ...]]] = {}
        for p in ranks:
            entries[p] = {}
            for n in lengths:
                plan = search_partition(n, p, cost)
                entries[p][n] = tuple(round(c / n, 6) for c in plan.chunks)
        return cls(model_name, _shape_key(shape), entries, cost.to_dict(), command, machine or {})


def find_table(shape: ModelShape, directory: str | Path = TABLES_DIR) -> PartitionTable | None:
    """The shipped table whose model shape equals ``shape``, or ``None``.

    Cached per (shape, directory) in this process, so a prefill with ``partition="searched"``
    reads the JSON once, not inside every TTFT window.
    """
    return _find_table_cached(shape, str(directory))


@functools.lru_cache(maxsize=32)
def _find_table_cached(shape: ModelShape, directory: str) -> PartitionTable | None:
    for path in sorted(Path(directory).glob("*.json")):
        table = PartitionTable.load(path)
        if table.matches(shape):
            return table
    return None
