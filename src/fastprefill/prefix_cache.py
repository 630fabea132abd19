"""Exact prefix caching: the keys and values of token sequences already prefilled, reused across requests.

A chat resends its whole history every turn; a RAG or code assistant asks many questions over
the same documents; agents repeat a long system prompt. :class:`PrefixCache` keeps the exact
per-layer K/V of what was prefilled, and :func:`fastprefill.engine.generate` with
``prefix_cache=`` prefills only the part of a new prompt that is not cached.

**Index: hashed token blocks** (as vLLM's automatic prefix caching). A sequence is cut into
blocks of ``block_tokens`` tokens; block ``i``'s key is a BLAKE2b digest of its tokens and of
block ``i - 1``'s key, so one key names the whole prefix up to it. The longest cached prefix of
a prompt is a walk of dictionary lookups, one per block, never a scan of the entries. Each block
also keeps its own token ids, compared on every hit, so a digest collision can never hand one
prompt another prompt's K/V. Chosen over a radix tree (SGLang) because whole blocks make the
byte accounting, LRU eviction and saving to disk simple, at the cost of recomputing the last
partial block (fewer than ``block_tokens`` tokens) of a hit.

**Eviction: least recently used leaves, under a byte bound.** A block is evicted only when no
cached block continues it (a leaf), so no cached block is ever unreachable. A hit refreshes its
blocks child-first, so the chain's root stays the most recent and leaves go first.

**Only exact K/V is stored.** A method reports how many leading positions of its cache equal
full prefill's at every layer (``PrefillOutput.exact_tokens``); only those are stored. What
LazyLLM pruned or KV Prediction predicted is never stored as if it were computed.

**Thread safety.** Every operation holds one lock; a stored block is complete before it is
visible, and blocks are never modified after (hits copy them into a new cache), so concurrent
requests sharing a prefix see whole blocks or none.

**Persistence.** :meth:`PrefixCache.save` writes the blocks to one safetensors file with a JSON
header (model fingerprint, dtype, block size, each block's tokens and parent) and a sha256
sidecar; :meth:`PrefixCache.load` refuses a file whose checksum, model, dtype or block size
differs, with a message, and loads nothing from it.

Shapes: one block is ``(2, L, H_kv, B, d)`` (keys, values; rotated keys, as a transformers
cache holds them); a hit's cache layer ``l`` is ``(1, H_kv, P, d)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from fastprefill.cache import layer_kv, roomy_from_blocks
from fastprefill.errors import ConfigError, FastprefillError, is_int
from fastprefill.models.fingerprint import file_sha256, weights_fingerprint
from fastprefill.models.shape import ModelShape

__all__ = ["PrefixCache", "PrefixCacheError", "PrefixHit", "supports_prefix_cache"]

FORMAT = "fastprefill-prefix-cache"
VERSION = 1


class PrefixCacheError(FastprefillError, ValueError):
    """A saved prefix cache that is corrupt or belongs to another model, dtype or block size."""


def supports_prefix_cache(model: PreTrainedModel) -> bool:
    """Whether ``model``'s transformers cache is plain full-attention layers (no sliding window),
    the only kind whose K/V a prefix can be cut from."""
    cache = DynamicCache(config=model.config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class _Block:
    """One cached block: its tokens, its parent's key and its K/V ``(2, L, H_kv, B, d)``; ``start``
    is ``None`` for a prefix block, the first position of an entry of a subclass's own kind (a
    :class:`~fastprefill.chunk_store.ChunkStore` chunk: ``B`` is then its length)."""

    tokens: tuple[int, ...]
    parent: bytes | None
    kv: torch.Tensor
    children: int = 0
    start: int | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


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
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # LRU order: oldest first
        self._bytes = 0
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

    # --- keys ------------------------------------------------------------------------------
    def _keys(self, ids: Sequence[int]) -> list[tuple[bytes, tuple[int, ...]]]:
        """``(key, tokens)`` of every whole block of ``ids``, in order."""
        out = []
        parent = b""
        b = self.block_tokens
        for start in range(0, len(ids) - b + 1, b):
            tokens = tuple(int(t) for t in ids[start:start + b])
            digest = hashlib.blake2b(parent + torch.tensor(tokens, dtype=torch.int64).numpy().tobytes(),
                                     digest_size=16).digest()
            out.append((digest, tokens))
            parent = digest
        return out

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
            for key, tokens in self._keys(ids):
                block = self._blocks.get(key)
                if block is None or block.tokens != tokens:
                    break
                found.append(key)
            self._refresh(found)
            kv = [self._blocks[key].kv for key in found]
            p = min(len(found) * self.block_tokens, len(ids) - 1)
            self.stats.lookups += 1
            self.stats.hits += bool(found)
            self.stats.hit_tokens += p
            self.stats.miss_tokens += len(ids) - p
        if p <= longer_than:
            return PrefixHit(p, None)
        return PrefixHit(p, roomy_from_blocks(model.config, kv, p, len(ids), model.device))

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
        keys = self._keys(ids[:n])
        with self._lock:
            self._bind(model)
            first_new = next((i for i, (key, _) in enumerate(keys) if key not in self._blocks), len(keys))
            if first_new == len(keys):  # all cached already
                self._refresh([key for key, _ in keys])
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
                if key not in self._blocks:
                    if parent is not None and parent not in self._blocks:
                        break  # evicted meanwhile: a block without its parent would be unreachable
                    self._insert(key, _Block(tokens, parent, block_kv))
                    stored += b
                parent = key
            self._refresh([key for key, _ in keys])
            self._evict(protect={key for key, _ in keys})
            self.stats.stored_tokens += stored
        return stored

    # --- bookkeeping ----------------------------------------------------------------------
    def _refresh(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # child first: the root ends most recent, leaves go first
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _insert(self, key: bytes, block: _Block) -> None:
        self._blocks[key] = block
        self._bytes += block.nbytes
        if block.parent is not None:
            self._blocks[block.parent].children += 1

    def _remove(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        self._bytes -= block.nbytes
        if block.parent is not None and block.parent in self._blocks:
            self._blocks[block.parent].children -= 1
        self.stats.evicted_blocks += 1

    def _evict(self, protect: set[bytes] = frozenset()) -> None:
        """Drop least recently used leaves until the bytes fit; the blocks just stored
        (``protect``) go last."""
        while self._bytes > self.max_bytes:
            victim = next((k for k, blk in self._blocks.items() if blk.children == 0 and k not in protect), None)
            if victim is None:
                victim = next((k for k, blk in self._blocks.items() if blk.children == 0), None)
            if victim is None:  # cannot happen: a non-empty forest has a leaf
                break
            self._remove(victim)

    def _depth(self, key: bytes) -> int:
        depth, parent = 0, self._blocks[key].parent
        while parent is not None:
            depth, parent = depth + 1, self._blocks[parent].parent
        return depth

    def clear(self) -> None:
        """Drop every block."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held."""
        return self._bytes

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def held_tokens(self) -> int:
        """Tokens held (``num_blocks * block_tokens`` for prefix blocks)."""
        return sum(len(block.tokens) for block in self._blocks.values())

    # --- persistence ----------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write every block to ``directory/<FILE_STEM>.safetensors`` (atomically) with a sha256 sidecar.

        Returns:
            The file written.

        Raises:
            ConfigError: the cache was never bound to a model (nothing to identify it by).
        """
        from safetensors.torch import save_file

        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._fingerprint is None:
                raise ConfigError("this PrefixCache has not served a model yet; nothing to save")
            lru = {key: rank for rank, key in enumerate(self._blocks)}  # 0 = least recently used
            order = sorted(self._blocks, key=lambda key: (self._depth(key), lru[key]))  # parents first
            tensors = {key.hex(): self._blocks[key].kv.detach().to("cpu").contiguous() for key in order}
            header = {
                "format": self.FORMAT, "version": VERSION, "fingerprint": self._fingerprint, "dtype": str(self._dtype),
                "block_tokens": self.block_tokens,
                "blocks": [{"key": key.hex(), "parent": None if self._blocks[key].parent is None
                            else self._blocks[key].parent.hex(), "tokens": list(self._blocks[key].tokens),
                            "lru": lru[key], **({} if self._blocks[key].start is None else
                                                {"start": self._blocks[key].start})} for key in order],
            }
        path = folder / f"{self.FILE_STEM}.safetensors"
        tmp = folder / f".{self.FILE_STEM}.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"fastprefill": json.dumps(header)})
        digest = file_sha256(tmp)
        os.replace(tmp, path)
        (folder / f"{self.FILE_STEM}.sha256").write_text(digest + "\n")
        return path

    def load(self, directory: str | os.PathLike[str], model: PreTrainedModel) -> int:
        """Load the blocks saved in ``directory`` for ``model`` (most recent last, within the bound).

        Returns:
            The tokens loaded (0 when there is no file).

        Raises:
            PrefixCacheError: a corrupt file (checksum, format) or one saved for another model,
                dtype or block size; nothing is loaded from it.
        """
        from safetensors import safe_open

        folder = Path(directory)
        path, sidecar = folder / f"{self.FILE_STEM}.safetensors", folder / f"{self.FILE_STEM}.sha256"
        if not path.exists():
            return 0
        if not sidecar.exists() or sidecar.read_text().strip() != file_sha256(path):
            raise PrefixCacheError(f"{path}: its sha256 does not match {sidecar.name}; the file is corrupt "
                                   "(delete it; the cache refills as requests come)")
        try:
            with safe_open(str(path), framework="pt") as handle:
                header = json.loads((handle.metadata() or {}).get("fastprefill", "{}"))
                self.bind(model)
                self._check_header(path, header)
                loaded = 0
                with self._lock:
                    new: dict[bytes, int] = {}
                    for entry in header["blocks"]:  # parents before children
                        key = bytes.fromhex(entry["key"])
                        parent = None if entry["parent"] is None else bytes.fromhex(entry["parent"])
                        if key in self._blocks or (parent is not None and parent not in self._blocks):
                            continue
                        kv = handle.get_tensor(entry["key"]).to(model.device)
                        self._insert(key, _Block(tuple(entry["tokens"]), parent, kv, start=entry.get("start")))
                        new[key] = int(entry["lru"])
                        loaded += self.block_tokens
                    for key in sorted(new, key=new.__getitem__):  # restore the saved recency order
                        self._blocks.move_to_end(key)
                    self._evict()
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            if isinstance(exc, FastprefillError):
                raise
            raise PrefixCacheError(f"{path} is not a readable prefix cache ({exc}); delete it") from None
        return loaded

    def _check_header(self, path: Path, header: dict[str, Any]) -> None:
        if header.get("format") != self.FORMAT or header.get("version") != VERSION:
            raise PrefixCacheError(f"{path} is not a fastprefill prefix cache (format {header.get('format')!r})")
        if header.get("fingerprint") != self._fingerprint:
            raise PrefixCacheError(f"{path} was saved for another model (weights fingerprint differs); "
                                   "it is ignored: delete it or point --prefix-cache-dir elsewhere")
        if header.get("dtype") != str(self._dtype):
            raise PrefixCacheError(f"{path} holds {header.get('dtype')} K/V; the model runs in {self._dtype}")
        if header.get("block_tokens") != self.block_tokens:
            raise PrefixCacheError(f"{path} has blocks of {header.get('block_tokens')} tokens, this cache "
                                   f"{self.block_tokens}")
