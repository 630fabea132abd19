"""Plain full prefill: the reference every figure is compared against.

It runs the model's own forward over the prompt with a transformers ``DynamicCache``, and the
engine decodes one token at a time from that cache with the model's forward, exactly as
transformers' greedy ``generate`` does (the tests assert the same tokens). Only the last
position goes through the LM head (``logits_to_keep=1``), as in ``generate``, so the baseline
is not handicapped. With a cached prefix it runs only the rest of the prompt over the prefix's
keys and values: the same computation, so the same logits to float rounding. The same path
prefills a long prompt in chunks (``chunked_prefill``): each chunk runs over the K/V of the ones
before, as over a cached prefix. :meth:`FullPrefill.prefill_steps` runs a unit of it a layer at a
time instead, so that a server's decode rows ride in its layer calls (mixed batches).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.cache import make_roomy
from fastprefill.methods.base import ComputeStats, LayeredPrefill, Method, PrefillOutput, prefix_length
from fastprefill.methods.layer_steps import LayerSteps, Rows
from fastprefill.models.adapters import DecoderAdapter, supports_layer_loop
from fastprefill.models.attention import MASK_MEMO_KWARG, attention_backend, fastprefill_attention
from fastprefill.models.fused import last_row_only
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
        with scope, last_row_only(model, cache) as last_row:  # the last layer's rest on the one row the head reads
            out = model(input_ids=input_ids[:, p:], past_key_values=cache, use_cache=True, logits_to_keep=1, **masks)
        return _output(model, out.logits[0, -1].float(), cache, n, p, last_row and n - p > 1)

    def prefill_steps(self, model: PreTrainedModel, input_ids: torch.Tensor,
                      prefix: DynamicCache | None = None) -> LayeredPrefill:
        """:meth:`prefill` a layer at a time: the rows of positions ``P..T-1`` (``(1, T - P, D)``)
        through each decoder layer over the same roomy cache, attending causally by position
        (fastprefill's attention function: the cached keys and their own rows up to each one), the
        last row's hidden state returned for the head. The same modules as the model's forward
        (its compiled blocks and packed products included), so a decode step's rows may share
        each layer call (:meth:`fastprefill.batch.DecodeBatch.mixed`).

        Raises:
            UnsupportedModelError: the model is not a layer-loop family.
        """
        adapter = DecoderAdapter(model, "a prefill beside decode rows")
        n, p = int(input_ids.shape[1]), prefix_length(prefix)
        cache = make_roomy(prefix if prefix is not None else DynamicCache(config=model.config))

        def steps() -> LayerSteps:
            hidden = adapter.embed(input_ids[:, p:])  # (1, T - P, D)
            positions = torch.arange(p, n, device=adapter.device)  # (T - P,)
            rotary = adapter.rotary(hidden, positions[None])
            for _ in range(adapter.num_layers):
                (hidden,) = yield [Rows(cache, hidden, positions, rotary)]
            return hidden[:, -1:]  # (1, 1, D)

        return LayeredPrefill(steps(), lambda logits: _output(model, logits, cache, n, p))


def _output(model: PreTrainedModel, logits: torch.Tensor, cache: DynamicCache, n: int, p: int,
            last_row: bool = False) -> PrefillOutput:
    """Full prefill's output for positions ``p..n-1`` computed over ``cache``; ``logits`` ``(V,)``
    float32; ``last_row``: the last layer computed the rest of the layer for the last row only."""
    shape = ModelShape.from_config(model.config)
    layer = shape.layer_flops(n - p, (n - p) * p + causal_pairs(n - p))
    last = shape.last_row_layer_flops(n - p, n) if last_row else layer
    stats = ComputeStats(
        token_layers=(n - p) * shape.num_layers,
        total_token_layers=n * shape.num_layers,
        flops=(shape.num_layers - 1) * layer + last + shape.head_flops(1),
    )
    return PrefillOutput(logits=logits, cache=cache, stats=stats, next_position=n, exact_tokens=n)

