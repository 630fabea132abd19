"""The cache contract, the position-indexed per-layer KV cache, the LazyLLM Aux Cache, export to transformers.

:class:`LayerCache` is the one contract a decoder layer's cache meets (transformers' own
``update`` / ``get_seq_length``): :class:`PositionKVCache`, :class:`ReplayCache`, KV-Runahead's
chain and gather caches and transformers' ``DynamicCache`` all implement it, and
:meth:`fastprefill.models.adapters.DecoderAdapter.layer` accepts any of them.

Each layer of :class:`PositionKVCache` holds keys and values for an arbitrary *set* of original
prompt positions, in the order they were computed. Different layers may hold different sets
(LazyLLM computes fewer tokens in deeper layers). Attention over such a layer uses an explicit
mask by original position (:func:`fastprefill.models.attention.causal_mask`), so the storage order
does not matter.

Shapes: keys/values ``(B, H_kv, N, d)``; positions ``(N,)`` int64; Aux Cache hidden states
``(B, M, D)``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

__all__ = ["AuxCache", "DenseKVCache", "LayerCache", "LayerKV", "PositionKVCache", "ReplayCache", "RoomyLayer",
           "fork_cache", "layer_kv", "make_roomy", "pad_caches", "roomy_from_blocks", "unpad_row",
           "wrap_dynamic_cache"]


@runtime_checkable
class LayerCache(Protocol):
    """What a decoder layer needs from its cache (transformers' ``update`` contract).

    A layer computes its new keys and values ``(B, H_kv, T, d)`` (rotated), calls
    ``update(k, v, layer_idx)`` and attends over the ``(K, V)`` ``(B, H_kv, N, d)`` it gets back,
    which include the rows just written.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new rows of ``layer_idx``; return the keys and values the layer attends over."""
        ...

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of key positions held at ``layer_idx``."""
        ...


@dataclass
class LayerKV:
    """One layer's keys, values and the original positions they belong to."""

    keys: torch.Tensor | None = None  # (B, H_kv, N, d)
    values: torch.Tensor | None = None  # (B, H_kv, N, d)
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # (N,)

    def __len__(self) -> int:
        return int(self.positions.numel())


class PositionKVCache:
    """Per-layer KV cache over the positions computed at that layer.

    The decoder layers call :meth:`update` (the transformers cache contract). Before a layer runs,
    the caller *stages* the original positions of the rows about to be written with
    :meth:`stage`; ``update`` then appends the new keys and values under those positions and
    returns the whole layer ``(K, V)``.

    Args:
        num_layers: number of decoder layers ``L``.
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.layers: list[LayerKV] = [LayerKV() for _ in range(num_layers)]
        self._staged: dict[int, torch.Tensor] = {}

    # --- transformers' cache contract -------------------------------------------------------
    def stage(self, layer_idx: int, positions: torch.Tensor) -> None:
        """Declare the original positions ``(T,)`` of the rows the next ``update`` at ``layer_idx`` writes."""
        self._staged[layer_idx] = positions.reshape(-1).to(torch.long)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H_kv, T, d)`` keys/values at the staged positions; return the layer's ``(K, V)``."""
        positions = self._staged.pop(layer_idx, None)
        if positions is None or positions.numel() != key_states.shape[-2]:
            got = None if positions is None else positions.numel()
            raise RuntimeError(
                f"PositionKVCache.update at layer {layer_idx}: {key_states.shape[-2]} rows but "
                f"{got} staged positions; call stage() before running the layer"
            )
        layer = self.layers[layer_idx]
        if layer.keys is None:
            layer.keys, layer.values = key_states, value_states
            layer.positions = positions.to(key_states.device)
        else:
            layer.keys = torch.cat([layer.keys, key_states], dim=-2)
            layer.values = torch.cat([layer.values, value_states], dim=-2)
            layer.positions = torch.cat([layer.positions, positions.to(layer.positions.device)])
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of positions stored at ``layer_idx``."""
        return len(self.layers[layer_idx])

    # --- queries ------------------------------------------------------------------------------
    def positions(self, layer_idx: int) -> torch.Tensor:
        """``(N,)`` original positions stored at ``layer_idx`` (in storage order)."""
        return self.layers[layer_idx].positions

    def key_positions_after(self, layer_idx: int, new_positions: torch.Tensor) -> torch.Tensor:
        """Positions ``(N + T,)`` the layer will hold once ``new_positions`` are appended."""
        old = self.layers[layer_idx].positions.to(new_positions.device)
        return torch.cat([old, new_positions.reshape(-1)])

    def has(self, layer_idx: int, positions: torch.Tensor) -> torch.Tensor:
        """Bool ``(T,)``: which of ``positions`` already have KV at ``layer_idx``."""
        stored = self.layers[layer_idx].positions.to(positions.device)
        return torch.isin(positions, stored)

    # --- export ----------------------------------------------------------------------------
    def to_dynamic_cache(self, config: PretrainedConfig) -> DynamicCache:
        """Export to a transformers ``DynamicCache`` in position order.

        Every layer must hold exactly positions ``0..N-1`` (no gaps): a model decoding from a
        ``DynamicCache`` numbers its keys by index. A layer already in position order is handed
        over without a copy.

        Raises:
            ValueError: if some layer has gaps or layers differ in length.
        """
        n = len(self.layers[0])
        kv = []
        for idx, layer in enumerate(self.layers):
            if len(layer) != n or layer.keys is None:
                raise ValueError(f"layer {idx} holds {len(layer)} positions, layer 0 holds {n}")
            expected = torch.arange(n, device=layer.positions.device)
            if torch.equal(layer.positions, expected):
                kv.append((layer.keys, layer.values))
                continue
            order = torch.argsort(layer.positions)
            if not torch.equal(layer.positions[order], expected):
                raise ValueError(f"layer {idx} positions are not 0..{n - 1}; cannot export to DynamicCache")
            kv.append((layer.keys[:, :, order], layer.values[:, :, order]))
        return wrap_dynamic_cache(config, kv)

    def ragged_view(self, config: PretrainedConfig) -> DynamicCache:
        """A ``DynamicCache`` over the same tensors (no copy), each layer in storage order.

        Layers may hold different position sets: only a single new query that attends every key
        of a layer (LazyLLM without revival, pruned baselines) may decode from it, because a
        ``DynamicCache`` does not know the positions.
        """
        return wrap_dynamic_cache(config, [(layer.keys, layer.values) for layer in self.layers])

class DenseKVCache:
    """A :class:`LayerCache` holding every position ``0..N-1`` at every layer, rows rewritten in place.

    Each layer is one ``(1, H_kv, N, d)`` key tensor and one value tensor, filled by the caller
    (:meth:`write`: K/V reused from elsewhere) before the layers run. A layer run on some rows
    overwrites their positions (staged with :meth:`stage`, as :class:`PositionKVCache`) and
    attends all ``N`` positions, under a mask by position. Blending reuses it: cached chunks
    are written in, the rows it recomputes overwrite theirs.

    Args:
        keys, values: one ``(1, H_kv, N, d)`` tensor each per layer (owned by the cache: written in place).
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(values) or not keys:
            raise ValueError(f"DenseKVCache: {len(keys)} key and {len(values)} value layers")
        self.keys, self.values = list(keys), list(values)
        self._staged: dict[int, torch.Tensor] = {}

    def write(self, layer_idx: int, positions: slice | torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put ``(1, H_kv, M, d)`` keys and values at ``positions`` (a slice or ``(M,)`` int64) of a layer."""
        self.keys[layer_idx][:, :, positions] = keys
        self.values[layer_idx][:, :, positions] = values

    def stage(self, layer_idx: int, positions: torch.Tensor) -> None:
        """The positions ``(T,)`` of the rows the next :meth:`update` at ``layer_idx`` writes."""
        self._staged[layer_idx] = positions.reshape(-1).to(torch.long)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Overwrite the staged positions with ``(1, H_kv, T, d)`` rows; return the layer's whole ``(K, V)``."""
        positions = self._staged.pop(layer_idx, None)
        if positions is None or positions.numel() != key_states.shape[-2]:
            raise RuntimeError(f"DenseKVCache.update at layer {layer_idx}: {key_states.shape[-2]} rows but "
                               f"{None if positions is None else positions.numel()} staged positions")
        self.write(layer_idx, positions, key_states, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[layer_idx].shape[-2])

    def to_dynamic_cache(self, config: PretrainedConfig) -> DynamicCache:
        """The same tensors as a transformers ``DynamicCache`` (positions ``0..N-1`` in order; no copy)."""
        return wrap_dynamic_cache(config, list(zip(self.keys, self.values, strict=True)))


#: Positions a :class:`RoomyLayer` allocates at least past what it holds (see :func:`_with_room`).
ROOM_TOKENS = 256


def _with_room(n: int) -> int:
    """The positions to allocate for ``n`` held: ``n`` plus :data:`ROOM_TOKENS` or ``n / 8``, whichever is more."""
    return n + max(ROOM_TOKENS, n // 8)


class RoomyLayer(DynamicLayer):
    """A ``DynamicCache`` layer that appends in place: its K/V lead storage with room for more.

    transformers' ``DynamicLayer`` concatenates on every update: each decode step and each prompt chunk
    copies the layer's whole K/V, a cost that grows with the cached length. Here ``keys`` / ``values``
    are views ``(B, H_kv, N, d)`` of ``(B, H_kv, C, d)`` buffers; an update of ``T`` rows copies only
    those rows while ``N + T <= C``, else moves to new buffers with room again (:func:`_with_room`).
    Everything else of ``DynamicLayer`` applies as is (``crop`` narrows the view; the next update
    overwrites the rows cut). Keys or values replaced from outside (a tensor that is not the leading
    view of the buffers) move to new buffers at the next update, so no caller's tensor is written to.
    """

    _kbuf: torch.Tensor | None = None  # (B, H_kv, C, d), set by the first update or adopt
    _vbuf: torch.Tensor | None = None

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, held: int) -> None:
        """Hold the leading ``held`` positions of the buffers ``kbuf`` / ``vbuf`` ``(B, H_kv, C, d)``."""
        if not self.is_initialized:
            self.lazy_initialization(kbuf, vbuf)
        self._kbuf, self._vbuf = kbuf, vbuf
        self.keys, self.values = kbuf[:, :, :held], vbuf[:, :, :held]

    def _in_place(self, n: int, key_states: torch.Tensor) -> bool:
        """Whether ``key_states``' rows fit after the ``n`` held, in the buffers the views lead."""
        kbuf, vbuf = self._kbuf, self._vbuf
        return (kbuf is not None and vbuf is not None and n + key_states.shape[-2] <= kbuf.shape[-2]
                and self.keys.data_ptr() == kbuf.data_ptr() and self.values.data_ptr() == vbuf.data_ptr()
                and self.keys.stride() == kbuf.stride() and self.values.stride() == vbuf.stride()
                and kbuf.shape[:2] == key_states.shape[:2] and kbuf.shape[3] == key_states.shape[3]
                and kbuf.dtype == key_states.dtype and kbuf.device == key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H_kv, T, d)`` rows; return the layer's ``(K, V)`` ``(B, H_kv, N + T, d)`` (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        end = n + key_states.shape[-2]
        if not self._in_place(n, key_states):
            shape = (*key_states.shape[:2], _with_room(end), key_states.shape[3])
            kbuf, vbuf = key_states.new_empty(shape), value_states.new_empty(shape)
            if n:
                kbuf[:, :, :n].copy_(self.keys)
                vbuf[:, :, :n].copy_(self.values)
            self._kbuf, self._vbuf = kbuf, vbuf
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[:, :, n:end].copy_(key_states)
        self._vbuf[:, :, n:end].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None


CacheT = TypeVar("CacheT", bound=Cache)


def make_roomy(cache: CacheT) -> CacheT:
    """Turn every plain ``DynamicLayer`` of a transformers cache into a :class:`RoomyLayer` holding the same
    keys and values (in place; returns ``cache``). Nothing is copied now: the first update moves a layer's
    K/V into storage with room (the copy ``DynamicLayer`` would make anyway). Other kinds are left alone."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            roomy = RoomyLayer()
            if layer.is_initialized:
                roomy.lazy_initialization(layer.keys, layer.values)
                roomy.keys, roomy.values = layer.keys, layer.values
            layers[i] = roomy
    return cache


def roomy_from_blocks(config: PretrainedConfig, blocks: Sequence[torch.Tensor], tokens: int, upto: int,
                      device: torch.device | str) -> DynamicCache:
    """A new ``DynamicCache`` of :class:`RoomyLayer` s holding the first ``tokens`` positions of ``blocks``
    (each ``(2, L, H_kv, B_i, d)``, in order), with room for ``upto`` positions and some decoding: the
    blocks are copied once, into that storage (a prefix-cache hit, whose suffix then appends in place)."""
    first = blocks[0]
    held = sum(b.shape[3] for b in blocks)
    storage = first.new_empty((*first.shape[:3], _with_room(max(held, upto)), first.shape[4]),
                              device=device)  # (2, L, H_kv, C, d)
    if first.device == storage.device:
        torch.cat(list(blocks), dim=3, out=storage[:, :, :, :held])
    else:
        storage[:, :, :, :held].copy_(torch.cat(list(blocks), dim=3))
    return _roomy_cache(config, [(storage[0, i][None], storage[1, i][None]) for i in range(first.shape[1])], tokens)


def _roomy_cache(config: PretrainedConfig, buffers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 held: int) -> DynamicCache:
    """A new ``DynamicCache`` whose layer ``l`` is a :class:`RoomyLayer` holding the first ``held``
    positions of ``buffers[l]`` (keys and values, each ``(B, H_kv, C, d)``)."""
    cache = make_roomy(DynamicCache(config=config))
    for layer, (kbuf, vbuf) in zip(cache.layers, buffers, strict=False):
        layer.adopt(kbuf, vbuf, held)
    return cache


def layer_kv(cache: DynamicCache, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``idx``'s keys and values ``(B, H_kv, N, d)`` held by a transformers ``DynamicCache``.

    Raises:
        ValueError: the layer holds nothing.
    """
    layer = cache.layers[idx]
    if not getattr(layer, "is_initialized", False) or layer.keys is None:
        raise ValueError(f"cache layer {idx} holds no keys")
    return layer.keys, layer.values


def fork_cache(cache: Cache) -> Cache:
    """An independent copy of a prefill's transformers ``Cache`` (every layer's keys and values
    copied), so that several answers can decode from one prefill: each appends to its own copy."""
    return copy.deepcopy(cache)


def wrap_dynamic_cache(
    config: PretrainedConfig, kv: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]]
) -> DynamicCache:
    """A transformers ``DynamicCache`` whose layer ``l`` holds ``kv[l]`` ``(B, H_kv, N_l, d)`` as given.

    ``DynamicCache.update`` on an empty layer concatenates onto an empty tensor, a copy of every
    layer; here the tensors are handed over as they are (later updates concatenate as usual, so
    the given tensors are never written to). A ``(None, None)`` layer stays empty.
    """
    cache = DynamicCache(config=config)
    if len(cache.layers) < len(kv):
        raise ValueError(f"{len(kv)} layers of KV for a config with {len(cache.layers)} cache layers")
    for layer, (keys, values) in zip(cache.layers, kv, strict=False):
        if keys is None or values is None:
            continue
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def pad_caches(config: PretrainedConfig, caches: Sequence[DynamicCache]) -> tuple[DynamicCache, list[int]]:
    """Stack one-row caches into one batched cache, left-padded: layer ``l`` becomes
    ``(B, H_kv, N_max, d)``, row ``i``'s ``N_i`` positions at its right end after ``N_max - N_i``
    zero rows. New tokens are then appended at the right end for every row, so each row's keys
    stay contiguous. Returns the cache and each row's pad ``N_max - N_i`` (the attention mask
    must hide a row's first ``pad`` keys).

    Raises:
        ValueError: a cache whose layer holds nothing.
    """
    lengths = [c.get_seq_length() for c in caches]
    n_max = max(lengths)
    pads = [n_max - n for n in lengths]
    buffers = []
    for idx in range(len(caches[0].layers)):
        rows = [layer_kv(c, idx) for c in caches]
        k0 = rows[0][0]
        kbuf = k0.new_zeros((len(rows), k0.shape[1], _with_room(n_max), k0.shape[3]))  # (B, H_kv, C, d)
        vbuf = torch.zeros_like(kbuf)
        for i, ((k, v), pad) in enumerate(zip(rows, pads, strict=True)):
            kbuf[i, :, pad:n_max] = k[0]
            vbuf[i, :, pad:n_max] = v[0]
        buffers.append((kbuf, vbuf))
    return _roomy_cache(config, buffers, n_max), pads  # decode steps append in place


def unpad_row(batched: DynamicCache, row: int, pad: int, target: DynamicCache) -> None:
    """Write row ``row`` of a :func:`pad_caches` cache (its keys from index ``pad`` on) into the
    one-row ``target``, in place (copied: the batched tensors can be freed)."""
    for idx, layer in enumerate(target.layers):
        keys, values = layer_kv(batched, idx)
        layer.keys = keys[row:row + 1, :, pad:].clone()  # (1, H_kv, N, d)
        layer.values = values[row:row + 1, :, pad:].clone()


class AuxCache:
    """LazyLLM's Aux Cache: hidden states of pruned tokens, keyed by the layer they resume at.

    When token ``i`` is pruned before layer ``l + 1`` its hidden state (the output of layer
    ``l``, i.e. the input of layer ``l + 1``) is stored under layer ``l + 1``. A later step that
    needs token ``i`` at layer ``l + 1`` *takes* it from here and computes it from layer ``l + 1``
    upward: it is never recomputed from layer 0.
    """

    def __init__(self) -> None:
        self._rows: dict[int, dict[int, torch.Tensor]] = {}  # layer -> {position: (D,)}

    def put(self, layer_idx: int, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store ``hidden`` ``(B=1, M, D)`` for ``positions`` ``(M,)`` as inputs of ``layer_idx``."""
        rows = self._rows.setdefault(layer_idx, {})
        for j, pos in enumerate(positions.tolist()):
            rows[pos] = hidden[0, j]

    def take(self, layer_idx: int, positions: torch.Tensor) -> torch.Tensor:
        """Remove and return the stored inputs of ``layer_idx`` for ``positions`` as ``(1, M, D)``.

        Raises:
            KeyError: if a position has no entry at that layer.
        """
        rows = self._rows.get(layer_idx, {})
        out = [rows.pop(pos) for pos in positions.tolist()]
        return torch.stack(out)[None]

    def positions(self, layer_idx: int) -> list[int]:
        """Positions waiting at ``layer_idx`` (sorted)."""
        return sorted(self._rows.get(layer_idx, {}))

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._rows.values())


class ReplayCache:
    """A :class:`LayerCache` that hands every layer fixed keys and values instead of its own.

    Used to run a model's layers against a given (for example predicted) KV: ``update`` ignores
    the rows the layer computed and returns ``kv[layer_idx]``.

    Args:
        kv: one ``(K, V)`` per layer, each ``(B, H_kv, N, d)`` with keys rotated.
    """

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv = kv

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.kv[layer_idx][0].shape[-2])
