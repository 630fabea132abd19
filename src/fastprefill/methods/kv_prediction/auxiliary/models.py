"""Auxiliary models for KV Prediction, and the checks that an aux model fits its base.

Two kinds (arXiv 2410.08391, Sec. 4):

- **KVP-C** (:meth:`AuxSpec.model`): a smaller member of the same family with the same tokenizer,
  named in the zoo (``qwen2.5-coder-0.5b`` for base ``qwen2.5-coder-1.5b``).
- **KVP-LP** (:meth:`AuxSpec.layer_drop`): the base itself with only every ``stride``-th layer
  kept, built at load time from the base's own weight tensors by
  :func:`fastprefill.models.kv.drop_layers` (no copy, no extra memory).

Identity of models and tokenizers is checked with cheap fingerprints
(:func:`weights_fingerprint`, :func:`tokenizer_fingerprint`) stored in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.models.fingerprint import PROBE_TEXT, tokenizer_fingerprint, weights_fingerprint
from fastprefill.models.kv import drop_layers

__all__ = [
    "AuxSpec",
    "TokenizerMismatchError",
    "check_tokenizers",
    "tokenizer_fingerprint",
    "weights_fingerprint",
]

class TokenizerMismatchError(FastprefillError, ValueError):
    """The aux and base tokenizers differ, so the aux model cannot read the base's prompt ids."""


def check_tokenizers(base: PreTrainedTokenizerBase, aux: PreTrainedTokenizerBase) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers have the same vocabulary and
    encode the probe text identically."""
    if len(base) != len(aux):
        raise TokenizerMismatchError(
            f"aux tokenizer has {len(aux)} tokens, base has {len(base)}: KV Prediction needs an aux "
            "model with the base's tokenizer (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)"
        )
    probe_b = base.encode(PROBE_TEXT, add_special_tokens=False)
    probe_a = aux.encode(PROBE_TEXT, add_special_tokens=False)
    if probe_a != probe_b or base.get_vocab() != aux.get_vocab():
        raise TokenizerMismatchError(
            "aux and base tokenizers encode text differently (vocabulary or probe encoding differ): "
            "KV Prediction needs an aux model with the base's tokenizer"
        )


@dataclass(frozen=True)
class AuxSpec:
    """How to obtain the aux model.

    Attributes:
        kind: ``"model"`` (KVP-C: a separate model, by zoo name) or ``"layer_drop"`` (KVP-LP).
        name: zoo name of the aux model (``kind="model"``).
        stride: keep base layers ``0, stride, 2*stride, ...`` (``kind="layer_drop"``; 2 or 4 in
            the paper, any ``>= 1`` accepted).
    """

    kind: str
    name: str | None = None
    stride: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("model", "layer_drop"):
            raise ConfigError(f"AuxSpec.kind must be 'model' or 'layer_drop', got {self.kind!r}")
        if self.kind == "layer_drop" and (not isinstance(self.stride, int) or self.stride < 1):
            raise ConfigError(f"AuxSpec.stride must be an int >= 1 for layer dropping, got {self.stride!r}")

    @classmethod
    def model(cls, name: str | None) -> AuxSpec:
        """KVP-C: a separate aux model (``name`` = its zoo name, or None if passed in directly)."""
        return cls("model", name=name)

    @classmethod
    def layer_drop(cls, stride: int) -> AuxSpec:
        """KVP-LP: the base with every ``stride``-th layer kept."""
        return cls("layer_drop", stride=stride)

    def keep(self, num_base_layers: int) -> list[int]:
        """Base layers kept by a layer-drop spec."""
        return list(range(0, num_base_layers, int(self.stride)))

    def build(self, base: PreTrainedModel) -> PreTrainedModel:
        """The aux model for ``base`` (layer-drop only; a separate model is loaded by name)."""
        if self.kind != "layer_drop":
            raise ConfigError("AuxSpec.build is for layer-drop aux models; load a separate aux by name")
        return drop_layers(base, self.keep(base.config.num_hidden_layers)).eval()

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "stride": self.stride}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AuxSpec:
        return cls(kind=data["kind"], name=data.get("name"), stride=data.get("stride"))

    def describe(self) -> str:
        return f"drop/{self.stride}" if self.kind == "layer_drop" else f"aux={self.name}"
