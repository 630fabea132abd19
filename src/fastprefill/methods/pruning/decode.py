"""Decoding after a pruned prefill: LazyLLM's revival of the tokens the prefill deferred.

The prefill side (:mod:`~fastprefill.methods.pruning.prefill`) leaves a
:class:`~fastprefill.methods.pruning.state.LazyState`: per-layer KV by position, the Aux Cache of
deferred tokens and the compute counter. :class:`RevivalDecoder` is the method's own decode step
over it (a :class:`~fastprefill.methods.base.Decoder`); :func:`decode_steps` feeds one generated
token under the revival policy of the state's options, a layer at a time, so that a decode batch
runs it with other streams' (:mod:`~fastprefill.methods.layer_steps`; :func:`decode_step` runs
it alone):

- ``all``, or at most ``R`` revived tokens per stage with ``budget:R``: stage-by-stage
  reselection from the new token's attention and revival from the Aux Cache
  (:func:`_reselecting_steps`);
- ``none``: plain decoding over the cache, the new token attending every key present;
- ``catch-up``: every deferred token-layer computed at the first step, in its layer calls
  (:class:`_CatchUp`), plain decoding after.

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

from fastprefill.methods.layer_steps import LayerSteps, Rows, run_layers
from fastprefill.methods.pruning.schedule import keep_count, scored_layers
from fastprefill.methods.pruning.select import cut_scores
from fastprefill.methods.pruning.state import LazyState, rows_for
from fastprefill.models.attention import causal_mask

__all__ = ["RevivalDecoder", "decode_step", "decode_steps"]


class RevivalDecoder:
    """LazyLLM's own decode step (a :class:`~fastprefill.methods.base.Decoder`): reselection and
    revival from the Aux Cache (``all``, ``budget:R``), or every deferred token-layer computed at
    the first step (``catch-up``); see :func:`decode_step`. A
    :class:`~fastprefill.methods.layer_steps.StepsDecoder` too: a decode batch runs its
    :meth:`layer_steps` with other streams', and :meth:`step` runs them alone.

    Args:
        state: the pruned prefill's state (its ``select`` is the policy's choice of tokens).
    """

    def __init__(self, state: LazyState) -> None:
        self.state = state

    def step(self, token_id: int) -> torch.Tensor:
        """Feed one token; ``(V,)`` float32 logits for the next one."""
        return decode_step(self.state, token_id)

    def layer_steps(self, token_id: int) -> LayerSteps:
        """One step feeding ``token_id``, a layer at a time (:func:`decode_steps`)."""
        return decode_steps(self.state, token_id)

    def stats(self) -> dict[str, Any]:
        """Revivals per decode step and their totals (:meth:`LazyState.revival_stats`)."""
        return self.state.revival_stats()


def decode_step(state: LazyState, token_id: int) -> torch.Tensor:
    """One decode step under the state's revival policy, alone (:func:`decode_steps` run by
    :func:`~fastprefill.methods.layer_steps.run_layers`).

    Returns:
        ``(V,)`` float32 logits for the next token.
    """
    return run_layers(state.adapter, [decode_steps(state, token_id)])[0]


def decode_steps(state: LazyState, token_id: int) -> LayerSteps:
    """One decode step under the state's revival policy, a layer at a time (see the module docstring).

    - ``all`` / ``budget:R`` with a schedule: stage-by-stage reselection from the new token's
      attention and revival from the Aux Cache (:func:`_reselecting_steps`).
    - ``none``, ``catch-up`` or an empty schedule: plain decoding over the cache, the new
      token attending every key present at every layer; ``catch-up`` also completes every
      deferred token-layer (:class:`_CatchUp`) at the first step.

    Returns:
        The step's :data:`~fastprefill.methods.layer_steps.LayerSteps` (its value: the token's
        ``(1, 1, D)`` hidden state after the last layer).
    """
    if state.schedule and state.options.revival.reselects:
        return _reselecting_steps(state, token_id)
    return _plain_steps(state, token_id)


def _record_step(state: LazyState, tokens: int, token_stages: int, token_layers: int) -> None:
    state.next_pos += 1
    state.revived_tokens_per_step.append(tokens)
    state.revived_token_stages_per_step.append(token_stages)
    state.revived_token_layers_per_step.append(token_layers)


def _plain_steps(state: LazyState, token_id: int) -> LayerSteps:
    """The new token through every layer, attending every key there (``mask=None`` with a single
    query is exact); with ``catch-up`` and tokens still deferred, the deferred rows in the same
    layer calls, before it (:class:`_CatchUp`)."""
    ad = state.adapter
    back = _CatchUp(state) if state.options.revival.kind == "catch-up" and len(state.aux) else None
    rows = torch.tensor([state.next_pos], device=ad.device)
    hidden = ad.embed(torch.tensor([[token_id]], device=ad.device))  # (1, 1, D)
    rot = ad.rotary(hidden, rows[None])
    for layer in range(ad.num_layers):
        deferred = back.rows_at(layer) if back is not None else None
        outs = yield [*([deferred] if deferred is not None else []), rows_for(state, layer, hidden, rows, rot, None)]
        if back is not None and deferred is not None:
            back.hidden = outs[0]
        hidden = outs[-1]
    _record_step(state, *(back.finish() if back is not None else (0, 0, 0)))
    return hidden


class _CatchUp:
    """``catch-up``: every deferred (token, layer) pair, computed beside the first step's token,
    leaving KV for every prompt token at every layer.

    From the first resume layer ``p_1 + 1`` up, the deferred rows run through every layer in the
    step's layer calls, before the new token (their K/V is written first, as a whole pass before
    the token would); the tokens deferred at a stage's start join from the Aux Cache there, so the
    rows grow stage by stage. Each row attends, by original position, the KV present at the layer
    (the kept tokens' and the rows' own). The Aux Cache ends empty and each pair is computed once
    (counted: :meth:`finish`).
    """

    def __init__(self, state: LazyState) -> None:
        self.state = state
        self.resume = sorted({layer + 1 for layer, _ in state.schedule})
        self.step = len(state.revived_tokens_per_step)
        self.rows = torch.empty(0, dtype=torch.long, device=state.adapter.device)  # (R,) positions, any order
        self.hidden: torch.Tensor | None = None  # (1, R, D)
        self.rot: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tokens = self.token_stages = self.token_layers = 0

    def rows_at(self, layer: int) -> Rows | None:
        """The deferred rows to compute at ``layer`` (the ones resuming there join), or None."""
        state, ad = self.state, self.state.adapter
        if layer in self.resume:
            join = torch.tensor(state.aux.positions(layer), dtype=torch.long, device=ad.device)
            if join.numel():
                back = state.aux.take(layer, join).to(ad.dtype)
                state.revivals.extend((self.step, p, layer) for p in join.tolist())
                self.tokens += int(join.numel())
                self.rows = torch.cat([self.rows, join])
                self.hidden = back if self.hidden is None else torch.cat([self.hidden, back], dim=1)
                self.rot = ad.rotary(self.hidden, self.rows[None])
            self.token_stages += int(self.rows.numel())
        if self.hidden is None or self.rot is None:
            return None
        self.token_layers += int(self.rows.numel())
        mask = causal_mask(self.rows, state.cache.key_positions_after(layer, self.rows))
        return rows_for(state, layer, self.hidden, self.rows, self.rot, mask)

    def finish(self) -> tuple[int, int, int]:
        """``(tokens, token_stages, token_layers)`` computed: distinct deferred tokens, (token,
        stage) pairs and (token, layer) pairs.

        Raises:
            RuntimeError: Aux Cache entries left outside the schedule's resume layers.
        """
        if len(self.state.aux):
            raise RuntimeError(f"pruning invariant broken: {len(self.state.aux)} Aux Cache entries outside "
                               "the schedule's resume layers")
        return self.tokens, self.token_stages, self.token_layers


def _reselecting_steps(state: LazyState, token_id: int) -> LayerSteps:
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
    hidden = ad.embed(torch.tensor([[token_id]], device=device))  # (1, R, D)
    rot = ad.rotary(hidden, rows[None])
    for layer in range(ad.num_layers):
        mask = None
        if selected is not None:
            keys = cache.key_positions_after(layer, rows)  # (N,)
            mask = causal_mask(rows, keys) & selected[keys][None, None, None, :]
        scores: dict[int, torch.Tensor] | None = {} if layer in scored else None
        (hidden,) = yield [rows_for(state, layer, hidden, rows, rot, mask, scores)]
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
    _record_step(state, len(revived), token_stages, token_layers)
    if chosen_per_stage:
        state.selected = chosen_per_stage
    return hidden[:, -1:]


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
