"""Selection primitives a pruning policy builds on.

A *select* callable is ``select(scores, k) -> indices``: ``scores`` ``(N,)`` over the
candidates (``-inf`` = not a candidate, ``+inf`` = must stay), ``k`` the number to keep, and
the result ``(k,)`` indices into ``scores`` in ascending order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SelectFn", "avg_pool_scores", "top_k_keep"]

SelectFn = Callable[[torch.Tensor, int], torch.Tensor]


def top_k_keep(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(k,)`` (ascending) of the ``k`` largest ``scores`` ``(N,)``; ``+inf`` entries always win."""
    return torch.topk(scores, k, sorted=False).indices.sort().values


def avg_pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average ``scores`` ``(N,)`` over a centred window of ``kernel`` (odd) positions; ``(N,)`` out.

    Zero padding at both ends counts in the average (``avg_pool1d``'s default, as GemFilter and
    SnapKV pool), so edge tokens are averaged with zeros. ``kernel=1`` returns ``scores``.
    """
    if kernel == 1:
        return scores
    pooled = torch.nn.functional.avg_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)
    return pooled[0, 0]
