"""kvp-prefix's maps: per later layer ``j``, K and V from the hidden state entering layer ``l``
(see :mod:`fastprefill.methods.kv_prediction.prefix` for the method and the maps' definitions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from fastprefill.errors import ConfigError, is_int
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.shape import ModelShape

__all__ = ["KV", "VARIANT", "LayerMap", "PrefixPredictor", "check_layer", "stored_delta"]

#: ``config.json["variant"]`` of a kvp-prefix checkpoint.
VARIANT = "prefix"

KV = tuple[torch.Tensor, torch.Tensor]


def check_layer(layer: Any, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers]``, else :class:`ConfigError` naming the range."""
    if not is_int(layer, 0, num_layers):
        raise ConfigError(
            f"kvp-prefix layer must be an int in [0, {num_layers}] for this {num_layers}-layer model "
            f"(the number of layers run exactly), got {layer!r}"
        )
    return layer


@dataclass
class LayerMap:
    """Layer ``j``'s K and V maps on the unit-RMS input ``x`` ``(B, N, D)``: ``W (g * x) + b``.

    Attributes:
        gain: ``(D,)`` or ``None`` (no gain).
        k_weight, v_weight: ``(H_kv*d, D)``.
        k_bias, v_bias: ``(H_kv*d,)`` or ``None``.
    """

    gain: torch.Tensor | None
    k_weight: torch.Tensor
    k_bias: torch.Tensor | None
    v_weight: torch.Tensor
    v_bias: torch.Tensor | None

    def apply(self, x: torch.Tensor) -> KV:
        """``(B, N, D)`` -> merged ``(K, V)``, each ``(B, N, H_kv*d)``."""
        if self.gain is not None:
            x = self.gain * x
        return (torch.nn.functional.linear(x, self.k_weight, self.k_bias),
                torch.nn.functional.linear(x, self.v_weight, self.v_bias))

    def augmented(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The maps as float64 ``(D + 1, H_kv*d)`` matrices on ``[x 1]`` (gain folded in), K then V."""
        out = []
        for weight, bias in ((self.k_weight, self.k_bias), (self.v_weight, self.v_bias)):
            w = weight.detach().to("cpu", torch.float64)
            if self.gain is not None:
                w = w * self.gain.detach().to("cpu", torch.float64)[None, :]
            b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.detach().to("cpu", torch.float64)
            out.append(torch.cat([w.T, b[None]], dim=0))
        return out[0], out[1]


class PrefixPredictor:
    """The maps of every layer ``j`` in ``l..L-1`` (see the module docstring).

    Args:
        shape: the base's shape.
        layer: ``l``, the number of layers run exactly.
        maps: ``{j: LayerMap}`` for ``j = l..L-1``.
        kind: ``"zero-shot"``, ``"least-squares"`` or ``"distilled"`` (for :meth:`describe`).
        rank: the correction's rank (``None``: full rank or none).
    """

    def __init__(self, shape: ModelShape, layer: int, maps: dict[int, LayerMap], kind: str,
                 rank: int | None = None) -> None:
        self.shape = shape
        self.layer = check_layer(layer, shape.num_layers)
        if sorted(maps) != list(range(layer, shape.num_layers)):
            raise ConfigError(f"kvp-prefix maps must cover layers {layer}..{shape.num_layers - 1}, got {sorted(maps)}")
        self.maps = maps
        self.kind = kind
        self.rank = rank

    @classmethod
    def zero_shot(cls, model: PreTrainedModel, layer: int) -> PrefixPredictor:
        """Layer ``j``'s own input-norm gain and k/v projections (the model's tensors, not copies)."""
        ad = DecoderAdapter(model, "kvp-prefix")
        check_layer(layer, ad.num_layers)
        maps = {}
        for j in range(layer, ad.num_layers):
            k_proj, v_proj = ad.kv_projections(j)
            maps[j] = LayerMap(ad.input_norm_gain(j), k_proj.weight, k_proj.bias, v_proj.weight, v_proj.bias)
        return cls(ad.shape, layer, maps, "zero-shot")

    @classmethod
    def corrected(cls, model: PreTrainedModel, layer: int, deltas: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  rank: int | None, kind: str = "least-squares") -> PrefixPredictor:
        """Zero-shot maps plus float64 ``(D + 1, H_kv*d)`` corrections ``{j: (Δ_K, Δ_V)}`` on ``[x 1]``
        (``kind``: how they were fitted, ``"least-squares"`` or ``"distilled"``)."""
        zero = cls.zero_shot(model, layer)
        dtype, device = model.dtype, next(model.parameters()).device
        maps = {}
        for j, zmap in zero.maps.items():
            mats = [base + delta for base, delta in zip(zmap.augmented(), deltas[j])]  # (D+1, out)
            (kw, kb), (vw, vb) = ((m[:-1].T.contiguous(), m[-1].contiguous()) for m in mats)
            maps[j] = LayerMap(None, *(t.to(device, dtype) for t in (kw, kb, vw, vb)))
        return cls(zero.shape, layer, maps, kind, rank)

    def predict(self, ad: DecoderAdapter, hidden: torch.Tensor) -> dict[int, KV]:
        """Pre-rotation ``{j: (K_j, V_j)}``, each ``(B, H_kv, N, d)``, from ``h_l`` ``(B, N, D)``."""
        out = {}
        for j, lmap in self.maps.items():
            k, v = lmap.apply(ad.unit_rms(j, hidden))
            out[j] = (ad.split_heads(k), ad.split_heads(v))
        return out

    def flops(self, n_tokens: int) -> float:
        """FLOPs of the maps for ``n_tokens`` rows at every predicted layer (K and V, bias included)."""
        d_kv = self.shape.num_kv_heads * self.shape.head_dim
        return 2.0 * 2 * len(self.maps) * n_tokens * (self.shape.hidden_size + 1) * d_kv

    def describe(self) -> str:
        if self.kind == "zero-shot":
            return "zero-shot"
        return self.kind + (f", rank {self.rank}" if self.rank else "")


def stored_delta(state: dict[str, torch.Tensor], which: str, j: int) -> torch.Tensor:
    """Layer ``j``'s stored correction as float64 ``(D + 1, H_kv*d)`` (full or ``a @ b``)."""
    key = f"{which}.{j}"
    if f"{key}.delta" in state:
        return state[f"{key}.delta"].to(torch.float64)
    return state[f"{key}.a"].to(torch.float64) @ state[f"{key}.b"].to(torch.float64)
