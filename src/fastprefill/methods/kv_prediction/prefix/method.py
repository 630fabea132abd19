"""kvp-prefix, the method: exact first layers, predicted later-layer K/V, an exact tail (see
:mod:`fastprefill.methods.kv_prediction.prefix`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.errors import ConfigError, is_int
from fastprefill.methods.base import ComputeStats, Method, PrefillOutput, prefix_length
from fastprefill.methods.kv_prediction.auxiliary.models import weights_fingerprint
from fastprefill.methods.kv_prediction.checkpoint import (
    CheckpointError,
    read_checkpoint,
)
from fastprefill.methods.kv_prediction.prefix.predictor import (
    KV,
    VARIANT,
    PrefixPredictor,
    check_layer,
    stored_delta,
)
from fastprefill.models.adapters import DecoderAdapter, require_layer_loop
from fastprefill.models.attention import causal_mask
from fastprefill.models.fused import last_row_only, trims_last_row
from fastprefill.models.kv import rotate_keys
from fastprefill.models.shape import ModelShape, causal_pairs

__all__ = ["KVPrefix", "predicted_tail"]


# ----------------------------------------------------------------------------------- the method
@dataclass
class KVPrefix(Method):
    """kvp-prefix: the base's first ``layer`` layers exact, later layers' prompt KV predicted.

    Args:
        layer: ``l`` in ``[0, L]``; with no ``predictor`` the zero-shot maps are used.
            ``l = L`` is full prefill (nothing is predicted).
        predictor: a checkpoint directory written by :func:`calibrate_prefix` (its ``l`` is
            used; a ``layer`` given too must equal it).
        tail: ``W >= 1``, the last prompt tokens that run through every layer exactly (``1`` is
            SwiftKV's rule: only the last token). The maps do not depend on it.

    Spec: ``kvp-prefix:layer=8`` (zero-shot), ``kvp-prefix:predictor=DIR`` or
    ``kvp-prefix:predictor=DIR,tail=64``.

    Raises:
        ConfigError: neither given, a bad ``layer``, a checkpoint that is missing, corrupted
            (sha256), of another kind or unfinished; at the first prefill, a model of another
            shape or other weights than the checkpoint's, or ``layer`` beyond its depth.
    """

    name: ClassVar[str] = "kvp-prefix"
    layer_loop: ClassVar[bool] = True
    takes_prefix: ClassVar[bool] = True

    layer: int | None = None
    predictor: str | None = None
    tail: int = 1
    _config: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _state: dict[str, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.layer is None and self.predictor is None:
            raise ConfigError(
                "kvp-prefix needs layer=L (zero-shot maps: the base runs its first L layers exactly) or "
                "predictor=DIR (a checkpoint from `fastprefill train-kvp --variant prefix --model NAME --layer L "
                "--out DIR`); for example --method kvp-prefix:layer=8"
            )
        if self.layer is not None and not is_int(self.layer, 0):
            raise ConfigError(f"KVPrefix.layer must be an int >= 0 (layers run exactly), got {self.layer!r}")
        if not is_int(self.tail, 1):
            raise ConfigError(f"KVPrefix.tail must be an int >= 1 (prompt tokens run through every layer; 1 = "
                              f"only the last, as in SwiftKV), got {self.tail!r}")
        if self.predictor is not None:
            config, state, _ = read_checkpoint(self.predictor)
            if config.get("variant") != VARIANT:
                raise CheckpointError(
                    f"{self.predictor} is not a kvp-prefix checkpoint (it is a KV Prediction aux-model predictor: "
                    "use --method kvp:predictor=DIR for it)"
                )
            if not config.get("complete"):
                raise CheckpointError(
                    f"the kvp-prefix calibration in {self.predictor} is unfinished "
                    f"({len(config.get('layers_done', []))} layers fitted); resume it with "
                    "`fastprefill train-kvp --variant prefix ... --resume`"
                )
            if self.layer is not None and self.layer != config["layer"]:
                raise ConfigError(
                    f"layer={self.layer} but the checkpoint {self.predictor} was calibrated for layer={config['layer']}"
                )
            self.layer = int(config["layer"])
            self._config, self._state = config, state
        self._bound: tuple[weakref.ref, PrefixPredictor] | None = None

    def bind(self, model: PreTrainedModel) -> PrefixPredictor:
        """Check ``model`` and build the maps for it (remembered per model; call before timing)."""
        if self._bound is not None and self._bound[0]() is model:
            return self._bound[1]
        require_layer_loop(model, "kvp-prefix")
        shape = ModelShape.from_config(model.config)
        check_layer(self.layer, shape.num_layers)
        if self._config is None:
            pred = PrefixPredictor.zero_shot(model, self.layer)
        else:
            pred = self._from_checkpoint(model, shape)
        self._bound = (weakref.ref(model), pred)
        return pred

    def _from_checkpoint(self, model: PreTrainedModel, shape: ModelShape) -> PrefixPredictor:
        config, state = self._config, self._state
        base = config.get("base", {})
        want = ModelShape.from_json(base["shape"])
        if want != shape:
            raise ConfigError(
                f"the kvp-prefix predictor {self.predictor} is for {base.get('name') or 'another model'!r} "
                f"of shape {want}, not this model of shape {shape}"
            )
        if base.get("fingerprint") and weights_fingerprint(model) != base["fingerprint"]:
            raise ConfigError(
                f"the kvp-prefix predictor {self.predictor} was calibrated for {base.get('name') or '?'!r}, "
                "whose weights differ from this model's (weights fingerprint mismatch)"
            )
        try:
            deltas = {j: tuple(stored_delta(state, w, j) for w in ("k", "v"))
                      for j in range(self.layer, shape.num_layers)}
        except KeyError as exc:
            raise CheckpointError(f"corrupted kvp-prefix checkpoint {self.predictor}: missing tensor {exc}") from None
        maps = config.get("maps", {})
        return PrefixPredictor.corrected(model, self.layer, deltas, maps.get("rank"),
                                         kind="distilled" if config.get("distillation") else "least-squares")

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        """Layers ``0..l-1`` exact on the prompt, later layers' K/V predicted except the last ``tail``
        tokens', which run through every layer.

        Args:
            input_ids: ``(1, T)``.
            prefix: exact K/V of positions ``0..P-1`` at every layer (a prefix cache's): context
                for the rest, which alone is computed and predicted.
        """
        pred = self.bind(model)
        ad = DecoderAdapter(model, "kvp-prefix")
        shape, l = ad.shape, pred.layer
        L, n = shape.num_layers, int(input_ids.shape[1])
        q = prefix_length(prefix)
        positions = torch.arange(q, n, device=input_ids.device)[None]  # (1, M) the rows computed
        cache = prefix if prefix is not None else DynamicCache(config=model.config)
        # over a prefix the rows are not the first keys: SDPA's causal flag would misalign them
        mask = causal_mask(positions[0], torch.arange(n, device=input_ids.device)) if q and n - q > 1 else None
        with torch.no_grad(), ad.attention_scope():
            hidden = ad.embed(input_ids[:, q:])  # (1, M, D)
            cos, sin = ad.rotary(hidden, positions)  # (1, M, d) each
            for i in range(l):  # exact on every computed prompt token (the last layer: its last row's output)
                with last_row_only(model, cache) if i == L - 1 else contextlib.nullcontext():
                    hidden = ad.layer(i, hidden, positions, cache, mask=mask, rotary=(cos, sin))
            p = max(n - q - self.tail, 0) if l < L else 0  # predicted rows
            tail = predicted_tail(ad, lambda h: pred.predict(ad, h), hidden, positions, (cos, sin), cache, l, p,
                                  context=q, last_row=True)
            logits = ad.head(tail[:, -1:])[0, -1]  # (V,)
        m = n - q
        w = m - p
        map_flops = pred.flops(p)
        exact_flops = l * shape.layer_flops(m, m * q + causal_pairs(m))
        tail_flops = (L - l) * shape.layer_flops(w, w * (q + p) + causal_pairs(w))
        r = m if l == L else w  # the rows at the last layer, which computed the rest for the last row only
        if trims_last_row(model) and r > 1:
            saved = shape.layer_flops(r, r * (n - r) + causal_pairs(r)) - shape.last_row_layer_flops(r, n)
            exact_flops, tail_flops = (exact_flops - saved, tail_flops) if l == L else (exact_flops, tail_flops - saved)
        stats = ComputeStats(
            token_layers=l * m + (L - l) * w,
            total_token_layers=n * L,
            flops=exact_flops + map_flops + tail_flops + shape.head_flops(1),
            extra={"exact_layers": l, "predicted_layers": (L - l) if p else 0,
                   "map_flops": map_flops, "exact_flops": exact_flops, "tail_flops": tail_flops},
        )
        return PrefillOutput(logits=logits, cache=cache, stats=stats, next_position=n, exact_tokens=n if not p else q)

    def describe(self) -> str:
        maps = Path(self.predictor).name if self.predictor else "zero-shot"
        return f"kvp-prefix(l={self.layer}, {maps}{'' if self.tail == 1 else f', tail={self.tail}'})"


def predicted_tail(
    ad: DecoderAdapter,
    predict: Callable[[torch.Tensor], dict[int, KV]],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    cache: Any,
    layer: int,
    predicted: int,
    context: int = 0,
    last_row: bool = False,
) -> torch.Tensor:
    """Steps 2-3 of kvp-prefix: the first ``predicted`` rows' K/V at every layer ``j >= layer``
    come from ``predict``, the other rows run through layers ``layer..L-1`` over them.

    Args:
        predict: ``h_l`` rows ``(1, p, D)`` -> pre-rotation ``{j: (K_j, V_j)}``, each
            ``(1, H_kv, p, d)`` (:meth:`PrefixPredictor.predict`'s contract).
        hidden: ``h_l`` ``(1, T, D)``, the input of layer ``layer``.
        positions: ``(1, T)``; rotary: their ``(cos, sin)``, each ``(1, T, d)``.
        cache: a ``DynamicCache`` (holding layers ``< layer``, or nothing; and, at every layer,
            the ``context`` positions before ``positions``); receives the rows.
        layer: ``l``; predicted: ``p`` in ``[0, T)``.
        context: ``P``, positions ``0..P-1`` already in ``cache`` at every layer (a cached
            prefix); ``positions`` then start at ``P``.
        last_row: only the last row is read: the model's last layer computes the rest for it
            alone (:func:`~fastprefill.models.fused.last_row_only`).

    Returns:
        ``(1, T - p, D)``: the exact rows' output of the last layer (before the final norm);
        ``(1, 1, D)`` where ``last_row`` took effect.
    """
    cos, sin = rotary
    p = predicted
    if p:
        for j, (k, v) in predict(hidden[:, :p]).items():  # (1, H_kv, p, d)
            cache.update(rotate_keys(k, cos[:, :p], sin[:, :p]), v, j)
    tail, tail_pos, tail_rot = hidden[:, p:], positions[:, p:], (cos[:, p:], sin[:, p:])  # (1, W, D)
    # A block of W > 1 rows over predicted rows needs an explicit mask: SDPA's own causal flag
    # aligns a short query block to the first keys, not the last.
    keys = torch.cat([torch.arange(context, device=positions.device), positions[0]])  # (P + T,)
    mask = causal_mask(tail_pos[0], keys) if (p or context) and tail.shape[1] > 1 else None  # (1, 1, W, P + T)
    for j in range(layer, ad.num_layers):  # the tail through every later layer (causal, over the predicted rows)
        with last_row_only(ad.model, cache) if last_row and j == ad.num_layers - 1 else contextlib.nullcontext():
            tail = ad.layer(j, tail, tail_pos, cache, mask=mask, rotary=tail_rot)
    return tail
