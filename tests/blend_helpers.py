"""The per-model check of moving cached keys, shared by the blending tests of unit/ and
integration/ (blending, :mod:`fastprefill.methods.research.blend`, places a passage's cached K/V
at a new position by rotating its keys)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.models.adapters import DecoderAdapter


def key_shift_error(model: PreTrainedModel, input_ids: torch.Tensor, delta: int) -> list[float]:
    """The per-model check of moving cached keys: how far keys computed at positions ``0..N-1``
    and moved by ``delta`` (:meth:`DecoderAdapter.shift_keys`) are from the keys the model
    computes for the same tokens at ``delta..delta+N-1``.

    Under rotary embedding attention depends only on relative positions, so every layer's keys
    (and values) of a sequence moved as a whole are its keys rotated by the move, up to float
    rounding; a model whose rotary scaling depends on the length breaks this.

    Args:
        model: a llama / qwen2 causal LM.
        input_ids: ``(1, N)`` int64.
        delta: the move, ``>= 0``.

    Returns:
        Per layer, ``max |shifted - computed| / max |computed|`` over the keys.
    """
    ad = DecoderAdapter(model, "key shift check")
    n = int(input_ids.shape[1])
    caches = []
    for start in (0, delta):
        cache = DynamicCache(config=model.config)
        positions = torch.arange(start, start + n, device=input_ids.device)[None]
        model.model(input_ids=input_ids, past_key_values=cache, position_ids=positions, use_cache=True)
        caches.append(cache)
    errors = []
    for at_zero, at_delta in zip(caches[0].layers, caches[1].layers, strict=True):
        moved = ad.shift_keys(at_zero.keys, delta).float()
        want = at_delta.keys.float()
        errors.append(float((moved - want).abs().max() / want.abs().max()))
    return errors
