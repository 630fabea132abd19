"""Selection primitives a pruning policy builds on.

A *select* callable is ``select(scores, k) -> indices``: ``scores`` ``(N,)`` over the
candidates (``-inf`` = not a candidate, ``+inf`` = must stay), ``k`` the number to keep, and
the result ``(k,)`` indices into ``scores`` in ascending order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SelectFn", "avg_pool_scores", "cut_scores", "pool_in_position_order", "top_k_keep"]

SelectFn = Callable[[torch.Tensor, int], torch.Tensor]


def top_k_keep(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(k,)`` (ascending) of the ``k`` largest ``scores`` ``(N,)``; ``+inf`` entries always win."""
    return torch.topk(scores, k, sorted=False).indices.sort().values


def avg_pool_scores(scores: torch.Tensor, kernel: int, count_pad: bool = True) -> torch.Tensor:
    """Average ``scores`` ``(N,)`` over a centred window of ``kernel`` (odd) positions; ``(N,)`` out.

    With ``count_pad`` (``avg_pool1d``'s default, as GemFilter and SnapKV pool) the zero padding
    at both ends counts in the average, so edge tokens are averaged with zeros; without it an edge
    token's average is over the entries that exist. ``kernel=1`` returns ``scores``.
    """
    if kernel == 1:
        return scores
    pooled = torch.nn.functional.avg_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2,
                                            count_include_pad=count_pad)
    return pooled[0, 0]


def pool_in_position_order(
    scores: torch.Tensor, positions: torch.Tensor, among: torch.Tensor | None, kernel: int
) -> torch.Tensor:
    """Average-pool the entries ``among`` of ``scores`` over their neighbours in position order.

    Args:
        scores: ``(N,)`` one score per key, in storage order.
        positions: ``(N,)`` the keys' original positions.
        among: ``(N,)`` bool, the keys pooled together (the others are neither pooled nor used);
            ``None``: every key (nothing is then read back from the device).
        kernel: odd window width over the ``among`` keys sorted by position; padding not counted.

    Returns:
        ``(N,)``: the pooled values at ``among``, ``scores`` elsewhere.
    """
    if kernel == 1 or not scores.numel():
        return scores
    if among is None:
        idx = positions.argsort()  # (N,)
    elif not bool(among.any()):
        return scores
    else:
        idx = among.nonzero().flatten()  # (M,)
        idx = idx[positions[idx].argsort()]
    out = scores.clone()
    out[idx] = avg_pool_scores(scores[idx], kernel, count_pad=False)
    return out


def cut_scores(
    row: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor | None, forced: torch.Tensor, kernel: int
) -> torch.Tensor:
    """A cut's selection row ``(N,)``: ``row`` pooled among ``candidates`` in position order,
    ``-inf`` outside them, ``+inf`` at ``forced`` (all ``(N,)``; ``candidates=None``: every row)."""
    row = pool_in_position_order(row, positions, candidates, kernel)
    if candidates is not None:
        row = row.masked_fill(~candidates, float("-inf"))
    return row.masked_fill(forced, float("inf"))
