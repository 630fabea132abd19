"""KV tensors outside a forward pass: pre-rotation keys, a model's own KV, a cache from KV, layer dropping.

Model-family knowledge used by :mod:`fastprefill.methods.kv_prediction` (the llama / qwen2
rotary convention and module layout). Shapes: keys/values ``(B, H_kv, N, d)``; ``cos``/``sin``
``(B, N, d)``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.models.adapters import DecoderAdapter, require_layer_loop, rotate_half
from fastprefill.models.shape import ModelShape

__all__ = [
    "attention_inputs", "cache_from_kv", "drop_layers", "prefix_kv", "rotate_half", "rotate_keys",
    "unrotate_keys",
]


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings to pre-rotation keys, as the llama/qwen2 attention does.

    Args:
        keys: ``(B, H_kv, N, d)`` keys before rotation.
        cos, sin: ``(B, N, d)`` from :meth:`DecoderAdapter.rotary` at the keys' positions.

    Returns:
        ``(B, H_kv, N, d)`` rotated keys, equal to what the model stores in its cache.
    """
    cos, sin = cos.unsqueeze(1).to(keys.dtype), sin.unsqueeze(1).to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin


def unrotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`rotate_keys`: rotation by ``-position`` (RoPE is orthogonal, so this is exact
    up to float rounding). Shapes as in :func:`rotate_keys`."""
    cos, sin = cos.unsqueeze(1).to(keys.dtype), sin.unsqueeze(1).to(keys.dtype)
    return keys * cos - rotate_half(keys) * sin


def prefix_kv(
    model: PreTrainedModel, input_ids: torch.Tensor, with_logits: bool = False
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Run the model's own forward over ``input_ids`` and return every layer's *pre-rotation* KV.

    The model runs its fused forward with a transformers ``DynamicCache``; the cached (rotated)
    keys are then un-rotated at positions ``0..N-1`` with :func:`unrotate_keys`. Gradients flow
    when called outside ``no_grad`` (used when the aux model is trained).

    Args:
        model: a llama / qwen2 causal LM.
        input_ids: ``(1, N)`` int64, ``N >= 1``.
        with_logits: also return the ``(1, N, V)`` float32 logits (else only the final hidden
            states are computed, no LM head).

    Returns:
        ``([(K_l, V_l) for each layer], logits or None)`` with ``K_l, V_l`` ``(1, H_kv, N, d)``.
    """
    require_layer_loop(model, "KV Prediction")
    cache = DynamicCache(config=model.config)
    out = model.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    cos, sin = model.model.rotary_emb(out.last_hidden_state, position_ids=positions)
    kv = [(unrotate_keys(layer.keys, cos, sin), layer.values) for layer in cache.layers]
    logits = model.lm_head(out.last_hidden_state).float() if with_logits else None
    return kv, logits


def attention_inputs(
    model: PreTrainedModel, input_ids: torch.Tensor, with_logits: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Every layer's normalised attention input (what its q/k/v projections read) over ``input_ids``.

    The model runs its own fused forward with ``output_hidden_states``; layer ``i``'s input
    ``hidden_states[i]`` goes through layer ``i``'s input norm
    (:meth:`~fastprefill.models.adapters.DecoderAdapter.attention_input`). Gradients flow
    outside ``no_grad``.

    Args:
        model: a llama / qwen2 causal LM.
        input_ids: ``(1, N)`` int64.
        with_logits: also return the ``(1, N, V)`` float32 logits.

    Returns:
        ``([X_i for each layer], logits or None)`` with ``X_i`` ``(1, N, D)``.
    """
    ad = DecoderAdapter(model, "KV Prediction")
    out = model.model(input_ids=input_ids, output_hidden_states=True)
    inputs = [ad.attention_input(i, out.hidden_states[i]) for i in range(ad.num_layers)]
    logits = model.lm_head(out.last_hidden_state).float() if with_logits else None
    return inputs, logits


def cache_from_kv(
    model: PreTrainedModel, kv: list[tuple[torch.Tensor, torch.Tensor]], pre_rotation: bool = True
) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` holding the given per-layer KV at positions ``0..N-1``.

    Args:
        kv: one ``(K, V)`` per decoder layer, each ``(1, H_kv, N, d)`` in the model's dtype.
        pre_rotation: the keys are before rotation; they are rotated with the model's own rotary
            embedding at positions ``0..N-1`` (as the model would have cached them).
    """
    shape = ModelShape.from_config(model.config)
    if len(kv) != shape.num_layers:
        raise ValueError(f"cache_from_kv: {len(kv)} layers of KV for a {shape.num_layers}-layer model")
    cache = DynamicCache(config=model.config)
    n = kv[0][0].shape[-2]
    if pre_rotation:
        positions = torch.arange(n, device=kv[0][0].device)[None]
        cos, sin = model.model.rotary_emb(kv[0][1], position_ids=positions)
    for idx, (k, v) in enumerate(kv):
        cache.update(rotate_keys(k, cos, sin) if pre_rotation else k, v, idx)
    return cache


def _shallow_module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing every parameter/buffer/child with ``module``.

    Its registries (children, parameters, buffers, hooks) are fresh dicts, so replacing a child
    of the copy never touches the original.
    """
    clone = copy.copy(module)
    for key, value in list(vars(module).items()):
        if isinstance(value, dict):
            clone.__dict__[key] = type(value)(value)
    return clone


def drop_layers(model: PreTrainedModel, keep: Sequence[int]) -> PreTrainedModel:
    """The model with only the decoder layers ``keep``, sharing the original weight tensors.

    Used by KVP-LP (an aux model made of the base's own layers). Nothing is copied: embeddings,
    layers, norm and head are the same tensors; only module *objects* are new, so the original
    model is untouched. The copy gets its own config (``num_hidden_layers = len(keep)``,
    ``layer_types`` subset) and the kept attention modules are renumbered ``layer_idx = 0..``
    so they index a cache of ``len(keep)`` layers.

    Args:
        model: a llama / qwen2 causal LM.
        keep: strictly increasing layer indices in ``[0, num_layers)``, at least one.

    Raises:
        UnsupportedModelError: for other families.
        ValueError: for a bad ``keep``.
    """
    require_layer_loop(model, "layer dropping")
    num = model.config.num_hidden_layers
    keep = [int(i) for i in keep]
    if not keep or any(b <= a for a, b in itertools.pairwise(keep)) or keep[0] < 0 or keep[-1] >= num:
        raise ValueError(f"keep must be strictly increasing layer indices in [0, {num}), got {keep}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [model.config.layer_types[i] for i in keep]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, len(keep))
    new = _shallow_module_copy(model)
    new.config = config
    inner = _shallow_module_copy(model.model)
    inner.config = config
    layers = []
    for new_idx, old_idx in enumerate(keep):
        layer = _shallow_module_copy(model.model.layers[old_idx])
        attn = _shallow_module_copy(layer.self_attn)
        attn.config = config
        attn.layer_idx = new_idx
        layer.self_attn = attn
        layers.append(layer)
    inner.layers = torch.nn.ModuleList(layers)
    new.model = inner
    return new
