"""Decoding after a pruned prefill: LazyLLM's revival of the tokens the prefill deferred.

The prefill side (:mod:`~fastprefill.methods.pruning.prefill`) leaves a
:class:`~fastprefill.methods.pruning.state.LazyState`: per-layer KV by position, the Aux Cache of
deferred tokens and the compute counter. :class:`RevivalDecoder` is the method's own decode step
over it (a :class:`~fastprefill.methods.base.Decoder`); :func:`decode_step` feeds one generated
token under the revival policy of the state's options:

- ``all``, or at most ``R`` revived tokens per stage with ``budget:R``: stage-by-stage
  reselection from the new token's attention and revival from the Aux Cache
  (:func:`_reselecting_step`);
- ``none``: plain decoding over the cache, the new token attending every key present;
- ``catch-up``: every deferred token-layer computed at the first step (:func:`catch_up`), plain
  decoding after.

Without a schedule decoding is plain. Each (token, layer) is computed at most once under every
policy.

A *stage* is the run of layers between two pruning layers (stage 0 = layers ``0..p_1``, where
every token is present). At a decode step, stage ``s`` attends over the **selected set** ``S_s``
only, not over all KV present at its layers: ``S_s`` is chosen from the tokens attended at
``p_s``, which are ``S_{s-1}``, so every token in ``S_s`` has KV through layer ``p_s`` and its
Aux Cache entry, if any, is exactly at ``b_s = p_s + 1``. With "all present KV" a selected
token could have stopped at an earlier stage and would need its missing middle layers
recomputed or skipped.

Keep count at a decode step: ``k = ceil(keep * n)`` with ``n`` the prompt plus the tokens so far
(the new one included), raised to the protected tokens present (the new token, sinks, recent
prompt tokens, generated ones under ``decode_protect``) and capped by the candidates.
"""

from __future__ import annotations

from typing import Any

import torch

from fastprefill.methods.pruning.schedule import keep_count, scored_layers
from fastprefill.methods.pruning.select import cut_scores
from fastprefill.methods.pruning.state import LazyState, run_rows
from fastprefill.models.attention import causal_mask

__all__ = ["RevivalDecoder", "catch_up", "decode_step"]


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
    """One decode step under the state's revival policy (see the module docstring).

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

    At each pruning layer the new token's attention row over the layer's keys (with
    ``accumulate``: summed over the stage's layers) chooses the stage's selected set
    (:func:`_reselect`). Chosen tokens without KV at the next layer resume from the Aux Cache
    there (:func:`_revive`); the revived rows carried so far rest in the Aux Cache at the next
    layer, and the new token goes on with the resumed ones.
    """
    ad, cache, aux, opts = state.adapter, state.cache, state.aux, state.options
    t = state.next_pos
    step = len(state.revived_tokens_per_step)
    prune = dict(state.schedule)
    scored = scored_layers(state.schedule, opts.accumulate)
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
            chosen, absent = _reselect(state, layer, keys, row, selected, t)
            # the revived rows carried so far rest in the Aux Cache at the next layer (their
            # entry is exactly at layer + 1): the chosen ones go on below, the others wait there
            if rows.numel() > 1:
                aux.put(layer + 1, rows[:-1], hidden[:, :-1])
            missing = chosen[absent]
            chosen_per_stage.append(chosen)
            selected = torch.zeros(t + 1, dtype=torch.bool, device=device)
            selected[chosen] = True
            back = _revive(state, layer + 1, missing, hidden.dtype, step, revived) if missing.numel() \
                else hidden[:, :0]
            token_stages += int(missing.numel())
            rows = torch.cat([missing, new_pos])
            hidden = torch.cat([back, hidden[:, -1:]], dim=1)
            rot = ad.rotary(hidden, rows[None])
        logits = ad.head(hidden[:, -1:])[0, -1]
    _record_step(state, len(revived), token_stages, token_layers)
    if chosen_per_stage:
        state.selected = chosen_per_stage
    return logits


def _reselect(
    state: LazyState, layer: int, keys: torch.Tensor, row: torch.Tensor, selected: torch.Tensor | None, t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected set of the stage after pruning layer ``layer`` at the step of the token at ``t``.

    ``select`` receives ``row`` ``(N,)`` (over the layer's keys ``(N,)``) pooled among the current
    selected set (``selected``, ``(t+1,)`` bool; ``None``: every token), ``-inf`` outside it and
    ``+inf`` at the new token and at the protected tokens, and
    ``k = max(keep_count(keep, t + 1), protected)`` (capped by the candidates).

    Returns:
        ``(chosen, absent)`` ``(K,)``: the chosen positions, and which of them have no KV at
        ``layer + 1`` (they resume from the Aux Cache); under ``budget:R`` only the ``R``
        highest-scoring absent ones stay chosen.
    """
    opts = state.options
    if selected is None:
        candidates = torch.ones(keys.numel(), dtype=torch.bool, device=state.adapter.device)
    else:
        candidates = selected[keys]
    forced = candidates & opts.protected(keys, state.prompt_len, decoding=True)
    forced[-1] = True
    row = cut_scores(row, keys, candidates, forced, opts.pool_kernel)
    k = min(max(keep_count(dict(state.schedule)[layer], t + 1), int(forced.sum())), int(candidates.sum()))
    picked = state.select(row, k)
    chosen = keys[picked]
    absent = (chosen != t) & ~state.cache.has(layer + 1, chosen)
    budget = opts.revival.budget
    if budget is not None and int(absent.sum()) > budget:
        chosen, absent = _within_budget(chosen, absent, row[picked], budget)
    return chosen, absent


def _revive(
    state: LazyState, layer: int, missing: torch.Tensor, dtype: torch.dtype, step: int, revived: set[int]
) -> torch.Tensor:
    """Take the hidden states ``(1, M, D)`` of ``missing`` ``(M,)`` from the Aux Cache at ``layer``;
    record the positions not yet revived at this ``step`` (added to ``revived``)."""
    try:
        back = state.aux.take(layer, missing).to(dtype)
    except KeyError as exc:
        raise RuntimeError(f"pruning invariant broken: position {exc} has no Aux Cache entry "
                           f"at layer {layer}") from None
    resumed = [p for p in missing.tolist() if p not in revived]
    revived.update(resumed)
    state.revivals.extend((step, p, layer) for p in resumed)
    return back


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
