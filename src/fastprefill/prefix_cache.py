"""Exact prefix caching: the keys and values of token sequences already prefilled, reused across requests.

A chat resends its whole history every turn; a RAG or code assistant asks many questions over
the same documents; agents repeat a long system prompt. :class:`PrefixCache` keeps the exact
per-layer K/V of what was prefilled, and :func:`fastprefill.engine.generate` with
``prefix_cache=`` prefills only the part of a new prompt that is not cached.

**Index: hashed token blocks** (as vLLM's automatic prefix caching), kept in a
:class:`~fastprefill.cache.blocks.BlockIndex`: block ``i``'s key names the whole prefix up to
it, so the longest cached prefix of a prompt is a walk of dictionary lookups, one per block,
never a scan of the entries; each block's own token ids are compared on every hit, so a digest
collision can never hand one prompt another prompt's K/V. Chosen over a radix tree (SGLang)
because whole blocks make the byte accounting, LRU eviction and saving to disk simple, at the
cost of recomputing the last partial block (fewer than ``block_tokens`` tokens) of a hit.

**Eviction: least recently used leaves, under a byte bound** (a block no cached block
continues), so no cached block is ever unreachable; a hit refreshes its blocks child-first.

**Only exact K/V is stored.** A method reports how many leading positions of its cache equal
full prefill's at every layer (``PrefillOutput.exact_tokens``); only those are stored. What
LazyLLM pruned or KV Prediction predicted is never stored as if it were computed.

**Thread safety.** Every operation holds one lock; a stored block is complete before it is
visible, and blocks are never modified after (hits copy them into a new cache), so concurrent
requests sharing a prefix see whole blocks or none.

**Persistence.** :meth:`PrefixCache.save` writes the blocks to one safetensors file with a JSON
header and a sha256 sidecar (:mod:`fastprefill.cache.block_file`); :meth:`PrefixCache.load`
refuses a file whose checksum, model, dtype or block size differs, with a message, and loads
nothing from it.

Shapes: one block is ``(2, L, H_kv, B, d)`` (keys, values; rotated keys, as a transformers
cache holds them); a hit's cache layer ``l`` is ``(1, H_kv, P, d)``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from fastprefill.cache import layer_kv, roomy_from_blocks
from fastprefill.cache.block_file import (
    PrefixCacheError,
    check_identity,
    open_blocks,
    restore_blocks,
    snapshot,
    write_blocks,
)
from fastprefill.cache.blocks import Block, BlockIndex, block_keys
from fastprefill.cache.dynamic import HIT_STORAGE, StoragePool
from fastprefill.errors import ConfigError, is_int
from fastprefill.models.fingerprint import weights_fingerprint
from fastprefill.models.shape import ModelShape

__all__ = ["PrefixCache", "PrefixCacheError", "PrefixHit", "supports_prefix_cache"]

FORMAT = "fastprefill-prefix-cache"


def supports_prefix_cache(model: PreTrainedModel) -> bool:
    """Whether ``model``'s transformers cache is plain full-attention layers (no sliding window),
    the only kind whose K/V a prefix can be cut from."""
    cache = DynamicCache(config=model.config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class PrefixHit:
    """The cached prefix of one prompt.

    Attributes:
        tokens: ``P``, the positions the cache gives (at most ``T - 1``: the last prompt token
            always runs, it makes the first-token logits).
        cache: a new ``DynamicCache`` holding positions ``0..P-1`` at every layer (``None``
            when ``P`` is 0, or not more than the caller held); the caller owns it.
    """

    tokens: int
    cache: DynamicCache | None


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made.

    Attributes:
        hit_tokens / miss_tokens: prompt tokens served from the cache / computed, over lookups.
        lookups: lookups (a request that waited for another's blocks makes two); hits: with a block.
        stored_tokens: tokens written; evicted_blocks: blocks dropped for the byte bound.
    """

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    stored_tokens: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Exact K/V of prefixes already prefilled, for one model (see the module docstring).

    Args:
        max_bytes: the bound on the K/V held (> 0). It must hold at least one block of the
            model it is used with (checked at first use, with the block size in the message).
        block_tokens: tokens per block (>= 1): hits are whole blocks, so a hit ends at most
            ``block_tokens - 1`` tokens before the shared prefix does.

    Raises:
        ConfigError: a bad argument.

    The cache binds to the first model it is used with (its shape, dtype and device); using it
    with another model raises :class:`~fastprefill.errors.ConfigError`.
    """

    #: The saved file's name (``<stem>.safetensors`` and ``<stem>.sha256``) and format tag.
    FILE_STEM: ClassVar[str] = "prefix-cache"
    FORMAT: ClassVar[str] = FORMAT

    def __init__(self, max_bytes: int, block_tokens: int = 16) -> None:
        if not is_int(max_bytes, 1):
            raise ConfigError(f"max_bytes must be an integer number of bytes > 0, got {max_bytes!r}")
        if not is_int(block_tokens, 1):
            raise ConfigError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.stats = PrefixCacheStats()
        #: where a hit's storage comes from: the process's pool (reused once no cache holds it), or
        #: ``None`` for a new tensor per hit
        self.hit_storage: StoragePool | None = HIT_STORAGE
        self._index = BlockIndex(max_bytes)
        self._lock = threading.Lock()
        self._model: weakref.ref[PreTrainedModel] | None = None
        self._fingerprint: str | None = None
        self._dtype: torch.dtype | None = None

    # --- binding ---------------------------------------------------------------------------
    def bind(self, model: PreTrainedModel) -> None:
        """Check that this cache can serve ``model`` and bind to it (done at first use).

        Raises:
            ConfigError: another model than the one bound; a model whose cache has sliding-window
                layers; a bound too small for one block of this model.
        """
        with self._lock:
            self._bind(model)

    def _bind(self, model: PreTrainedModel) -> None:
        if self._model is not None:
            if self._model() is model:
                return
            if self._model() is not None:
                raise ConfigError("this PrefixCache serves another model; make one PrefixCache per model")
        if not supports_prefix_cache(model):
            raise ConfigError(
                f"prefix caching needs full-attention cache layers; {getattr(model.config, 'model_type', '?')!r} "
                "has sliding-window layers, whose K/V cannot be cut into prefixes: run without a prefix cache"
            )
        block = self._block_bytes(model)
        if block > self.max_bytes:
            raise ConfigError(
                f"a prefix cache of {self.max_bytes} bytes cannot hold one block of {self.block_tokens} tokens of "
                f"this model ({block} bytes, {block / self.block_tokens:.0f} per token); raise max_bytes to at "
                f"least {block} or lower block_tokens"
            )
        fingerprint = weights_fingerprint(model)
        if self._fingerprint is not None and fingerprint != self._fingerprint:
            raise ConfigError("this PrefixCache holds blocks of another model (weights fingerprint); make a new one")
        if self._dtype is not None and self._dtype != model.dtype:
            raise ConfigError(f"this PrefixCache holds {self._dtype} blocks; the model runs in {model.dtype}")
        self._model = weakref.ref(model)
        self._fingerprint = fingerprint
        self._dtype = model.dtype

    def _block_bytes(self, model: PreTrainedModel) -> int:
        shape = ModelShape.from_config(model.config)
        element = torch.empty(0, dtype=model.dtype).element_size()
        return 2 * shape.num_layers * shape.num_kv_heads * self.block_tokens * shape.head_dim * element

    # --- the two operations ---------------------------------------------------------------
    def lookup(self, model: PreTrainedModel, input_ids: torch.Tensor, longer_than: int = 0) -> PrefixHit:
        """The longest cached prefix of a prompt, as a new cache.

        Args:
            model: the model the prompt runs on (bound at first use).
            input_ids: ``(1, T)`` prompt ids.
            longer_than: the hit a caller already holds: a hit no longer comes without K/V.

        Returns:
            ``P`` (whole blocks, capped at ``T - 1``) and, when ``P > longer_than``, a ``DynamicCache``
            with their K/V on the model's device (the hit's blocks become the most recently used).
        """
        ids = input_ids.reshape(-1).tolist()
        with self._lock:
            self._bind(model)
            found: list[bytes] = []
            kv: list[torch.Tensor] = []
            for key, tokens in block_keys(ids, self.block_tokens):
                block = self._index.get(key)
                if block is None or block.tokens != tokens:
                    break
                found.append(key)
                kv.append(block.kv)
            self._index.refresh(found)
            p = min(len(found) * self.block_tokens, len(ids) - 1)
            self.stats.lookups += 1
            self.stats.hits += bool(found)
            self.stats.hit_tokens += p
            self.stats.miss_tokens += len(ids) - p
        if p <= longer_than:
            return PrefixHit(p, None)
        return PrefixHit(p, roomy_from_blocks(model.config, kv, p, len(ids), model.device, self.hit_storage))

    def store(self, model: PreTrainedModel, token_ids: Sequence[int] | torch.Tensor, cache: DynamicCache,
              exact_tokens: int) -> int:
        """Keep the exact K/V of ``token_ids[:exact_tokens]`` (whole blocks; the ones already
        cached are only refreshed); returns the tokens newly stored.

        Args:
            model: the model that made ``cache``.
            token_ids: the sequence ``cache`` holds, position by position (the prompt, and
                generated tokens fed through the model).
            cache: a transformers cache whose every layer holds positions ``0..N-1`` in order.
            exact_tokens: ``E <= N``: how many leading positions are exact at every layer.

        Raises:
            ValueError: ``exact_tokens`` outside ``0..len(token_ids)``, or too short a cache (nothing stored).
        """
        ids = (token_ids.reshape(-1).tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids))
        if not is_int(exact_tokens, 0) or (n := int(exact_tokens)) > len(ids):
            raise ValueError(f"exact_tokens must be an integer in 0..{len(ids)}, got {exact_tokens!r}")
        keys = block_keys(ids[:n], self.block_tokens)
        with self._lock:
            self._bind(model)
            first_new = next((i for i, (key, _) in enumerate(keys) if key not in self._index), len(keys))
            if first_new == len(keys):  # all cached already
                self._index.refresh([key for key, _ in keys])
                return 0
        b = self.block_tokens
        start, end = first_new * b, len(keys) * b
        layers = [layer_kv(cache, i) for i in range(len(cache.layers))]
        if bad := [i for i, (k, v) in enumerate(layers) if k.shape[0] != 1 or min(k.shape[2], v.shape[2]) < end]:
            raise ValueError(f"cache layer {bad[0]} holds no single sequence of {end} positions; nothing stored")
        keys0 = layers[0][0]
        kv = keys0.new_empty((2, len(layers), keys0.shape[1], end - start, keys0.shape[3]))  # (2, L, H_kv, M, d)
        for i, (k, v) in enumerate(layers):
            kv[0, i].copy_(k[0, :, start:end])
            kv[1, i].copy_(v[0, :, start:end])
        blocks = [chunk.clone() for chunk in kv.split(b, dim=3)]  # each block owns its memory (eviction frees it)
        stored = 0
        with self._lock:
            parent = keys[first_new - 1][0] if first_new else None
            for (key, tokens), block_kv in zip(keys[first_new:], blocks, strict=True):
                if key not in self._index:
                    if parent is not None and parent not in self._index:
                        break  # evicted meanwhile: a block without its parent would be unreachable
                    self._index.insert(key, Block(tokens, parent, block_kv))
                    stored += b
                parent = key
            self._index.refresh([key for key, _ in keys])
            self._evict(protect={key for key, _ in keys})
            self.stats.stored_tokens += stored
        return stored

    # --- bookkeeping ----------------------------------------------------------------------
    def _evict(self, protect: set[bytes] = frozenset()) -> None:
        """Drop least recently used leaves until the bytes fit; the blocks just stored
        (``protect``) go last. Called with the lock held."""
        self.stats.evicted_blocks += self._index.evict(protect)

    def clear(self) -> None:
        """Drop every block."""
        with self._lock:
            self._index.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held."""
        return self._index.nbytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def held_tokens(self) -> int:
        """Tokens held (``num_blocks * block_tokens`` for prefix blocks)."""
        return sum(len(block.tokens) for _, block in self._index.items())

    # --- persistence ----------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        """What this cache's blocks are valid for, as its file records it."""
        return {"format": self.FORMAT, "fingerprint": self._fingerprint, "dtype": str(self._dtype),
                "block_tokens": self.block_tokens}

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write every block to ``directory/<FILE_STEM>.safetensors`` (atomically) with a sha256 sidecar.

        Returns:
            The file written.

        Raises:
            ConfigError: the cache was never bound to a model (nothing to identify it by).
        """
        with self._lock:
            if self._fingerprint is None:
                raise ConfigError("this PrefixCache has not served a model yet; nothing to save")
            header, tensors = snapshot(self._index, self._identity())
        return write_blocks(directory, self.FILE_STEM, header, tensors)

    def load(self, directory: str | os.PathLike[str], model: PreTrainedModel) -> int:
        """Load the blocks saved in ``directory`` for ``model`` (most recent last, within the bound).

        Returns:
            The tokens loaded (0 when there is no file).

        Raises:
            PrefixCacheError: a corrupt file (checksum, format) or one saved for another model,
                dtype or block size; nothing is loaded from it.
        """
        with open_blocks(directory, self.FILE_STEM) as saved:
            if saved is None:
                return 0
            self.bind(model)
            check_identity(saved, self._identity())
            with self._lock:
                loaded = restore_blocks(self._index, saved, model.device)
                self._evict()
        return loaded * self.block_tokens
