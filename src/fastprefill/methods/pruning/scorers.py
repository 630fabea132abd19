"""Scorers: what a token's importance is, computed beside the fused attention at a cut.

A :class:`Scorer` turns a layer's rotated queries ``(B, H_q, T, d)``, keys ``(B, H_kv, N, d)``
and boolean mask ``(B, 1, T, N)`` (``None``: causal) into one score per key ``(B, N)``; the
family adapter calls it inside its attention function
(:meth:`~fastprefill.models.adapters.DecoderAdapter.layer`) so the score is one row, never the
full matrix. A pruning method is a schedule, a scorer and a selection over one mechanism
(:mod:`fastprefill.methods.pruning.prefill` and :mod:`~fastprefill.methods.pruning.decode`):

- :class:`AttentionScorer`: attention probabilities from the last query (LazyLLM's paper rule),
  or averaged over a window of last queries (SnapKV / FastKV practice);
- :class:`LogitScorer`: pre-softmax logits of the last query summed over heads (GemFilter);
- :class:`RandomScorer`: a seeded random order that ignores the attention (random drop).

Average pooling over positions belongs to the selection
(:mod:`fastprefill.methods.pruning.select`), which knows the candidates' positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["AttentionScorer", "LogitScorer", "RandomScorer", "Scorer", "last_query_attention",
           "last_query_logits", "window_attention"]


@runtime_checkable
class Scorer(Protocol):
    """One score per key from the last ``queries`` query rows (see the module docstring)."""

    @property
    def queries(self) -> int:
        """Query rows read (each costs one row of ``QK^T`` in the FLOP count)."""
        ...

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor:
        """``(B, N)`` float32 scores, higher = more important."""
        ...


def last_query_attention(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """Attention probabilities of the last query over all keys, averaged over every query head.

    Args:
        query: ``(B, H_q, T, d)``; only ``query[:, :, -1]`` is used.
        key: ``(B, H_kv, N, d)`` with ``H_q % H_kv == 0`` (grouped-query attention).
        attention_mask: ``None`` (the last query sees every key) or boolean ``(B, 1, T, N)``.
        scaling: the softmax scale (``d ** -0.5`` when ``None``).

    Returns:
        ``(B, N)`` float32 probabilities, each row summing to 1.
    """
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    scale = scaling if scaling is not None else d**-0.5
    q_last = query[:, :, -1, :].reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, G, d)
    logits = torch.einsum("bhgd,bhnd->bhgn", q_last.float(), key.float()) * scale  # (B, H_kv, G, N)
    if attention_mask is not None:
        allowed = attention_mask[:, :, -1, :].unsqueeze(2)  # (B, 1, 1, N)
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.mean(dim=(1, 2))  # (B, N)


def window_attention(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
    window: int,
) -> torch.Tensor:
    """Attention probabilities of the last ``window`` queries, averaged over every query head and those queries.

    Each of the last ``W = min(window, T)`` query rows is causally masked on its own: with
    ``attention_mask=None`` the ``T`` queries are aligned to the last ``T`` keys (row ``i`` sees
    keys ``0..N - T + i``, as SDPA's causal kernel); otherwise row ``i`` sees
    ``attention_mask[:, 0, i]``. Under GQA each key is read once per KV group (no ``repeat_kv``).
    ``window=1`` is :func:`last_query_attention`.

    Args:
        query: ``(B, H_q, T, d)``; key: ``(B, H_kv, N, d)`` with ``H_q % H_kv == 0``.
        attention_mask: ``None`` or boolean ``(B, 1, T, N)``.
        scaling: the softmax scale (``d ** -0.5`` when ``None``).
        window: ``W >= 1``.

    Returns:
        ``(B, N)`` float32, each row summing to 1.
    """
    b, h_q, t, d = query.shape
    h_kv, n = key.shape[1], key.shape[2]
    w = min(window, t)
    scale = scaling if scaling is not None else d**-0.5
    q_win = query[:, :, t - w:, :].float().reshape(b, h_kv, h_q // h_kv, w, d)  # (B, H_kv, G, W, d)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q_win, key.float()) * scale  # (B, H_kv, G, W, N)
    if attention_mask is None:
        last_key = torch.arange(n - w, n, device=key.device)  # (W,) the last key each row may see
        allowed = torch.arange(n, device=key.device)[None, :] <= last_key[:, None]  # (W, N)
        allowed = allowed[None, None, None]
    else:
        allowed = attention_mask[:, :, t - w:, :].unsqueeze(2)  # (B, 1, 1, W, N)
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs.mean(dim=(1, 2, 3))  # (B, N)


def last_query_logits(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """Pre-softmax attention logits of the last query over all keys, summed over every query head.

    GemFilter's selection score. Under GQA the ``G`` query heads of a KV group share its keys,
    so their sum is ``(sum_j q_j) . k``: the queries are summed per group first and each key is
    read once (no ``repeat_kv``).

    Args:
        query, key, attention_mask, scaling: as in :func:`last_query_attention`.

    Returns:
        ``(B, N)`` float32, ``-inf`` at keys the last query may not attend.
    """
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    scale = scaling if scaling is not None else d**-0.5
    q_sum = query[:, :, -1, :].float().reshape(b, h_kv, h_q // h_kv, d).sum(2)  # (B, H_kv, d)
    logits = torch.einsum("bhd,bhnd->bn", q_sum, key.float()) * scale  # (B, N)
    if attention_mask is not None:
        logits = logits.masked_fill(~attention_mask[:, 0, -1, :], float("-inf"))
    return logits


@dataclass(frozen=True)
class AttentionScorer:
    """Attention probabilities of the last ``window`` queries, averaged over every query head and
    those queries (:func:`window_attention`; ``window=1`` is :func:`last_query_attention`, the
    LazyLLM paper's score)."""

    window: int = 1

    @property
    def queries(self) -> int:
        return self.window

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor:
        if self.window == 1:
            return last_query_attention(query, key, attention_mask, scaling)
        return window_attention(query, key, attention_mask, scaling, self.window)


@dataclass(frozen=True)
class LogitScorer:
    """GemFilter's score: the last query's pre-softmax logits summed over heads (:func:`last_query_logits`)."""

    @property
    def queries(self) -> int:
        return 1

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor:
        return last_query_logits(query, key, attention_mask, scaling)


@dataclass(frozen=True)
class RandomScorer:
    """A seeded random order, independent of the attention (random token drop).

    :meth:`rank` gives ``n`` scores whose top-``k`` is the first ``k`` of ``torch.randperm(n)``
    under a CPU generator seeded with ``seed`` (the same on every device).
    """

    seed: int = 0

    @property
    def queries(self) -> int:
        return 0

    def rank(self, n: int) -> torch.Tensor:
        """``(n,)`` float32: position ``perm[i]`` scores ``n - i``."""
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        scores = torch.empty(n, dtype=torch.float32)
        scores[perm] = torch.arange(n, 0, -1, dtype=torch.float32)
        return scores

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor:
        return self.rank(key.shape[2]).to(key.device)[None].expand(key.shape[0], -1)
