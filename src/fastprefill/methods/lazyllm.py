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

*Choose* (decode attention set and keep count): see :mod:`fastprefill.methods.pruning.decode`. The
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
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.errors import ConfigError
from fastprefill.methods.base import Method, PrefillOutput
from fastprefill.methods.pruning import (
    DepthSchedule,
    PrunedPrefill,
    PruneOptions,
    Schedule,
    check_depth_schedule,
    check_layers,
    check_schedule,
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
#: a rule fixed in code before the run (``choose_default`` in benchmarks/research/selection.py,
#: beside the benchmark scripts); docs/results/lazyllm.md gives the run, its figures and its
#: command. ``"paper"`` is the four-stage schedule under the paper's selection rule, an explicit
#: name for the faithful path.
#:
#: The ``cutDDkFF`` family cuts later with small keep fractions (a cut at ``DD``% of the depth
#: keeping ``FF``% of the prompt; two cuts joined by ``-``): each computes at most
#: ``FIDELITY_BUDGET`` (benchmarks/research/selection.py) of the prompt token-layers on 24, 28
#: and 30 layers (a test checks it), so it can reach 2x. Which one becomes ``default`` is decided
#: by that file's ``choose_by_fidelity`` on the dev split (docs/results/lazyllm.md).
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

#: Named bundles of selection options (fields of
#: :class:`~fastprefill.methods.pruning.PruneOptions`); a preset combines a schedule with one as
#: ``"<schedule>+<selection>"`` (``"paper"``, the paper's rule, when none is named). ``snap``
#: scores as SnapKV / FastKV select (a window of the last 16 queries, pooled over 7 positions)
#: and protects 4 attention sinks and the last 16 prompt tokens; ``snap-protect`` also keeps
#: every generated token in every stage while decoding.
SELECTIONS: dict[str, dict[str, Any]] = {
    "paper": {},
    "snap": {"score_window": 16, "pool_kernel": 7, "sinks": 4, "keep_recent": 16},
    "snap-protect": {"score_window": 16, "pool_kernel": 7, "sinks": 4, "keep_recent": 16, "decode_protect": True},
}
#: The option fields (those of :class:`PruneOptions`), settable by spec string beside a preset.
OPTION_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PruneOptions))


@dataclass
class LazyLLM(Method):
    """LazyLLM progressive token pruning with an Aux Cache (arXiv 2407.14057).

    The schedule comes from ``preset`` unless an absolute ``schedule`` or a relative
    ``depth_schedule`` is given; the options are the ``selection`` bundle's (the preset's own
    bundle when it names one), with ``options`` applied over it. The defaults are the paper's
    rule and the :data:`DEFAULT_PRESET` schedule; the presets go beyond the paper where it is
    silent (see :class:`~fastprefill.methods.pruning.PruneOptions` for each option).

    Args:
        preset: ``"<schedule>"`` or ``"<schedule>+<selection>"`` from :data:`PRESETS` and
            :data:`SELECTIONS` (``default`` is :data:`DEFAULT_PRESET`); ignored when a
            schedule is given (giving both is an error, unless the preset is ``default``).
        schedule: ``((layer, keep), ...)``: after pruning layer ``layer`` only
            ``ceil(keep * T)`` tokens (the last always among them) are computed in the layers
            above. Layers strictly increasing in ``[0, L - 2]`` (checked at prefill); ``keep``
            in ``(0, 1]`` and non-increasing with depth. Spec: ``schedule=8:0.7+16:0.5``.
        depth_schedule: the same with relative depths in ``[0, 1)`` instead of layers, resolved
            by :func:`resolve_depth_schedule` for the model at hand.
        selection: the options bundle from :data:`SELECTIONS` (default: the preset's, else
            ``paper``).
        options: a complete :class:`PruneOptions` (then ``selection`` must not be given), or a
            mapping of option fields applied over the bundle (the spec's ``revival=none``).
        label: the name :meth:`describe` shows for a custom schedule (sweeps set it).

    Raises:
        ConfigError: an unknown preset or selection, a bad schedule (see above), two schedules
            given, or an option outside its range (the message names the field).
    """

    name: ClassVar[str] = "lazyllm"
    layer_loop: ClassVar[bool] = True
    takes_prefix: ClassVar[bool] = True

    preset: str = "default"
    schedule: Schedule = ()
    depth_schedule: DepthSchedule = ()
    selection: str | None = None
    options: PruneOptions | Mapping[str, Any] = field(default_factory=dict)
    label: str | None = None
    _custom: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.schedule = check_schedule(self.schedule)
        self.depth_schedule = check_depth_schedule(self.depth_schedule)
        if self.schedule and self.depth_schedule:
            raise ConfigError("give either schedule or depth_schedule, not both")
        sched, plus, named_selection = self.preset.partition("+")
        if sched not in PRESETS:
            raise ConfigError(f"unknown LazyLLM preset {sched!r}; choose one of {sorted(PRESETS)}")
        custom = bool(self.schedule or self.depth_schedule)
        if custom and self.preset != "default":
            raise ConfigError("lazyllm: give preset or schedule, not both")
        if plus and self.selection is not None and self.selection != named_selection:
            raise ConfigError(f"lazyllm: preset {self.preset!r} names selection {named_selection!r}, "
                              f"selection={self.selection!r} another; give one")
        chosen = self.selection or (named_selection if plus and not custom else "paper")
        if chosen not in SELECTIONS:
            raise ConfigError(f"unknown LazyLLM selection {chosen!r}; choose one of {sorted(SELECTIONS)}")
        if isinstance(self.options, PruneOptions):
            if self.selection is not None or plus:
                raise ConfigError("lazyllm: give a selection bundle or complete options, not both")
        elif isinstance(self.options, Mapping):
            unknown = set(self.options) - set(OPTION_FIELDS)
            if unknown:
                raise ConfigError(f"lazyllm has no option(s) {sorted(unknown)}; options: {sorted(OPTION_FIELDS)}")
            self.options = PruneOptions(**{**SELECTIONS[chosen], **self.options})
        else:
            raise ConfigError(f"lazyllm: options must be PruneOptions or a mapping of its fields, got {self.options!r}")
        self.selection = chosen
        self._custom = custom
        if not custom:
            named = DEFAULT_PRESET if sched == "default" else sched
            self.depth_schedule = PRESETS[named]
            self.preset = named if chosen == "paper" else f"{named}+{chosen}"

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

    def own_decoder(self, model: PreTrainedModel) -> bool:
        """A revival policy other than ``none`` with a schedule that cuts: decoding revives
        deferred tokens with :class:`~fastprefill.methods.pruning.RevivalDecoder`."""
        assert isinstance(self.options, PruneOptions)
        layers = ModelShape.from_config(model.config).num_layers
        return self.options.revival.kind != "none" and bool(self.resolved(layers))

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        """Progressively pruned prefill; see the module docstring and :meth:`run`."""
        return self.run(model, input_ids, prefix).output

    def run(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrunedPrefill:
        """The prefill with the pruning mechanism's state (KV by position, Aux Cache, counters).

        Args:
            input_ids: ``(1, T)`` with ``T >= 1``.
            prefix: exact K/V of positions ``0..P-1``: context at every layer; only positions
                ``P..T-1`` are computed and pruned.

        Raises:
            UnsupportedModelError: model family other than llama/qwen2.
            ConfigError: a pruning layer outside ``[0, L - 2]``.
        """
        ad = DecoderAdapter(model, method="LazyLLM")
        assert isinstance(self.options, PruneOptions)
        return progressive_prefill(ad, input_ids, self.resolved(ad.num_layers), self.select, self.options, prefix)

    def describe(self, *, show: Collection[str] = ()) -> str:
        """``lazyllm[<preset, label or schedule>]``, then the options that differ from the preset's
        selection bundle (the paper's rule for a custom schedule), and the options named in
        ``show`` even when they do not (the server shows ``revival``)."""
        if self.label:
            where = self.label
        elif not self._custom:
            where = self.preset
        elif self.depth_schedule:
            where = "depth " + " ".join(f"{d:g}:{f:g}" for d, f in self.depth_schedule)
        elif not self.schedule:
            where = "keep-all"
        else:
            where = " ".join(f"{layer}:{f:g}" for layer, f in self.schedule)
        assert isinstance(self.options, PruneOptions)
        expected = PruneOptions(**(SELECTIONS[self.selection or "paper"] if not self._custom else {}))
        differ = [f"{key}={getattr(self.options, key)}" for key in OPTION_FIELDS
                  if key in show or getattr(self.options, key) != getattr(expected, key)]
        return f"lazyllm[{where}{' ' + ','.join(differ) if differ else ''}]"

    def served_name(self) -> str:
        """:meth:`describe` with the revival policy always named, so that a response says how it
        decoded (``lazyllm[four-stage revival=none]``)."""
        return self.describe(show=("revival",))

    def metric_label(self) -> str:
        """``lazyllm[revival=<policy>]``."""
        assert isinstance(self.options, PruneOptions)
        return f"{self.name}[revival={self.options.revival.kind}]"
