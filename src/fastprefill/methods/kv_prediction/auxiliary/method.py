"""The KV Prediction method (arXiv 2410.08391): an aux model's KV, mapped, stands in for the base's.

Prefill (everything inside TTFT):

1. the aux model runs ``prompt[:-1]`` (its own fused forward, no LM head);
2. the predictor maps its per-layer KV (or, with ``source="hidden"``, its layers' normalised
   attention inputs) to every base layer's KV (keys before rotation; the base's
   rotary is applied at the original positions) and fills a transformers ``DynamicCache``;
3. the base runs only the last prompt token against that cache and emits the first token.

Decoding is then the base alone on that cache (the aux model is not used again), exactly as in
:class:`~fastprefill.methods.full.FullPrefill`.

Usage::

    method = KVPrediction.load("benchmarks/checkpoints/kvp-c-qwen2.5-coder")
    generate(base, tokenizer, prompt, method=method)
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError
from fastprefill.methods.base import ComputeStats, Method, ModelDecoder, PrefillOutput
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction.auxiliary.models import (
    AuxSpec,
    check_tokenizers,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from fastprefill.methods.kv_prediction.auxiliary.predictor import KVPredictor
from fastprefill.methods.kv_prediction.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from fastprefill.models.adapters import require_layer_loop
from fastprefill.models.kv import cache_from_kv
from fastprefill.models.shape import ModelShape

__all__ = ["AuxAlone", "KVPrediction"]


@dataclass
class KVPrediction(Method):
    """KV Prediction with a trained :class:`KVPredictor`.

    Args:
        predictor: the maps (aux KV -> base KV).
        aux_spec: where the aux model comes from: :meth:`AuxSpec.model` (KVP-C, ``aux`` required)
            or :meth:`AuxSpec.layer_drop` (KVP-LP, built from the base at the first prefill).
        aux: the aux model for KVP-C (same tokenizer as the base; check with
            :func:`~fastprefill.methods.kv_prediction.auxiliary.models.check_tokenizers`).
        base_fingerprint: :func:`weights_fingerprint` of the base the predictor was trained for;
            when set, the first prefill on a base refuses any other model.
        meta: checkpoint metadata (model names, λ, step, ...), written back by :meth:`save`.
    """

    name: ClassVar[str] = "kvp"
    layer_loop: ClassVar[bool] = True

    predictor: KVPredictor | str | None = None
    aux_spec: AuxSpec = field(default_factory=lambda: AuxSpec.model(None), metadata={"spec": False})
    aux: PreTrainedModel | None = field(default=None, metadata={"spec": False})
    base_fingerprint: str | None = field(default=None, metadata={"spec": False})
    meta: dict[str, Any] = field(default_factory=dict, metadata={"spec": False})

    def __post_init__(self) -> None:
        if self.predictor is None:
            raise ConfigError(
                "kvp needs a trained predictor: pass --method kvp:predictor=DIR, where DIR was written by "
                "`fastprefill train-kvp --base qwen2.5-coder-1.5b --aux qwen2.5-coder-0.5b --out DIR` "
                "(or --drop-stride 2 instead of --aux for a layer-drop aux). No file needed: "
                "--method kvp-prefix:layer=L runs the first L layers exactly with zero-shot maps"
            )
        if isinstance(self.predictor, str):
            loaded = _read_checkpoint(self.predictor, self.aux)
            self.predictor, self.aux_spec, self.aux = loaded.predictor, loaded.aux_spec, loaded.aux
            self.base_fingerprint, self.meta = loaded.base_fingerprint, loaded.meta
        if not isinstance(self.predictor, KVPredictor):
            raise ConfigError(f"KVPrediction.predictor must be a KVPredictor, got {type(self.predictor).__name__}")
        if not isinstance(self.aux_spec, AuxSpec):
            raise ConfigError(f"KVPrediction.aux_spec must be an AuxSpec, got {type(self.aux_spec).__name__}")
        if self.aux_spec.kind == "model":
            if self.aux is None:
                raise ConfigError("KVPrediction.aux is required for a separate aux model (KVP-C)")
            require_layer_loop(self.aux, "KV Prediction (aux model)")
            self._check_shape("aux", ModelShape.from_config(self.aux.config), self.predictor.aux_shape)
        elif self.aux is not None:
            raise ConfigError("KVPrediction.aux must be None for a layer-drop aux (it is built from the base)")
        self._bound: tuple[weakref.ref, PreTrainedModel] | None = None

    @staticmethod
    def _check_shape(role: str, got: ModelShape, want: ModelShape) -> None:
        if got != want:
            raise CheckpointError(
                f"the predictor was trained for a {role} model of shape {want}, but the {role} model has shape {got}"
            )

    # --- binding to a base --------------------------------------------------------------------
    def bind(self, base: PreTrainedModel) -> PreTrainedModel:
        """Check ``base`` against the predictor (shape, fingerprint) and return the aux model.

        Called by :meth:`prefill`; the result is remembered per base model, so the checks (a few
        milliseconds) run once. Call it before timing to keep them out of the first TTFT.

        Raises:
            CheckpointError: ``base`` is not the model the predictor was trained for.
            UnsupportedModelError: ``base`` is not a llama / qwen2 causal LM.
        """
        if self._bound is not None and self._bound[0]() is base:
            return self._bound[1]
        require_layer_loop(base, "KV Prediction")
        self._check_shape("base", ModelShape.from_config(base.config), self.predictor.base_shape)
        if self.base_fingerprint is not None and weights_fingerprint(base) != self.base_fingerprint:
            raise CheckpointError(
                f"this predictor was trained for base {self.meta.get('base', {}).get('name', '?')!r}, "
                "whose weights differ from the model passed in (weights fingerprint mismatch)"
            )
        aux = self.aux if self.aux_spec.kind == "model" else self.aux_spec.build(base)
        self._check_shape("aux", ModelShape.from_config(aux.config), self.predictor.aux_shape)
        self.predictor.to(base.device)
        self._bound = (weakref.ref(base), aux)
        return aux

    # --- the method contract ------------------------------------------------------------------
    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        self.refuse_prefix(prefix)
        aux = self.bind(model)
        base_shape = self.predictor.base_shape
        n = int(input_ids.shape[1])
        with torch.no_grad():
            if n == 1:  # nothing to predict: the base reads its only token
                return FullPrefill().prefill(model, input_ids)
            features, _ = self.predictor.features(aux, input_ids[:, :-1])  # aux prefill: KV or attention inputs
            predicted = self.predictor(features, dtype=model.dtype)  # L_base x (1, H, T-1, d)
            cache = cache_from_kv(model, predicted, pre_rotation=True)
            out = model(input_ids=input_ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        aux_shape = ModelShape.from_config(aux.config)
        aux_flops = aux_shape.causal_prefill_flops(n - 1) - aux_shape.head_flops(1)  # no LM head
        predictor_flops = self.predictor.flops(n - 1)
        base_flops = base_shape.num_layers * base_shape.layer_flops(1, n) + base_shape.head_flops(1)
        stats = ComputeStats(
            token_layers=base_shape.num_layers,
            total_token_layers=n * base_shape.num_layers,
            flops=aux_flops + predictor_flops + base_flops,
            extra={
                "aux_token_layers": (n - 1) * aux_shape.num_layers,
                "aux_flops": aux_flops,
                "predictor_flops": predictor_flops,
                "base_flops": base_flops,
            },
        )
        return PrefillOutput(logits=logits, cache=cache, stats=stats, next_position=n, exact_tokens=0)

    def describe(self) -> str:
        return f"kvp({self.aux_spec.describe()})"

    # --- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the predictor and its metadata to ``path`` (atomic; see :mod:`.checkpoint`)."""
        meta = dict(self.meta)
        meta.setdefault("base", {})
        meta["base"] = {**meta["base"], "shape": self.predictor.base_shape.to_json(),
                        "fingerprint": self.base_fingerprint}
        meta.setdefault("aux", {})
        meta["aux"] = {**meta["aux"], "spec": self.aux_spec.to_json(), "shape": self.predictor.aux_shape.to_json()}
        meta["layer_map"] = list(self.predictor.layer_map)
        meta["source"] = self.predictor.source
        write_checkpoint(path, self.predictor.state_dict(), meta, step=int(meta.get("step", 0)))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        aux: PreTrainedModel | None = None,
        aux_tokenizer: PreTrainedTokenizerBase | None = None,
        base_tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> KVPrediction:
        """Load a checkpoint written by :meth:`save` or ``train_kvp``.

        Args:
            path: the checkpoint directory.
            aux: the aux model for a KVP-C checkpoint; ``None`` loads it from the zoo by the name
                recorded in the checkpoint. Ignored for layer-drop checkpoints.
            aux_tokenizer: the aux tokenizer (with ``aux``); checked against the recorded one.
            base_tokenizer: if given, checked against the aux tokenizer / the recorded one.

        Raises:
            CheckpointError: missing or corrupted checkpoint, or an aux model of another shape /
                other weights than recorded.
            TokenizerMismatchError: the aux and base tokenizers differ.
        """
        return _read_checkpoint(path, aux, aux_tokenizer, base_tokenizer)


def _read_checkpoint(
    path: str | os.PathLike[str],
    aux: PreTrainedModel | None = None,
    aux_tokenizer: PreTrainedTokenizerBase | None = None,
    base_tokenizer: PreTrainedTokenizerBase | None = None,
) -> KVPrediction:
    """:meth:`KVPrediction.load`'s work (see there)."""
    config, state, _ = read_checkpoint(path)
    if config.get("variant") == "prefix":
        raise CheckpointError(f"{path} is a kvp-prefix checkpoint: use --method kvp-prefix:predictor={path}")
    try:
        base_shape = ModelShape.from_json(config["base"]["shape"])
        aux_shape = ModelShape.from_json(config["aux"]["shape"])
        spec = AuxSpec.from_json(config["aux"]["spec"])
        predictor = KVPredictor(aux_shape, base_shape, layer_map=config["layer_map"],
                                source=config.get("source", "kv"))
        predictor.load_state_dict(state, strict=True)
    except (KeyError, TypeError, RuntimeError, ConfigError) as exc:
        raise CheckpointError(f"corrupted checkpoint {path}: {exc}") from None
    predictor.eval().requires_grad_(False)
    recorded_tok = config["base"].get("tokenizer")
    if spec.kind == "model":
        if aux is None:
            if not spec.name:
                raise CheckpointError(f"checkpoint {path} names no aux model; pass aux=...")
            from fastprefill.models import load

            aux, aux_tokenizer = load(spec.name)
        fp = config["aux"].get("fingerprint")
        if fp is not None and weights_fingerprint(aux) != fp:
            raise CheckpointError(
                f"the aux model passed in is not {spec.name!r}, the one this predictor was trained with "
                "(weights fingerprint mismatch)"
            )
    else:
        aux = None
    if aux_tokenizer is not None and base_tokenizer is not None:
        check_tokenizers(base_tokenizer, aux_tokenizer)
    for tok in (aux_tokenizer, base_tokenizer):
        if tok is not None and recorded_tok is not None and tokenizer_fingerprint(tok) != recorded_tok:
            from fastprefill.methods.kv_prediction.auxiliary.models import TokenizerMismatchError

            raise TokenizerMismatchError(
                f"tokenizer differs from the one the predictor at {path} was trained with "
                f"(base {config['base'].get('name', '?')!r})"
            )
    meta = {k: v for k, v in config.items() if k not in ("weights", "weights_sha256", "train_state", "format", "version")}
    return KVPrediction(predictor=predictor, aux_spec=spec, aux=aux, base_fingerprint=config["base"].get("fingerprint"), meta=meta)


@dataclass
class AuxAlone(Method):
    """Baseline of the paper: the aux model answers by itself (prefill and decode), ignoring the
    base passed to :meth:`prefill`. ``aux`` is a model, or an :class:`AuxSpec` layer-drop spec
    built from the base at the first prefill (the KVP-LP aux alone)."""

    name: ClassVar[str] = "aux-alone"
    layer_loop: ClassVar[bool] = True

    aux: PreTrainedModel | AuxSpec

    def __post_init__(self) -> None:
        if isinstance(self.aux, AuxSpec):
            if self.aux.kind != "layer_drop":
                raise ConfigError("AuxAlone.aux must be a model or a layer-drop AuxSpec")
        elif not isinstance(self.aux, PreTrainedModel):
            raise ConfigError(f"AuxAlone.aux must be a model or an AuxSpec, got {type(self.aux).__name__}")
        self._built: tuple[weakref.ref, PreTrainedModel] | None = None

    def _model(self, base: PreTrainedModel) -> PreTrainedModel:
        if isinstance(self.aux, PreTrainedModel):
            return self.aux
        if self._built is None or self._built[0]() is not base:
            self._built = (weakref.ref(base), self.aux.build(base))
        return self._built[1]

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        self.refuse_prefix(prefix)
        aux = self._model(model)
        out = FullPrefill().prefill(aux, input_ids)
        out.exact_tokens = 0  # the aux model's cache, not the base's
        out.decoder = ModelDecoder(aux, out)  # the aux model decodes its own cache
        base_layers = ModelShape.from_config(model.config).num_layers
        out.stats.token_layers = 0  # the base computed nothing
        out.stats.total_token_layers = int(input_ids.shape[1]) * base_layers
        return out

    def describe(self) -> str:
        spec = self.aux.describe() if isinstance(self.aux, AuxSpec) else getattr(self.aux.config, "_name_or_path", "aux")
        return f"aux-alone({spec})"
