"""The pruned prefill: run decoder layers on gathered rows at their positions, defer the pruned ones.

Every method built here (LazyLLM, random drop, static pruning, GemFilter) is a *policy*: it
decides which tokens to keep; the functions below do the rest. Rows are *gathered*
(``index_select``) so a pruned token is really not computed; each row carries its position into
the rotary embedding and the causal mask. Every layer call is counted per (layer, position) by
the state's :class:`~fastprefill.methods.pruning.state.ComputeCounter`. Decoding after it lives in
:mod:`~fastprefill.methods.pruning.decode`.

- :func:`progressive_prefill`: all tokens enter layer 0; at each pruning layer of a schedule the
  policy's ``select`` picks from a score row (the last prompt token's attention by default; see
  :class:`~fastprefill.methods.pruning.options.PruneOptions`) which tokens go on; the others
  wait in the Aux Cache at the next layer, for the decoder to revive.
- :func:`probe_scores` and :func:`subset_prefill`: the static shape, one selection (or none) and
  then every layer on the kept rows only, at their original positions or renumbered ``0..K-1``.

Keep count at a cut: ``k = ceil(keep * M)`` with ``M`` the rows computed (the prompt, or the part
after a cached prefix), raised to the protected tokens present (the last token, sinks, recent
prompt tokens) and capped by the tokens present.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from fastprefill.cache import PositionKVCache, layer_kv
from fastprefill.errors import ConfigError
from fastprefill.methods.base import ComputeStats, PrefillOutput
from fastprefill.methods.pruning.decode import RevivalDecoder
from fastprefill.methods.pruning.options import PruneOptions
from fastprefill.methods.pruning.schedule import Schedule, keep_count, scored_layers
from fastprefill.methods.pruning.scorers import AttentionScorer, Scorer
from fastprefill.methods.pruning.select import SelectFn, cut_scores
from fastprefill.methods.pruning.state import LazyState, new_state, run_rows
from fastprefill.methods.research.fill import FillMaps
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.attention import causal_mask
from fastprefill.models.shape import causal_pairs

__all__ = ["PrunedPrefill", "probe_scores", "progressive_prefill", "recording_kept_positions", "subset_prefill"]

_RECORD_KEPT: ContextVar[bool] = ContextVar("fastprefill_record_kept_positions", default=False)


def recording_kept_positions() -> contextlib.AbstractContextManager[None]:
    """Inside this block, pruned prefills also report which positions each cut kept.

    :func:`progressive_prefill` and :func:`subset_prefill` then add
    ``extra["kept_positions"]``: a list with one ``(K_s,)`` int64 tensor of original positions
    per cut (one for a subset prefill). Tensors are not JSON values, so this is off by default
    (engine timings stay serialisable); the bench runner turns it on to measure the share of
    gold tokens kept and drops the tensors from its records.
    """
    return _recording()


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    token = _RECORD_KEPT.set(True)
    try:
        yield
    finally:
        _RECORD_KEPT.reset(token)


def _dropped_rows(keep: torch.Tensor, r: int) -> torch.Tensor:
    """Indices ``(R - K,)`` (ascending) of the ``R`` rows not in ``keep`` ``(K,)`` (distinct row
    indices): a stable sort of the drop mask, so nothing is read back from the device (a boolean
    index would wait on it for the count)."""
    drop = torch.ones(r, dtype=torch.uint8, device=keep.device)
    drop[keep] = 0
    return torch.sort(drop, descending=True, stable=True).indices[: r - int(keep.numel())]


def _filled_rows(ranked: torch.Tensor, dropped: torch.Tensor, share: float) -> torch.Tensor:
    """Indices (ascending) of the pruned rows that get filled rows: of ``dropped`` ``(R - K,)``
    (ascending row indices), the ``ceil(share * pruned)`` with the highest selection scores
    ``ranked`` ``(R,)``."""
    count = math.ceil(share * int(dropped.numel()))
    if count >= dropped.numel():
        return dropped
    top = ranked[dropped].topk(count).indices
    return dropped[top].sort().values


@dataclass
class PrunedPrefill:
    """A pruned prefill's output for the engine and the mechanism's state (its KV by position,
    Aux Cache, compute counter and selections), for inspection and tests."""

    output: PrefillOutput
    state: LazyState


@dataclass
class _Rows:
    """A progressive prefill in flight: the rows computed at the current layer and the counts so far."""

    positions: torch.Tensor  # (R,) original positions, ascending
    hidden: torch.Tensor  # (1, R, D)
    rotary: tuple[torch.Tensor, torch.Tensor]  # (1, R, d) each
    prefix: int  # P: the cached prefix's positions, context at every layer
    token_layers: int = 0
    flops: float = 0.0
    kept: list[int] = field(default_factory=list)  # rows kept at each cut
    filled_from: int = 0  # the first layer where pruned tokens have filled rows (L: none)
    filled_positions: torch.Tensor | None = None  # (F,) ascending: the positions with filled rows
    filled_token_layers: int = 0
    filled_layer_calls: int = 0  # layers run while filled rows were there (their pairs are counted at the end)


def progressive_prefill(
    adapter: DecoderAdapter, input_ids: torch.Tensor, schedule: Schedule, select: SelectFn,
    options: PruneOptions | None = None, prefix: DynamicCache | None = None, scorer: Scorer | None = None,
) -> PrunedPrefill:
    """Prefill with progressive pruning at the layers of ``schedule`` (validated against the model).

    At pruning layer ``l`` with keep fraction ``f``, ``select`` receives a score per row present
    and ``k = max(keep_count(f, M), protected)`` (``M`` the rows computed: the prompt, or the part
    after a cached prefix); the rows it drops go to the Aux Cache under ``l + 1``. The score
    (see :class:`PruneOptions`) is the attention of the last ``score_window`` rows (the paper:
    the last prompt token) at ``l``, or its sum over the stage's layers (``accumulate``),
    average-pooled over ``pool_kernel`` positions; the last row, the ``sinks`` and the last
    ``keep_recent`` prompt positions are ``+inf``.

    Args:
        input_ids: ``(1, T)`` with ``T >= 1``.
        options: scoring, protection and decoding options (default: the paper's rule).
        prefix: the exact K/V of positions ``0..P-1`` (``P < T``) at every layer: context every
            row attends at every layer, never pruned and never recomputed; only positions
            ``P..T-1`` are rows.
        scorer: what a cut's score is (default :class:`AttentionScorer` over the options'
            ``score_window``).

    Returns:
        The output: ``(V,)`` logits; a ragged cache view; the stats (``kept_per_stage`` in
        ``extra``; ``kept_positions`` too inside :func:`recording_kept_positions`);
        ``exact_tokens = P`` (the pruned rows' K/V at later layers attend a pruned context); and
        a :class:`~fastprefill.methods.pruning.decode.RevivalDecoder` unless the revival policy
        is ``none``. And the state.
    """
    ad = adapter
    opts = options or PruneOptions()
    if opts.fill.active and len(schedule) > 1:
        raise ConfigError(f"fill={opts.fill} supports one-cut schedules; this one cuts {len(schedule)} times")
    n = int(input_ids.shape[1])
    prune = dict(schedule)
    scored = scored_layers(schedule, opts.accumulate)
    scorer = scorer or AttentionScorer(opts.score_window)
    state = new_state(ad, schedule, n, opts, select)
    p = _load_prefix(state, prefix)
    acc: torch.Tensor | None = None  # (R,) scores summed over the stage so far (accumulate)
    with torch.inference_mode(), ad.attention_scope():
        hidden = ad.embed(input_ids[:, p:])  # (1, R, D)
        positions = torch.arange(p, n, device=ad.device)  # (R,) positions computed at the current layer
        rows = _Rows(positions, hidden, ad.rotary(hidden, positions[None]), p, filled_from=ad.num_layers,
                     filled_positions=positions[:0])
        for layer in range(ad.num_layers):
            row = _run_layer(state, rows, layer, scorer, scored=layer in scored)
            if row is None:
                continue
            if opts.accumulate:
                acc = row if acc is None else acc + row
                if layer not in prune:
                    continue
                row, acc = acc, None
            _cut(state, rows, layer, keep_count(prune[layer], n - p), row)
        logits = ad.head(rows.hidden[:, -1:])[0, -1]
    return _output(state, rows, logits)


def _load_prefix(state: LazyState, prefix: DynamicCache | None) -> int:
    """Put a cached prefix's K/V into every layer of ``state.cache``; return its length ``P``."""
    p = 0 if prefix is None else int(prefix.get_seq_length())
    if p:
        for layer in range(len(state.cache.layers)):
            keys, values = layer_kv(prefix, layer)
            state.cache.stage(layer, torch.arange(p, device=keys.device))
            state.cache.update(keys, values, layer)
    return p


def _run_layer(state: LazyState, rows: _Rows, layer: int, scorer: Scorer, scored: bool) -> torch.Tensor | None:
    """Run ``layer`` on the rows and count it; the rows' score row ``(R,)`` when the layer is ``scored``."""
    shape, positions, p = state.adapter.shape, rows.positions, rows.prefix
    r = int(positions.numel())
    scores: dict[int, torch.Tensor] | None = {} if scored else None
    filled = layer >= rows.filled_from
    # an empty layer cache and ascending rows: mask=None (causal kernel) is exact; over a
    # prefix or filled rows the rows are not the first keys, so the mask goes by position
    mask = causal_mask(positions, state.cache.key_positions_after(layer, positions)) if p or filled else None
    last = layer == state.adapter.num_layers - 1 and scores is None  # the head reads the last row alone
    rows.hidden = run_rows(state, layer, rows.hidden, positions, rows.rotary, mask, scores, scorer, last_row=last)
    rows.token_layers += r
    trimmed = last and r > 1 and rows.hidden.shape[1] == 1
    rows.flops += shape.last_row_layer_flops(r, r + p) if trimmed else shape.layer_flops(r, r * p + causal_pairs(r))
    rows.filled_layer_calls += filled  # the pairs with the filled rows before them: counted in _output
    if scores is None:
        return None
    rows.flops += min(scorer.queries, r) * shape.scoring_flops(r + p)
    return scores[layer][0][-r:]  # (R,): the rows are the layer's last keys


def _cut(state: LazyState, rows: _Rows, layer: int, k: int, row: torch.Tensor) -> None:
    """Keep ``max(k, protected)`` of the rows by ``state.select`` over ``row`` ``(R,)``; the others
    wait in the Aux Cache at ``layer + 1`` (and get filled rows, with the options' ``fill``)."""
    opts, positions = state.options, rows.positions
    r = int(positions.numel())
    # counted on the host: every protected prompt row is still present (each cut keeps them)
    k = max(k, opts.protected_count(rows.prefix, state.prompt_len))
    if k < r:
        forced = opts.protected(positions, state.prompt_len, decoding=False)
        forced[-1] = True
        ranked = cut_scores(row, positions, None, forced, opts.pool_kernel)
        keep = state.select(ranked, k)
        dropped = _dropped_rows(keep, r)  # (R - K,)
        state.aux.put(layer + 1, positions.index_select(0, dropped), rows.hidden.index_select(1, dropped))
        if opts.fill.active:
            _fill(state, rows, layer, ranked, dropped)
        rows.hidden = rows.hidden.index_select(1, keep)
        rows.rotary = (rows.rotary[0].index_select(1, keep), rows.rotary[1].index_select(1, keep))
        rows.positions = positions[keep]
    rows.kept.append(int(rows.positions.numel()))
    state.selected.append(rows.positions)


def _fill(state: LazyState, rows: _Rows, layer: int, ranked: torch.Tensor, dropped: torch.Tensor) -> None:
    """Give the best-ranked pruned rows (of ``dropped`` ``(R - K,)``, ascending row indices) filled
    K/V at every layer above ``layer`` (the options' ``fill``)."""
    ad, positions = state.adapter, rows.positions
    filled = _filled_rows(ranked, dropped, state.options.fill_share)
    maps = FillMaps(state.options.fill, ad, layer + 1)
    for j, (k_j, v_j) in maps.fill(rows.hidden[:, filled], positions[filled]).items():
        state.cache.stage(j, positions[filled])
        state.cache.update(k_j, v_j, j)
    rows.filled_from, rows.filled_positions = layer + 1, positions[filled]
    rows.filled_token_layers += int(filled.numel()) * (ad.num_layers - layer - 1)
    rows.flops += maps.flops(int(filled.numel()))


def _output(state: LazyState, rows: _Rows, logits: torch.Tensor) -> PrunedPrefill:
    """The engine's :class:`PrefillOutput` of a progressive prefill, with its state."""
    ad, schedule, n = state.adapter, state.schedule, state.prompt_len
    flops = rows.flops + ad.shape.head_flops(1)
    if rows.filled_layer_calls:  # the rows attended the filled rows before them at every layer after the (one) cut
        pairs = int(torch.searchsorted(rows.filled_positions, rows.positions).sum())
        flops += rows.filled_layer_calls * ad.shape.attention_flops(pairs)
    extra: dict[str, Any] = {"kept_per_stage": rows.kept, "schedule": [list(pair) for pair in schedule]}
    if state.options.fill.active:
        extra["filled_token_layers"] = rows.filled_token_layers
    if _RECORD_KEPT.get():
        extra["kept_positions"] = list(state.selected)
    stats = ComputeStats(token_layers=rows.token_layers, total_token_layers=n * ad.num_layers, flops=flops,
                         extra=extra)
    revives = bool(schedule) and state.options.revival.kind != "none"
    output = PrefillOutput(
        logits=logits, cache=state.cache.ragged_view(ad.config), stats=stats, next_position=n,
        exact_tokens=rows.prefix, ragged=bool(schedule), decoder=RevivalDecoder(state) if revives else None,
    )
    return PrunedPrefill(output, state)


def probe_scores(
    adapter: DecoderAdapter, input_ids: torch.Tensor, layer: int, scorer: Scorer | None = None
) -> torch.Tensor:
    """The last prompt token's score row ``(T,)`` at ``layer``, from layers ``0..layer`` on the whole prompt.

    The layers run into a throwaway cache: this is a static policy's selection pass, paid in
    its TTFT and charged by :func:`subset_prefill` (``selection_layer``). ``scorer`` is the
    policy's score (default :class:`AttentionScorer`: the last query's attention probabilities
    averaged over heads).
    """
    ad = adapter
    scorer = scorer or AttentionScorer()
    n = int(input_ids.shape[1])
    with torch.inference_mode(), ad.attention_scope():
        probe = PositionKVCache(ad.num_layers)
        pos = torch.arange(n, device=ad.device)
        hidden = ad.embed(input_ids)
        rot = ad.rotary(hidden, pos[None])
        scores: dict[int, torch.Tensor] = {}
        for i in range(layer + 1):
            probe.stage(i, pos)
            hidden = ad.layer(i, hidden, pos[None], probe, mask=None, rotary=rot,
                              scores=scores if i == layer else None, scorer=scorer)
        return scores[layer][0].clone()


def subset_prefill(
    adapter: DecoderAdapter, input_ids: torch.Tensor, keep: torch.Tensor, selection_layer: int | None = None,
    renumber: bool = False,
) -> PrunedPrefill:
    """Run every layer on the prompt rows ``keep`` ``(K,)`` (ascending original positions).

    The layer caches start empty and the rows are sorted, so causal-by-position equals causal by
    row index and ``mask=None`` (SDPA's causal kernel) is exact.

    Args:
        selection_layer: if the policy chose ``keep`` by :func:`probe_scores` at this layer, the
            probe's ``T * (selection_layer + 1)`` token-layers, FLOPs and scoring are charged too.
        renumber: run the kept rows at positions ``0..K-1`` (as if the prompt were only them)
            instead of their original positions; decoding then continues at ``K``.

    Returns:
        ``(V,)`` logits of the last kept row, its cache (decoded by the model's forward from the
        position after the kept prompt) and the stats; and a :class:`LazyState` whose
        ``selected`` holds ``keep``.
    """
    ad = adapter
    shape = ad.shape
    n, k = int(input_ids.shape[1]), int(keep.numel())
    positions = torch.arange(k, device=keep.device) if renumber else keep  # (K,)
    state = new_state(ad, (), k if renumber else n)
    state.selected = [keep]
    with torch.inference_mode(), ad.attention_scope():
        ids = input_ids.index_select(1, keep)
        hidden = ad.embed(ids)
        rot = ad.rotary(hidden, positions[None])
        for layer in range(ad.num_layers):
            hidden = run_rows(state, layer, hidden, positions, rot, None)
        logits = ad.head(hidden[:, -1:])[0, -1]
    flops = shape.num_layers * shape.layer_flops(k) + shape.head_flops(1)
    token_layers = k * ad.num_layers
    extra: dict[str, Any] = {"kept": k}
    if selection_layer is not None:
        selected = n * (selection_layer + 1)
        flops += (selection_layer + 1) * shape.layer_flops(n) + shape.scoring_flops(n)
        token_layers += selected
        extra["selection_token_layers"] = selected
    if _RECORD_KEPT.get():
        extra["kept_positions"] = [keep]
    stats = ComputeStats(token_layers=token_layers, total_token_layers=n * ad.num_layers, flops=flops, extra=extra)
    output = PrefillOutput(logits=logits, cache=state.cache.to_dynamic_cache(ad.config) if renumber
                           else state.cache.ragged_view(ad.config), stats=stats,
                           next_position=k if renumber else n, exact_tokens=0, ragged=not renumber)
    return PrunedPrefill(output, state)
