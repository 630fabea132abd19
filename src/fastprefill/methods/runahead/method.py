"""KV-Runahead (arXiv 2405.05329) and its all-gather baseline (TSP) as fastprefill methods.

**KV-Runahead.** ``P`` ranks, each with a full model copy; the prompt is split into ``P``
contiguous chunks by a frozen :class:`~fastprefill.methods.runahead.plan.PartitionPlan`.
At every layer ``l`` rank ``i``:

1. computes its own q/k/v (the model's own decoder layer, via
   :class:`~fastprefill.models.adapters.DecoderAdapter`);
2. inside the layer's cache update (:class:`_RunaheadCache`), waits for the accumulated KV of
   chunks ``0..i-1`` from rank ``i-1`` and appends its own;
3. posts an asynchronous ``isend`` of the result to rank ``i+1`` right there, *before* its own
   attention and MLP run, so the next rank's wait overlaps this rank's remaining work;
4. attends its ``c_i`` queries over the ``s_i + c_i`` keys of chunks ``0..i`` with a causal mask
   by original position (the upper triangle of the full ``QK^T`` is never computed).

What overlaps, honestly: all ``L`` receives of a prefill are posted (``irecv``) before the first
layer runs, so gloo's/NCCL's background progress fills them while this rank computes; a rank
blocks only when it needs layer ``l``'s prefix and it has not arrived. Sends overlap the
sender's attention + MLP and all its later layers. The embedding and rotary tables are computed
before any wait. Rank 0 never waits; rank ``i`` can start layer ``l``'s attention no earlier than
rank ``i-1`` finished layer ``l``'s q/k/v projections.

*choose* (engine integration): only the **last rank runs the engine loop**. It calls
:meth:`KVRunahead.prefill` through :func:`fastprefill.engine.generate` and ends with the full
KV cache; it emits the first token and decodes alone with the HF model (its chain cache already
holds every layer in position order, so it is handed to a ``DynamicCache`` without a copy). The
other ranks call :meth:`KVRunahead.contribute` with the same prompt and are then free for the
next prompt. This
keeps decoding free of any per-token broadcast (it would cost a message per token and gain
nothing: only one rank holds the full cache). Both methods meet
:class:`~fastprefill.methods.base.DistributedMethod`; the local rank pool
(``fastprefill.distributed.pool``) and torchrun ranks (``python -m fastprefill.launch``) drive
both roles through it.

*choose* (masks): ranks with a prefix pass an explicit boolean mask. With ``mask=None``
transformers' sdpa path crops the keys to the first ``T`` when there are more keys than
queries (upper-left alignment), which would be wrong for a prefix; rank 0 (no prefix) uses the
plain causal path, like single-process prefill.

**TSP baseline** (:class:`SequenceParallel`): even chunks; at every layer each rank all-gathers
the keys and values of every chunk (``all_gather``) and attends its queries over all ``T`` keys
with the causal mask (the paper's comparison; the masked kernel computes the whole rectangle).

Both run in the default torch.distributed process group (gloo on CPU, NCCL on CUDA); with
``procs=1`` no group is needed and the chain is a plain layer loop.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from transformers import DynamicCache, PreTrainedModel

from fastprefill.cache import PositionKVCache
from fastprefill.errors import ConfigError, is_int
from fastprefill.methods.base import ComputeStats, DistributedMethod, LayerHook, PrefillOutput
from fastprefill.methods.runahead.comm import ChainComm, ChainCommError
from fastprefill.methods.runahead.plan import PartitionPlan, check_procs
from fastprefill.methods.runahead.search import CostModel, search_partition
from fastprefill.methods.runahead.tables import PartitionTable, find_table
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.attention import causal_mask
from fastprefill.models.fused import last_row_only, trims_last_row
from fastprefill.models.shape import ModelShape

__all__ = ["KVRunahead", "SequenceParallel"]

class _RunaheadCache:
    """The :class:`~fastprefill.cache.LayerCache` a chain rank's decoder layers write to (transformers' ``update`` contract).

    ``update(k, v, l)`` is called by the layer after its q/k/v projections and rotary: it waits
    for the prefix of layer ``l`` (rank > 0), appends the own rows, sends the accumulated KV on
    (not on the last rank) and returns ``(K, V)`` ``(1, H_kv, s_i + c_i, d)``.
    """

    def __init__(self, num_layers: int, comm: ChainComm | None, own: torch.Tensor) -> None:
        self.store = PositionKVCache(num_layers)
        self.comm = comm
        self.own = own  # (c,) original positions of this rank's chunk
        start = int(own[0])
        self.prefix = torch.arange(start, device=own.device)  # (s,)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        comm = self.comm
        if comm is not None and not comm.is_first:
            pk, pv = comm.wait(layer_idx)
            self.store.stage(layer_idx, self.prefix)
            self.store.update(pk, pv, layer_idx)
        self.store.stage(layer_idx, self.own)
        keys, values = self.store.update(key_states, value_states, layer_idx)
        if comm is not None and not comm.is_last:
            comm.send_recv(layer_idx, send=(keys, values))
            comm.commit()
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.get_seq_length(layer_idx)


class _GatherCache:
    """TSP's :class:`~fastprefill.cache.LayerCache`: ``update`` all-gathers every rank's chunk of KV (padded to the largest chunk)
    and returns the full ``(1, H_kv, T, d)`` keys and values in position order."""

    def __init__(self, num_layers: int, plan: PartitionPlan, rank: int, timeout_s: float) -> None:
        self.store = PositionKVCache(num_layers)
        self.plan, self.rank = plan, rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.bytes_received = 0

    def _gather(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        if self.plan.procs == 1:
            return t
        width = max(self.plan.chunks)
        pad = torch.zeros(t.shape[0], t.shape[1], width, t.shape[3], dtype=t.dtype, device=t.device)
        pad[:, :, : t.shape[2]] = t
        parts = [torch.empty_like(pad) for _ in range(self.plan.procs)]
        work = dist.all_gather(parts, pad, async_op=True)
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise ChainCommError(
                f"rank {self.rank}: all-gather at layer {layer} failed ({str(exc).splitlines()[0][:200]}); "
                "another rank died or hung"
            ) from None
        self.bytes_received += sum(p.numel() * p.element_size() for i, p in enumerate(parts) if i != self.rank)
        return torch.cat([p[:, :, :c] for p, c in zip(parts, self.plan.chunks, strict=True)], dim=2)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        keys = self._gather(key_states, layer_idx)
        values = self._gather(value_states, layer_idx)
        total = keys.shape[2]
        self.store.stage(layer_idx, torch.arange(total, device=keys.device))
        return self.store.update(keys, values, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.get_seq_length(layer_idx)


@dataclass
class _DistributedPrefill(DistributedMethod):
    """Shared plumbing of the two multi-rank prefills: roles, validation, stats, decoding."""

    layer_loop: ClassVar[bool] = True

    procs: int = 2
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not is_int(self.procs, 1):
            raise ConfigError(f"procs must be an integer >= 1, got {self.procs!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be a number > 0 (seconds), got {self.timeout_s!r}")

    # --- roles --------------------------------------------------------------------------------
    def rank(self) -> int:
        """This process's rank; 0 when ``procs == 1``.

        Raises:
            ConfigError: ``procs > 1`` without an initialised process group of that size.
        """
        if self.procs == 1:
            return 0
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"{self.name} with procs={self.procs} needs a torch.distributed process group: run it "
                "on a rank pool (fastprefill.distributed.pool.RankPool, or `fastprefill generate --method "
                f"{self.name} --procs N`) or under torchrun (`torchrun ... -m fastprefill.launch`)"
            )
        world = dist.get_world_size()
        if world != self.procs:
            raise ConfigError(f"procs={self.procs}, but the process group has {world} ranks; they must be equal")
        return dist.get_rank()

    def check_prompt(self, model: PreTrainedModel, prompt_len: int) -> None:
        """Every rank needs a token, and the frozen partition must be valid for this prompt."""
        self.plan(model, prompt_len)

    def plan(self, model: PreTrainedModel, total: int) -> PartitionPlan:
        """The frozen partition for a ``total``-token prompt (the same on every rank)."""
        check_procs(self.procs, total)
        return PartitionPlan.even(total, self.procs)

    # --- the engine's contract ----------------------------------------------------------------
    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        """Run this rank's part; on the last rank return the first-token logits ``(V,)`` and the
        whole prompt's cache (the chain's, handed over in position order without a copy).

        Raises:
            ConfigError: on a rank other than the last (call :meth:`contribute` there), or a bad
                ``procs`` / partition for this prompt.
            ChainCommError: a neighbour died or timed out.
        """
        self.refuse_prefix(prefix)
        rank = self.rank()
        if rank != self.procs - 1:
            raise ConfigError(
                f"rank {rank} of {self.procs} only contributes KV; call {type(self).__name__}.contribute() "
                "there. The last rank runs the engine (prefill + decode)."
            )
        logits, cache, stats = self._run(model, input_ids, rank, None)
        assert logits is not None
        n = int(input_ids.shape[1])
        return PrefillOutput(logits=logits, cache=cache.to_dynamic_cache(model.config), stats=stats,
                             next_position=n, exact_tokens=n)

    def contribute(self, model: PreTrainedModel, input_ids: torch.Tensor, layer_hook: LayerHook | None = None) -> ComputeStats:
        """A helper rank's part of the prefill (ranks ``0..P-2``): compute and send KV.

        Args:
            input_ids: ``(1, T)`` the full prompt (identical on every rank).
            layer_hook: called as ``hook(rank, layer)`` after every layer (tests inject faults).
        """
        rank = self.rank()
        _, _, stats = self._run(model, input_ids, rank, layer_hook)
        return stats

    # --- the work -----------------------------------------------------------------------------
    def _attention_pairs(self, plan: PartitionPlan) -> list[int]:
        raise NotImplementedError

    def _make_cache(self, ad: DecoderAdapter, plan: PartitionPlan, rank: int, own: torch.Tensor) -> Any:
        raise NotImplementedError

    def _mask(self, plan: PartitionPlan, own: torch.Tensor, total: int) -> torch.Tensor | None:
        raise NotImplementedError

    def _run(
        self, model: PreTrainedModel, input_ids: torch.Tensor, rank: int, layer_hook: LayerHook | None
    ) -> tuple[torch.Tensor | None, PositionKVCache, ComputeStats]:
        ad = DecoderAdapter(model, method=self.name)
        total = int(input_ids.shape[1])
        plan = self.plan(model, total)
        start, c = plan.start(rank), plan.chunks[rank]
        own = torch.arange(start, start + c, device=ad.device)  # (c,)
        cache = self._make_cache(ad, plan, rank, own)
        mask = self._mask(plan, own, total)
        with ad.attention_scope():
            hidden = ad.embed(input_ids[:, start : start + c])  # (1, c, D)
            pos = own[None]  # (1, c)
            rot = ad.rotary(hidden, pos)
            for layer in range(ad.num_layers):
                last = layer == ad.num_layers - 1  # its rest on the last row, the one the head reads
                with last_row_only(model, cache) if last else contextlib.nullcontext():
                    hidden = ad.layer(layer, hidden, pos, cache, mask=mask, rotary=rot)
                if layer_hook is not None:
                    layer_hook(rank, layer)
            comm = getattr(cache, "comm", None)
            if comm is not None:
                comm.flush()
            logits = ad.head(hidden[:, -1:])[0, -1] if rank == self.procs - 1 else None  # (V,)
        stats = self._stats(ad.shape, plan, rank, cache, trims_last_row(model))
        return logits, cache.store, stats

    def _stats(self, shape: ModelShape, plan: PartitionPlan, rank: int, cache: Any, last_row: bool) -> ComputeStats:
        total, layers = plan.length, shape.num_layers
        pairs = self._attention_pairs(plan)
        flops = layers * shape.layer_flops(total, sum(pairs))
        if last_row:  # each rank's last layer: its rows' keys and values, the rest for its last row
            flops -= sum(shape.layer_flops(c, n) - shape.last_row_layer_flops(c, plan.start(r) + c)
                         for r, (c, n) in enumerate(zip(plan.chunks, pairs)))
        comm = getattr(cache, "comm", None)
        received = comm.bytes_received if comm is not None else getattr(cache, "bytes_received", 0)
        sent = comm.bytes_sent if comm is not None else 0
        extra = {
            "procs": plan.procs,
            "chunks": list(plan.chunks),
            "rank": rank,
            "attention_pairs_per_rank_layer_head": pairs,
            "busiest_rank_attention_pairs": max(pairs),
            "kv_bytes_received_this_rank": received,
            "kv_bytes_sent_this_rank": sent,
        }
        return ComputeStats(total * layers, total * layers, flops + shape.head_flops(1), extra)


@dataclass
class KVRunahead(_DistributedPrefill):
    """KV-Runahead parallel prefill over ``procs`` ranks (see the module docstring).

    Args:
        procs: number of ranks ``P`` (>= 1; equal to the process group's size when > 1).
        partition: ``"even"``; ``"searched"`` (the shipped lookup table for this model shape,
            interpolated at the prompt length; a table path in ``table`` overrides it; without
            any table the grid search runs on an uncalibrated FLOP cost model); or explicit chunk
            sizes ``(c_0, ..., c_{P-1})`` that must sum to the prompt length, as a tuple or as
            a string like ``"600/424"`` (the CLI's and the registry's form).
        table: path to a partition table JSON (built by ``fastprefill calibrate-runahead``), or
            ``None``.
        timeout_s: bound on every communication wait (a dead or hung rank raises instead).

    Raises:
        ConfigError: a field out of range (named in the message).
    """

    name: ClassVar[str] = "runahead"
    partition: str | tuple[int, ...] = "even"
    table: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.partition, str) and self.partition not in ("even", "searched"):
            try:
                self.partition = tuple(int(x) for x in self.partition.split("/"))
            except ValueError:
                raise ConfigError(
                    f"partition must be 'even', 'searched' or chunk sizes like 600/424, got {self.partition!r}"
                ) from None
        if not isinstance(self.partition, str):
            chunks = tuple(self.partition)
            PartitionPlan(chunks)  # every chunk an integer >= 1
            if len(chunks) != self.procs:
                raise ConfigError(f"partition has {len(chunks)} chunks but procs={self.procs}; give one chunk per rank")
            self.partition = chunks
        if self.table is not None and not isinstance(self.table, str):
            raise ConfigError(f"table must be a path string or None, got {self.table!r}")

    def describe(self) -> str:
        part = self.partition if isinstance(self.partition, str) else "/".join(map(str, self.partition))
        return f"runahead(procs={self.procs}, partition={part})"

    def plan(self, model: PreTrainedModel, total: int) -> PartitionPlan:
        check_procs(self.procs, total)
        if isinstance(self.partition, tuple):
            return PartitionPlan(self.partition, total)
        if self.partition == "even" or self.procs == 1:
            return PartitionPlan.even(total, self.procs)
        shape = ModelShape.from_config(model.config)
        table = PartitionTable.load(self.table) if self.table else find_table(shape)
        if table is not None:
            return table.plan(total, self.procs)
        return search_partition(total, self.procs, CostModel.from_flops(shape, 5e10, 2e9))

    def _attention_pairs(self, plan: PartitionPlan) -> list[int]:
        return [plan.attention_pairs(i) for i in range(plan.procs)]

    def _make_cache(self, ad: DecoderAdapter, plan: PartitionPlan, rank: int, own: torch.Tensor) -> Any:
        comm = None
        if plan.procs > 1:
            comm = ChainComm(plan, rank, ad.shape.num_kv_heads, ad.shape.head_dim, ad.dtype, ad.device,
                             timeout_s=self.timeout_s)
            if not comm.is_first:
                for layer in range(ad.num_layers):  # post every receive up front (see module docstring)
                    comm.send_recv(layer, recv=True)
                comm.commit()
        return _RunaheadCache(ad.num_layers, comm, own)

    def _mask(self, plan: PartitionPlan, own: torch.Tensor, total: int) -> torch.Tensor | None:
        start = int(own[0])
        if start == 0:
            return None  # plain causal, queries and keys aligned
        return causal_mask(own, torch.arange(start + own.numel(), device=own.device))  # (1, 1, c, s + c)


@dataclass
class SequenceParallel(_DistributedPrefill):
    """TSP baseline: even chunks, KV all-gathered at every layer, attention over all ``T`` keys.

    Args:
        procs: number of ranks (>= 1; equal to the process group's size when > 1).
        timeout_s: bound on every all-gather wait.
    """

    name: ClassVar[str] = "tsp"

    def describe(self) -> str:
        return f"tsp(procs={self.procs})"

    def _attention_pairs(self, plan: PartitionPlan) -> list[int]:
        return [c * plan.length for c in plan.chunks]

    def _make_cache(self, ad: DecoderAdapter, plan: PartitionPlan, rank: int, own: torch.Tensor) -> Any:
        return _GatherCache(ad.num_layers, plan, rank, self.timeout_s)

    def _mask(self, plan: PartitionPlan, own: torch.Tensor, total: int) -> torch.Tensor | None:
        if len(plan.chunks) == 1:
            return None  # one rank: plain causal prefill, the same attention call as full prefill's
        return causal_mask(own, torch.arange(total, device=own.device))  # (1, 1, c, T)
