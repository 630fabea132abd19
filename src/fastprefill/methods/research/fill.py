"""Fill policies: what the later layers see of a token pruned at a cut.

LazyLLM's rule (``none``) is that a token pruned after layer ``l`` leaves every later layer's
context: its K/V exist only up to layer ``l``. A *fill* policy keeps a stand-in K/V row for it at
every later layer ``j > l``, computed from its hidden state at the cut (the output of layer
``l``, the row the Aux Cache holds) by per-layer linear maps, so the kept tokens still attend
something of it. The maps are kvp-prefix's (:class:`~fastprefill.methods.kv_prediction.prefix.PrefixPredictor`
with source layer ``l + 1``):

- ``zero-shot``: layer ``j``'s own input norm and k/v projections applied to the cut's hidden
  state (no file);
- ``calibrated:DIR``: least-squares maps fitted on dev text against the exact pre-rotation K and
  V (a kvp-prefix checkpoint calibrated at layer ``l + 1``, ``fastprefill train-kvp --variant
  prefix --layer l+1``).

Filled keys are rotated at the token's original position. A filled row is never computed
exactly later (fill needs ``revival=none``: a revived token would have both), never stored in
a prefix cache, and its cost (``2 (D + 1) H_kv d`` multiply-adds per token, layer and K/V for
the maps, and the kept rows' attention to the filled rows before them) is inside TTFT, in the
FLOP count and in the ``filled_token_layers`` stat.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from fastprefill.errors import ConfigError
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.kv import rotate_keys

__all__ = ["FILL_POLICIES", "Fill", "FillMaps"]

#: The fill policies by name (``calibrated`` is written ``calibrated:DIR``).
FILL_POLICIES = ("none", "zero-shot", "calibrated:DIR")


@dataclass(frozen=True)
class Fill:
    """A fill policy (see the module docstring).

    Attributes:
        kind: ``"none"``, ``"zero-shot"`` or ``"calibrated"``.
        path: the kvp-prefix checkpoint of ``calibrated``, else ``None``.
    """

    kind: str = "none"
    path: str | None = None

    @classmethod
    def parse(cls, text: object) -> Fill:
        """``"none"``, ``"zero-shot"`` or ``"calibrated:DIR"``."""
        if isinstance(text, Fill):
            return text
        allowed = f"allowed: {', '.join(FILL_POLICIES)}"
        if not isinstance(text, str):
            raise ConfigError(f"fill must be a string, got {text!r}; {allowed}")
        kind, sep, path = text.strip().partition(":")
        if kind in ("none", "zero-shot") and not sep:
            return cls(kind)
        if kind == "calibrated" and sep and path:
            return cls("calibrated", path)
        raise ConfigError(f"fill {text!r} is not a policy; {allowed}")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def __str__(self) -> str:
        return f"calibrated:{self.path}" if self.kind == "calibrated" else self.kind


_BOUND: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[Fill, int], object]] = weakref.WeakKeyDictionary()


class FillMaps:
    """A fill policy bound to a model and a cut: predicts pruned rows' K/V at the later layers.

    Args:
        fill: the policy (active).
        adapter: the model's adapter.
        source: the layer whose *input* the maps read (the cut's layer ``+ 1``).

    Raises:
        ConfigError: a checkpoint calibrated at another layer, for another model, or unreadable.
    """

    def __init__(self, fill: Fill, adapter: DecoderAdapter, source: int) -> None:
        from fastprefill.methods.kv_prediction.prefix import KVPrefix, PrefixPredictor

        self.adapter = adapter
        cache = _BOUND.setdefault(adapter.model, {})
        key = (fill, source)
        if key not in cache:
            if fill.kind == "zero-shot":
                cache[key] = PrefixPredictor.zero_shot(adapter.model, source)
            else:
                method = KVPrefix(predictor=fill.path)
                if method.layer != source:
                    raise ConfigError(f"fill {fill}: the checkpoint maps from layer {method.layer}, but this cut's "
                                      f"pruned tokens leave after layer {source - 1} (maps from layer {source} "
                                      f"needed: fastprefill train-kvp --variant prefix --layer {source})")
                cache[key] = method.bind(adapter.model)
        self.predictor = cache[key]

    def fill(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Rotated keys and values ``{j: (K_j, V_j)}``, each ``(1, H_kv, M, d)``, for the pruned rows
        ``hidden`` ``(1, M, D)`` at their original ``positions`` ``(M,)``, at every later layer."""
        ad = self.adapter
        cos, sin = ad.rotary(hidden, positions[None])
        return {j: (rotate_keys(k, cos, sin), v) for j, (k, v) in self.predictor.predict(ad, hidden).items()}

    def flops(self, rows: int) -> float:
        """FLOPs of the maps for ``rows`` pruned rows (every later layer, K and V)."""
        return self.predictor.flops(rows)
