"""The cache contract: what a decoder layer needs from its cache (transformers' ``update`` /
``get_seq_length``). fastprefill's own caches (:mod:`fastprefill.cache.storage`), KV-Runahead's
chain and gather caches and transformers' ``DynamicCache`` all meet it, and
:meth:`fastprefill.models.adapters.DecoderAdapter.layer` accepts any of them.

Shapes: keys/values ``(B, H_kv, N, d)``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["LayerCache"]


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
