"""Paired summaries of benchmark records: one :class:`Summary` per (length, method).

Each method is paired, sample by sample, with a reference method that ran on the same prompts
in the same process (full prefill unless a mapping says otherwise):

- TTFT: median and quartiles; ``speedup`` is ``median(reference TTFT) / median(method TTFT)``
  and ``speedup_paired_median`` the median of the per-prompt ratios.
- Accuracy: the mean score, and the mean paired difference to the reference with a 95%
  percentile bootstrap interval (seeded, 2000 resamples).
- Cost: mean token-layer fraction, the ideal speedup ``1 / fraction``, the mean paired FLOPs
  ratio, decode seconds per token, total seconds (prefill plus decoding): the median of the
  per-prompt total ratios ``reference total / method total`` and the share of prompts on which
  the method's total is the longer.
- Fidelity: first-token agreement with the reference, the share of answers identical to the
  reference's (``output.strip()`` equal), and the median first-token KL(reference || method)
  where the runs recorded it.
- Gold tokens: where the runs recorded it, the mean share of the task's gold tokens still
  computed after each cut (per stage).

Statistics of the method alone use all its records in the cell; everything compared with the
reference uses the paired samples only.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastprefill.bench.records import FULL, Record
from fastprefill.errors import ConfigError, is_number

__all__ = ["Summary", "bootstrap_ci", "summarize"]

#: Extras that are per-run facts, not counters to average.
_NOT_COUNTERS = ("first_token", "first_token_kl", "gold_kept_share_per_stage")


@dataclass
class Summary:
    """Aggregate of one (length, method) cell, paired with its reference method."""

    length: int | None
    method: str
    reference: str
    n: int
    n_paired: int
    ttft_median_s: float
    ttft_p25_s: float
    ttft_p75_s: float
    reference_ttft_median_s: float
    speedup: float
    speedup_paired_median: float
    score_mean: float
    reference_score_mean: float
    score_diff: float
    score_diff_ci95: tuple[float, float]
    metric_means: dict[str, float]
    token_layer_fraction: float
    ideal_speedup: float
    realised_over_ideal: float
    flops_ratio: float
    flops_median: float
    decode_s_per_token_median: float | None
    total_median_s: float
    reference_total_median_s: float
    new_tokens_mean: float
    new_tokens_median: float
    peak_mem_mb: float
    first_token_agreement: float | None
    identical_answers: float
    first_token_kl_median: float | None
    first_token_kl_n: int
    counters: dict[str, float] = field(default_factory=dict)
    gold_kept_share_per_stage: list[float] | None = None
    total_speedup_paired_median: float = float("nan")
    slower_total_share: float = float("nan")

    @property
    def is_reference(self) -> bool:
        """The cell is its own reference (full prefill against itself)."""
        return self.method == self.reference


def bootstrap_ci(diffs: Sequence[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``diffs``."""
    arr = np.asarray(diffs, dtype=float)
    if arr.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return (float(lo), float(hi))


def _median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else float("nan")


def _mean(values: Sequence[float]) -> float:
    return float(statistics.mean(values)) if len(values) else float("nan")


def _counter_value(value: Any) -> float | None:
    """A counter's per-run value: a number, or the mean of a list of numbers (empty: 0)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list) and all(is_number(v) for v in value):
        return float(statistics.mean(value)) if value else 0.0
    return None


def _counters(records: Sequence[Record]) -> dict[str, float]:
    """Mean of each numeric counter in ``extra`` over the records (a run without it counts 0)."""
    keys = {k for r in records for k, v in r.extra.items() if k not in _NOT_COUNTERS and _counter_value(v) is not None}
    out = {}
    for key in sorted(keys):
        values = [_counter_value(r.extra.get(key)) for r in records]
        out[key] = float(statistics.mean(v if v is not None else 0.0 for v in values))
    return out


def _gold_shares(records: Sequence[Record]) -> list[float] | None:
    """Mean share of gold tokens kept per stage over the records that have it (``None``: none has).

    Stage ``s``'s mean is over the records with at least ``s + 1`` stages.
    """
    rows = [r.extra["gold_kept_share_per_stage"] for r in records if r.extra.get("gold_kept_share_per_stage")]
    if not rows:
        return None
    return [_mean([row[s] for row in rows if len(row) > s]) for s in range(max(map(len, rows)))]


def _reference_of(reference: str | Mapping[str, str], method: str) -> str:
    if isinstance(reference, str):
        return reference
    if method not in reference:
        raise ConfigError(f"reference: no reference method given for {method!r}; known: {sorted(reference)}")
    return reference[method]


def _cell(length: int | None, method: str, ref: str, rs: list[Record], refs: Mapping[str, Record]) -> Summary:
    paired = [(refs[r.sample_id], r) for r in rs if r.sample_id in refs]
    ttft = np.array([r.ttft_s for r in rs])
    med = float(np.median(ttft))
    ref_med = _median([f.ttft_s for f, _ in paired])
    frac = float(np.mean([r.token_layer_fraction for r in rs]))
    speedup = ref_med / med if med > 0 else float("nan")
    diffs = [r.score - f.score for f, r in paired]
    decode = [r.decode_s_per_token for r in rs if r.decode_s_per_token is not None]
    firsts = [(f.extra["first_token"], r.extra["first_token"]) for f, r in paired
              if "first_token" in f.extra and "first_token" in r.extra]
    kls = [float(r.extra["first_token_kl"]) for r in rs if r.extra.get("first_token_kl") is not None]
    metric_names = sorted({k for r in rs for k in r.metrics})
    return Summary(
        length=length,
        method=method,
        reference=ref,
        n=len(rs),
        n_paired=len(paired),
        ttft_median_s=med,
        ttft_p25_s=float(np.percentile(ttft, 25)),
        ttft_p75_s=float(np.percentile(ttft, 75)),
        reference_ttft_median_s=ref_med,
        speedup=speedup,
        speedup_paired_median=_median([f.ttft_s / r.ttft_s for f, r in paired]),
        score_mean=float(np.mean([r.score for r in rs])),
        reference_score_mean=_mean([f.score for f, _ in paired]),
        score_diff=float(np.mean(diffs)) if diffs else float("nan"),
        score_diff_ci95=bootstrap_ci(diffs),
        metric_means={m: _mean([r.metrics[m] for r in rs if m in r.metrics]) for m in metric_names},
        token_layer_fraction=frac,
        ideal_speedup=1.0 / frac if frac > 0 else float("nan"),
        realised_over_ideal=speedup * frac,
        flops_ratio=float(np.mean([r.prefill_flops / f.prefill_flops for f, r in paired])) if paired else float("nan"),
        flops_median=_median([r.prefill_flops for r in rs]),
        decode_s_per_token_median=float(np.median(decode)) if decode else None,
        total_median_s=_median([r.total_s for r in rs]),
        reference_total_median_s=_median([f.total_s for f, _ in paired]),
        new_tokens_mean=_mean([r.new_tokens for r in rs]),
        new_tokens_median=_median([r.new_tokens for r in rs]),
        peak_mem_mb=float(max(r.peak_mem_mb for r in rs)),
        first_token_agreement=_mean([float(a == b) for a, b in firsts]) if firsts else None,
        identical_answers=_mean([float(r.output.strip() == f.output.strip()) for f, r in paired]),
        first_token_kl_median=_median(kls) if kls else None,
        first_token_kl_n=len(kls),
        counters=_counters(rs),
        gold_kept_share_per_stage=_gold_shares(rs),
        total_speedup_paired_median=_median([f.total_s / r.total_s for f, r in paired]),
        slower_total_share=_mean([float(r.total_s > f.total_s) for f, r in paired]),
    )


def summarize(
    records: Sequence[Record],
    reference: str | Mapping[str, str] = FULL,
    order: Sequence[str] | None = None,
) -> list[Summary]:
    """One :class:`Summary` per (length, method), lengths ascending (``None`` last).

    Args:
        records: runs of one benchmark (every method on the same samples).
        reference: the method every other is paired with, or a mapping method -> its reference
            (a method may be its own reference).
        order: method order within a length; by default the reference methods first, then the
            rest alphabetically. Methods not listed follow, alphabetically.

    Raises:
        ConfigError: a mapping ``reference`` without an entry for a method in ``records``.
    """
    cells: dict[tuple[Any, str], list[Record]] = defaultdict(list)
    for r in records:
        cells[(r.length, r.method)].append(r)
    refs_of = {m: _reference_of(reference, m) for _, m in cells}
    is_ref = set(refs_of.values())
    rank = {m: i for i, m in enumerate(order or ())}
    out: list[Summary] = []
    for length in sorted({k[0] for k in cells}, key=lambda x: (x is None, x)):
        methods = [m for (ln, m) in cells if ln == length]
        if order is None:
            methods.sort(key=lambda m: (m not in is_ref, m))
        else:
            methods.sort(key=lambda m: (rank.get(m, len(rank)), m))
        for m in methods:
            ref = refs_of[m]
            ref_records = {r.sample_id: r for r in cells.get((length, ref), [])}
            out.append(_cell(length, m, ref, cells[(length, m)], ref_records))
    return out


