"""The pruning mechanism: run decoder layers on gathered rows at their positions, defer, revive.

Every method built here (LazyLLM, random drop, static pruning) is a *policy*: it decides which
tokens to keep; the functions below do the rest. Rows are *gathered* (``index_select``) so a
pruned token is really not computed; each row carries its position into the rotary embedding
and the causal mask. Every layer call is counted per (layer, position) by the state's
:class:`~fastprefill.methods.pruning.state.ComputeCounter`.

- :func:`progressive_prefill`: all tokens enter layer 0; at each pruning layer of a schedule the
  policy's ``select`` picks from the last prompt token's attention row which tokens go on; the
  others wait in the Aux Cache at the next layer.
- :func:`probe_scores` and :func:`subset_prefill`: the static shape, one selection (or none) and
  then every layer on the kept rows only, at their original positions or renumbered ``0..K-1``.
- :func:`decode_step`: one generated token; with a schedule, stage-by-stage reselection and
  revival from the Aux Cache (each (token, layer) computed at most once); without, plain
  decoding over the cache.

A *stage* is the run of layers between two pruning layers (stage 0 = layers ``0..p_1``, where
every token is present). At a decode step, stage ``s`` attends over the **selected set** ``S_s``
only, not over all KV present at its layers: ``S_s`` is chosen from the tokens attended at
``p_s``, which are ``S_{s-1}``, so every token in ``S_s`` has KV through layer ``p_s`` and its
Aux Cache entry, if any, is exactly at ``b_s = p_s + 1``. With "all present KV" a selected
token could have stopped at an earlier stage and would need its missing middle layers
recomputed or skipped.

Keep count: ``k = ceil(keep * n)`` with ``n`` the sequence length (prompt at prefill; prompt +
tokens so far, the new one included, at decode), capped by the tokens present.
"""

from __future__ import annotations

import torch

from fastprefill.cache import PositionKVCache
from fastprefill.methods.base import ComputeStats, PrefillOutput
from fastprefill.methods.pruning.schedule import Schedule, keep_count
from fastprefill.methods.pruning.select import SelectFn
from fastprefill.methods.pruning.state import LazyState, new_state
from fastprefill.models.adapters import DecoderAdapter, ScoreFn, causal_mask, last_query_attention
from fastprefill.models.shape import ModelShape

__all__ = ["decode_step", "probe_scores", "progressive_prefill", "run_rows", "subset_prefill"]


def run_rows(
    state: LazyState, layer: int, hidden: torch.Tensor, positions: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
    scores: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run ``layer`` on rows ``hidden`` ``(1, R, D)`` at ``positions`` ``(R,)``, writing their KV; count them."""
    state.cache.stage(layer, positions)
    out = state.adapter.layer(layer, hidden, positions[None], state.cache, mask=mask, rotary=rotary, scores=scores)
    state.counter.add(layer, positions)
    return out


def progressive_prefill(
    adapter: DecoderAdapter, input_ids: torch.Tensor, schedule: Schedule, select: SelectFn
) -> PrefillOutput:
    """Prefill with progressive pruning at the layers of ``schedule`` (validated against the model).

    At pruning layer ``l`` with keep fraction ``f``, ``select`` receives the last prompt token's
    attention row over the rows present (the last row ``+inf``) and ``keep_count(f, T)``; the
    rows it drops go to the Aux Cache under ``l + 1``.

    Args:
        input_ids: ``(1, T)`` with ``T >= 1``.

    Returns:
        ``(V,)`` logits, a :class:`LazyState` and the stats (``kept_per_stage`` in ``extra``).
    """
    ad = adapter
    n = int(input_ids.shape[1])
    prune = dict(schedule)
    shape: ModelShape = ad.shape
    state = new_state(ad, schedule, n)
    rows = torch.arange(n, device=ad.device)  # (R,) positions computed at the current layer
    token_layers, flops = 0, 0.0
    kept: list[int] = []
    with torch.inference_mode(), ad.attention_scope():
        hidden = ad.embed(input_ids)  # (1, R, D)
        cos, sin = ad.rotary(hidden, rows[None])  # (1, R, d) each
        for layer in range(ad.num_layers):
            r = int(rows.numel())
            scores: dict[int, torch.Tensor] | None = {} if layer in prune else None
            # each layer's cache is empty and rows ascend: mask=None (causal kernel) is exact
            hidden = run_rows(state, layer, hidden, rows, (cos, sin), None, scores)
            token_layers += r
            flops += shape.layer_flops(r)
            if scores is None:
                continue
            flops += shape.scoring_flops(r)
            k = keep_count(prune[layer], n)
            if k < r:
                row = scores[layer][0].clone()
                row[-1] = float("inf")
                keep = select(row, k)
                drop = torch.ones(r, dtype=torch.bool, device=rows.device)
                drop[keep] = False
                state.aux.put(layer + 1, rows[drop], hidden[:, drop])
                hidden = hidden.index_select(1, keep)
                cos, sin = cos.index_select(1, keep), sin.index_select(1, keep)
                rows = rows[keep]
            kept.append(int(rows.numel()))
            state.selected.append(rows)
        logits = ad.head(hidden[:, -1:])[0, -1]
    flops += shape.head_flops(1)
    stats = ComputeStats(
        token_layers=token_layers,
        total_token_layers=n * ad.num_layers,
        flops=flops,
        extra={"kept_per_stage": kept, "schedule": [list(p) for p in schedule]},
    )
    return PrefillOutput(logits=logits, state=state, stats=stats)


def probe_scores(
    adapter: DecoderAdapter, input_ids: torch.Tensor, layer: int, scorer: ScoreFn = last_query_attention
) -> torch.Tensor:
    """The last prompt token's score row ``(T,)`` at ``layer``, from layers ``0..layer`` on the whole prompt.

    The layers run into a throwaway cache: this is a static policy's selection pass, paid in
    its TTFT and charged by :func:`subset_prefill` (``selection_layer``). ``scorer`` is the
    policy's score (attention probabilities averaged over heads by default).
    """
    ad = adapter
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
) -> PrefillOutput:
    """Run every layer on the prompt rows ``keep`` ``(K,)`` (ascending original positions).

    The layer caches start empty and the rows are sorted, so causal-by-position equals causal by
    row index and ``mask=None`` (SDPA's causal kernel) is exact.

    Args:
        selection_layer: if the policy chose ``keep`` by :func:`probe_scores` at this layer, the
            probe's ``T * (selection_layer + 1)`` token-layers, FLOPs and scoring are charged too.
        renumber: run the kept rows at positions ``0..K-1`` (as if the prompt were only them)
            instead of their original positions; decoding then continues at ``K``.

    Returns:
        ``(V,)`` logits of the last kept row, a :class:`LazyState` with an empty schedule (plain
        decoding from the position after the kept prompt) whose ``selected`` holds ``keep``, and
        the stats.
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
    token_layers, extra = k * ad.num_layers, {"kept": k}
    if selection_layer is not None:
        selected = n * (selection_layer + 1)
        flops += (selection_layer + 1) * shape.layer_flops(n) + shape.scoring_flops(n)
        token_layers += selected
        extra["selection_token_layers"] = selected
    stats = ComputeStats(token_layers=token_layers, total_token_layers=n * ad.num_layers, flops=flops, extra=extra)
    return PrefillOutput(logits=logits, state=state, stats=stats)


def decode_step(state: LazyState, token_id: int, select: SelectFn) -> torch.Tensor:
    """One decode step with stage-by-stage reselection and Aux Cache revival (see module doc).

    At each pruning layer ``select`` receives the new token's attention row over the layer's
    keys (``-inf`` outside the current selected set, the new token ``+inf``) and the keep count.
    With an empty schedule this is plain decoding over the cache: the new token attends every
    key of every layer (``mask=None`` with a single query is exact) and ``select`` is not called.

    Returns:
        ``(V,)`` float32 logits for the next token.
    """
    ad, cache, aux = state.adapter, state.cache, state.aux
    t = state.next_pos
    step = len(state.revived_tokens_per_step)
    prune = dict(state.schedule)
    device = ad.device
    new_pos = torch.tensor([t], device=device)
    rows = new_pos  # (R,) original positions of the rows being computed, the new token last
    selected: torch.Tensor | None = None  # (t+1,) bool over positions; None = every token (stage 0)
    revived: set[int] = set()  # distinct earlier positions computed at this step
    token_stages = token_layers = 0
    chosen_per_stage: list[torch.Tensor] = []
    with torch.inference_mode(), ad.attention_scope():
        hidden = ad.embed(torch.tensor([[token_id]], device=device))  # (1, R, D)
        rot = ad.rotary(hidden, rows[None])
        for layer in range(ad.num_layers):
            mask = None
            if selected is not None:
                keys = cache.key_positions_after(layer, rows)  # (N,)
                mask = causal_mask(rows, keys) & selected[keys][None, None, None, :]
            scores: dict[int, torch.Tensor] | None = {} if layer in prune else None
            hidden = run_rows(state, layer, hidden, rows, rot, mask, scores)
            token_layers += int(rows.numel()) - 1
            if scores is None:
                continue
            keys = cache.positions(layer)  # (N,), the new token's key last
            row = scores[layer][0].clone()  # (N,) the new token's attention over this layer's keys
            if selected is not None:
                row = row.masked_fill(~selected[keys], float("-inf"))
            row[-1] = float("inf")
            n_allowed = int(torch.isfinite(row).sum()) + 1
            k = min(keep_count(prune[layer], t + 1), n_allowed)
            chosen = keys[select(row, k)]
            chosen_per_stage.append(chosen)
            selected = torch.zeros(t + 1, dtype=torch.bool, device=device)
            selected[chosen] = True
            # revived rows carried so far rest in the Aux Cache at the next layer; take back the
            # selected tokens that have no KV there (their Aux entry is exactly at layer + 1):
            # the carried ones go on into the next stage, the others resume here
            if rows.numel() > 1:
                aux.put(layer + 1, rows[:-1], hidden[:, :-1])
            cand = chosen[chosen != t]
            missing = cand[~cache.has(layer + 1, cand)]
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
    state.next_pos = t + 1
    state.revived_tokens_per_step.append(len(revived))
    state.revived_token_stages_per_step.append(token_stages)
    state.revived_token_layers_per_step.append(token_layers)
    if chosen_per_stage:
        state.selected = chosen_per_stage
    return logits
