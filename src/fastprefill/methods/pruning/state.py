"""What a pruned prefill leaves for decoding: per-layer KV, the Aux Cache, the compute counter;
and :func:`run_rows`, the one way prefill runs a layer on gathered rows of that state
(:func:`rows_for`: the same rows as one group of a decode step, run with other streams').

Shapes: positions ``(N,)`` int64; the counter is ``(L, N)`` int32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from fastprefill.cache import AuxCache, PositionKVCache
from fastprefill.methods.layer_steps import Rows
from fastprefill.methods.pruning.options import PruneOptions
from fastprefill.methods.pruning.schedule import Schedule
from fastprefill.methods.pruning.scorers import AttentionScorer, Scorer
from fastprefill.methods.pruning.select import SelectFn, top_k_keep
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.fused import last_row_only

__all__ = ["LAST_QUERY", "ComputeCounter", "DeferredAuxCache", "LazyState", "new_state", "rows_for", "run_rows"]

#: The paper's score (the last query's attention), used while decoding: the new token is the only query.
LAST_QUERY = AttentionScorer()


class ComputeCounter:
    """How many times each (layer, position) was computed: an ``(L, capacity)`` int32 tensor.

    Always on: one ``index_add_`` per layer call, independent of the caches. The invariant of
    the pruning mechanism is ``counts.max() <= 1`` over the whole generation.
    """

    def __init__(self, num_layers: int, capacity: int, device: torch.device) -> None:
        self._counts = torch.zeros(num_layers, max(1, capacity), dtype=torch.int32, device=device)
        self._ones = torch.ones(max(1, capacity), dtype=torch.int32, device=device)

    def add(self, layer: int, positions: torch.Tensor, bound: int | None = None) -> None:
        """Count one computation at ``layer`` for each of ``positions`` ``(R,)``.

        Args:
            bound: a number above every one of ``positions``, known to the caller (the next
                position to generate, plus one): with it nothing is read back from the device;
                ``None`` reads the positions' maximum (a host round-trip on an accelerator).
        """
        if not positions.numel():
            return
        need = bound if bound is not None else int(positions.max()) + 1
        if need > self._counts.shape[1]:
            grow = max(need, 2 * self._counts.shape[1])
            pad = torch.zeros(self._counts.shape[0], grow - self._counts.shape[1], dtype=torch.int32,
                              device=self._counts.device)
            self._counts = torch.cat([self._counts, pad], dim=1)
            self._ones = torch.ones(grow, dtype=torch.int32, device=self._counts.device)
        self._counts[layer].index_add_(0, positions, self._ones[: positions.numel()])

    @property
    def length(self) -> int:
        """The highest position counted so far, plus one (0 before any count); read from the
        counts themselves, so counting never waits on the device."""
        seen = self._counts.any(dim=0).nonzero()  # (S, 1) columns with a count
        return int(seen.max()) + 1 if seen.numel() else 0

    @property
    def counts(self) -> torch.Tensor:
        """``(L, N)`` computations per layer and position, ``N`` = highest position seen + 1."""
        return self._counts[:, : self.length]


class DeferredAuxCache(AuxCache):
    """An :class:`~fastprefill.cache.AuxCache` whose ``put`` keeps the positions and hidden states
    as tensors until the rows are first read (``take``, ``positions``, ``len``), so a prefill's cut
    reads nothing back from the device; the puts are then applied in order, as ``AuxCache`` would."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, (M,), (1, M, D))

    def put(self, layer_idx: int, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store ``hidden`` ``(1, M, D)`` for ``positions`` ``(M,)`` as inputs of ``layer_idx`` (later)."""
        self._pending.append((layer_idx, positions, hidden))

    def _apply(self) -> None:
        pending, self._pending = self._pending, []
        for layer_idx, positions, hidden in pending:
            super().put(layer_idx, positions, hidden)

    def take(self, layer_idx: int, positions: torch.Tensor) -> torch.Tensor:
        self._apply()
        return super().take(layer_idx, positions)

    def positions(self, layer_idx: int) -> list[int]:
        self._apply()
        return super().positions(layer_idx)

    def __len__(self) -> int:
        self._apply()
        return super().__len__()


@dataclass
class LazyState:
    """Decode state of every method built on the pruning mechanism.

    Attributes:
        adapter: the model's :class:`DecoderAdapter`.
        cache: per-layer KV over the positions computed at each layer.
        aux: the Aux Cache of deferred tokens (empty when nothing is deferred).
        schedule: resolved ``(layer, keep)`` pairs (empty: plain decoding over the cache).
        next_pos: position of the next token fed to :func:`~fastprefill.methods.pruning.decode.decode_step`.
        prompt_len: positions ``0..prompt_len-1`` are the prompt (as run: the kept count when
            renumbered); later positions are generated tokens.
        options: the scoring, protection and revival options decoding applies (those of the
            prefill).
        counter: computations per (layer, position), prefill and decode.
        revived_tokens_per_step: distinct earlier tokens computed at each decode step (each
            resumed from the Aux Cache).
        revived_token_stages_per_step: (token, stage) pairs computed for them per step; a revived
            token that goes on through the next stage counts once per stage.
        revived_token_layers_per_step: (token, layer) pairs computed for them per step.
        revivals: ``(step, position, layer)`` for every revived token, once per step (``layer`` =
            where it resumed).
        selected: positions selected for each stage at the last step (prefill, then decode).
        select: the policy's choice of tokens from a score row, used again at every
            reselecting decode step.
    """

    adapter: DecoderAdapter
    cache: PositionKVCache
    aux: AuxCache
    schedule: Schedule
    next_pos: int
    counter: ComputeCounter
    prompt_len: int = 0
    options: PruneOptions = field(default_factory=PruneOptions)
    revived_tokens_per_step: list[int] = field(default_factory=list)
    revived_token_stages_per_step: list[int] = field(default_factory=list)
    revived_token_layers_per_step: list[int] = field(default_factory=list)
    revivals: list[tuple[int, int, int]] = field(default_factory=list)
    selected: list[torch.Tensor] = field(default_factory=list)
    select: SelectFn = top_k_keep

    def revival_stats(self) -> dict[str, Any]:
        """The revival counters per decode step, their totals and the tokens still deferred."""
        return {
            "revived_tokens_per_step": list(self.revived_tokens_per_step),
            "revived_token_stages_per_step": list(self.revived_token_stages_per_step),
            "revived_token_layers_per_step": list(self.revived_token_layers_per_step),
            "revived_tokens_total": int(sum(self.revived_tokens_per_step)),
            "revived_token_layers_total": int(sum(self.revived_token_layers_per_step)),
            "aux_cache_waiting": len(self.aux),
        }


def new_state(
    adapter: DecoderAdapter, schedule: Schedule, n_prompt: int, options: PruneOptions | None = None,
    select: SelectFn = top_k_keep,
) -> LazyState:
    """An empty :class:`LazyState` for an ``n_prompt``-token prompt."""
    return LazyState(
        adapter=adapter, cache=PositionKVCache(adapter.num_layers), aux=DeferredAuxCache(), schedule=schedule,
        next_pos=n_prompt, counter=ComputeCounter(adapter.num_layers, n_prompt + 64, adapter.device),
        prompt_len=n_prompt, options=options or PruneOptions(), select=select,
    )


def run_rows(
    state: LazyState, layer: int, hidden: torch.Tensor, positions: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
    scores: dict[int, torch.Tensor] | None = None, scorer: Scorer = LAST_QUERY, last_row: bool = False,
) -> torch.Tensor:
    """Run ``layer`` on rows ``hidden`` ``(1, R, D)`` at ``positions`` ``(R,)``, writing their KV; count them.
    ``last_row``: only the last row's output is read (the model's last layer in a prefill), so
    the layer runs inside :func:`~fastprefill.models.fused.last_row_only` (``(1, 1, D)`` back
    where that applies).

    Every position is below ``state.next_pos + 1`` (the prompt, revived tokens, the token being
    decoded), so the count reads nothing back from the device."""
    state.cache.stage(layer, positions)
    with last_row_only(state.adapter.model, state.cache) if last_row else contextlib.nullcontext():
        out = state.adapter.layer(layer, hidden, positions[None], state.cache, mask=mask, rotary=rotary,
                                  scores=scores, scorer=scorer)
    state.counter.add(layer, positions, bound=max(state.next_pos, state.prompt_len) + 1)
    return out


def rows_for(
    state: LazyState, layer: int, hidden: torch.Tensor, positions: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
    scores: dict[int, torch.Tensor] | None = None,
) -> Rows:
    """:func:`run_rows`' rows as one group of a decode step's layer call
    (:func:`~fastprefill.methods.layer_steps.run_layers`): ``hidden`` ``(1, R, D)`` at
    ``positions`` ``(R,)`` into ``state.cache`` (staged when the layer runs), scored by the new
    token's attention (:data:`LAST_QUERY`) when ``scores`` is given; counted now."""
    state.counter.add(layer, positions, bound=max(state.next_pos, state.prompt_len) + 1)
    return Rows(state.cache, hidden, positions, rotary, mask, stage=True, scores=scores, scorer=LAST_QUERY)
