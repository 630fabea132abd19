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

Beyond the paper (each off by default, so the presets run the paper's rule): a window of the
last ``score_window`` queries instead of the last one, average pooling of the scores over
positions, attention sinks and the prompt's last tokens kept at every cut, scores summed over
a stage's layers, generated tokens protected while decoding, and the ``revival`` policies
(``all`` as the paper, ``budget:R``, ``none``, ``catch-up``). Named bundles of these options
are in :data:`SELECTIONS`; a preset ``"<schedule>+<selection>"`` combines one with a schedule.

This module is the *policy*: the schedule, its presets and the top-``k`` choice
(:meth:`LazyLLM.select`). The layer loop, the Aux Cache deferral and revival, the decode step
and the compute counter are the mechanism in :mod:`fastprefill.methods.pruning`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from fastprefill.errors import ConfigError
from fastprefill.methods.base import Method, PrefillOutput
from fastprefill.methods.pruning import (
    DepthSchedule,
    PruneOptions,
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

__all__ = ["DEFAULT_PRESET", "LATE_SCHEDULES", "OPTION_FIELDS", "PRESETS", "SELECTIONS", "LazyLLM"]

#: Named schedules as ``(relative depth in [0, 1), keep fraction)``; resolved against the
#: model's layer count at prefill by :func:`resolve_depth_schedule` (layer ``floor(d * L)``).
#: ``"default"`` is an alias of :data:`DEFAULT_PRESET`, the schedule a dev-split sweep chose by
#: a rule fixed in code (:mod:`fastprefill.bench.selection`); the README gives the run, its
#: figures and its command. ``"paper"`` is the four-stage schedule under the paper's selection
#: rule, an explicit name for the faithful path.
#:
#: The ``cutDDkFF`` family cuts later with small keep fractions (a cut at ``DD``% of the depth
#: keeping ``FF``% of the prompt; two cuts joined by ``-``): each computes at most
#: :data:`fastprefill.bench.selection.FIDELITY_BUDGET` of the prompt token-layers on 24, 28 and
#: 30 layers (a test checks it), so it can reach 2x. Which one becomes ``default`` is decided by
#: :func:`fastprefill.bench.selection.choose_by_fidelity` on the dev split.
_NAMED: dict[str, DepthSchedule] = {
    "keep-all": (),
    "late-quarter": ((0.75, 0.25),),
    "gentle": ((0.5, 0.7), (0.75, 0.5)),
    "late-half": ((0.5, 0.5),),
    "balanced": ((0.25, 0.7), (0.5, 0.5), (0.75, 0.3)),
    "four-stage": ((0.2, 0.8), (0.4, 0.6), (0.6, 0.4), (0.8, 0.2)),
    "paper": ((0.2, 0.8), (0.4, 0.6), (0.6, 0.4), (0.8, 0.2)),
    "aggressive": ((0.15, 0.5), (0.4, 0.3), (0.7, 0.15)),
    "cut20k30": ((0.2, 0.3),),
    "cut25k25": ((0.25, 0.25),),
    "cut30k20": ((0.3, 0.2),),
    "cut35k15": ((0.35, 0.15),),
    "cut40k06": ((0.4, 0.06),),
    "cut20k50-cut50k15": ((0.2, 0.5), (0.5, 0.15)),
    "cut25k40-cut55k12": ((0.25, 0.4), (0.55, 0.12)),
    "cut30k35-cut60k08": ((0.3, 0.35), (0.6, 0.08)),
}
DEFAULT_PRESET = "four-stage"
PRESETS: dict[str, DepthSchedule] = {**_NAMED, "default": _NAMED[DEFAULT_PRESET]}
#: The depth schedules that go beyond the paper's (later cuts, small keeps), for sweeps.
LATE_SCHEDULES: tuple[str, ...] = tuple(name for name in _NAMED if name.startswith("cut"))

#: Named bundles of selection options (fields of :class:`LazyLLM`); a preset combines a schedule
#: with one as ``"<schedule>+<selection>"`` (``"paper"``, the paper's rule, when none is named).
#: ``snap`` scores as SnapKV / FastKV select (a window of the last 16 queries, pooled over 7
#: positions) and protects 4 attention sinks and the last 16 prompt tokens; ``snap-protect``
#: also keeps every generated token in every stage while decoding.
SELECTIONS: dict[str, dict[str, Any]] = {
    "paper": {},
    "snap": {"score_window": 16, "pool_kernel": 7, "sinks": 4, "keep_recent": 16},
    "snap-protect": {"score_window": 16, "pool_kernel": 7, "sinks": 4, "keep_recent": 16, "decode_protect": True},
}
#: The option fields of :class:`LazyLLM` (settable by spec string) and their types.
OPTION_FIELDS: dict[str, type] = {
    "score_window": int, "pool_kernel": int, "sinks": int, "keep_recent": int,
    "accumulate": bool, "decode_protect": bool, "revival": str,
}


def _spec_value(key: str, value: Any) -> Any:
    """A spec string's value for the option field ``key`` (non-strings pass through)."""
    kind = OPTION_FIELDS[key]
    if not isinstance(value, str) or kind is str:
        return value
    text = value.strip().lower()
    if kind is bool:
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"lazyllm option {key}={value!r} must be true or false")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"lazyllm option {key}={value!r} must be an integer") from None


@dataclass
class LazyLLM(Method):
    """LazyLLM progressive token pruning with an Aux Cache (arXiv 2407.14057).

    Give either an absolute ``schedule`` or a relative ``depth_schedule`` (as the presets do);
    both empty means keep-all, which reproduces full prefill. The option fields default to the
    paper's rule; each one goes beyond the paper where it is silent (see
    :class:`~fastprefill.methods.pruning.PruneOptions` for the exact definitions).

    Args:
        schedule: ``((layer, keep), ...)``: after pruning layer ``layer`` only
            ``ceil(keep * T)`` tokens (the last always among them) are computed in the layers
            above. Layers strictly increasing in ``[0, L - 2]`` (checked at prefill); ``keep``
            in ``(0, 1]`` and non-increasing with depth.
        depth_schedule: the same with relative depths in ``[0, 1)`` instead of layers, resolved
            by :func:`resolve_depth_schedule` for the model at hand.
        preset_name: informational label set by :meth:`preset`.
        score_window: score a prefill cut by the attention of the last ``W`` queries (``1..64``;
            1 = the paper's last token), averaged over every query head and the ``W`` queries.
        pool_kernel: average-pool the scores over this many positions (odd, ``1..15``; 1 = none).
        sinks: keep the first ``S`` prompt positions at every cut, prefill and decode (``>= 0``).
        keep_recent: keep the last ``R`` prompt positions at every cut (``>= 0``).
        accumulate: score a cut by the sum of the scores of every layer since the previous cut.
        decode_protect: while decoding, every stage also keeps every generated token.
        revival: the decoding policy: ``all`` (the paper), ``budget:R`` (at most ``R >= 0``
            revived tokens per stage per step), ``none`` (no reselection or revival) or
            ``catch-up`` (every deferred token-layer computed at the first decode step, then
            plain decoding).

    Raises:
        ConfigError: a bad schedule (see above), both schedules given, or an option outside its
            range (the message names the field).
    """

    name: ClassVar[str] = "lazyllm"
    layer_loop: ClassVar[bool] = True

    schedule: Schedule = ()
    depth_schedule: DepthSchedule = ()
    preset_name: str | None = None
    score_window: int = 1
    pool_kernel: int = 1
    sinks: int = 0
    keep_recent: int = 0
    accumulate: bool = False
    decode_protect: bool = False
    revival: str = "all"

    def __post_init__(self) -> None:
        self.schedule = check_schedule(self.schedule)
        self.depth_schedule = check_depth_schedule(self.depth_schedule)
        if self.schedule and self.depth_schedule:
            raise ConfigError("give either schedule or depth_schedule, not both")
        self.revival = str(self.options.revival)  # validates every option field

    @property
    def options(self) -> PruneOptions:
        """The option fields as the pruning mechanism's :class:`PruneOptions`."""
        return PruneOptions(**{key: getattr(self, key) for key in OPTION_FIELDS})

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, selection: str | None = None, **options: Any) -> LazyLLM:
        """A named schedule from :data:`PRESETS` with a selection bundle from :data:`SELECTIONS`.

        Args:
            name: ``"<schedule>"`` or ``"<schedule>+<selection>"``; ``default`` is
                :data:`DEFAULT_PRESET`.
            selection: the bundle when ``name`` names none (default ``"paper"``).
            options: option fields that override the bundle's.

        Raises:
            ConfigError: an unknown schedule, bundle or option, or two different bundles named.
        """
        sched, plus, named_selection = name.partition("+")
        if sched not in PRESETS:
            raise ConfigError(f"unknown LazyLLM preset {sched!r}; choose one of {sorted(PRESETS)}")
        if plus and selection is not None and selection != named_selection:
            raise ConfigError(f"lazyllm: preset {name!r} names selection {named_selection!r}, "
                              f"selection={selection!r} another; give one")
        chosen = named_selection if plus else (selection or "paper")
        if chosen not in SELECTIONS:
            raise ConfigError(f"unknown LazyLLM selection {chosen!r}; choose one of {sorted(SELECTIONS)}")
        unknown = set(options) - set(OPTION_FIELDS)
        if unknown:
            raise ConfigError(f"lazyllm has no option(s) {sorted(unknown)}; options: {sorted(OPTION_FIELDS)}")
        named = DEFAULT_PRESET if sched == "default" else sched
        label = named if chosen == "paper" else f"{named}+{chosen}"
        return cls(depth_schedule=PRESETS[named], preset_name=label, **{**SELECTIONS[chosen], **options})

    @classmethod
    def from_spec(
        cls, preset: str | None = None, schedule: str | None = None, selection: str | None = None, **options: Any
    ) -> LazyLLM:
        """Build from CLI strings: ``preset=NAME`` or ``schedule=8:0.7+16:0.5`` (``layer:keep``), an
        optional ``selection=NAME`` bundle and any option field, e.g.
        ``preset=paper,revival=catch-up`` or ``schedule=6:0.3,score_window=16,sinks=4``.

        Raises:
            ConfigError: both preset and schedule, a malformed schedule string, an unknown
                option or a value outside its range.
        """
        if preset is not None and schedule is not None:
            raise ConfigError("lazyllm: give preset or schedule, not both")
        unknown = set(options) - set(OPTION_FIELDS)
        if unknown:
            known = sorted({"preset", "schedule", "selection", *OPTION_FIELDS})
            raise ConfigError(f"lazyllm has no option(s) {sorted(unknown)}; options: {known}")
        fields = {key: _spec_value(key, value) for key, value in options.items()}
        if schedule is None:
            return cls.preset(preset or "default", selection, **fields)
        if selection is not None and selection not in SELECTIONS:
            raise ConfigError(f"unknown LazyLLM selection {selection!r}; choose one of {sorted(SELECTIONS)}")
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
        return cls(schedule=tuple(pairs), **{**SELECTIONS[selection or "paper"], **fields})

    def resolved(self, num_layers: int) -> Schedule:
        """The absolute schedule for an ``L``-layer model (validated against ``L``)."""
        sched = self.schedule or resolve_depth_schedule(self.depth_schedule, num_layers)
        check_layers(sched, num_layers)
        return sched

    def select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (ascending) of the tokens kept from ``scores`` ``(N,)``: top-``k``.

        Non-candidates are ``-inf`` and the tokens that must stay (the last, protected ones)
        are ``+inf``.
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
        return progressive_prefill(ad, input_ids, self.resolved(ad.num_layers), self.select, self.options)

    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        """Feed one token under the ``revival`` policy; return ``(V,)`` logits."""
        return decode_step(state, token_id, self.select)

    def decode_stats(self, state: Any) -> dict[str, Any]:
        """Revivals per decode step (distinct tokens, (token, stage) pairs, token-layers) and totals."""
        return state.revival_stats()

    def describe(self) -> str:
        """``lazyllm[<preset or schedule>]``, then the options that differ from the preset's bundle
        (the paper's rule without one)."""
        if self.preset_name:
            where = self.preset_name
        elif self.depth_schedule:
            where = "depth " + " ".join(f"{d:g}:{f:g}" for d, f in self.depth_schedule)
        elif not self.schedule:
            where = "keep-all"
        else:
            where = " ".join(f"{layer}:{f:g}" for layer, f in self.schedule)
        paper = {f.name: f.default for f in dataclasses.fields(self) if f.name in OPTION_FIELDS}
        expected = {**paper, **SELECTIONS.get((self.preset_name or "").partition("+")[2], {})}
        differ = [f"{key}={getattr(self, key)}" for key in OPTION_FIELDS if getattr(self, key) != expected[key]]
        return f"lazyllm[{where}{' ' + ','.join(differ) if differ else ''}]"
