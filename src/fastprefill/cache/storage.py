"""fastprefill's own K/V storage: the position-indexed per-layer cache, the dense cache, LazyLLM's
Aux Cache and the replayed cache; each exports to a transformers ``DynamicCache``
(:mod:`fastprefill.cache.dynamic`).

Each layer of :class:`PositionKVCache` holds keys and values for an arbitrary *set* of original
prompt positions, in the order they were computed. Different layers may hold different sets
(LazyLLM computes fewer tokens in deeper layers). Attention over such a layer uses an explicit
mask by original position (:func:`fastprefill.models.attention.causal_mask`), so the storage order
does not matter.

Shapes: keys/values ``(B, H_kv, N, d)``; positions ``(N,)`` int64; Aux Cache hidden states
``(B, M, D)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig

from fastprefill.cache.dynamic import wrap_dynamic_cache

__all__ = ["AuxCache", "DenseKVCache", "LayerKV", "PositionKVCache", "ReplayCache"]


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
    """A :class:`~fastprefill.cache.contract.LayerCache` holding every position ``0..N-1`` at every layer, rows rewritten in place.

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
    """A :class:`~fastprefill.cache.contract.LayerCache` that hands every layer fixed keys and values instead of its own.

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
