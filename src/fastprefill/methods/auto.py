"""Tuning profiles: which method serves which prompt length, chosen by measured fidelity.

A :class:`TuneProfile` is what ``fastprefill tune`` writes: the model it was measured on
(weights and tokenizer fingerprints) and the dtype it ran in, the fidelity target, and per
prompt-length bucket the method spec to run with its held-out TTFT ratio and fidelity.
``--method auto:profile=FILE`` (:class:`~fastprefill.methods.registry.AutoMethod`) reads one and
picks the bucket's method for each prompt; a model whose weights fingerprint differs from the
profile's, or that runs in another dtype, is refused (a method's speed and fidelity both change
with the dtype). The tokenizer's fingerprint is recorded, not checked. A profile without a
``dtype`` field was measured in float32.

The file is JSON (``format`` ``"fastprefill-tune-profile"``, ``version`` 1)::

    {"format": ..., "version": 1, "model": "qwen2.5-coder-0.5b",
     "fingerprint": "<weights sha256>", "tokenizer_fingerprint": "<sha256>", "dtype": "bfloat16",
     "target": {"measure": "first-token", "value": 0.9, "confidence": 0.95},
     "buckets": [{"label": "512", "upto": 768, "method": "full", ...}, ...]}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastprefill.errors import ConfigError, is_number

__all__ = ["FORMAT", "MEASURES", "ProfileBucket", "Target", "TuneProfile"]

FORMAT = "fastprefill-tune-profile"
VERSION = 1
#: Fidelity measures a target may name: the share of prompts whose first token (or whole answer)
#: equals full prefill's (a floor), or the first-token KL divergence from full prefill (a ceiling).
MEASURES = ("first-token", "identical", "kl")


@dataclass(frozen=True)
class Target:
    """A fidelity target: ``first-token=0.9`` (at least 90% of first tokens equal full prefill's,
    judged by the lower end of the interval), ``identical=0.8``, or ``kl=0.1`` (mean first-token
    KL at most 0.1 nats, judged by the upper end).

    Attributes:
        measure: one of :data:`MEASURES`.
        value: the floor (a share in ``(0, 1]``) or, for ``kl``, the ceiling (``> 0``).
        confidence: the two-sided level of the interval (``0.5 <= c < 1``).
    """

    measure: str
    value: float
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ConfigError(f"target measure must be one of {MEASURES}, got {self.measure!r}")
        if not is_number(self.value) or not self.value > 0 or (
                self.measure != "kl" and self.value > 1):
            allowed = "> 0" if self.measure == "kl" else "a share in (0, 1]"
            raise ConfigError(f"target {self.measure} must be {allowed}, got {self.value!r}")
        if not isinstance(self.confidence, (int, float)) or not 0.5 <= self.confidence < 1:
            raise ConfigError(f"confidence must lie in [0.5, 1), got {self.confidence!r}")

    @classmethod
    def parse(cls, text: str, confidence: float = 0.95) -> Target:
        """``"first-token=0.9"``, ``"identical=0.8"`` or ``"kl=0.1"``.

        Raises:
            ConfigError: another form, measure or value.
        """
        measure, eq, value = text.strip().partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not eq or math.isnan(number):
            raise ConfigError(f"target {text!r} must look like first-token=0.9, identical=0.8 or kl=0.1")
        return cls(measure.strip(), number, confidence)

    @property
    def is_floor(self) -> bool:
        """Whether higher is better (a share), judged by the interval's lower end."""
        return self.measure != "kl"

    def describe(self) -> str:
        return f"{self.measure} {'>=' if self.is_floor else '<='} {self.value:g}"


@dataclass(frozen=True)
class ProfileBucket:
    """One prompt-length bucket of a profile.

    Attributes:
        label: its name (``"512"``, ``"2k"``, ...).
        upto: prompts of at most this many tokens (``None``: every longer prompt).
        method: the method spec to run (``"full"`` when nothing met the target at >= the
            minimum speedup).
        reason: why it was chosen, in words.
        ttft_ratio: full prefill's TTFT over the method's, median of per-prompt ratios on the
            held-out half (``None`` for ``full``).
        fidelity: the target's measure on the held-out half, and its interval ``[lo, hi]``.
        n_choose, n_report: prompts in the choosing and the held-out half.
    """

    label: str
    upto: int | None
    method: str
    reason: str = ""
    ttft_ratio: float | None = None
    fidelity: float | None = None
    fidelity_ci: tuple[float, float] | None = None
    n_choose: int = 0
    n_report: int = 0


@dataclass(frozen=True)
class TuneProfile:
    """A tuning profile (see the module docstring).

    Attributes:
        model: the model's name as given to ``fastprefill tune``.
        fingerprint, tokenizer_fingerprint: of the model it was measured on
            (:mod:`fastprefill.models.fingerprint`).
        dtype: the model's dtype when it was measured (``"bfloat16"``, ``"float32"``, ...).
        target: the fidelity target.
        buckets: by ascending ``upto``; the last has ``upto=None``.
        meta: how it was made (command, prompts, candidates, result file).
    """

    model: str
    fingerprint: str
    tokenizer_fingerprint: str
    target: Target
    buckets: tuple[ProfileBucket, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ConfigError("a tuning profile needs at least one length bucket")
        limits = [b.upto for b in self.buckets]
        if limits[-1] is not None or any(u is None for u in limits[:-1]) or limits[:-1] != sorted(set(limits[:-1])):
            raise ConfigError(f"profile buckets must have ascending limits and an open last one, got {limits}")

    def bucket(self, prompt_len: int) -> ProfileBucket:
        """The bucket of a ``prompt_len``-token prompt."""
        return next(b for b in self.buckets if b.upto is None or prompt_len <= b.upto)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "fingerprint": self.fingerprint,
                "tokenizer_fingerprint": self.tokenizer_fingerprint, "dtype": self.dtype, "target": asdict(self.target),
                "buckets": [asdict(b) for b in self.buckets], "meta": self.meta}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON (atomically)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TuneProfile:
        """Read a profile written by :meth:`save`.

        Raises:
            ConfigError: no such file, not JSON, or not a profile of this format.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"no tuning profile at {p}; make one with `fastprefill tune --model NAME "
                              "--prompts FILE.jsonl --out PROFILE.json`")
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{p} is not a readable tuning profile ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ConfigError(f"{p} is not a fastprefill tuning profile (format {FORMAT!r}, version {VERSION})")
        try:
            buckets = tuple(ProfileBucket(**{**b, "fidelity_ci": tuple(b["fidelity_ci"]) if b.get("fidelity_ci")
                                             else None}) for b in data["buckets"])
            return cls(model=data["model"], fingerprint=data["fingerprint"],
                       tokenizer_fingerprint=data["tokenizer_fingerprint"], target=Target(**data["target"]),
                       buckets=buckets, meta=data.get("meta", {}), dtype=str(data.get("dtype", "float32")))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{p} is a damaged tuning profile ({exc})") from None
