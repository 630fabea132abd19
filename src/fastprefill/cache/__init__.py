"""K/V caches, split by what they do:

- :mod:`fastprefill.cache.contract`: :class:`LayerCache`, the one contract a decoder layer's cache
  meets;
- :mod:`fastprefill.cache.storage`: fastprefill's own storage (:class:`PositionKVCache`,
  :class:`DenseKVCache`, LazyLLM's :class:`AuxCache`, :class:`ReplayCache`);
- :mod:`fastprefill.cache.dynamic`: helpers over transformers' ``DynamicCache`` (:class:`RoomyLayer`
  and :func:`make_roomy`, :func:`fork_cache`, :func:`pad_caches` / :func:`unpad_row`,
  :func:`wrap_dynamic_cache`, :func:`layer_kv`);
- :mod:`fastprefill.cache.blocks`: the block index the prefix cache and the chunk store keep
  their K/V in (:class:`BlockIndex`: blocks keyed by :func:`block_keys`, a byte bound, least
  recently used leaves evicted first), and :mod:`fastprefill.cache.block_file` the file it is
  saved to (the caches themselves: :mod:`fastprefill.prefix_cache`, :mod:`fastprefill.chunk_store`).

Only this package and ``fastprefill.models.adapters`` touch transformers' cache internals. The
names are importable from ``fastprefill.cache`` itself (the file format's from its module).
"""

from __future__ import annotations

from fastprefill.cache.blocks import Block, BlockIndex, block_keys
from fastprefill.cache.contract import LayerCache
from fastprefill.cache.dynamic import (
    ROOM_TOKENS,
    RoomyLayer,
    fork_cache,
    layer_kv,
    make_roomy,
    pad_caches,
    roomy_from_blocks,
    unpad_row,
    wrap_dynamic_cache,
)
from fastprefill.cache.storage import AuxCache, DenseKVCache, LayerKV, PositionKVCache, ReplayCache

__all__ = ["ROOM_TOKENS", "AuxCache", "Block", "BlockIndex", "DenseKVCache", "LayerCache", "LayerKV", "PositionKVCache", "ReplayCache",
           "RoomyLayer", "block_keys", "fork_cache", "layer_kv", "make_roomy", "pad_caches", "roomy_from_blocks", "unpad_row",
           "wrap_dynamic_cache"]
