"""Plain full prefill: the reference every figure is compared against.

It runs the model's own forward over the prompt with a transformers ``DynamicCache``, and the
engine decodes one token at a time from that cache with the model's forward, exactly as
transformers' greedy ``generate`` does (the tests assert the same tokens). Only the last
position goes through the LM head (``logits_to_keep=1``), as in ``generate``, so the baseline
is not handicapped. With a cached prefix it runs only the rest of the prompt over the prefix's
keys and values: the same computation, so the same logits to float rounding. The same path
prefills a long prompt in chunks (``chunked_prefill``): each chunk runs over the K/V of the ones
before, as over a cached prefix.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.cache import make_roomy
from fastprefill.methods.base import ComputeStats, Method, PrefillOutput, prefix_length
from fastprefill.models.adapters import supports_layer_loop
from fastprefill.models.attention import MASK_MEMO_KWARG, attention_backend, fastprefill_attention
from fastprefill.models.shape import ModelShape, causal_pairs


@dataclass
class FullPrefill(Method):
    """Plain prefill of every prompt token at every layer (no settings)."""

    name: ClassVar[str] = "full"
    takes_prefix: ClassVar[bool] = True
    chunked_prefill: ClassVar[bool] = True

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        n, p = int(input_ids.shape[1]), prefix_length(prefix)
        cache = make_roomy(prefix if prefix is not None else DynamicCache(config=model.config))  # K/V appended in place
        # layer-loop families: fastprefill's attention function (the C++ kernel where the model's
        # backend resolves to it); over a cached prefix, the suffix's causal mask built once for
        # all the layers
        layered = supports_layer_loop(model.config)
        over_prefix = bool(p) and layered
        scope = fastprefill_attention(model) if over_prefix or layered and attention_backend(model)[0] == "kernel" \
            else contextlib.nullcontext()
        masks = {MASK_MEMO_KWARG: {}} if over_prefix else {}
        with scope:
            out = model(input_ids=input_ids[:, p:], past_key_values=cache, use_cache=True, logits_to_keep=1, **masks)
        logits = out.logits[0, -1].float()  # (V,)
        shape = ModelShape.from_config(model.config)
        stats = ComputeStats(
            token_layers=(n - p) * shape.num_layers,
            total_token_layers=n * shape.num_layers,
            flops=shape.num_layers * shape.layer_flops(n - p, (n - p) * p + causal_pairs(n - p)) + shape.head_flops(1),
        )
        return PrefillOutput(logits=logits, cache=cache, stats=stats, next_position=n, exact_tokens=n)

