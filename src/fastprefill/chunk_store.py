"""Chunk-addressed K/V: a passage's keys and values computed once, reused wherever it appears.

A :class:`ChunkStore` is a :class:`~fastprefill.prefix_cache.PrefixCache` that also holds
*chunks*: the per-layer K/V of one passage, computed without the passages around it. It is the
prefix cache's machinery, not a parallel one: the same byte bound over every entry, the same
least-recently-used eviction (a chunk is a leaf, evicted like a leaf block), the same binding to
one model (weights fingerprint and dtype checked), the same thread safety and the same
persistence format (its own file, ``chunk-store.safetensors``). It still serves as the
engine's prefix cache (``generate(..., prefix_cache=store)``): a prompt's exact prefix is served
by whole blocks as before.

**Where a chunk is computed: after an anchor.** A chunk's K/V depend on what it was computed
after. The store keys a chunk by its tokens *and* its anchor, the tokens before it when it was
computed (empty: the chunk alone from position 0); the entry keeps the chunk's first position
(the anchor's length). Blending (:mod:`fastprefill.methods.research.blend`) chooses the anchor: the
prompt's *lead* (everything before its first passage: the chat template's system turn and the
instructions) by default, or nothing. The model fingerprint and dtype are the store's own
(checked at binding), so they need not be in each key.

**Keys.** A chunk's key is a BLAKE2b digest of ``b"chunk"``, the anchor's digest and the chunk's
tokens; the entry keeps its tokens, compared on every hit, so a digest collision never hands one
passage another's K/V. Prefix blocks are keyed by their parent chain and can never be a chunk's key.

Shapes: one chunk entry is ``(2, L, H_kv, n, d)`` (keys rotated at positions ``start..start+n-1``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import PreTrainedModel

from fastprefill.cache.blocks import Block
from fastprefill.prefix_cache import PrefixCache

__all__ = ["ChunkEntry", "ChunkStore", "ChunkStoreStats", "anchor_digest"]


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()


def anchor_digest(anchor: Sequence[int]) -> bytes:
    """The digest naming an anchor (``b""`` for none: the chunk computed alone from position 0)."""
    return hashlib.blake2b(b"anchor" + _token_bytes(anchor), digest_size=16).digest() if len(anchor) else b""


@dataclass(frozen=True)
class ChunkEntry:
    """A stored chunk: its K/V ``(2, L, H_kv, n, d)`` on the model's device, computed at positions
    ``start..start+n-1`` (after an anchor of ``start`` tokens)."""

    kv: torch.Tensor
    start: int


@dataclass
class ChunkStoreStats:
    """Chunk counters since the store was made: lookups that found a chunk (``hits``) or not
    (``misses``), their tokens, and chunks written (``stored``)."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    stored: int = 0


class ChunkStore(PrefixCache):
    """Chunks' K/V beside prefix blocks, in one bounded store (see the module docstring).

    Args:
        max_bytes: the bound on all K/V held (prefix blocks and chunks), > 0.
        block_tokens: the prefix blocks' size (as :class:`PrefixCache`).

    Raises:
        ConfigError: a bad argument; using the store with another model, or one whose cache has
            sliding-window layers (as :class:`PrefixCache`).
    """

    FILE_STEM: ClassVar[str] = "chunk-store"
    FORMAT: ClassVar[str] = "fastprefill-chunk-store"

    def __init__(self, max_bytes: int, block_tokens: int = 16) -> None:
        super().__init__(max_bytes, block_tokens)
        self.chunk_stats = ChunkStoreStats()

    @staticmethod
    def chunk_key(tokens: Sequence[int], anchor: bytes) -> bytes:
        """The key of ``tokens`` computed after the anchor named ``anchor`` (:func:`anchor_digest`)."""
        return hashlib.blake2b(b"chunk" + anchor + _token_bytes(tokens), digest_size=16).digest()

    def get_chunk(self, model: PreTrainedModel, tokens: Sequence[int], anchor: bytes) -> ChunkEntry | None:
        """The stored K/V of a chunk (refreshed as most recently used), or ``None``.

        Args:
            model: the model (bound at first use).
            tokens: the chunk's token ids.
            anchor: :func:`anchor_digest` of what it was computed after.
        """
        tokens = tuple(int(t) for t in tokens)
        key = self.chunk_key(tokens, anchor)
        with self._lock:
            self._bind(model)
            block = self._index.get(key)
            found = block is not None and block.start is not None and block.tokens == tokens
            if found:
                self._index.touch(key)
            stats = self.chunk_stats
            stats.hits, stats.misses = stats.hits + found, stats.misses + (not found)
            stats.hit_tokens += len(tokens) if found else 0
            stats.miss_tokens += 0 if found else len(tokens)
        if not found:
            return None
        assert block is not None and block.start is not None
        return ChunkEntry(block.kv.to(model.device), block.start)

    def put_chunk(self, model: PreTrainedModel, tokens: Sequence[int], anchor: bytes, entry: ChunkEntry) -> bool:
        """Keep a chunk's K/V (a copy); ``False`` when it was already held (then only refreshed).

        Args:
            entry: its K/V ``(2, L, H_kv, n, d)`` with ``n = len(tokens)`` and its first position.

        Raises:
            ValueError: K/V whose length is not the chunk's.
        """
        tokens = tuple(int(t) for t in tokens)
        if entry.kv.dim() != 5 or entry.kv.shape[3] != len(tokens):
            raise ValueError(f"put_chunk: K/V of shape {tuple(entry.kv.shape)} for a chunk of {len(tokens)} tokens")
        key = self.chunk_key(tokens, anchor)
        kv = entry.kv.detach().clone()  # owns its memory: eviction frees it
        with self._lock:
            self._bind(model)
            if key in self._index:
                self._index.touch(key)
                return False
            self._index.insert(key, Block(tokens, None, kv, start=int(entry.start)))
            self.chunk_stats.stored += 1
            self._evict(protect={key})
        return True

    @property
    def num_chunks(self) -> int:
        """Chunks held."""
        with self._lock:
            return sum(block.start is not None for _, block in self._index.items())
