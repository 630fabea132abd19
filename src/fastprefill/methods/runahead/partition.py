"""KV-Runahead load balancing: frozen partition plans, a calibrated cost model, a grid search,
and per-context-length lookup tables.

In the KV-Runahead chain (arXiv 2405.05329) rank ``i`` attends its ``c_i`` queries over the
``s_i + c_i`` keys of chunks ``0..i`` (``s_i = c_0 + ... + c_{i-1}``), so later ranks do more
attention work per query and should get shorter chunks. The paper searches partitions offline
with a hierarchical grid search on measured TTFT, stores the best partition per context length
in a lookup table and interpolates at run time. Here:

- :class:`PartitionPlan` is the frozen plan (chunk sizes) computed before anything runs. Its
  prefix lengths tell every rank, in advance, the shape of every message it will receive, so
  no shape handshake is needed.
- :class:`CostModel` predicts the chain's TTFT (:meth:`CostModel.runahead_s`) by simulating the
  per-layer pipeline of the chain exactly as :mod:`fastprefill.methods.runahead.method` runs
  it (own q/k/v, wait for the prefix, send on, attention + MLP), and the all-gather baseline
  (:meth:`CostModel.tsp_s`).
- *choose* (the search): we search on the calibrated cost model instead of on measured TTFT
  for every candidate, because one measured candidate costs a full multi-process prefill
  (seconds at 4k tokens on a CPU) while the model evaluates in microseconds. The coefficients are
  fitted by timing one decoder layer for a grid of (chunk, prefix) sizes on this machine
  (:func:`calibrate`); the comm coefficients come from a loopback gloo ping-pong
  (:func:`measure_loopback`). Evidence that the fitted model ranks partitions right is the
  benchmark ``benchmarks/runahead_ttft.py`` (even vs searched, measured).
- :func:`search_partition` is hierarchical: a coarse grid over the simplex of chunk fractions,
  then a local grid around the best point with the step halved until it reaches one token.
- :class:`PartitionTable` holds the searched fractions per (ranks, context length) for a model
  shape; shipped tables live in ``tables/`` next to this file and are rebuilt by::

      python -m fastprefill.methods.runahead.partition --model smollm2-135m \\
          --out src/fastprefill/methods/runahead/tables/smollm2-135m.json

Shapes: chunk sizes are token counts; a KV message for a prefix of ``s`` tokens is two
``(1, H_kv, s, d)`` tensors (keys, values).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastprefill.errors import ConfigError
from fastprefill.models.shape import ModelShape

__all__ = [
    "CostModel",
    "PartitionPlan",
    "PartitionTable",
    "calibrate",
    "find_table",
    "search_partition",
]

TABLES_DIR = Path(__file__).with_name("tables")
#: Context lengths of the shipped tables (interpolated in log2 of the length in between).
TABLE_LENGTHS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
TABLE_RANKS: tuple[int, ...] = (2, 3, 4, 8)


@dataclass(frozen=True)
class PartitionPlan:
    """Contiguous chunk sizes of the prompt, one per rank, fixed before the run.

    Args:
        chunks: ``(c_0, ..., c_{P-1})``, each ``>= 1``.
        total: the prompt length ``T`` the chunks must sum to (``None``: not checked).

    Raises:
        ConfigError: no chunks, a chunk ``< 1`` or a non-integer, or a sum other than ``total``.
    """

    chunks: tuple[int, ...]
    total: int | None = None

    def __post_init__(self) -> None:
        chunks = tuple(self.chunks)
        object.__setattr__(self, "chunks", chunks)
        if not chunks:
            raise ConfigError("partition: needs at least one chunk (procs >= 1)")
        for i, c in enumerate(chunks):
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ConfigError(f"partition: chunk {i} is {c!r}; every chunk must be an integer >= 1")
        if self.total is not None and sum(chunks) != self.total:
            raise ConfigError(
                f"partition: chunk sizes {list(chunks)} sum to {sum(chunks)}, but the prompt has "
                f"{self.total} tokens; they must sum to the prompt length"
            )

    @classmethod
    def even(cls, total: int, procs: int) -> PartitionPlan:
        """As even as possible; the first ``total % procs`` chunks get one token more.

        Raises:
            ConfigError: ``procs < 1`` or ``procs > total``.
        """
        check_procs(procs, total)
        base, extra = divmod(total, procs)
        return cls(tuple(base + (1 if i < extra else 0) for i in range(procs)), total)

    @classmethod
    def from_fractions(cls, total: int, fractions: Sequence[float]) -> PartitionPlan:
        """Round fractions of ``total`` to integer chunks ``>= 1`` summing to ``total``
        (largest remainder)."""
        procs = len(fractions)
        check_procs(procs, total)
        s = float(sum(fractions))
        spare = total - procs  # every chunk gets 1, the rest by fraction
        raw = [max(f, 0.0) / s * spare for f in fractions]
        base = [math.floor(r) for r in raw]
        order = sorted(range(procs), key=lambda i: raw[i] - base[i], reverse=True)
        for i in order[: spare - sum(base)]:
            base[i] += 1
        return cls(tuple(b + 1 for b in base), total)

    @property
    def procs(self) -> int:
        return len(self.chunks)

    @property
    def length(self) -> int:
        return sum(self.chunks)

    def start(self, rank: int) -> int:
        """First original position of ``rank``'s chunk (= the prefix length it receives)."""
        return sum(self.chunks[:rank])

    def prefix_lengths(self) -> tuple[int, ...]:
        """``(s_0, ..., s_{P-1})`` with ``s_i = c_0 + ... + c_{i-1}`` (``s_0 = 0``)."""
        return tuple(itertools.accumulate((0,) + self.chunks[:-1]))

    def attention_pairs(self, rank: int) -> int:
        """Query-key dot products per layer and head that ``rank``'s masked kernel computes:
        the ``c_i x (s_i + c_i)`` block of its queries over chunks ``0..i`` (the paper's count:
        9 tokens split 4/3/2 give 16/21/18; the upper triangle right of the block is never
        computed)."""
        c, s = self.chunks[rank], self.start(rank)
        return c * (s + c)

    def kv_rows_moved(self) -> int:
        """Token rows of KV sent per layer along the chain: ``sum_{i>=1} s_i``."""
        return sum(self.prefix_lengths()[1:])


def check_procs(procs: Any, total: int) -> None:
    """Raise :class:`ConfigError` unless ``1 <= procs <= total``."""
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise ConfigError(f"procs must be an integer >= 1, got {procs!r}")
    if procs > total:
        raise ConfigError(
            f"procs ({procs}) is larger than the prompt ({total} tokens): every rank needs at least "
            "one token; use fewer processes or a longer prompt"
        )


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

    def single_s(self, total: int) -> float:
        """One process, plain causal prefill of ``total`` tokens."""
        per_layer = self.layer_overhead_s + self.linear_s_per_token * total + self.attn_s_per_pair * self._own_pairs(total)
        return self.num_layers * per_layer + self.head_s

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

    def tsp_s(self, total: int, procs: int) -> float:
        """Predicted TTFT of the all-gather baseline (even chunks, padded to the largest).

        Every layer: own linear work, a ring all-gather of ``(P-1)`` chunks of KV, attention of
        the own queries over all ``T`` keys (a masked kernel computes the whole rectangle), and
        all ranks move in lockstep.
        """
        c = -(-total // procs)
        gather = (procs - 1) * self.transfer_s(c) if procs > 1 else 0.0
        per_layer = self.layer_overhead_s + self.linear_s_per_token * c + gather + self.attn_s_per_pair * c * total
        if procs == 1:
            per_layer = self.layer_overhead_s + self.linear_s_per_token * c + self.attn_s_per_pair * self._own_pairs(c)
        return self.num_layers * per_layer + self.head_s


# --- search -------------------------------------------------------------------------------------
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


# --- lookup tables ------------------------------------------------------------------------------
def _shape_key(shape: ModelShape) -> dict[str, int]:
    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
    }


@dataclass(frozen=True)
class PartitionTable:
    """Searched chunk fractions per (ranks, context length) for one model shape.

    Attributes:
        model: the model's name (informational).
        shape: the :class:`ModelShape` fields the table applies to.
        entries: ``{procs: {length: fractions}}``.
        cost_model: the calibrated :class:`CostModel` the search used (as a dict).
        command: the command that rebuilds the table.
    """

    model: str
    shape: dict[str, int]
    entries: dict[int, dict[int, tuple[float, ...]]]
    cost_model: dict[str, Any]
    command: str = ""
    machine: dict[str, Any] = field(default_factory=dict)

    def matches(self, shape: ModelShape) -> bool:
        return self.shape == _shape_key(shape)

    def plan(self, total: int, procs: int) -> PartitionPlan:
        """Chunk sizes for ``total`` tokens on ``procs`` ranks.

        Fractions are interpolated linearly in ``log2(length)`` between the two nearest
        table lengths (clamped outside the table) and rounded to integers summing to ``total``.
        When ``procs`` is not in the table, the search runs on the stored cost model.
        """
        check_procs(procs, total)
        if procs == 1:
            return PartitionPlan((total,), total)
        rows = self.entries.get(procs)
        if not rows:
            return search_partition(total, procs, CostModel.from_dict(self.cost_model))
        lengths = sorted(rows)
        x = math.log2(total)
        if total <= lengths[0]:
            fr = rows[lengths[0]]
        elif total >= lengths[-1]:
            fr = rows[lengths[-1]]
        else:
            hi = next(k for k, n in enumerate(lengths) if n >= total)
            n0, n1 = lengths[hi - 1], lengths[hi]
            w = (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            fr = tuple((1 - w) * a + w * b for a, b in zip(rows[n0], rows[n1], strict=True))
        return PartitionPlan.from_fractions(total, fr)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "shape": self.shape,
            "command": self.command,
            "machine": self.machine,
            "cost_model": self.cost_model,
            "entries": {str(p): {str(n): list(f) for n, f in rows.items()} for p, rows in self.entries.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartitionTable:
        entries = {int(p): {int(n): tuple(f) for n, f in rows.items()} for p, rows in d["entries"].items()}
        return cls(d["model"], dict(d["shape"]), entries, dict(d["cost_model"]), d.get("command", ""), d.get("machine", {}))

    @classmethod
    def load(cls, path: str | Path) -> PartitionTable:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"partition table {path}: cannot read it ({exc})") from exc

    @classmethod
    def build(
        cls,
        model_name: str,
        shape: ModelShape,
        cost: CostModel,
        ranks: Sequence[int] = TABLE_RANKS,
        lengths: Sequence[int] = TABLE_LENGTHS,
        command: str = "",
        machine: dict[str, Any] | None = None,
    ) -> PartitionTable:
        """Search every (ranks, length) and store the chunk fractions."""
        entries: dict[int, dict[int, tuple[float, ...]]] = {}
        for p in ranks:
            entries[p] = {}
            for n in lengths:
                plan = search_partition(n, p, cost)
                entries[p][n] = tuple(round(c / n, 6) for c in plan.chunks)
        return cls(model_name, _shape_key(shape), entries, cost.to_dict(), command, machine or {})


def find_table(shape: ModelShape, directory: str | Path = TABLES_DIR) -> PartitionTable | None:
    """The shipped table whose model shape equals ``shape``, or ``None``.

    Cached per (shape, directory) in this process, so a prefill with ``partition="searched"``
    reads the JSON once, not inside every TTFT window.
    """
    return _find_table_cached(shape, str(directory))


@functools.lru_cache(maxsize=32)
def _find_table_cached(shape: ModelShape, directory: str) -> PartitionTable | None:
    for path in sorted(Path(directory).glob("*.json")):
        table = PartitionTable.load(path)
        if table.matches(shape):
            return table
    return None


# --- calibration --------------------------------------------------------------------------------
def _median_time(fn: Any, repeats: int) -> float:
    fn()  # warm-up, discarded
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(
    model: Any,
    chunks: Sequence[int] = (32, 128, 512),
    prefixes: Sequence[int] = (0, 1024, 3072),
    repeats: int = 3,
    bandwidth_bytes_s: float | None = None,
    latency_s: float | None = None,
    progress: bool = True,
) -> CostModel:
    """Fit a :class:`CostModel` by timing decoder layer 0 of ``model`` on this machine.

    For every ``(c, s)`` in ``chunks x prefixes`` it times one layer call on ``c`` rows whose
    cache holds ``s`` prefix rows, exactly as a chain rank runs it (explicit mask when
    ``s > 0``, plain causal when ``s = 0``), and fits
    ``t = a0 + a_lin * c + a_attn * pairs`` by least squares, with ``pairs = c*(s+c)`` for the
    masked calls and ``c*(c+1)/2`` for the plain causal ones. The LM head is timed on one row.
    Communication coefficients come from :func:`measure_loopback` unless given.
    """
    from tqdm import tqdm

    from fastprefill.cache import PositionKVCache
    from fastprefill.models.adapters import DecoderAdapter, causal_mask

    ad = DecoderAdapter(model, method="runahead calibration")
    shape = ad.shape
    dev, dt = ad.device, ad.dtype
    rows, times = [], []
    grid = [(c, s) for c in chunks for s in prefixes]
    with torch.inference_mode(), ad.attention_scope():
        for c, s in tqdm(grid, desc="calibrate layer", disable=not progress):
            hidden = torch.randn(1, c, shape.hidden_size, device=dev, dtype=dt)
            pos = torch.arange(s, s + c, device=dev)[None]
            pk = torch.randn(1, shape.num_kv_heads, s, shape.head_dim, device=dev, dtype=dt)
            rot = ad.rotary(hidden, pos)
            mask = causal_mask(pos[0], torch.arange(s + c, device=dev)) if s else None

            def run(s=s, pk=pk, pos=pos, hidden=hidden, mask=mask, rot=rot) -> None:
                cache = PositionKVCache(shape.num_layers)
                if s:
                    cache.stage(0, torch.arange(s, device=dev))
                    cache.update(pk, pk, 0)
                cache.stage(0, pos[0])
                ad.layer(0, hidden, pos, cache, mask=mask, rotary=rot)

            times.append(_median_time(run, repeats))
            rows.append([1.0, float(c), float(c * (s + c) if s else c * (c + 1) / 2)])
        h1 = torch.randn(1, 1, shape.hidden_size, device=dev, dtype=dt)
        head_s = _median_time(lambda: ad.head(h1), repeats)
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(a, b).solution[:, 0].clamp(min=0.0).tolist()
    if bandwidth_bytes_s is None or latency_s is None:
        bw, lat = measure_loopback()
        bandwidth_bytes_s = bandwidth_bytes_s if bandwidth_bytes_s is not None else bw
        latency_s = latency_s if latency_s is not None else lat
    flop = CostModel.from_flops(shape, 1.0, 1.0)
    itemsize = torch.empty((), dtype=dt).element_size()
    return CostModel(
        num_layers=shape.num_layers,
        layer_overhead_s=coef[0],
        linear_s_per_token=coef[1],
        attn_s_per_pair=coef[2],
        qkv_fraction=flop.qkv_fraction,
        kv_bytes_per_token=2 * shape.num_kv_heads * shape.head_dim * itemsize,
        bandwidth_bytes_s=bandwidth_bytes_s,
        latency_s=latency_s,
        head_s=head_s,
        causal_kernel_pairs="half",
        notes={"samples": [[c, s, t] for (c, s), t in zip(grid, times, strict=True)], "threads": torch.get_num_threads()},
    )


def _pingpong_worker(rank: int, port: int, sizes: list[int], repeats: int, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        result = []
        for n in sizes:
            buf = torch.zeros(n // 4, dtype=torch.float32)
            ts = []
            for k in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if k:
                    ts.append((time.perf_counter() - t0) / 2)
            result.append(statistics.median(ts))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def measure_loopback(sizes: Sequence[int] = (4096, 1 << 20, 8 << 20), repeats: int = 5) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of gloo point-to-point between two local processes,
    fitted as ``t = latency + bytes / bandwidth`` on a ping-pong (127.0.0.1 only)."""
    import torch.multiprocessing as mp

    from fastprefill.launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_pingpong_worker, args=(r, port, list(sizes), repeats, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        ts = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    a = torch.tensor([[1.0, float(n)] for n in sizes], dtype=torch.float64)
    coef = torch.linalg.lstsq(a, torch.tensor(ts, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    lat = max(coef[0], 1e-6)
    per_byte = max(coef[1], 1e-12)
    return 1.0 / per_byte, lat


def main(argv: Sequence[str] | None = None) -> None:
    """Calibrate on this machine and write a partition table (see the module docstring)."""
    import platform
    import sys

    parser = argparse.ArgumentParser(prog="python -m fastprefill.methods.runahead.partition", description=main.__doc__)
    parser.add_argument("--model", required=True, help="zoo name or local model folder")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing (one rank's setting)")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(TABLE_RANKS))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(TABLE_LENGTHS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from fastprefill.launch import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    cost = calibrate(model, repeats=args.repeats)
    command = "python -m fastprefill.methods.runahead.partition " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
               "threads": args.threads, "built": time.strftime("%Y-%m-%d %H:%M:%S")}
    table = PartitionTable.build(args.model, ModelShape.from_config(model.config), cost, args.ranks, args.lengths,
                                 command=command, machine=machine)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(table.to_json(), indent=1) + "\n")
    print(f"wrote {args.out}: {json.dumps({p: table.entries[p] for p in table.entries if p == 2})}")


if __name__ == "__main__":
    main()
