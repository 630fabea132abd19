"""How much better could a LazyLLM cut choose? Oracle selections at the same budget (dev diagnostic).

A one-cut schedule keeps ``k`` tokens at its pruning layer. :func:`selection_ceiling` runs the
same cut, same ``k`` and same protected tokens (sinks, recent, last) three ways and compares
each first token with full prefill's:

- ``policy``: the method's own score (the attention of its query window at the cut);
- ``gold``: the task's gold tokens first (:meth:`gold_token_positions`, ranked among themselves
  by the policy's score), then the policy's order: what a selection that always found the gold
  passages would give;
- ``deep``: ranked by the attention of the same query window at a deeper *probe* layer of the
  full model (pooled as the policy pools), i.e. what a score that already saw ``probe_depth``
  of the model would pick. The probe's cost is not charged: this is a ceiling, not a method.

Only the selection differs between the three (the same mechanism, :func:`progressive_prefill`),
so the gap between ``policy`` and the oracles is what a better score could still buy at this
budget, and the gap between the oracles and 100% is what the budget itself costs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastprefill.bench.runner import first_token_kl, gold_kept_shares
from fastprefill.errors import ConfigError
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.pruning import (
    SelectFn,
    pool_in_position_order,
    probe_scores,
    progressive_prefill,
    recording_kept_positions,
    top_k_keep,
)
from fastprefill.methods.pruning.scorers import AttentionScorer
from fastprefill.models.adapters import DecoderAdapter

__all__ = ["ORACLES", "CeilingRow", "ceiling_summary", "oracle_select", "selection_ceiling", "summarize_ceiling"]

#: The selections compared, in report order.
ORACLES = ("policy", "gold", "deep")


def oracle_select(priority: torch.Tensor | None = None, first: torch.Tensor | None = None) -> SelectFn:
    """A ``select`` for a schedule's *first* cut (every prompt row present, row ``i`` = position ``i``).

    Protected rows (``+inf``) stay protected. The other candidates are ranked by ``priority``
    ``(T,)`` instead of the cut's score when it is given, and the positions in ``first`` ``(G,)``
    come before every other candidate (ranked among themselves by the same order).
    """

    def select(scores: torch.Tensor, k: int) -> torch.Tensor:
        free = torch.isfinite(scores)  # (T,)
        order = scores.clone()
        if priority is not None:
            order[free] = priority.to(order.dtype)[free]
        if first is not None and bool(free.any()):
            lift = torch.zeros_like(free)
            lift[first] = True
            span = float(order[free].max() - order[free].min()) + 1.0
            order[free & lift] += span
        return top_k_keep(order, k)

    return select


@dataclass(frozen=True)
class CeilingRow:
    """One prompt under one selection: agreement and KL with full prefill, gold share kept."""

    sample_id: str
    selection: str
    first_token_agrees: bool
    first_token_kl: float
    gold_kept_share: float
    token_layer_fraction: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def selection_ceiling(
    model: Any, tokenizer: Any, task: Any, samples: Sequence[Any], method: LazyLLM, probe_depth: float = 0.67,
    progress: Callable[[Any], Any] | None = None,
) -> list[CeilingRow]:
    """Run ``method``'s one-cut schedule under the three :data:`ORACLES` on every sample.

    Args:
        task: a task with ``gold_token_positions(sample, tokenizer)`` (multidoc-qa, needle, ...).
        samples: the task's samples (``input_ids`` of ``T`` tokens each).
        method: a LazyLLM whose schedule resolves to exactly one cut for this model.
        probe_depth: the ``deep`` oracle's probe layer, ``floor(probe_depth * L)``, in ``[0, 1)``
            and below the last layer.
        progress: wraps the sample iterable (e.g. ``tqdm``).

    Returns:
        ``len(samples) * 3`` rows, sample by sample in :data:`ORACLES` order.

    Raises:
        ConfigError: a schedule with other than one cut, a probe depth out of range, or a task
            without gold positions.
    """
    ad = DecoderAdapter(model, method="selection ceiling")
    schedule = method.resolved(ad.num_layers)
    if len(schedule) != 1:
        raise ConfigError(f"selection_ceiling needs a one-cut schedule, {method.describe()} has {len(schedule)} cuts")
    if not 0.0 <= probe_depth < 1.0 or int(probe_depth * ad.num_layers) >= ad.num_layers - 1:
        raise ConfigError(f"probe_depth must be in [0, 1) and below the last layer, got {probe_depth!r}")
    if not hasattr(task, "gold_token_positions"):
        raise ConfigError(f"task {getattr(task, 'name', task)!r} knows no gold positions")
    opts = method.options
    probe_layer = int(probe_depth * ad.num_layers)
    rows: list[CeilingRow] = []
    for sample in progress(samples) if progress else samples:
        ids = torch.tensor([sample.input_ids], device=ad.device)  # (1, T)
        t = int(ids.shape[1])
        with torch.inference_mode():
            reference = model(ids).logits[0, -1].float()  # (V,)
        gold = task.gold_token_positions(sample, tokenizer).to(ad.device)  # (G,)
        positions = torch.arange(t, device=ad.device)
        deep = probe_scores(ad, ids, probe_layer, AttentionScorer(opts.score_window))  # (T,)
        deep = pool_in_position_order(deep, positions, torch.ones_like(positions, dtype=torch.bool), opts.pool_kernel)
        selects = {"policy": method.select, "gold": oracle_select(first=gold), "deep": oracle_select(priority=deep)}
        for name in ORACLES:
            with recording_kept_positions():
                out = progressive_prefill(ad, ids, schedule, selects[name], opts).output
            kept = out.stats.extra["kept_positions"]
            rows.append(CeilingRow(
                sample_id=sample.id, selection=name,
                first_token_agrees=int(out.logits.argmax()) == int(reference.argmax()),
                first_token_kl=first_token_kl(reference, out.logits),
                gold_kept_share=gold_kept_shares(gold, kept)[0],
                token_layer_fraction=out.stats.token_layers / out.stats.total_token_layers,
            ))
    return rows


def summarize_ceiling(rows: Sequence[CeilingRow]) -> list[dict[str, Any]]:
    """Per selection: n, first-token agreement, median KL, mean gold share kept, token-layers."""
    out = []
    for name in ORACLES:
        mine = [r for r in rows if r.selection == name]
        if not mine:
            continue
        out.append({
            "selection": name, "n": len(mine),
            "first_token_agreement": sum(r.first_token_agrees for r in mine) / len(mine),
            "median_first_token_kl": statistics.median(r.first_token_kl for r in mine),
            "gold_kept_share_mean": sum(r.gold_kept_share for r in mine) / len(mine),
            "token_layer_fraction_mean": sum(r.token_layer_fraction for r in mine) / len(mine),
        })
    return out


def ceiling_summary(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A ceiling file's summary from its rows (a :class:`CeilingRow`'s fields plus ``length`` and
    ``preset``): :func:`summarize_ceiling` per (length, preset), in the order they first appear."""
    groups: dict[tuple[Any, Any], list[CeilingRow]] = {}
    for row in rows:
        fields = {k: v for k, v in row.items() if k not in ("length", "preset")}
        groups.setdefault((row["length"], row["preset"]), []).append(CeilingRow(**fields))
    return [{"length": length, "preset": preset, **entry}
            for (length, preset), got in groups.items() for entry in summarize_ceiling(got)]
