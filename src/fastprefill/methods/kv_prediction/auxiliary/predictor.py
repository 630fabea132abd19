"""The KV predictor: per base layer, a linear map from an aux layer's KV to the base layer's KV.

Following KV Prediction (Horton et al., arXiv 2410.08391, Sec. 3): base layer ``l`` is fed by aux
layer ``a(l)``. Its keys and values are predicted separately by one ``nn.Linear`` with bias each,
acting on the aux KV with heads merged::

    K_aux[a(l)]  (1, H_aux, N, d_aux) -> (N, H_aux*d_aux) -> Linear -> (N, H_base*d_base)
                 -> (1, H_base, N, d_base) = K_hat[l]          (same for V)

**Rotary (a choice, with evidence).** Keys are predicted *before* rotation: the aux model's
pre-rotation keys (its cached keys un-rotated exactly, see
:func:`fastprefill.models.kv.prefix_kv`) map to the base's pre-rotation keys, and the base's
own rotary embedding is applied at the original positions when the cache is filled
(:func:`~fastprefill.models.kv.cache_from_kv`). A linear map on *rotated* keys has to
undo one position-dependent rotation and apply another with a single position-independent
matrix; when the two models' rotary frequencies differ (e.g. ``rope_theta`` 1e6 in Qwen2.5 vs
1e5 in SmolLM2) no such matrix exists. Evidence: ``tests/unit/test_kv_prediction.py::
test_pre_rotation_map_beats_rotated_map`` plants exactly that situation (aux = base with another
``rope_theta``): the pre-rotation least-squares map is exact at layer 0 while the rotated one
keeps a large held-out error; ``benchmarks/kvp_bench.py rope`` measures both on a real pair
(held-out text; the figures are in ``benchmarks/results/kvp_rope_lp.json``).
Values carry no rotation and are mapped directly.

**Source** (``source``, a choice beyond the paper, recorded in checkpoints). ``"kv"`` (the
paper's, the default): base layer ``l``'s K map reads aux layer ``a(l)``'s keys and its V map
the values, heads merged (``H_aux * d_aux`` features). ``"hidden"``: both maps read aux layer
``a(l)``'s normalised attention input ``(1, N, D_aux)`` (what its own k/v projections read,
:func:`fastprefill.models.kv.attention_inputs`), so nothing the aux's projections drop is lost.
``"hidden2"``: the attention inputs of two aux layers concatenated (``2 * D_aux`` features):
``a(l)`` and ``a(l) + 1``, or ``a(l) - 1`` and ``a(l)`` for the last aux layer.

**Layer map.** Monotone (non-decreasing), length ``L_base``, values in ``[0, L_aux)``. Default
proportional ``a(l) = floor(l * L_aux / L_base)`` (for equal depths, the identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fastprefill.errors import ConfigError, is_int
from fastprefill.models.kv import attention_inputs, prefix_kv
from fastprefill.models.shape import ModelShape

__all__ = ["SOURCES", "KVPredictor", "default_layer_map", "validate_layer_map"]

#: What the maps read from the aux model (see the module docstring).
SOURCES: tuple[str, ...] = ("kv", "hidden", "hidden2")

KV = tuple[torch.Tensor, torch.Tensor]


def default_layer_map(num_aux: int, num_base: int) -> tuple[int, ...]:
    """Proportional map ``a(l) = floor(l * L_aux / L_base)`` for ``l in 0..L_base-1``."""
    if num_aux < 1 or num_base < 1:
        raise ConfigError(f"layer counts must be >= 1, got aux={num_aux}, base={num_base}")
    return tuple((l * num_aux) // num_base for l in range(num_base))


def validate_layer_map(layer_map: Sequence[int], num_aux: int, num_base: int) -> tuple[int, ...]:
    """Check a layer map and return it as a tuple of ints.

    Raises:
        ConfigError: wrong length (must be ``num_base``), a value outside ``[0, num_aux)``, a
            non-integer, or not monotone (non-decreasing).
    """
    values = list(layer_map)
    if len(values) != num_base:
        raise ConfigError(
            f"layer_map must have one aux layer per base layer (length {num_base}), got length {len(values)}"
        )
    for l, a in enumerate(values):
        if not (is_int(a) or (isinstance(a, torch.Tensor) and a.numel() == 1)):
            raise ConfigError(f"layer_map[{l}] must be an int in [0, {num_aux}), got {a!r}")
        if not 0 <= int(a) < num_aux:
            raise ConfigError(f"layer_map[{l}] = {int(a)} is out of range: aux layers are [0, {num_aux})")
    values = [int(a) for a in values]
    for l in range(1, num_base):
        if values[l] < values[l - 1]:
            raise ConfigError(
                f"layer_map must be monotone (non-decreasing): layer_map[{l - 1}]={values[l - 1]} > "
                f"layer_map[{l}]={values[l]}"
            )
    return tuple(values)


class KVPredictor(nn.Module):
    """Per-base-layer linear maps from aux features to base KV (keys before rotation).

    Args:
        aux_shape: shape of the aux model (``L_aux``, ``H_kv``, ``d``, ``D``).
        base_shape: shape of the base model.
        layer_map: ``a(l)`` for each base layer; ``None`` = :func:`default_layer_map`.
        source: ``"kv"`` (default), ``"hidden"`` or ``"hidden2"`` (see the module docstring).

    Attributes:
        k_maps, v_maps: ``ModuleList`` of ``L_base`` ``nn.Linear(in_features, H_base*d_base)``.
        layer_map: the validated tuple.
    """

    def __init__(self, aux_shape: ModelShape, base_shape: ModelShape, layer_map: Sequence[int] | None = None,
                 source: str = "kv") -> None:
        super().__init__()
        if source not in SOURCES:
            raise ConfigError(f"KVPredictor.source must be one of {SOURCES}, got {source!r}")
        if source == "hidden2" and aux_shape.num_layers < 2:
            raise ConfigError("KVPredictor.source='hidden2' needs an aux model with at least 2 layers")
        self.aux_shape = aux_shape
        self.base_shape = base_shape
        self.source = source
        if layer_map is None:
            layer_map = default_layer_map(aux_shape.num_layers, base_shape.num_layers)
        self.layer_map = validate_layer_map(layer_map, aux_shape.num_layers, base_shape.num_layers)
        self.in_features = {
            "kv": aux_shape.num_kv_heads * aux_shape.head_dim,
            "hidden": aux_shape.hidden_size,
            "hidden2": 2 * aux_shape.hidden_size,
        }[source]
        self.out_features = base_shape.num_kv_heads * base_shape.head_dim
        n = base_shape.num_layers
        self.k_maps = nn.ModuleList(nn.Linear(self.in_features, self.out_features) for _ in range(n))
        self.v_maps = nn.ModuleList(nn.Linear(self.in_features, self.out_features) for _ in range(n))

    def flops(self, n_tokens: int) -> float:
        """Multiply-add FLOPs of predicting ``n_tokens`` positions for every base layer (K and V)."""
        return 2.0 * 2 * self.base_shape.num_layers * n_tokens * self.in_features * self.out_features

    # --- what the maps read -------------------------------------------------------------------
    def features(self, aux: nn.Module, input_ids: torch.Tensor, with_logits: bool = False) -> tuple[list[Any], Any]:
        """The aux model's features for :meth:`forward` over ``input_ids`` ``(1, N)``: per aux
        layer ``(K, V)`` ``(1, H_aux, N, d_aux)`` (source ``"kv"``) or the attention input
        ``(1, N, D_aux)``; and the aux logits if ``with_logits``."""
        if self.source == "kv":
            return prefix_kv(aux, input_ids, with_logits=with_logits)
        return attention_inputs(aux, input_ids, with_logits=with_logits)

    def input_keys(self, l: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Which features base layer ``l``'s K and V maps read: ``(a, 0)`` / ``(a, 1)`` (aux keys /
        values, source ``"kv"``) or the aux layers whose attention inputs are concatenated."""
        a = self.layer_map[l]
        if self.source == "kv":
            return (a, 0), (a, 1)
        if self.source == "hidden":
            return (a,), (a,)
        pair = (a, a + 1) if a + 1 < self.aux_shape.num_layers else (a - 1, a)
        return pair, pair

    def input_rows(self, features: Sequence[Any], key: tuple[int, ...]) -> torch.Tensor:
        """The ``(B, N, in_features)`` input named by an :meth:`input_keys` key."""
        if self.source == "kv":
            t = features[key[0]][key[1]]  # (B, H_aux, N, d_aux)
            b, _, n, _ = t.shape
            return t.transpose(1, 2).reshape(b, n, self.in_features)
        return torch.cat([features[a] for a in key], dim=-1)

    def _map(self, lin: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, n, _ = x.shape
        out = lin(x.to(lin.weight.dtype)).to(dtype)  # (B, N, H_base*d_base)
        return out.view(b, n, self.base_shape.num_kv_heads, self.base_shape.head_dim).transpose(1, 2)

    def forward(self, features: Sequence[Any], dtype: torch.dtype | None = None) -> list[KV]:
        """Predict the base KV.

        Args:
            features: ``L_aux`` entries from :meth:`features`: pairs ``(K, V)`` each
                ``(B, H_aux, N, d_aux)``, keys *before* rotation (source ``"kv"``), or attention
                inputs ``(B, N, D_aux)``.
            dtype: output dtype (default: the features' dtype).

        Returns:
            ``L_base`` pairs ``(K_hat, V_hat)``, each ``(B, H_base, N, d_base)``, keys before rotation.
        """
        if len(features) != self.aux_shape.num_layers:
            raise ValueError(f"expected features of {self.aux_shape.num_layers} aux layers, got {len(features)}")
        out: list[KV] = []
        for l in range(len(self.layer_map)):
            key_k, key_v = self.input_keys(l)
            xk, xv = self.input_rows(features, key_k), self.input_rows(features, key_v)
            dt = dtype or xk.dtype
            out.append((self._map(self.k_maps[l], xk, dt), self._map(self.v_maps[l], xv, dt)))
        return out
