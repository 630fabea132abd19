"""KV-Runahead load balancing: a cost model of the chain and a hierarchical grid search.

:class:`CostModel` predicts the chain's TTFT (:meth:`CostModel.runahead_s`) by simulating the
per-layer pipeline of the chain exactly as :mod:`fastprefill.methods.runahead.method` runs it
(own q/k/v, wait for the prefix, send on, attention + MLP); one rank is plain prefill
(``runahead_s([total])``). Its coefficients come from FLOP counts (:meth:`CostModel.from_flops`)
or from timing a decoder layer on this machine (:func:`fastprefill.methods.runahead.calibrate.calibrate`,
which ``fastprefill calibrate-runahead`` runs).

*choose* (the search): the paper searches partitions offline with a grid search on measured
TTFT; we search on the calibrated cost model instead, because one measured candidate costs a
full multi-process prefill while the model evaluates in microseconds. Evidence that the fitted
model ranks partitions right is the benchmark ``benchmarks/runahead_ttft.py`` (even vs searched,
measured). :func:`search_partition` is hierarchical: a coarse grid over the simplex of chunk
fractions, then a local grid around the best point with the step halved down to one token.

Shapes: chunk sizes are token counts; a KV message for a prefix of ``s`` tokens is two
``(1, H_kv, s, d)`` tensors (keys, values).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fastprefill.methods.runahead.plan import PartitionPlan, check_procs
from fastprefill.models.shape import ModelShape

__all__ = ["CostModel", "search_partition"]


@dataclass(frozen=True)
class CostModel:
    """Seconds of one rank's work per decoder layer, and of moving KV between ranks.

    Attributes:
        num_layers: ``L``.
        layer_overhead_s: fixed cost of one layer call.
        linear_s_per_token: q/k/v/o projections + MLP, per token.
        attn_s_per_pair: attention per (query, key) pair computed by the kernel (all heads).
        qkv_fraction: share of the linear work done before a layer needs the received prefix
            (the q/k/v projections; the rest, o-proj + MLP, follows the attention).
        kv_bytes_per_token: keys + values of one token at one layer (``2 * H_kv * d * itemsize``).
        bandwidth_bytes_s: point-to-point bandwidth between neighbouring ranks.
        latency_s: per-message latency.
        head_s: final norm + LM head for one row.
        causal_kernel_pairs: pairs the single-rank kernel computes for a plain causal block of
            ``c`` queries: ``"half"`` (``c*(c+1)/2``; a kernel that skips the upper triangle) or
            ``"full"`` (``c*c``; a masked kernel). Ranks with a prefix use an explicit mask and
            compute the full ``c * (s + c)`` rectangle.
    """

    num_layers: int
    layer_overhead_s: float
    linear_s_per_token: float
    attn_s_per_pair: float
    qkv_fraction: float
    kv_bytes_per_token: float
    bandwidth_bytes_s: float
    latency_s: float
    head_s: float = 0.0
    causal_kernel_pairs: str = "half"
    notes: dict[str, Any] = field(default_factory=dict, compare=False)

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_flops(
        cls,
        shape: ModelShape,
        flops_per_s: float,
        bandwidth_bytes_s: float,
        latency_s: float = 10e-6,
        bytes_per_element: int = 2,
        layer_overhead_s: float = 0.0,
    ) -> CostModel:
        """An uncalibrated model from FLOP counts at a sustained ``flops_per_s`` (projections)."""
        lin = shape.linear_flops_per_token() / flops_per_s
        pair = shape.attention_flops(1) / flops_per_s
        d_kv = shape.num_kv_heads * shape.head_dim
        qkv = shape.qkv_share()
        return cls(
            num_layers=shape.num_layers,
            layer_overhead_s=layer_overhead_s,
            linear_s_per_token=lin,
            attn_s_per_pair=pair,
            qkv_fraction=qkv,
            kv_bytes_per_token=2 * d_kv * bytes_per_element,
            bandwidth_bytes_s=bandwidth_bytes_s,
            latency_s=latency_s,
            head_s=shape.head_flops(1) / flops_per_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**d)

    # --- predictions --------------------------------------------------------------------------
    def _own_pairs(self, c: int) -> float:
        return c * (c + 1) / 2 if self.causal_kernel_pairs == "half" else float(c * c)

    def transfer_s(self, tokens: int) -> float:
        """Seconds to send the KV of ``tokens`` rows of one layer (keys and values)."""
        return self.latency_s + tokens * self.kv_bytes_per_token / self.bandwidth_bytes_s

    def runahead_s(self, chunks: Sequence[int]) -> float:
        """Predicted TTFT of the KV-Runahead chain with these chunk sizes.

        Simulates, per layer ``l`` and rank ``i``: own q/k/v (``qkv_fraction`` of the linear
        work), then wait until the prefix KV of layer ``l`` sent by rank ``i-1`` has arrived
        (rank ``i-1`` sends as soon as its own KV of layer ``l`` is appended), then attention
        over ``s_i + c_i`` keys and the rest of the layer. Sends are asynchronous and overlap
        the sender's remaining work. Returns the last rank's finish time plus the LM head.
        """
        prev_ready: list[float] | None = None  # kv-ready time of rank i-1 per layer
        s = 0
        finish = 0.0
        for i, c in enumerate(chunks):
            ready = []
            t = 0.0
            lin, lin_pre = self.linear_s_per_token * c, self.linear_s_per_token * c * self.qkv_fraction
            pairs = self._own_pairs(c) if i == 0 else c * (s + c)
            attn = self.attn_s_per_pair * pairs
            arrive = self.transfer_s(s) if i else 0.0
            for layer in range(self.num_layers):
                t += self.layer_overhead_s / 2 + lin_pre
                if prev_ready is not None:
                    t = max(t, prev_ready[layer] + arrive)
                ready.append(t)
                t += self.layer_overhead_s / 2 + attn + (lin - lin_pre)
            prev_ready, s, finish = ready, s + c, t
        return finish + self.head_s


def _compositions(units: int, parts: int) -> Any:
    """All tuples of ``parts`` positive integers summing to ``units``."""
    for cuts in itertools.combinations(range(1, units), parts - 1):
        bounds = (0,) + cuts + (units,)
        yield tuple(bounds[k + 1] - bounds[k] for k in range(parts))


def search_partition(total: int, procs: int, cost: CostModel, max_coarse: int = 4000) -> PartitionPlan:
    """Hierarchical grid search for the chunk sizes minimising :meth:`CostModel.runahead_s`.

    Level 0: every composition of ``units`` grid steps into ``procs`` parts, with ``units`` the
    largest number that keeps the count at most ``max_coarse`` (e.g. 4000 points for 2 ranks,
    15 units for 8). Then refinement: around the best point, try moving ``step`` tokens from
    any chunk to any other (a local grid), keep the best, and halve ``step`` when nothing
    improves, down to one token.

    Raises:
        ConfigError: ``procs < 1`` or ``procs > total``.
    """
    check_procs(procs, total)
    if procs == 1:
        return PartitionPlan((total,), total)
    units = procs
    while units < total and math.comb(units, procs - 1) <= max_coarse:
        units += 1
    best = PartitionPlan.even(total, procs).chunks
    best_t = cost.runahead_s(best)
    for comp in _compositions(units, procs):
        cand = PartitionPlan.from_fractions(total, comp).chunks
        t = cost.runahead_s(cand)
        if t < best_t:
            best, best_t = cand, t
    step = max(1, total // (2 * units))
    while step >= 1:
        improved = True
        while improved:
            improved = False
            for a, b in itertools.permutations(range(procs), 2):
                if best[a] - step < 1:
                    continue
                cand = list(best)
                cand[a] -= step
                cand[b] += step
                t = cost.runahead_s(cand)
                if t < best_t - 1e-12:
                    best, best_t, improved = tuple(cand), t, True
        step //= 2
    return PartitionPlan(best, total)
