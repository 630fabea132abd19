"""Selection primitives a pruning policy builds on.

A *select* callable is ``select(scores, k) -> indices``: ``scores`` ``(N,)`` over the
candidates (``-inf`` = not a candidate, ``+inf`` = must stay), ``k`` the number to keep, and
the result ``(k,)`` indices into ``scores`` in ascending order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SelectFn", "top_k_keep"]

SelectFn = Callable[[torch.Tensor, int], torch.Tensor]


def top_k_keep(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(k,)`` (ascending) of the ``k`` largest ``scores`` ``(N,)``; ``+inf`` entries always win."""
    return torch.topk(scores, k, sorted=False).indices.sort().values
