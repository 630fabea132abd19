"""Options of the pruning mechanism: how a cut scores and selects, and how decoding revives.

:class:`PruneOptions` is what :func:`~fastprefill.methods.pruning.progressive_prefill` and
:func:`~fastprefill.methods.pruning.decode_step` read besides the schedule and the ``select``
callable. Every option's default is the paper's rule, so ``PruneOptions()`` changes nothing.
Values are validated here (a :class:`~fastprefill.errors.ConfigError` names the field and its
allowed range); LazyLLM builds its options from its own fields of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fastprefill.errors import ConfigError, is_int, is_number
from fastprefill.methods.research.fill import Fill

__all__ = ["MAX_POOL_KERNEL", "MAX_SCORE_WINDOW", "REVIVAL_POLICIES", "PruneOptions", "Revival"]

MAX_SCORE_WINDOW = 64
MAX_POOL_KERNEL = 15
#: The revival policies by name (``budget`` is written ``budget:R``).
REVIVAL_POLICIES = ("all", "budget:R", "none", "catch-up")


@dataclass(frozen=True)
class Revival:
    """A decoding policy for the tokens a pruned prefill deferred.

    Attributes:
        kind: ``"all"`` (the paper: reselect at every step, revive every selected token from
            the Aux Cache), ``"budget"`` (reselect, revive at most ``budget`` tokens per stage
            per step), ``"none"`` (no reselection, no revival: every layer attends the KV
            present there) or ``"catch-up"`` (at the first decode step compute every deferred
            token-layer, then decode plainly).
        budget: ``R >= 0`` for ``"budget"``, else ``None``.
    """

    kind: str = "all"
    budget: int | None = None

    @classmethod
    def parse(cls, text: Any) -> Revival:
        """``"all"``, ``"none"``, ``"catch-up"`` or ``"budget:R"`` (``R`` an integer >= 0)."""
        if isinstance(text, Revival):
            return text
        allowed = f"allowed: {', '.join(REVIVAL_POLICIES)} (R an integer >= 0)"
        if not isinstance(text, str):
            raise ConfigError(f"revival must be a string, got {text!r}; {allowed}")
        name, sep, value = text.strip().partition(":")
        if name in ("all", "none", "catch-up") and not sep:
            return cls(name)
        if name == "budget" and sep:
            try:
                budget = int(value)
            except ValueError:
                budget = -1
            if budget >= 0:
                return cls("budget", budget)
        raise ConfigError(f"revival {text!r} is not a policy; {allowed}")

    @property
    def reselects(self) -> bool:
        """Whether decoding redoes the selection stage by stage (``all`` and ``budget``)."""
        return self.kind in ("all", "budget")

    def __str__(self) -> str:
        return f"budget:{self.budget}" if self.kind == "budget" else self.kind


def _check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not is_int(value, low, high):
        upper = f"..{high}" if high is not None else " or more"
        raise ConfigError(f"{name} must be an integer in {low}{upper}, got {value!r}")
    return value


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class PruneOptions:
    """How a cut scores and selects, and how decoding revives (defaults: the paper).

    Attributes:
        score_window: ``W`` in ``1..64``: a prefill cut scores with the attention probabilities
            of the last ``W`` query rows present at the layer (each causally masked), averaged
            over every query head and the ``W`` rows. ``1`` is the paper (the last token).
            Decoding scores from the new token's row (the only query it has).
        pool_kernel: odd, ``1..15``: scores are average-pooled over this many neighbours in
            position order among the candidates (padding not counted); ``1`` = no pooling.
        sinks: the first ``S`` prompt positions are kept at every cut (prefill and decode).
        keep_recent: the last ``R`` prompt positions are kept at every cut (the last prompt token
            always is).
        accumulate: a cut's score is the sum of the scores captured at every layer of the stage
            it ends (the layers after the previous cut, up to and including this one), over the
            tokens present there.
        decode_protect: at a decode step every stage's set also always holds every generated
            token (the sinks and the last ``keep_recent`` prompt tokens are kept anyway).
        revival: the decoding :class:`Revival` policy.
        fill: what later layers keep of a pruned token (:class:`~fastprefill.methods.research.fill.Fill`;
            ``none``, the paper: nothing). Any other needs ``revival=none`` and a one-cut
            schedule.
        fill_share: in ``(0, 1]``: the share of a cut's pruned tokens that get filled rows, those
            with the highest selection scores first (``ceil(fill_share * pruned)``); the others
            are dropped as under ``none``. ``1`` fills every pruned token. Needs a fill policy.

    A cut keeps ``max(keep_count(keep, n), forced)`` tokens, ``forced`` being the protected
    ones present (the last token, sinks, recent, generated); the protected ones are always
    among them.
    """

    score_window: int = 1
    pool_kernel: int = 1
    sinks: int = 0
    keep_recent: int = 0
    accumulate: bool = False
    decode_protect: bool = False
    revival: Revival = field(default_factory=Revival)
    fill: Fill = field(default_factory=Fill)
    fill_share: float = 1.0

    def __post_init__(self) -> None:
        _check_int(self.score_window, "score_window", 1, MAX_SCORE_WINDOW)
        kernel = _check_int(self.pool_kernel, "pool_kernel", 1, MAX_POOL_KERNEL)
        if kernel % 2 == 0:
            raise ConfigError(f"pool_kernel must be odd (1, 3, ..., {MAX_POOL_KERNEL}; 1 = no pooling), got {kernel}")
        _check_int(self.sinks, "sinks", 0)
        _check_int(self.keep_recent, "keep_recent", 0)
        _check_bool(self.accumulate, "accumulate")
        _check_bool(self.decode_protect, "decode_protect")
        object.__setattr__(self, "revival", Revival.parse(self.revival))
        object.__setattr__(self, "fill", Fill.parse(self.fill))
        share = self.fill_share
        if not is_number(share) or not 0 < share <= 1:
            raise ConfigError(f"fill_share must be a number in (0, 1], got {share!r}")
        object.__setattr__(self, "fill_share", float(share))
        if share != 1 and not self.fill.active:
            raise ConfigError(f"fill_share={share} needs a fill policy (fill=calibrated:DIR or zero-shot); "
                              "with fill=none no pruned token is filled")
        if self.fill.active and self.revival.kind != "none":
            raise ConfigError(f"fill={self.fill} needs revival=none: a revived token would have both a filled and "
                              "an exact K/V row")

    def protected(self, positions: torch.Tensor, prompt_len: int, decoding: bool) -> torch.Tensor:
        """Bool ``(N,)``: which of ``positions`` ``(N,)`` a cut must keep (besides the newest token).

        Sinks and the last ``keep_recent`` prompt positions; while decoding with
        ``decode_protect``, every generated position too (``>= prompt_len``).
        """
        keep = (positions < self.sinks) | ((positions >= prompt_len - self.keep_recent) & (positions < prompt_len))
        if decoding and self.decode_protect:
            keep |= positions >= prompt_len
        return keep

    def protected_count(self, start: int, prompt_len: int) -> int:
        """How many of the prompt positions ``start..prompt_len-1`` a prefill's cut must keep:
        those :meth:`protected` marks while not decoding, and the last one; counted on the host.

        A cut keeps every protected row (they score ``+inf``), so at every cut of a prefill the
        rows present hold all of them and this equals the count of protected rows present.
        """
        if start >= prompt_len:
            return 0
        sinks_end = max(start, min(self.sinks, prompt_len))  # [start, sinks_end): the sinks
        recent_start = max(start, min(prompt_len - self.keep_recent, prompt_len - 1))  # [recent_start, T)
        overlap = max(0, sinks_end - recent_start)
        return (sinks_end - start) + (prompt_len - recent_start) - overlap

    def describe(self) -> str:
        """The options that differ from the paper's, as ``key=value`` items joined by ``,``."""
        default = PruneOptions()
        items = [f"{name}={getattr(self, name)}" for name in
                 ("score_window", "pool_kernel", "sinks", "keep_recent", "accumulate", "decode_protect", "revival",
                  "fill", "fill_share")
                 if getattr(self, name) != getattr(default, name)]
        return ",".join(items)
