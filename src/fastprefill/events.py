"""What a generation reports: its :class:`Timing` (measured with :class:`TimingWindow`, the
engine's only clock), one :class:`StreamEvent` per generated token, and the whole
:class:`GenerationResult` with its :class:`Answer` s. :mod:`fastprefill.engine` produces them
and exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

import torch

from fastprefill.host import device_clock
from fastprefill.methods.base import ComputeStats
from fastprefill.sampling import TokenLogprob

__all__ = ["Answer", "GenerationResult", "StreamEvent", "Timing", "TimingWindow"]


@dataclass
class Timing:
    """Timings of one generation and what its prefill computed.

    Attributes:
        method: the method's :meth:`~fastprefill.methods.base.Method.describe` string.
        prompt_tokens: prompt length ``T``.
        new_tokens: tokens generated (the first one included).
        ttft_s: seconds from the start of prefill (the prefix-cache lookup) through the first
            token; under the server's interleaved scheduler, the other requests' work between
            this prompt's chunks included (the wall time this request's prefill took).
        decode_s_per_token: mean seconds per token after the first (``None`` if only one).
        total_s: TTFT plus all decoding.
        stats: the prefill's :class:`~fastprefill.methods.base.ComputeStats` (token-layers,
            FLOPs, method counters), as the method reported it.
        decode_extra: counters the method's own decoder gathered (``Decoder.stats``).
        cached_tokens: prompt tokens whose K/V came from a prefix cache (not computed).
        shared_tokens: of ``cached_tokens``, those other requests stored after this one was
            admitted (in-flight sharing: it waited for a running prefill of the same prefix).
        prefix_cache: what the prefix cache did: ``"off"`` (none given), ``"hit"``, ``"miss"``,
            or ``"not used: <method> takes no cached prefix"`` (the whole prompt ran).
        stored_tokens: tokens this generation added to the prefix cache.
        prefix_lookup_s: of ``ttft_s``, the seconds spent looking the prompt up in the prefix cache
            (and assembling the hit's K/V).
        prefix_store_s: seconds spent storing into the prefix cache: the prompt's blocks after
            the first token (outside TTFT; a chunked prefill's earlier chunks inside it), the
            answer's after the last token.
        dtype: the model's dtype (``"bfloat16"``, ``"float32"``, ...): every timing names it.
    """

    method: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_s_per_token: float | None
    total_s: float
    stats: ComputeStats
    decode_extra: dict[str, Any] = field(default_factory=dict)
    cached_tokens: int = 0
    prefix_cache: str = "off"
    stored_tokens: int = 0
    prefix_lookup_s: float = 0.0
    prefix_store_s: float = 0.0
    dtype: str = ""
    shared_tokens: int = 0

    @property
    def extra(self) -> dict[str, Any]:
        """Prefill and decode counters in one dict (decode keys win on a clash)."""
        return {**self.stats.extra, **self.decode_extra}

    def to_dict(self) -> dict[str, Any]:
        """A flat, JSON-friendly dict (the keys benchmark records and the pool's replies use): the
        timings, :meth:`ComputeStats.to_dict`'s keys (with ``extra`` the prefill and decode
        counters of :attr:`extra`), and the prefix cache's fields."""
        return {
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ttft_s": self.ttft_s,
            "decode_s_per_token": self.decode_s_per_token,
            "total_s": self.total_s,
            **self.stats.to_dict(),
            "extra": self.extra,
            "cached_tokens": self.cached_tokens,
            "shared_tokens": self.shared_tokens,
            "prefix_cache": self.prefix_cache,
            "stored_tokens": self.stored_tokens,
            "prefix_lookup_s": self.prefix_lookup_s,
            "prefix_store_s": self.prefix_store_s,
            "dtype": self.dtype,
        }


@dataclass
class StreamEvent:
    """One generated token of answer ``choice`` (its ``index``-th). ``timing`` and
    ``first_logits`` are set on the last event of the generation only, ``finish_reason``
    (``"stop"`` or ``"length"``) on the last event of each answer, ``logprob`` when the sampling
    parameters ask for log-probabilities, ``prompt_logprobs`` on the very first event when they
    ask for the prompt's (see :func:`fastprefill.sampling.prompt_logprobs`)."""

    token_id: int
    text: str
    index: int
    timing: Timing | None = None
    first_logits: torch.Tensor | None = None
    choice: int = 0
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Answer:
    """One of a generation's ``n`` answers: its text (cut before a stop string), token ids,
    why it ended (``"stop"``: end-of-sequence token, stop string or ``stop`` predicate;
    ``"length"``: the token budget) and each token's log-probability if asked for."""

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    """The generated text, its token ids, the :class:`Timing` and ``first_logits``: the prefill's
    ``(V,)`` float32 logits for the first token, a copy on the CPU (taken outside the timing window).

    ``text`` and ``token_ids`` are the first answer's; ``answers`` holds all ``n``, and
    ``prompt_logprobs`` the prompt's log-probabilities when the sampling parameters ask for them."""

    text: str
    token_ids: list[int]
    timing: Timing
    first_logits: torch.Tensor | None = None
    answers: list[Answer] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TimingWindow:
    """The engine's clock: ``with TimingWindow(device) as w: ...`` then ``w.seconds``.

    Both reads are :func:`fastprefill.host.device_clock`: the device is synchronised before the
    start and the end reads (CUDA work is asynchronous), so the window holds all the work queued
    inside it. A span over several windows (the engine's TTFT across chunks) reads the same clock.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> Self:
        self._t0 = device_clock(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = device_clock(self.device) - self._t0
