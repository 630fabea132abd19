"""LazyLLM: dynamic token pruning for a faster first token (arXiv 2407.14057).

Prefill runs the model layer by layer. At each *pruning layer* ``l`` of the schedule the last
prompt token's attention row (averaged over every query head, GQA included; captured beside the
fused SDPA kernel by :class:`~fastprefill.models.adapters.DecoderAdapter`) scores the tokens
present at ``l``; only the top ``ceil(keep * T)`` of them (the last token always among them) are
computed in layers ``> l``. The others are *deferred*, not dropped: their hidden state (the
output of layer ``l``) goes to the :class:`~fastprefill.cache.AuxCache` under layer ``l + 1``.

Kept rows are *gathered* (``index_select``) so pruned tokens are really not computed; every
token keeps its original position (rotary by original position, never renumbered).

Decoding (one step per generated token) redoes the selection from the new token's attention at
the pruning layers, stage by stage. A stage is the run of layers between two pruning layers
(stage 0 = layers ``0..p_1``, where every token is present). A token selected for stage ``s``
that has no KV at the stage's first layer ``b_s = p_s + 1`` is *revived*: its hidden state is
taken from the Aux Cache at ``b_s`` and it is computed from ``b_s`` upward together with the
new token, never from layer 0. Every (token, layer) pair is computed at most once over the whole
generation (counted by :class:`ComputeCounter`, always on).

*Choose* (decode attention set): at a decode step, stage ``s`` attends over the **selected set**
``S_s`` only (the paper's formulation), not over all KV present at the layer. Evidence: this is
what makes the revival invariant hold: ``S_s`` is chosen from the tokens attended at ``p_s``,
which are ``S_{s-1}``, so every token in ``S_s`` has KV through layer ``p_s`` and its Aux Cache
entry, if any, is exactly at ``b_s``; with "all present KV" a selected token could have stopped
at an earlier stage and would need its missing middle layers recomputed or skipped. The
keep-all schedule reproduces full prefill and decoding to float rounding either way (tested).

*Choose* (keep count): ``k = ceil(keep * n)`` with ``n`` the sequence length (prompt at
prefill; prompt + tokens so far, the new one included, at decode), capped by the tokens present.
Fractions are relative to the full length, so a schedule's fractions must not grow with depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from fastprefill.cache import AuxCache, PositionKVCache
from fastprefill.errors import ConfigError
from fastprefill.methods.base import ComputeStats, Method, PrefillOutput
from fastprefill.models.adapters import DecoderAdapter, causal_mask
from fastprefill.models.shape import ModelShape

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "ComputeCounter",
    "LazyLLM",
    "LazyState",
    "keep_count",
    "resolve_depth_schedule",
    "schedule_token_layers",
]

Schedule = tuple[tuple[int, float], ...]
DepthSchedule = tuple[tuple[float, float], ...]

#: Named schedules as ``(relative depth in [0, 1), keep fraction)``; resolved against the
#: model's layer count at prefill by :func:`resolve_depth_schedule` (layer ``floor(d * L)``).
#: ``"default"`` is an alias of :data:`DEFAULT_PRESET`, the schedule chosen by the dev-split
#: sweep (``benchmarks/lazyllm_bench.py sweep``; ``benchmarks/results/lazyllm_sweep_*``): on
#: Qwen2.5-Coder-0.5B at 2k tokens, the fewest token-layers (62% on 24 layers) among the
#: schedules whose mean dev F1 was within 1 point of full prefill (n = 24, a noisy criterion).
_NAMED: dict[str, DepthSchedule] = {
    "keep-all": (),
    "late-quarter": ((0.75, 0.25),),
    "gentle": ((0.5, 0.7), (0.75, 0.5)),
    "late-half": ((0.5, 0.5),),
    "balanced": ((0.25, 0.7), (0.5, 0.5), (0.75, 0.3)),
    "four-stage": ((0.2, 0.8), (0.4, 0.6), (0.6, 0.4), (0.8, 0.2)),
    "aggressive": ((0.15, 0.5), (0.4, 0.3), (0.7, 0.15)),
}
DEFAULT_PRESET = "four-stage"
PRESETS: dict[str, DepthSchedule] = {**_NAMED, "default": _NAMED[DEFAULT_PRESET]}


def keep_count(fraction: float, n: int) -> int:
    """Tokens kept by a keep fraction of a length-``n`` sequence: ``ceil(fraction * n)`` in ``[1, n]``."""
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


def _check_fractions(pairs: tuple[tuple[Any, float], ...], fieldname: str) -> None:
    prev = 1.0
    for where, frac in pairs:
        if not isinstance(frac, (int, float)) or not 0.0 < float(frac) <= 1.0:
            raise ConfigError(f"{fieldname}: keep fraction at {where} must lie in (0, 1], got {frac!r}")
        if frac > prev + 1e-12:
            raise ConfigError(
                f"{fieldname}: keep fractions must not grow with depth (they are fractions of the whole "
                f"prompt), got {frac} at {where} after {prev}"
            )
        prev = float(frac)


def _pairs(value: Any, fieldname: str, first: str) -> tuple[tuple[Any, Any], ...]:
    """``value`` as a tuple of pairs, or a :class:`ConfigError` naming ``fieldname``."""
    try:
        return tuple((a, b) for a, b in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{fieldname} must be a sequence of ({first}, keep_fraction) pairs, got {value!r}") from None


def check_schedule(schedule: Any) -> Schedule:
    """Validate the shape, order and fractions of an absolute schedule (layer counts come later)."""
    pairs = _pairs(schedule, "schedule", "layer")
    prev = -1
    for layer, _ in pairs:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigError(f"schedule: pruning layer must be an integer >= 0, got {layer!r}")
        if layer <= prev:
            raise ConfigError(
                f"schedule: pruning layers must be strictly increasing (sorted, no repeats), got {layer} after {prev}"
            )
        prev = layer
    _check_fractions(pairs, "schedule")
    return tuple((int(layer), float(frac)) for layer, frac in pairs)


def resolve_depth_schedule(depth_schedule: DepthSchedule, num_layers: int) -> Schedule:
    """Turn ``(relative depth, keep)`` pairs into ``(layer, keep)`` for an ``L``-layer model.

    Layer = ``min(floor(depth * L), L - 2)``. Pairs that land on the same layer (shallow models)
    merge into one, keeping the smaller fraction (the deeper pair's).
    """
    out: dict[int, float] = {}
    for depth, frac in depth_schedule:
        layer = min(math.floor(depth * num_layers), num_layers - 2)
        out[layer] = min(frac, out.get(layer, 1.0))
    return tuple(sorted(out.items()))


def check_layers(schedule: Schedule, num_layers: int, what: str = "schedule") -> None:
    """Raise :class:`ConfigError` unless every pruning layer lies in ``[0, L - 2]``.

    Pruning at the last layer ``L - 1`` would prune nothing (no layer follows it).
    """
    for layer, _ in schedule:
        if layer > num_layers - 2:
            raise ConfigError(
                f"{what}: pruning layer {layer} out of range for a {num_layers}-layer model; "
                f"allowed 0..{num_layers - 2} (a layer after which some layer still runs)"
            )


def schedule_token_layers(schedule: Schedule, num_layers: int, prompt_len: int) -> int:
    """Prompt (token, layer) pairs a prefill with ``schedule`` computes (exact, by :func:`keep_count`)."""
    total, n, prune = 0, prompt_len, dict(schedule)
    for layer in range(num_layers):
        total += n
        if layer in prune:
            n = min(n, keep_count(prune[layer], prompt_len))
    return total


class ComputeCounter:
    """How many times each (layer, position) was computed: an ``(L, capacity)`` int32 tensor.

    Always on: one ``index_add_`` per layer call, independent of the caches. The invariant of
    LazyLLM is ``counts.max() <= 1`` over the whole generation.
    """

    def __init__(self, num_layers: int, capacity: int, device: torch.device) -> None:
        self._counts = torch.zeros(num_layers, max(1, capacity), dtype=torch.int32, device=device)
        self._ones = torch.ones(max(1, capacity), dtype=torch.int32, device=device)
        self.length = 0

    def add(self, layer: int, positions: torch.Tensor) -> None:
        """Count one computation at ``layer`` for each of ``positions`` ``(R,)``."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._counts.shape[1]:
            grow = max(need, 2 * self._counts.shape[1])
            pad = torch.zeros(self._counts.shape[0], grow - self._counts.shape[1], dtype=torch.int32,
                              device=self._counts.device)
            self._counts = torch.cat([self._counts, pad], dim=1)
            self._ones = torch.ones(grow, dtype=torch.int32, device=self._counts.device)
        self.length = max(self.length, need)
        self._counts[layer].index_add_(0, positions, self._ones[: positions.numel()])

    @property
    def counts(self) -> torch.Tensor:
        """``(L, N)`` computations per layer and position, ``N`` = highest position seen + 1."""
        return self._counts[:, : self.length]


@dataclass
class LazyState:
    """Decode state shared by LazyLLM and the baselines.

    Attributes:
        adapter: the model's :class:`DecoderAdapter`.
        cache: per-layer KV over the positions computed at each layer.
        aux: LazyLLM's Aux Cache (empty for the baselines).
        schedule: resolved ``(layer, keep)`` pairs (empty: plain decoding over the cache).
        next_pos: original position of the next token fed to :meth:`Method.decode`.
        counter: computations per (layer, position), prefill and decode.
        revived_per_step: tokens revived at each decode step.
        revived_token_layers_per_step: (token, layer) pairs computed for revived tokens per step.
        revivals: ``(step, position, layer)`` for every revival (``layer`` = where it resumed).
        selected: positions selected for each stage at the last step (prefill, then decode).
    """

    adapter: DecoderAdapter
    cache: PositionKVCache
    aux: AuxCache
    schedule: Schedule
    next_pos: int
    counter: ComputeCounter
    revived_per_step: list[int] = field(default_factory=list)
    revived_token_layers_per_step: list[int] = field(default_factory=list)
    revivals: list[tuple[int, int, int]] = field(default_factory=list)
    selected: list[torch.Tensor] = field(default_factory=list)


def top_k_keep(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(k,)`` (ascending) of the ``k`` largest ``scores`` ``(N,)``; ``+inf`` entries always win."""
    return torch.topk(scores, k, sorted=False).indices.sort().values


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


def new_state(adapter: DecoderAdapter, schedule: Schedule, n_prompt: int) -> LazyState:
    """An empty :class:`LazyState` for an ``n_prompt``-token prompt."""
    return LazyState(
        adapter=adapter, cache=PositionKVCache(adapter.num_layers), aux=AuxCache(), schedule=schedule,
        next_pos=n_prompt, counter=ComputeCounter(adapter.num_layers, n_prompt + 64, adapter.device),
    )


def subset_prefill(
    adapter: DecoderAdapter, state: LazyState, input_ids: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Run every layer on the prompt rows ``keep`` ``(K,)`` (ascending original positions).

    The layer caches start empty and the rows are sorted, so causal-by-position equals causal by
    row index and ``mask=None`` (SDPA's causal kernel) is exact. Returns ``(V,)`` logits of the
    last kept row and the FLOPs spent.
    """
    shape = adapter.shape
    ids = input_ids.index_select(1, keep)
    hidden = adapter.embed(ids)
    rot = adapter.rotary(hidden, keep[None])
    for layer in range(adapter.num_layers):
        hidden = run_rows(state, layer, hidden, keep, rot, None)
    flops = shape.num_layers * shape.layer_flops(int(keep.numel()))
    return adapter.head(hidden[:, -1:])[0, -1], flops + shape.head_flops(1)


def decode_step(method: Method, state: LazyState, token_id: int) -> torch.Tensor:
    """One decode step with stage-by-stage reselection and Aux Cache revival (see module doc).

    With an empty schedule this is plain decoding over the cache: the new token attends every
    key of every layer (``mask=None`` with a single query is exact).
    """
    ad, cache, aux = state.adapter, state.cache, state.aux
    t = state.next_pos
    step = len(state.revived_per_step)
    prune = dict(state.schedule)
    device = ad.device
    new_pos = torch.tensor([t], device=device)
    rows = new_pos  # (R,) original positions of the rows being computed, the new token last
    hidden = ad.embed(torch.tensor([[token_id]], device=device))  # (1, R, D)
    rot = ad.rotary(hidden, rows[None])
    selected: torch.Tensor | None = None  # (t+1,) bool over positions; None = every token (stage 0)
    revived = revived_layers = 0
    chosen_per_stage: list[torch.Tensor] = []
    with torch.inference_mode(), ad.attention_scope():
        for layer in range(ad.num_layers):
            mask = None
            if selected is not None:
                keys = cache.key_positions_after(layer, rows)  # (N,)
                mask = causal_mask(rows, keys) & selected[keys][None, None, None, :]
            scores: dict[int, torch.Tensor] | None = {} if layer in prune else None
            hidden = run_rows(state, layer, hidden, rows, rot, mask, scores)
            revived_layers += int(rows.numel()) - 1
            if scores is None:
                continue
            keys = cache.positions(layer)  # (N,), the new token's key last
            row = scores[layer][0].clone()  # (N,) the new token's attention over this layer's keys
            if selected is not None:
                row = row.masked_fill(~selected[keys], float("-inf"))
            row[-1] = float("inf")
            n_allowed = int(torch.isfinite(row).sum()) + 1
            k = min(keep_count(prune[layer], t + 1), n_allowed)
            chosen = keys[method.select(row, k)]
            chosen_per_stage.append(chosen)
            selected = torch.zeros(t + 1, dtype=torch.bool, device=device)
            selected[chosen] = True
            # revived rows carried so far rest in the Aux Cache at the next layer; take back the
            # selected tokens that have no KV there (their Aux entry is exactly at layer + 1)
            if rows.numel() > 1:
                aux.put(layer + 1, rows[:-1], hidden[:, :-1])
            cand = chosen[chosen != t]
            missing = cand[~cache.has(layer + 1, cand)]
            if missing.numel():
                try:
                    back = aux.take(layer + 1, missing).to(hidden.dtype)
                except KeyError as exc:
                    raise RuntimeError(f"LazyLLM invariant broken: position {exc} has no Aux Cache entry "
                                       f"at layer {layer + 1}") from None
                revived += int(missing.numel())
                state.revivals.extend((step, p, layer + 1) for p in missing.tolist())
            else:
                back = hidden[:, :0]
            rows = torch.cat([missing, new_pos])
            hidden = torch.cat([back, hidden[:, -1:]], dim=1)
            rot = ad.rotary(hidden, rows[None])
        logits = ad.head(hidden[:, -1:])[0, -1]
    state.next_pos = t + 1
    state.revived_per_step.append(revived)
    state.revived_token_layers_per_step.append(revived_layers)
    if chosen_per_stage:
        state.selected = chosen_per_stage
    return logits


@dataclass
class LazyLLM(Method):
    """LazyLLM progressive token pruning with an Aux Cache (arXiv 2407.14057).

    Give either an absolute ``schedule`` or a relative ``depth_schedule`` (as the presets do);
    both empty means keep-all, which reproduces full prefill.

    Args:
        schedule: ``((layer, keep), ...)``: after pruning layer ``layer`` only
            ``ceil(keep * T)`` tokens (the last always among them) are computed in the layers
            above. Layers strictly increasing in ``[0, L - 2]`` (checked at prefill); ``keep``
            in ``(0, 1]`` and non-increasing with depth.
        depth_schedule: the same with relative depths in ``[0, 1)`` instead of layers, resolved
            by :func:`resolve_depth_schedule` for the model at hand.
        preset_name: informational label set by :meth:`preset`.

    Raises:
        ConfigError: a bad schedule (see above), or both schedules given.
    """

    name: ClassVar[str] = "lazyllm"
    layer_loop: ClassVar[bool] = True

    schedule: Schedule = ()
    depth_schedule: DepthSchedule = ()
    preset_name: str | None = None

    def __post_init__(self) -> None:
        self.schedule = check_schedule(self.schedule)
        depth = _pairs(self.depth_schedule, "depth_schedule", "depth")
        prev = -1.0
        for d, _ in depth:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0 or d <= prev:
                raise ConfigError(f"depth_schedule: depths must be strictly increasing in [0, 1), got {d} after {prev}")
            prev = d
        _check_fractions(depth, "depth_schedule")
        self.depth_schedule = tuple((float(d), float(f)) for d, f in depth)
        if self.schedule and self.depth_schedule:
            raise ConfigError("give either schedule or depth_schedule, not both")

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> LazyLLM:
        """A named schedule from :data:`PRESETS`; ``default`` is :data:`DEFAULT_PRESET`."""
        if name not in PRESETS:
            raise ConfigError(f"unknown LazyLLM preset {name!r}; choose one of {sorted(PRESETS)}")
        named = DEFAULT_PRESET if name == "default" else name
        return cls(depth_schedule=PRESETS[named], preset_name=named)

    @classmethod
    def from_spec(cls, preset: str | None = None, schedule: str | None = None) -> LazyLLM:
        """Build from CLI strings: ``preset=default`` or ``schedule=8:0.7+16:0.5`` (``layer:keep``).

        Raises:
            ConfigError: both or a malformed schedule string.
        """
        if preset is not None and schedule is not None:
            raise ConfigError("lazyllm: give preset or schedule, not both")
        if schedule is None:
            return cls.preset(preset or "default")
        pairs = []
        for item in schedule.replace(";", "+").replace(" ", "+").split("+"):
            if not item:
                continue
            layer, sep, frac = item.partition(":")
            try:
                pairs.append((int(layer), float(frac)))
            except ValueError:
                raise ConfigError(f"lazyllm schedule item {item!r} must look like layer:keep (e.g. 8:0.7)") from None
            if not sep:
                raise ConfigError(f"lazyllm schedule item {item!r} must look like layer:keep (e.g. 8:0.7)")
        return cls(schedule=tuple(pairs))

    def resolved(self, num_layers: int) -> Schedule:
        """The absolute schedule for an ``L``-layer model (validated against ``L``)."""
        sched = self.schedule or resolve_depth_schedule(self.depth_schedule, num_layers)
        check_layers(sched, num_layers)
        return sched

    def select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (ascending) of the tokens kept from ``scores`` ``(N,)``: top-``k``.

        Non-candidates are ``-inf`` and the token that must stay (the last) is ``+inf``.
        """
        return top_k_keep(scores, k)

    # --- the contract ---------------------------------------------------------------------------
    def check_prompt(self, model: PreTrainedModel, prompt_len: int) -> None:
        """The schedule's pruning layers must exist in this model (see :meth:`resolved`)."""
        self.resolved(ModelShape.from_config(model.config).num_layers)

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrefillOutput:
        """Progressively pruned prefill; see the module docstring.

        Args:
            input_ids: ``(1, T)`` with ``T >= 1``.

        Raises:
            UnsupportedModelError: model family other than llama/qwen2.
            ConfigError: a pruning layer outside ``[0, L - 2]``.
        """
        ad = DecoderAdapter(model, method="LazyLLM")
        n = int(input_ids.shape[1])
        sched = self.resolved(ad.num_layers)
        prune = dict(sched)
        shape: ModelShape = ad.shape
        state = new_state(ad, sched, n)
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
                    keep = self.select(row, k)
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
            extra={"kept_per_stage": kept, "schedule": [list(p) for p in sched]},
        )
        return PrefillOutput(logits=logits, state=state, stats=stats)

    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        """Feed one token: reselect stage by stage, revive from the Aux Cache, return ``(V,)`` logits."""
        return decode_step(self, state, token_id)

    def decode_stats(self, state: Any) -> dict[str, Any]:
        """Revivals per decode step (tokens and token-layers) and their totals."""
        return {
            "revived_per_step": list(state.revived_per_step),
            "revived_token_layers_per_step": list(state.revived_token_layers_per_step),
            "revived_total": int(sum(state.revived_per_step)),
            "aux_cache_waiting": len(state.aux),
        }

    def describe(self) -> str:
        if self.preset_name:
            return f"lazyllm[{self.preset_name}]"
        if self.depth_schedule:
            return "lazyllm[depth " + " ".join(f"{d:g}:{f:g}" for d, f in self.depth_schedule) + "]"
        if not self.schedule:
            return "lazyllm[keep-all]"
        return "lazyllm[" + " ".join(f"{layer}:{f:g}" for layer, f in self.schedule) + "]"
