"""The frozen KV-Runahead partition: contiguous chunk sizes of the prompt, one per rank.

In the KV-Runahead chain (arXiv 2405.05329) rank ``i`` attends its ``c_i`` queries over the
``s_i + c_i`` keys of chunks ``0..i`` (``s_i = c_0 + ... + c_{i-1}``). A :class:`PartitionPlan`
is computed before anything runs; its prefix lengths tell every rank, in advance, the shape of
every message it will receive, so no shape handshake is needed. How the chunk sizes are chosen
lives in :mod:`.search` (cost model, grid search) and :mod:`.tables` (per-length lookup tables).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastprefill.errors import ConfigError, is_int

__all__ = ["PartitionPlan", "check_procs"]


def check_procs(procs: Any, total: int) -> None:
    """Raise :class:`ConfigError` unless ``1 <= procs <= total``."""
    if not is_int(procs, 1):
        raise ConfigError(f"procs must be an integer >= 1, got {procs!r}")
    if procs > total:
        raise ConfigError(
            f"procs ({procs}) is larger than the prompt ({total} tokens): every rank needs at least "
            "one token; use fewer processes or a longer prompt"
        )


@dataclass(frozen=True)
class PartitionPlan:
    """Contiguous chunk sizes of the prompt, one per rank, fixed before the run.

    Args:
        chunks: ``(c_0, ..., c_{P-1})``, each ``>= 1``.
        total: the prompt length ``T`` the chunks must sum to (``None``: not checked).

    Raises:
        ConfigError: no chunks, a chunk ``< 1`` or a non-integer, or a sum other than ``total``.
    """

    chunks: tuple[int, ...]
    total: int | None = None

    def __post_init__(self) -> None:
        chunks = tuple(self.chunks)
        object.__setattr__(self, "chunks", chunks)
        if not chunks:
            raise ConfigError("partition: needs at least one chunk (procs >= 1)")
        for i, c in enumerate(chunks):
            if not is_int(c, 1):
                raise ConfigError(f"partition: chunk {i} is {c!r}; every chunk must be an integer >= 1")
        if self.total is not None and sum(chunks) != self.total:
            raise ConfigError(
                f"partition: chunk sizes {list(chunks)} sum to {sum(chunks)}, but the prompt has "
                f"{self.total} tokens; they must sum to the prompt length"
            )

    @classmethod
    def even(cls, total: int, procs: int) -> PartitionPlan:
        """As even as possible; the first ``total % procs`` chunks get one token more.

        Raises:
            ConfigError: ``procs < 1`` or ``procs > total``.
        """
        check_procs(procs, total)
        base, extra = divmod(total, procs)
        return cls(tuple(base + (1 if i < extra else 0) for i in range(procs)), total)

    @classmethod
    def from_fractions(cls, total: int, fractions: Sequence[float]) -> PartitionPlan:
        """Round fractions of ``total`` to integer chunks ``>= 1`` summing to ``total``
        (largest remainder)."""
        procs = len(fractions)
        check_procs(procs, total)
        s = float(sum(fractions))
        spare = total - procs  # every chunk gets 1, the rest by fraction
        raw = [max(f, 0.0) / s * spare for f in fractions]
        base = [math.floor(r) for r in raw]
        order = sorted(range(procs), key=lambda i: raw[i] - base[i], reverse=True)
        for i in order[: spare - sum(base)]:
            base[i] += 1
        return cls(tuple(b + 1 for b in base), total)

    @property
    def procs(self) -> int:
        return len(self.chunks)

    @property
    def length(self) -> int:
        return sum(self.chunks)

    def start(self, rank: int) -> int:
        """First original position of ``rank``'s chunk (= the prefix length it receives)."""
        return sum(self.chunks[:rank])

    def attention_pairs(self, rank: int) -> int:
        """Query-key dot products per layer and head that ``rank``'s masked kernel computes:
        the ``c_i x (s_i + c_i)`` block of its queries over chunks ``0..i`` (the paper's count:
        9 tokens split 4/3/2 give 16/21/18; the upper triangle right of the block is never
        computed)."""
        c, s = self.chunks[rank], self.start(rank)
        return c * (s + c)
