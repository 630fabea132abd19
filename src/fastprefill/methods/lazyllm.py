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
generation (counted by :class:`~fastprefill.methods.pruning.ComputeCounter`, always on).

*Choose* (decode attention set and keep count): see :mod:`fastprefill.methods.pruning.loop`. The
keep-all schedule reproduces full prefill and decoding to float rounding (tested).

This module is the *policy*: the schedule, its presets and the top-``k`` choice
(:meth:`LazyLLM.select`). The layer loop, the Aux Cache deferral and revival, the decode step
and the compute counter are the mechanism in :mod:`fastprefill.methods.pruning`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from fastprefill.errors import ConfigError
from fastprefill.methods.base import Method, PrefillOutput
from fastprefill.methods.pruning import (
    DepthSchedule,
    Schedule,
    check_depth_schedule,
    check_layers,
    check_schedule,
    decode_step,
    progressive_prefill,
    resolve_depth_schedule,
    top_k_keep,
)
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.shape import ModelShape

__all__ = ["DEFAULT_PRESET", "PRESETS", "LazyLLM"]

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
        self.depth_schedule = check_depth_schedule(self.depth_schedule)
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
        return progressive_prefill(ad, input_ids, self.resolved(ad.num_layers), self.select)

    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        """Feed one token: reselect stage by stage, revive from the Aux Cache, return ``(V,)`` logits."""
        return decode_step(state, token_id, self.select)

    def decode_stats(self, state: Any) -> dict[str, Any]:
        """Revivals per decode step (distinct tokens, (token, stage) pairs, token-layers) and totals."""
        return state.revival_stats()

    def describe(self) -> str:
        if self.preset_name:
            return f"lazyllm[{self.preset_name}]"
        if self.depth_schedule:
            return "lazyllm[depth " + " ".join(f"{d:g}:{f:g}" for d, f in self.depth_schedule) + "]"
        if not self.schedule:
            return "lazyllm[keep-all]"
        return "lazyllm[" + " ".join(f"{layer}:{f:g}" for layer, f in self.schedule) + "]"
