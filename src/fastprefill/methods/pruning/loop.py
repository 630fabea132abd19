"""The pruning mechanism: run decoder layers on gathered rows at their positions, defer, revive.

Every method built here (LazyLLM, random drop, static pruning) is a *policy*: it decides which
tokens to keep; the functions below do the rest. Rows are *gathered* (``index_select``) so a
pruned token is really not computed; each row carries its position into the rotary embedding
and the causal mask. Every layer call is counted per (layer, position) by the state's
:class:`~fastprefill.methods.pruning.state.ComputeCounter`.

- :func:`progressive_prefill`: all tokens enter layer 0; at each pruning layer of a schedule the
  policy's ``select`` picks from a score row (the last prompt token's attention by default; see
  :class:`~fastprefill.methods.pruning.options.PruneOptions`) which tokens go on; the others
  wait in the Aux Cache at the next layer.
- :func:`probe_scores` and :func:`subset_prefill`: the static shape, one selection (or none) and
  then every layer on the kept rows only, at their original positions or renumbered ``0..K-1``.
- :func:`decode_step`: one generated token; with a schedule, under the revival policy of the
  state's options: stage-by-stage reselection and revival from the Aux Cache (``all``, or at
  most ``R`` revived tokens per stage with ``budget:R``), no revival (``none``), or every
  deferred token-layer computed at the first step (:func:`catch_up`) and plain decoding after;
  without a schedule, plain decoding over the cache. Each (token, layer) is computed at most
  once under every policy.

A *stage* is the run of layers between two pruning layers (stage 0 = layers ``0..p_1``, where
every token is present). At a decode step, stage ``s`` attends over the **selected set** ``S_s``
only, not over all KV present at its layers: ``S_s`` is chosen from the tokens attended at
``p_s``, which are ``S_{s-1}``, so every token in ``S_s`` has KV through layer ``p_s`` and its
Aux Cache entry, if any, is exactly at ``b_s = p_s + 1``. With "all present KV" a selected
token could have stopped at an earlier stage and would need its missing middle layers
recomputed or skipped.

Keep count: ``k = ceil(keep * n)`` with ``n`` the sequence length (prompt at prefill; prompt +
tokens so far, the new one included, at decode), raised to the protected tokens present (the
last token, sinks, recent prompt tokens, generated ones under ``decode_protect``) and capped by
the tokens present.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from fastprefill.cache import PositionKVCache, layer_kv
from fastprefill.errors import ConfigError
from fastprefill.methods.base import ComputeStats, PrefillOutput
from fastprefill.methods.pruning.fill import FillMaps
from fastprefill.methods.pruning.options import PruneOptions
from fastprefill.methods.pruning.schedule import Schedule, keep_count
from fastprefill.methods.pruning.scorers import AttentionScorer, Scorer
from fastprefill.methods.pruning.select import SelectFn, pool_in_position_order
from fastprefill.methods.pruning.state import LazyState, new_state
from fastprefill.models.adapters import DecoderAdapter, causal_mask
from fastprefill.models.shape import ModelShape, causal_pairs

__all__ = ["PrunedPrefill", "RevivalDecoder", "catch_up", "decode_step", "probe_scores", "progressive_prefill",
           "recording_kept_positions", "run_rows", "subset_prefill"]

#: The paper's score (the last query's attention), used while decoding: the new token is the only query.
LAST_QUERY = AttentionScorer()

_RECORD_KEPT: ContextVar[bool] = ContextVar("fastprefill_record_kept_positions", default=False)


def run_rows(
    state: LazyState, layer: int, hidden: torch.Tensor, positions: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
    scores: dict[int, torch.Tensor] | None = None, scorer: Scorer = LAST_QUERY,
) -> torch.Tensor:
    """Run ``layer`` on rows ``hidden`` ``(1, R, D)`` at ``positions`` ``(R,)``, writing their KV; count them."""
    state.cache.stage(layer, positions)
    out = state.adapter.layer(layer, hidden, positions[None], state.cache, mask=mask, rotary=rotary, scores=scores,
                              scorer=scorer)
    state.counter.add(layer, positions)
    return out


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


def _cut_scores(
    row: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor, forced: torch.Tensor, kernel: int
) -> torch.Tensor:
    """A cut's selection row ``(N,)``: ``row`` pooled among ``candidates`` in position order,
    ``-inf`` outside them, ``+inf`` at ``forced`` (all ``(N,)``)."""
    row = pool_in_position_order(row, positions, candidates, kernel)
    return row.masked_fill(~candidates, float("-inf")).masked_fill(forced, float("inf"))


def _filled_rows(ranked: torch.Tensor, drop: torch.Tensor, share: float) -> torch.Tensor:
    """Indices (ascending) of the pruned rows that get filled rows: of ``drop`` ``(R,)`` (bool),
    the ``ceil(share * pruned)`` with the highest selection scores ``ranked`` ``(R,)``."""
    dropped = drop.nonzero().flatten()
    count = math.ceil(share * int(dropped.numel()))
    if count >= dropped.numel():
        return dropped
    top = ranked[dropped].topk(count).indices
    return dropped[top].sort().values


def _scored_layers(schedule: Schedule, options: PruneOptions) -> set[int]:
    """The layers whose scores a cut uses: the pruning layers, or every layer up to the last one
    when scores accumulate over a stage."""
    prune = {layer for layer, _ in schedule}
    if options.accumulate and prune:
        return set(range(max(prune) + 1))
    return prune


@dataclass
class PrunedPrefill:
    """A pruned prefill's output for the engine and the mechanism's state (its KV by position,
    Aux Cache, compute counter and selections), for inspection and tests."""

    output: PrefillOutput
    state: LazyState


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
        a :class:`RevivalDecoder` unless the revival policy is ``none``. And the state.
    """
    ad = adapter
    opts = options or PruneOptions()
    n = int(input_ids.shape[1])
    prune = dict(schedule)
    scored = _scored_layers(schedule, opts)
    scorer = scorer or AttentionScorer(opts.score_window)
    shape: ModelShape = ad.shape
    state = new_state(ad, schedule, n, opts, select)
    p = _load_prefix(state, prefix)
    m = n - p  # rows computed at layer 0
    rows = torch.arange(p, n, device=ad.device)  # (R,) positions computed at the current layer
    token_layers, flops = 0, 0.0
    kept: list[int] = []
    kept_positions: list[torch.Tensor] = []
    acc: torch.Tensor | None = None  # (R,) scores summed over the stage so far (accumulate)
    if opts.fill.active and len(schedule) > 1:
        raise ConfigError(f"fill={opts.fill} supports one-cut schedules; this one cuts {len(schedule)} times")
    filled_from, filled_token_layers = ad.num_layers, 0  # layers from which pruned tokens have filled rows
    filled_positions = rows[:0]  # (F,) ascending: the positions that have filled rows
    with torch.inference_mode(), ad.attention_scope():
        hidden = ad.embed(input_ids[:, p:])  # (1, R, D)
        cos, sin = ad.rotary(hidden, rows[None])  # (1, R, d) each
        for layer in range(ad.num_layers):
            r = int(rows.numel())
            scores: dict[int, torch.Tensor] | None = {} if layer in scored else None
            # an empty layer cache and ascending rows: mask=None (causal kernel) is exact; over a
            # prefix or filled rows the rows are not the first keys, so the mask goes by position
            mask = causal_mask(rows, state.cache.key_positions_after(layer, rows)) if p or layer >= filled_from \
                else None
            hidden = run_rows(state, layer, hidden, rows, (cos, sin), mask, scores, scorer)
            token_layers += r
            # the rows also attend the filled rows before them (none before the cut)
            filled_pairs = int(torch.searchsorted(filled_positions, rows).sum()) if layer >= filled_from else 0
            flops += shape.layer_flops(r, r * p + causal_pairs(r) + filled_pairs)
            if scores is None:
                continue
            flops += min(scorer.queries, r) * shape.scoring_flops(r + p)
            row = scores[layer][0][-r:]  # (R,): the rows are the layer's last keys
            if opts.accumulate:
                acc = row if acc is None else acc + row
                if layer not in prune:
                    continue
                row, acc = acc, None
            forced = opts.protected(rows, n, decoding=False)
            forced[-1] = True
            k = max(keep_count(prune[layer], m), int(forced.sum()))
            if k < r:
                everyone = torch.ones(r, dtype=torch.bool, device=rows.device)
                ranked = _cut_scores(row, rows, everyone, forced, opts.pool_kernel)
                keep = select(ranked, k)
                drop = torch.ones(r, dtype=torch.bool, device=rows.device)
                drop[keep] = False
                state.aux.put(layer + 1, rows[drop], hidden[:, drop])
                if opts.fill.active:
                    filled = _filled_rows(ranked, drop, opts.fill_share)
                    maps = FillMaps(opts.fill, ad, layer + 1)
                    for j, (k_j, v_j) in maps.fill(hidden[:, filled], rows[filled]).items():
                        state.cache.stage(j, rows[filled])
                        state.cache.update(k_j, v_j, j)
                    filled_from, filled_positions = layer + 1, rows[filled]
                    filled_token_layers += int(filled.numel()) * (ad.num_layers - layer - 1)
                    flops += maps.flops(int(filled.numel()))
                hidden = hidden.index_select(1, keep)
                cos, sin = cos.index_select(1, keep), sin.index_select(1, keep)
                rows = rows[keep]
            kept.append(int(rows.numel()))
            kept_positions.append(rows)
            state.selected.append(rows)
        logits = ad.head(hidden[:, -1:])[0, -1]
    flops += shape.head_flops(1)
    extra: dict[str, Any] = {"kept_per_stage": kept, "schedule": [list(pair) for pair in schedule]}
    if opts.fill.active:
        extra["filled_token_layers"] = filled_token_layers
    if _RECORD_KEPT.get():
        extra["kept_positions"] = kept_positions
    stats = ComputeStats(token_layers=token_layers, total_token_layers=n * ad.num_layers, flops=flops, extra=extra)
    revives = bool(schedule) and opts.revival.kind != "none"
    output = PrefillOutput(
        logits=logits, cache=state.cache.ragged_view(ad.config), stats=stats, next_position=n, exact_tokens=p,
        ragged=bool(schedule), decoder=RevivalDecoder(state) if revives else None,
    )
    return PrunedPrefill(output, state)


def _load_prefix(state: LazyState, prefix: DynamicCache | None) -> int:
    """Put a cached prefix's K/V into every layer of ``state.cache``; return its length ``P``."""
    p = 0 if prefix is None else int(prefix.get_seq_length())
    if p:
        for layer in range(len(state.cache.layers)):
            keys, values = layer_kv(prefix, layer)
            state.cache.stage(layer, torch.arange(p, device=keys.device))
            state.cache.update(keys, values, layer)
    return p


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


class RevivalDecoder:
    """LazyLLM's own decode step (a :class:`~fastprefill.methods.base.Decoder`): reselection and
    revival from the Aux Cache (``all``, ``budget:R``), or every deferred token-layer computed at
    the first step (``catch-up``); see :func:`decode_step`.

    Args:
        state: the pruned prefill's state (its ``select`` is the policy's choice of tokens).
    """

    def __init__(self, state: LazyState) -> None:
        self.state = state

    def step(self, token_id: int) -> torch.Tensor:
        """Feed one token; ``(V,)`` float32 logits for the next one."""
        return decode_step(self.state, token_id)

    def stats(self) -> dict[str, Any]:
        """Revivals per decode step and their totals (:meth:`LazyState.revival_stats`)."""
        return self.state.revival_stats()


def decode_step(state: LazyState, token_id: int) -> torch.Tensor:
    """One decode step under the state's revival policy (see module doc).

    - ``all`` / ``budget:R`` with a schedule: stage-by-stage reselection from the new token's
      attention and revival from the Aux Cache (:func:`_reselecting_step`).
    - ``none``, ``catch-up`` or an empty schedule: plain decoding over the cache, the new
      token attending every key present at every layer; ``catch-up`` first completes every
      deferred token-layer (:func:`catch_up`) at the first step.

    Returns:
        ``(V,)`` float32 logits for the next token.
    """
    if state.schedule and state.options.revival.reselects:
        return _reselecting_step(state, token_id)
    return _plain_step(state, token_id)


def _record_step(state: LazyState, tokens: int, token_stages: int, token_layers: int) -> None:
    state.next_pos += 1
    state.revived_tokens_per_step.append(tokens)
    state.revived_token_stages_per_step.append(token_stages)
    state.revived_token_layers_per_step.append(token_layers)


def _plain_step(state: LazyState, token_id: int) -> torch.Tensor:
    """The new token through every layer, attending every key there (``mask=None`` with a single
    query is exact); with ``catch-up`` and tokens still deferred, :func:`catch_up` first."""
    ad = state.adapter
    revived = (0, 0, 0)
    if state.options.revival.kind == "catch-up" and len(state.aux):
        revived = catch_up(state)
    rows = torch.tensor([state.next_pos], device=ad.device)
    with torch.inference_mode(), ad.attention_scope():
        hidden = ad.embed(torch.tensor([[token_id]], device=ad.device))  # (1, 1, D)
        rot = ad.rotary(hidden, rows[None])
        for layer in range(ad.num_layers):
            hidden = run_rows(state, layer, hidden, rows, rot, None)
        logits = ad.head(hidden[:, -1:])[0, -1]
    _record_step(state, *revived)
    return logits


def catch_up(state: LazyState) -> tuple[int, int, int]:
    """Compute every deferred (token, layer) pair, leaving KV for every prompt token at every layer.

    For each stage in order (from the first resume layer ``p_1 + 1`` up), one batched pass runs
    the deferred rows through the stage's layers; the tokens deferred at the stage's start join
    from the Aux Cache, so the rows grow stage by stage. Each row attends, by original position,
    the KV present at the layer (the kept tokens' and the rows' own). Called before the first
    generated token is fed (no generated KV exists yet); the Aux Cache ends empty and each pair
    is computed once (counted).

    Returns:
        ``(tokens, token_stages, token_layers)`` computed: distinct deferred tokens, (token,
        stage) pairs and (token, layer) pairs.
    """
    ad, cache, aux = state.adapter, state.cache, state.aux
    step = len(state.revived_tokens_per_step)
    resume = sorted({layer + 1 for layer, _ in state.schedule})
    rows = torch.empty(0, dtype=torch.long, device=ad.device)  # (R,) original positions, any order
    hidden: torch.Tensor | None = None  # (1, R, D)
    rot: tuple[torch.Tensor, torch.Tensor] | None = None
    tokens = token_stages = token_layers = 0
    with torch.inference_mode(), ad.attention_scope():
        for layer in range(resume[0], ad.num_layers):
            if layer in resume:
                join = torch.tensor(aux.positions(layer), dtype=torch.long, device=ad.device)
                if join.numel():
                    back = aux.take(layer, join).to(ad.dtype)
                    state.revivals.extend((step, p, layer) for p in join.tolist())
                    tokens += int(join.numel())
                    rows = torch.cat([rows, join])
                    hidden = back if hidden is None else torch.cat([hidden, back], dim=1)
                    rot = ad.rotary(hidden, rows[None])
                token_stages += int(rows.numel())
            if hidden is None:
                continue
            mask = causal_mask(rows, cache.key_positions_after(layer, rows))
            hidden = run_rows(state, layer, hidden, rows, rot, mask)
            token_layers += int(rows.numel())
    if len(aux):
        raise RuntimeError(f"pruning invariant broken: {len(aux)} Aux Cache entries outside the schedule's resume layers")
    return tokens, token_stages, token_layers


def _reselecting_step(state: LazyState, token_id: int) -> torch.Tensor:
    """Stage-by-stage reselection and Aux Cache revival (``all`` / ``budget:R``).

    At each pruning layer ``select`` receives the new token's attention row over the layer's
    keys (with ``accumulate``: summed over the stage's layers), pooled among the current
    selected set, ``-inf`` outside it, ``+inf`` at the new token and at the protected tokens,
    and ``k = max(keep_count(keep, t + 1), protected)`` (capped by the candidates). Chosen
    tokens without KV at the next layer resume from the Aux Cache there; under ``budget:R``
    only the ``R`` highest-scoring of them do and the others leave this step's set.
    """
    ad, cache, aux, opts = state.adapter, state.cache, state.aux, state.options
    t = state.next_pos
    step = len(state.revived_tokens_per_step)
    prune = dict(state.schedule)
    scored = _scored_layers(state.schedule, opts)
    budget = opts.revival.budget
    device = ad.device
    new_pos = torch.tensor([t], device=device)
    rows = new_pos  # (R,) original positions of the rows being computed, the new token last
    selected: torch.Tensor | None = None  # (t+1,) bool over positions; None = every token (stage 0)
    revived: set[int] = set()  # distinct earlier positions computed at this step
    token_stages = token_layers = 0
    chosen_per_stage: list[torch.Tensor] = []
    acc: torch.Tensor | None = None  # (t+1,) scores by position summed over the stage (accumulate)
    with torch.inference_mode(), ad.attention_scope():
        hidden = ad.embed(torch.tensor([[token_id]], device=device))  # (1, R, D)
        rot = ad.rotary(hidden, rows[None])
        for layer in range(ad.num_layers):
            mask = None
            if selected is not None:
                keys = cache.key_positions_after(layer, rows)  # (N,)
                mask = causal_mask(rows, keys) & selected[keys][None, None, None, :]
            scores: dict[int, torch.Tensor] | None = {} if layer in scored else None
            hidden = run_rows(state, layer, hidden, rows, rot, mask, scores)
            token_layers += int(rows.numel()) - 1
            if scores is None:
                continue
            keys = cache.positions(layer)  # (N,), the new token's key last
            row = scores[layer][0]  # (N,) the new token's attention over this layer's keys
            if opts.accumulate:
                dense = torch.zeros(t + 1, dtype=row.dtype, device=device).index_copy_(0, keys, row)
                acc = dense if acc is None else acc + dense
                if layer not in prune:
                    continue
                row, acc = acc[keys], None
            if selected is None:
                candidates = torch.ones(keys.numel(), dtype=torch.bool, device=device)
            else:
                candidates = selected[keys]
            forced = candidates & opts.protected(keys, state.prompt_len, decoding=True)
            forced[-1] = True
            row = _cut_scores(row, keys, candidates, forced, opts.pool_kernel)
            k = min(max(keep_count(prune[layer], t + 1), int(forced.sum())), int(candidates.sum()))
            picked = state.select(row, k)
            chosen = keys[picked]
            # revived rows carried so far rest in the Aux Cache at the next layer; take back the
            # selected tokens that have no KV there (their Aux entry is exactly at layer + 1):
            # the carried ones go on into the next stage, the others resume here
            if rows.numel() > 1:
                aux.put(layer + 1, rows[:-1], hidden[:, :-1])
            absent = (chosen != t) & ~cache.has(layer + 1, chosen)
            if budget is not None and int(absent.sum()) > budget:
                chosen, absent = _within_budget(chosen, absent, row[picked], budget)
            missing = chosen[absent]
            chosen_per_stage.append(chosen)
            selected = torch.zeros(t + 1, dtype=torch.bool, device=device)
            selected[chosen] = True
            if missing.numel():
                try:
                    back = aux.take(layer + 1, missing).to(hidden.dtype)
                except KeyError as exc:
                    raise RuntimeError(f"pruning invariant broken: position {exc} has no Aux Cache entry "
                                       f"at layer {layer + 1}") from None
                token_stages += int(missing.numel())
                resumed = [p for p in missing.tolist() if p not in revived]
                revived.update(resumed)
                state.revivals.extend((step, p, layer + 1) for p in resumed)
            else:
                back = hidden[:, :0]
            rows = torch.cat([missing, new_pos])
            hidden = torch.cat([back, hidden[:, -1:]], dim=1)
            rot = ad.rotary(hidden, rows[None])
        logits = ad.head(hidden[:, -1:])[0, -1]
    _record_step(state, len(revived), token_stages, token_layers)
    if chosen_per_stage:
        state.selected = chosen_per_stage
    return logits


def _within_budget(
    chosen: torch.Tensor, absent: torch.Tensor, scores: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep only the ``budget`` highest-scoring ``absent`` tokens of ``chosen`` (all ``(K,)``);
    the other absent ones leave the set. Returns the filtered ``(chosen, absent)``."""
    idx = absent.nonzero().flatten()  # (M,)
    stay = torch.ones_like(absent)
    stay[idx] = False
    stay[idx[scores[idx].topk(budget).indices]] = True
    return chosen[stay], absent[stay]
