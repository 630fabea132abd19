"""Which seams fail: a blended cache's K/V against full prefill's, per token, binned by seam.

A blend prompt is a lead, passages, the glue between them and the question. Each passage's K/V
was computed without its neighbours (:mod:`fastprefill.methods.research.blend`); where the blended cache
(after the recompute) differs from full prefill's, and whether that decides the answer, is read
from the dev gate's own runs (``benchmarks/blend_gate.py``), outside TTFT:

- :class:`SeamRecorder` hands out full prefill and blend methods that keep the K/V their last
  prefill returned (:class:`KVSink`: references to the cache's per-layer tensors, no copy;
  decoding appends by concatenation, so the kept tensors stay the prefill's). Once a run and
  full prefill's run on the same prompt have both finished, it adds to every record
  ``extra["gold_passages"]`` (the 1-based indices of the passages that hold the answer:
  HotpotQA's supporting facts) and ``extra["passages"]``, and to a blend record
  ``extra["seam"]`` (:func:`seam_stats`, with the seconds it took).
- :func:`token_errors`: each token's relative L2 error of keys and of values against full
  prefill's (over heads and channels) at every layer.
- :func:`seam_stats`: those errors, averaged over layers, binned (token-weighted means and token
  counts only): by offset from the start of the token's passage (:data:`OFFSET_EDGES`; a passage
  placed where it was computed is left out), per passage, for the glue and for the question;
  and at the first, middle and last layer.
- :func:`seam_row`: one method's records pooled (token-weighted), and first-token agreement by
  where the gold passages sit (:func:`gold_group`); :func:`seam_tables` prints them. The gate's
  summary and its check (``benchmarks/figures/results.py``) call the same functions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastprefill.bench.records import FULL, Record
from fastprefill.cache import layer_kv
from fastprefill.methods.base import PrefillOutput
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.research.blend import Blend

__all__ = ["GOLD_GROUPS", "OFFSET_EDGES", "KVSink", "KeepingBlend", "KeepingFull", "SeamPrompt", "SeamRecorder",
           "agreement_by_gold", "gold_group", "offset_labels", "seam_row", "seam_stats", "seam_summary",
           "seam_tables", "token_errors"]

#: The lower edges of the offset bins (offset 0, 1-3, 4-15, 16-63, 64 and on).
OFFSET_EDGES: tuple[int, ...] = (0, 1, 4, 16, 64)
#: Where a prompt's gold passages sit (:func:`gold_group`).
GOLD_GROUPS: tuple[str, ...] = ("1st half", "both halves", "2nd half")

KV = Sequence[tuple[torch.Tensor, torch.Tensor]]


class KVSink:
    """What one method's last prefill returned: its ids ``(1, N)`` and per layer ``(K, V)``, each
    ``(1, H_kv, N, d)`` (the cache's own tensors)."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(self, ids: torch.Tensor, cache: Any) -> None:
        """Hold ``cache``'s per-layer tensors (references: nothing is copied)."""
        self.ids, self.kv = ids, [layer_kv(cache, i) for i in range(len(cache.layers))]

    def take(self, ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The kept K/V if the last prefill ran exactly ``ids``, else ``None``."""
        if self.ids is None or self.ids.shape[1] != len(ids) or self.ids[0].tolist() != list(ids):
            return None
        return self.kv

    def clear(self) -> None:
        self.ids, self.kv = None, []


@dataclass
class _Keeps:
    """A method that keeps the K/V of its last prefill in ``sink``."""

    sink: KVSink = field(default_factory=KVSink, repr=False, compare=False, metadata={"spec": False})

    def prefill(self, model: Any, input_ids: torch.Tensor, prefix: Any = None) -> PrefillOutput:
        out: PrefillOutput = super().prefill(model, input_ids, prefix)  # type: ignore[misc]
        self.sink.keep(input_ids, out.cache)
        return out


@dataclass
class KeepingFull(_Keeps, FullPrefill):
    """Full prefill, keeping its K/V."""


@dataclass
class KeepingBlend(_Keeps, Blend):
    """Blend, keeping its blended K/V (after the recompute)."""


@dataclass(frozen=True)
class SeamPrompt:
    """One prompt: its ids, its passages' ``[start, end)`` spans (in order) and the 1-based
    indices of its gold passages."""

    ids: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    gold: tuple[int, ...]


class SeamRecorder:
    """Makes the methods that keep their K/V, and adds the seam data to each record (module docstring).

    Args:
        prompts: sample id -> :class:`SeamPrompt`.
    """

    def __init__(self, prompts: Mapping[str, SeamPrompt]) -> None:
        self.prompts = dict(prompts)
        self.sinks: dict[str, KVSink] = {}

    def full(self) -> KeepingFull:
        """Full prefill, the reference (named :data:`FULL` in the records)."""
        method = KeepingFull()
        self.sinks[FULL] = method.sink
        return method

    def blend(self, name: str, **settings: Any) -> KeepingBlend:
        """A :class:`~fastprefill.methods.research.blend.Blend` with ``settings``, recorded as ``name``."""
        method = KeepingBlend(**settings)
        self.sinks[name] = method.sink
        return method

    def annotate(self, record: Record) -> None:
        """Add the gold passages to ``record``, and for a blend run whose prompt full prefill has
        run last, its seam data (then the run's K/V is let go)."""
        prompt = self.prompts.get(record.sample_id)
        if prompt is None:
            return
        record.extra.update(gold_passages=list(prompt.gold), passages=len(prompt.chunks))
        sink, ref = self.sinks.get(record.method), self.sinks.get(FULL)
        if record.method == FULL or sink is None or ref is None:
            return
        started = time.perf_counter()
        mine, full = sink.take(prompt.ids), ref.take(prompt.ids)
        if mine is None or full is None:
            return
        exact_first = record.extra.get("exact_chunk_tokens", 0) > 0  # the first passage sits where computed
        moved = [i > 0 or not exact_first for i in range(len(prompt.chunks))]
        stats = seam_stats(token_errors(full, mine, len(prompt.ids)), prompt.chunks, moved)
        sink.clear()
        record.extra["seam"] = {**stats, "seconds": round(time.perf_counter() - started, 4)}


def token_errors(full: KV, other: KV, n: int) -> torch.Tensor:
    """The relative L2 error ``||other - full|| / ||full||`` (over heads and channels) of each of
    the first ``n`` positions' keys and values, at every layer.

    Args:
        full, other: per layer ``(K, V)``, each ``(1, H_kv, N, d)`` with ``N >= n``.

    Returns:
        ``(2, L, n)`` float32 on the CPU: keys ``[0]``, values ``[1]``.
    """
    out = torch.zeros(2, len(full), n)
    for layer, (ref, mine) in enumerate(zip(full, other, strict=True)):
        for j in range(2):
            a, b = ref[j][0, :, :n].float(), mine[j][0, :, :n].float()  # (H_kv, n, d)
            norm = a.square().sum((0, 2)).sqrt().clamp_min(1e-12)
            out[j, layer] = ((b - a).square().sum((0, 2)).sqrt() / norm).cpu()
    return out


def _num(x: float) -> float:
    return float(f"{x:.6g}")


def _cell(per_token: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """``{"tokens", "k", "v"}``: the mean key and value error of ``positions`` ``(P,)`` (``None``
    for no position) under ``per_token`` ``(2, n)``."""
    if not positions.numel():
        return {"tokens": 0, "k": None, "v": None}
    mean = per_token[:, positions].mean(1)
    return {"tokens": int(positions.numel()), "k": _num(float(mean[0])), "v": _num(float(mean[1]))}


def _cells(per_token: torch.Tensor, groups: Sequence[torch.Tensor]) -> dict[str, list[Any]]:
    cells = [_cell(per_token, g) for g in groups]
    return {key: [c[key] for c in cells] for key in ("tokens", "k", "v")}


def seam_stats(errors: torch.Tensor, chunks: Sequence[tuple[int, int]], moved: Sequence[bool],
               edges: Sequence[int] = OFFSET_EDGES) -> dict[str, Any]:
    """One run's seam data (what a record keeps: means and token counts).

    Args:
        errors: ``(2, L, n)`` per-layer key and value errors of each position (:func:`token_errors`).
        chunks: the passages' ``[start, end)`` spans, in order.
        moved: per passage, whether it sits elsewhere than where its K/V was computed (only those
            count in ``offset`` and ``layers``).
        edges: the offset bins' lower edges, from 0 (:data:`OFFSET_EDGES`).

    Returns:
        ``edges``; ``offset`` and ``passage`` (``{"tokens", "k", "v"}`` lists, per bin and per
        passage; ``passage["moved"]`` too); ``glue`` (between passages) and ``question`` (after the
        last passage), each ``{"tokens", "k", "v"}``; ``layers``: ``index`` (first, middle, last)
        and the moved passages' mean ``k`` and ``v`` at each. Errors are averaged over layers
        except in ``layers``.
    """
    n, layers = errors.shape[2], errors.shape[1]
    per_token = errors.mean(1)  # (2, n)
    spans = [torch.arange(s, e) for s, e in chunks]
    away = [span for span, m in zip(spans, moved, strict=True) if m]
    positions = torch.cat(away) if away else torch.empty(0, dtype=torch.long)
    offsets = torch.cat([span - span[0] for span in away]) if away else positions
    bins = torch.searchsorted(torch.tensor(list(edges)), offsets, right=True) - 1
    in_passage = torch.zeros(n, dtype=torch.bool)
    in_passage[torch.cat(spans)] = True
    glue = torch.arange(chunks[0][0], chunks[-1][1])[~in_passage[chunks[0][0]:chunks[-1][1]]]
    index = [0, layers // 2, layers - 1]
    deep = errors[:, index][:, :, positions].mean(2) if positions.numel() else None  # (2, 3)
    return {
        "edges": list(edges),
        "offset": _cells(per_token, [positions[bins == b] for b in range(len(edges))]),
        "passage": {**_cells(per_token, spans), "moved": [bool(m) for m in moved]},
        "glue": _cell(per_token, glue),
        "question": _cell(per_token, torch.arange(chunks[-1][1], n)),
        "layers": {"index": index, "k": None if deep is None else [_num(float(x)) for x in deep[0]],
                   "v": None if deep is None else [_num(float(x)) for x in deep[1]]},
    }


def _pool(cells: Sequence[tuple[float | None, int]]) -> float | None:
    """The token-weighted mean of ``(mean, tokens)`` cells (``None`` without a token)."""
    tokens = sum(t for m, t in cells if m is not None)
    return sum(m * t for m, t in cells if m is not None) / tokens if tokens else None


def _pooled(cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{"tokens", "k", "v"}`` cells pooled."""
    return {"tokens": sum(c["tokens"] for c in cells),
            "k": _pool([(c["k"], c["tokens"]) for c in cells]), "v": _pool([(c["v"], c["tokens"]) for c in cells])}


def _column(lists: Mapping[str, Sequence[Any]], i: int) -> dict[str, Any]:
    return {key: lists[key][i] for key in ("tokens", "k", "v")}


def seam_summary(seams: Sequence[Mapping[str, Any]], golds: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One method's seam data pooled over its prompts (token-weighted means).

    Args:
        seams: each run's ``extra["seam"]`` (:func:`seam_stats`).
        golds: each run's gold passages (1-based).

    Returns:
        ``prompts``, ``edges``; ``offset`` (lists per bin), ``glue``, ``question``; ``gold`` and
        ``other``: the moved gold and other passages; ``passage``: per index (lists, with how
        many ``prompts`` have it); ``layers``: the mean ``k`` and ``v`` at the first, middle and
        last layer (weighted by the moved tokens); ``seconds_mean``.

    Raises:
        ValueError: runs binned by different offset edges.
    """
    edges = seams[0]["edges"]
    if any(s["edges"] != edges for s in seams):
        raise ValueError("seam data binned by different offset edges cannot be pooled")
    offset = [_pooled([_column(s["offset"], b) for s in seams]) for b in range(len(edges))]
    groups: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for s, gold in zip(seams, golds, strict=True):
        for i, moved in enumerate(s["passage"]["moved"]):
            if moved:
                groups[i + 1 in gold].append(_column(s["passage"], i))
    most = max(len(s["passage"]["tokens"]) for s in seams)
    per_index = [[_column(s["passage"], i) for s in seams if i < len(s["passage"]["tokens"])] for i in range(most)]
    passage = [{**_pooled(cells), "prompts": len(cells)} for cells in per_index]
    weights = [sum(s["offset"]["tokens"]) for s in seams]
    return {
        "prompts": len(seams), "edges": edges,
        "offset": {key: [c[key] for c in offset] for key in ("tokens", "k", "v")},
        "glue": _pooled([s["glue"] for s in seams]), "question": _pooled([s["question"] for s in seams]),
        "gold": _pooled(groups[True]), "other": _pooled(groups[False]),
        "passage": {key: [c[key] for c in passage] for key in ("prompts", "tokens", "k", "v")},
        "layers": {key: [_pool([(s["layers"][key][j], w) for s, w in zip(seams, weights, strict=True)
                                if s["layers"][key] is not None]) for j in range(3)] for key in ("k", "v")},
        "seconds_mean": statistics.mean(s.get("seconds", 0.0) for s in seams),
    }


def gold_group(gold: Sequence[int], passages: int) -> str | None:
    """Where the gold passages (1-based) of a prompt of ``passages`` sit: every one in the first
    half (index <= passages / 2), every one in the second, or some in each (``None``: no gold)."""
    if not gold:
        return None
    if max(gold) <= passages / 2:
        return GOLD_GROUPS[0]
    return GOLD_GROUPS[2] if min(gold) > passages / 2 else GOLD_GROUPS[1]


def agreement_by_gold(pairs: Sequence[tuple[Record, Record]]) -> dict[str, list[int]]:
    """Per :data:`GOLD_GROUPS` group: ``[runs whose first token is full prefill's, runs]`` over
    ``(full prefill's record, the method's record)`` pairs (records without gold passages skipped)."""
    out = {g: [0, 0] for g in GOLD_GROUPS}
    for f, r in pairs:
        group = gold_group(r.extra.get("gold_passages", []), r.extra.get("passages", 0))
        if group is not None:
            out[group][0] += int(f.extra["first_token"] == r.extra["first_token"])
            out[group][1] += 1
    return out


def seam_row(pairs: Sequence[tuple[Record, Record]]) -> dict[str, Any]:
    """The seam figures of one method's runs paired with full prefill's: ``agreement_by_gold``
    when the records name their gold passages, ``seam`` (:func:`seam_summary`) when they hold
    seam data; ``{}`` for records that hold neither."""
    out: dict[str, Any] = {}
    if any("gold_passages" in r.extra for _, r in pairs):
        out["agreement_by_gold"] = agreement_by_gold(pairs)
    runs = [r for _, r in pairs if "seam" in r.extra]
    if runs:
        out["seam"] = seam_summary([r.extra["seam"] for r in runs], [r.extra["gold_passages"] for r in runs])
    return out


def offset_labels(edges: Sequence[int]) -> list[str]:
    """``[0, 1, 4]`` -> ``["0", "1-3", "4+"]``."""
    out = []
    for lo, hi in zip(edges, [*edges[1:], None], strict=True):
        out.append(f"{lo}+" if hi is None else str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}")
    return out


_ERRORS = ("Relative L2 error of each token's keys / values against full prefill's (over heads and channels), "
           "averaged over layers (except the layer columns), then over tokens and prompts. Offsets count from "
           "the start of the token's passage; the offset, gold, other and layer columns leave out a passage "
           "placed where it was computed (the first, with anchor lead).")


def _kv(k: float | None, v: float | None) -> str:
    return "—" if k is None or v is None else f"{k:.3f} / {v:.3f}"


def _seam_lines(seams: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """The three error tables: by offset, gold against other passages with the layers, by passage."""
    labels = offset_labels(seams[0][1]["edges"])
    lines = ["| method | " + " | ".join(f"offset {x}" for x in labels) + " | glue | question |",
             "|---" * (len(labels) + 3) + "|"]
    for name, s in seams:
        cells = [_kv(k, v) for k, v in zip(s["offset"]["k"], s["offset"]["v"], strict=True)]
        lines.append(f"| {name} | " + " | ".join([*cells, _kv(s["glue"]["k"], s["glue"]["v"]),
                                                   _kv(s["question"]["k"], s["question"]["v"])]) + " |")
    lines += ["", "| method | gold passages | other passages | first layer | middle layer | last layer |",
              "|---|---|---|---|---|---|"]
    for name, s in seams:
        layers = [_kv(k, v) for k, v in zip(s["layers"]["k"], s["layers"]["v"], strict=True)]
        lines.append(f"| {name} | {_kv(s['gold']['k'], s['gold']['v'])} | "
                     f"{_kv(s['other']['k'], s['other']['v'])} | " + " | ".join(layers) + " |")
    most = max(len(s["passage"]["k"]) for _, s in seams)
    lines += ["", "| passage | prompts | " + " | ".join(name for name, _ in seams) + " |",
              "|---" * (len(seams) + 2) + "|"]
    for i in range(most):
        prompts = max(s["passage"]["prompts"][i] if i < len(s["passage"]["k"]) else 0 for _, s in seams)
        cells = [_kv(s["passage"]["k"][i], s["passage"]["v"][i]) if i < len(s["passage"]["k"]) else "—"
                 for _, s in seams]
        lines.append(f"| {i + 1} | {prompts} | " + " | ".join(cells) + " |")
    return lines


def seam_tables(rows: Sequence[Mapping[str, Any]]) -> str:
    """The gate's seam section in markdown from its summary rows (:func:`seam_row`'s keys); ``""``
    when no row has seam figures."""
    seams = [(r["method"], r["seam"]) for r in rows if "seam" in r]
    golds = [(r["method"], r["agreement_by_gold"]) for r in rows if "agreement_by_gold" in r]
    if not seams and not golds:
        return ""
    lines = ["", "## Seams: where the blended K/V differs from full prefill's", ""]
    if seams:
        seconds = statistics.mean(s["seconds_mean"] for _, s in seams)
        lines += [_ERRORS, "", *_seam_lines(seams), "",
                  f"Seam analysis: {seconds:.3f} s per blend run (mean), outside TTFT.", ""]
    if golds:
        lines += ["First-token agreement with full prefill by where the gold passages sit (agreeing / prompts):",
                  "", "| method | " + " | ".join(f"gold in {g}" for g in GOLD_GROUPS) + " |",
                  "|---" * (len(GOLD_GROUPS) + 1) + "|"]
        for name, groups in golds:
            cells = [f"{a / n:.2f} ({a}/{n})" if n else "— (0/0)" for a, n in (groups[g] for g in GOLD_GROUPS)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
