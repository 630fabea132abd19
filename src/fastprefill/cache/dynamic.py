"""Helpers over transformers' ``DynamicCache``: layers with room to append in place
(:class:`RoomyLayer`), a cache wrapped around given tensors, forked for several answers, padded into
one batch and unpadded back.

Shapes: keys/values ``(B, H_kv, N, d)``.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

__all__ = ["HIT_STORAGE", "ROOM_TOKENS", "RoomyLayer", "StoragePool", "fork_cache", "layer_kv", "make_roomy", "pad_caches", "roomy_from_blocks",
           "unpad_row", "wrap_dynamic_cache"]


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


class StoragePool:
    """Storage of earlier prefix-cache hits, kept to be written again by the next hit.

    A hit copies its blocks into one new ``(2, L, H_kv, C, d)`` tensor, as large as the prompt's
    whole K/V, and memory the process has not touched before costs a page fault per page, more
    than the copy itself where measured (``benchmarks/hit_storage.py``); whether it happens
    depends on how the heap was cut up by earlier requests. The pool keeps the
    last ``keep`` storages it handed out; :meth:`take` gives back one that no tensor uses any more
    (no view of it is alive: the cache it served is gone) and is large enough, so a steady stream
    of hits reuses memory whose pages are already in place. A storage still in use is never
    handed out twice.

    Whether anything else uses a storage is read from its reference count
    (``torch._C._storage_Use_Count``); where that is missing the pool keeps nothing and every hit
    allocates, as without it. The memory kept is at most ``keep`` hits' K/V with room.
    """

    #: a new storage's positions are rounded up to a multiple of this, so that hits of about one
    #: length (a document and different questions) fit each other's storage
    GRANULE = 512

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._held: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._count = getattr(torch._C, "_storage_Use_Count", None)
        self._alone = 0  # the count of a storage that one tensor alone uses (read with its Python object alive)
        if self._count is not None:
            probe = torch.empty(1)
            held = probe.untyped_storage()
            self._alone = self._count(held._cdata)
        self.reused = 0  # takes served from the pool
        self.allocated = 0  # takes that allocated

    def _unused(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the only tensor on its storage (its count against a lone tensor's)."""
        assert self._count is not None
        held = t.untyped_storage()  # alive while its count is read
        return self._count(held._cdata) <= self._alone

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A ``(2, L, H_kv, C', d)`` tensor with ``C' >= C`` (``shape`` is ``(2, L, H_kv, C, d)``),
        uninitialised: a view of a kept one no tensor uses (the smallest that fits), else a new one
        (``C'``: ``C`` rounded up to a multiple of :attr:`GRANULE`).
        It, or a view of it, stays the caller's while alive."""
        device = torch.device(device)
        with self._lock:  # nothing is held where the count cannot be read
            fits = [t for t in self._held if t.dtype == dtype and t.device == device and t.shape[:3] == shape[:3]
                    and t.shape[4] == shape[4] and t.shape[3] >= shape[3] and self._unused(t)]
            if fits:
                best = min(fits, key=lambda t: t.shape[3])
                self._held = [t for t in self._held if t is not best] + [best]  # the most recently used last
                self.reused += 1
                return best.view(best.shape)  # a view: while the caller holds it, the pool sees it used
            room = -(-shape[3] // self.GRANULE) * self.GRANULE
            with torch.inference_mode(False):  # a normal tensor: the next hit may write it outside inference mode
                storage = torch.empty((*shape[:3], room, shape[4]), dtype=dtype, device=device)
            self.allocated += 1
            if self._count is not None and self.keep > 0:
                self._held.append(storage)
                while len(self._held) > self.keep:  # forget the oldest, free ones first
                    drop = next((t for t in self._held[:-1] if self._unused(t)), self._held[0])
                    self._held = [t for t in self._held if t is not drop]
            return storage.view(storage.shape)

    def clear(self) -> None:
        """Keep nothing (storages in use stay with their users)."""
        with self._lock:
            self._held.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the storages kept (in use or not)."""
        return sum(t.nbytes for t in self._held)


#: The process's pool of prefix-cache hit storage (:func:`roomy_from_blocks`).
HIT_STORAGE = StoragePool()


def roomy_from_blocks(config: PretrainedConfig, blocks: Sequence[torch.Tensor], tokens: int, upto: int,
                      device: torch.device | str, pool: StoragePool | None = HIT_STORAGE) -> DynamicCache:
    """A new ``DynamicCache`` of :class:`RoomyLayer` s holding the first ``tokens`` positions of ``blocks``
    (each ``(2, L, H_kv, B_i, d)``, in order), with room for ``upto`` positions and some decoding: the
    blocks are copied once, into that storage (a prefix-cache hit, whose suffix then appends in place).
    The storage comes from ``pool`` (``None``: a new tensor)."""
    first = blocks[0]
    held = sum(b.shape[3] for b in blocks)
    shape = (*first.shape[:3], _with_room(max(held, upto)), first.shape[4])  # (2, L, H_kv, C, d)
    if pool is None:
        storage = first.new_empty(shape, device=device)
    else:
        storage = pool.take(shape, first.dtype, device)
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
