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
1e5 in SmolLM2) no such matrix exists. Evidence: ``tests/test_kv_prediction.py::
test_pre_rotation_map_beats_rotated_map`` plants exactly that situation (aux = base with another
``rope_theta``): the pre-rotation least-squares map is exact at layer 0 while the rotated one
keeps a large held-out error; ``benchmarks/kvp_bench.py rope`` measures both on a real pair
(held-out text; ``benchmarks/results/kvp_rope_lp.json``: 0.380 vs 0.399 mean relative K error).
Values carry no rotation and are mapped directly.

**Layer map.** Monotone (non-decreasing), length ``L_base``, values in ``[0, L_aux)``. Default
proportional ``a(l) = floor(l * L_aux / L_base)`` (for equal depths, the identity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastprefill.errors import ConfigError
from fastprefill.models.shape import ModelShape

__all__ = ["KVPredictor", "default_layer_map", "validate_layer_map"]

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
        if isinstance(a, bool) or not isinstance(a, int) and not (isinstance(a, torch.Tensor) and a.numel() == 1):
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
    """Per-base-layer linear maps from aux KV to base KV (keys before rotation).

    Args:
        aux_shape: shape of the aux model (``L_aux``, ``H_kv``, ``d``).
        base_shape: shape of the base model.
        layer_map: ``a(l)`` for each base layer; ``None`` = :func:`default_layer_map`.

    Attributes:
        k_maps, v_maps: ``ModuleList`` of ``L_base`` ``nn.Linear(H_aux*d_aux, H_base*d_base)``.
        layer_map: the validated tuple.
    """

    def __init__(self, aux_shape: ModelShape, base_shape: ModelShape, layer_map: Sequence[int] | None = None) -> None:
        super().__init__()
        self.aux_shape = aux_shape
        self.base_shape = base_shape
        if layer_map is None:
            layer_map = default_layer_map(aux_shape.num_layers, base_shape.num_layers)
        self.layer_map = validate_layer_map(layer_map, aux_shape.num_layers, base_shape.num_layers)
        self.in_features = aux_shape.num_kv_heads * aux_shape.head_dim
        self.out_features = base_shape.num_kv_heads * base_shape.head_dim
        n = base_shape.num_layers
        self.k_maps = nn.ModuleList(nn.Linear(self.in_features, self.out_features) for _ in range(n))
        self.v_maps = nn.ModuleList(nn.Linear(self.in_features, self.out_features) for _ in range(n))

    @classmethod
    def identity(cls, shape: ModelShape) -> KVPredictor:
        """Identity maps between two models of the same ``shape`` (the corenet identity check)."""
        pred = cls(shape, shape, layer_map=tuple(range(shape.num_layers)))
        with torch.no_grad():
            for lin in [*pred.k_maps, *pred.v_maps]:
                lin.weight.copy_(torch.eye(pred.out_features))
                lin.bias.zero_()
        return pred

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops(self, n_tokens: int) -> float:
        """Multiply-add FLOPs of predicting ``n_tokens`` positions for every base layer (K and V)."""
        return 2.0 * 2 * self.base_shape.num_layers * n_tokens * self.in_features * self.out_features

    def _map(self, lin: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, _, n, _ = x.shape
        merged = x.transpose(1, 2).reshape(b, n, self.in_features).to(lin.weight.dtype)  # (B, N, H_aux*d_aux)
        out = lin(merged).to(dtype)  # (B, N, H_base*d_base)
        return out.view(b, n, self.base_shape.num_kv_heads, self.base_shape.head_dim).transpose(1, 2)

    def forward(self, aux_kv: Sequence[KV], dtype: torch.dtype | None = None) -> list[KV]:
        """Predict the base KV.

        Args:
            aux_kv: ``L_aux`` pairs ``(K, V)``, each ``(B, H_aux, N, d_aux)``, keys *before* rotation.
            dtype: output dtype (default: the aux KV's dtype).

        Returns:
            ``L_base`` pairs ``(K_hat, V_hat)``, each ``(B, H_base, N, d_base)``, keys before rotation.
        """
        if len(aux_kv) != self.aux_shape.num_layers:
            raise ValueError(f"expected KV of {self.aux_shape.num_layers} aux layers, got {len(aux_kv)}")
        out: list[KV] = []
        for l, a in enumerate(self.layer_map):
            k, v = aux_kv[a]
            dt = dtype or k.dtype
            out.append((self._map(self.k_maps[l], k, dt), self._map(self.v_maps[l], v, dt)))
        return out

    def describe_map(self) -> str:
        return ",".join(map(str, self.layer_map))
