"""KV Prediction's maps fitted in closed form, and how far their predictions are from the base's KV.

Each map is linear, so its L2-optimal weights are closed form (:func:`fit_least_squares`). For
every aux layer the Gram matrix ``[X 1]^T [X 1]`` (X = aux KV rows, heads merged, keys before
rotation) and for every base layer ``[X 1]^T Y`` (Y = the base KV rows) are accumulated in
float64 over the corpus (streaming, no activations kept), then
``W = (G + ρ·mean(diag G)·I)^{-1} [X 1]^T Y`` (ridge ρ, bias not penalised).
:func:`kv_relative_errors` measures a predictor per base layer (relative error and centred R²).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from fastprefill.errors import ConfigError
from fastprefill.methods.kv_prediction.auxiliary.predictor import KVPredictor
from fastprefill.models.kv import prefix_kv

__all__ = ["fit_least_squares", "kv_relative_errors"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``(1, N, F)`` -> float64 ``(N, F + 1)`` with a ones column."""
    x = t[0].to("cpu", torch.float64)
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)


def _merged(t: torch.Tensor) -> torch.Tensor:
    """``(1, H, N, d)`` -> float64 ``(N, H*d)``."""
    return t[0].transpose(0, 1).reshape(t.shape[2], -1).to("cpu", torch.float64)


@torch.no_grad()
def fit_least_squares(
    predictor: KVPredictor,
    pairs: Iterator[tuple[Sequence[Any], Sequence[tuple[torch.Tensor, torch.Tensor]]]],
    ridge: float = 1e-4,
) -> int:
    """Fit every map of ``predictor`` in closed form on streamed ``(aux features, base KV)`` pairs.

    Args:
        predictor: its ``k_maps`` / ``v_maps`` are overwritten.
        pairs: yields ``(features, base_kv)``: the aux features of :meth:`KVPredictor.features`
            (``L_aux`` pairs ``(K, V)`` ``(1, H, N, d)``, or attention inputs ``(1, N, D_aux)``)
            and ``L_base`` pairs ``(K, V)`` ``(1, H, N, d)`` for the same ``N`` tokens (keys
            before rotation).
        ridge: ρ, relative to the mean diagonal of the Gram matrix (bias not penalised).

    Returns:
        The number of token rows fitted.
    """
    din, dout = predictor.in_features, predictor.out_features
    keys = [predictor.input_keys(l) for l in range(len(predictor.layer_map))]  # per base layer: (K key, V key)
    gram = {key: torch.zeros(din + 1, din + 1, dtype=torch.float64) for pair in keys for key in pair}
    cross = [[torch.zeros(din + 1, dout, dtype=torch.float64) for _ in (0, 1)] for _ in keys]
    rows = 0
    for features, base_kv in pairs:
        xs = {key: _rows(predictor.input_rows(features, key)) for key in gram}
        for key, x in xs.items():
            gram[key] += x.T @ x
        for l, pair in enumerate(keys):
            for w in (0, 1):
                cross[l][w] += xs[pair[w]].T @ _merged(base_kv[l][w])
        rows += int(next(iter(xs.values())).shape[0])
    if rows == 0:
        raise ConfigError("fit_least_squares got no data")
    for l, pair in enumerate(keys):
        for w, maps in ((0, predictor.k_maps), (1, predictor.v_maps)):
            g = gram[pair[w]].clone()
            scale = g.diagonal()[:-1].mean().clamp_min(1e-12)
            g.diagonal()[:-1] += ridge * scale
            sol = torch.linalg.solve(g, cross[l][w])  # (din + 1, dout)
            maps[l].weight.copy_(sol[:-1].T.to(maps[l].weight.dtype))
            maps[l].bias.copy_(sol[-1].to(maps[l].bias.dtype))
    return rows


@torch.no_grad()
def kv_relative_errors(
    base: PreTrainedModel, aux: PreTrainedModel, predictor: KVPredictor, sequences: Sequence[torch.Tensor]
) -> dict[str, list[float]]:
    """Per base layer, pooled over ``sequences``: relative error ``||K̂ - K||_F / ||K||_F`` (and V)
    and the centred ``R² = 1 - SSE / Σ||K - mean K||²`` (mean over tokens per feature).

    The relative error divides by the raw energy, which a constant offset (a bias any linear map
    fits) can dominate; R² divides by the energy around the mean, so it says how much of the
    varying part is predicted (0: no better than the mean, 1: exact). Keys are compared before
    rotation (RoPE is orthogonal per position, so the rotated error is the same).

    Returns:
        ``{"k": [...], "v": [...], "r2_k": [...], "r2_v": [...]}``, one value per base layer.
    """
    n = predictor.base_shape.num_layers
    sse = {"k": [0.0] * n, "v": [0.0] * n}
    energy = {"k": [0.0] * n, "v": [0.0] * n}
    count = [0] * n
    total: dict[str, list[torch.Tensor | None]] = {"k": [None] * n, "v": [None] * n}
    for ids in sequences:
        ids = ids.to(base.device)
        true, _ = prefix_kv(base, ids)
        pred = predictor(predictor.features(aux, ids)[0], dtype=torch.float32)
        for l in range(n):
            count[l] += int(ids.shape[1])
            for w, name in ((0, "k"), (1, "v")):
                y, yh = _merged(true[l][w]), _merged(pred[l][w])
                sse[name][l] += float((yh - y).pow(2).sum())
                energy[name][l] += float(y.pow(2).sum())
                s = y.sum(0)
                total[name][l] = s if total[name][l] is None else total[name][l] + s
    out: dict[str, list[float]] = {}
    for name in ("k", "v"):
        out[name] = [math.sqrt(a / max(b, 1e-30)) for a, b in zip(sse[name], energy[name])]
        centred = [e - float((t**2).sum()) / max(c, 1) if t is not None else 0.0
                   for e, t, c in zip(energy[name], total[name], count)]
        out[f"r2_{name}"] = [1.0 - a / max(c, 1e-30) for a, c in zip(sse[name], centred)]
    return out


