"""Plain full prefill: the reference every figure is compared against.

It runs the model's own forward over the whole prompt with a transformers ``DynamicCache`` and
decodes one token at a time from it, exactly as transformers' greedy ``generate`` does (the
tests assert the same tokens). Only the last position goes through the LM head
(``logits_to_keep=1``), as in ``generate``, so the baseline is not handicapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.methods.base import ComputeStats, Method, PrefillOutput
from fastprefill.models.shape import ModelShape


@dataclass
class FullState:
    """Decode state of full prefill: the model and its transformers cache."""

    model: PreTrainedModel
    cache: DynamicCache


@dataclass
class FullPrefill(Method):
    """Plain prefill of every prompt token at every layer (no settings)."""

    name: ClassVar[str] = "full"

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrefillOutput:
        cache = DynamicCache(config=model.config)
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()  # (V,)
        shape = ModelShape.from_config(model.config)
        n = int(input_ids.shape[1])
        stats = ComputeStats(
            token_layers=n * shape.num_layers,
            total_token_layers=n * shape.num_layers,
            flops=shape.causal_prefill_flops(n),
        )
        return PrefillOutput(logits=logits, state=FullState(model, cache), stats=stats)

    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        model, cache = state.model, state.cache
        ids = torch.tensor([[token_id]], device=model.device)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()
