"""Seeded tiny random decoder models for tests and smoke runs (no download, no tokenizer).

``random:llama`` and ``random:qwen2`` are 4-layer models of a layer-loop family (vocab 128,
hidden 64, 4 query heads over 2 KV heads, 512 positions, tied embeddings, sdpa attention);
``random:gpt2`` is a family no layer-loop method supports (for testing that refusal). The
weights depend only on the seed, so every process that builds the same spec gets the same
model bit for bit: rank pools and torchrun ranks load them like any other model name.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig, Qwen2Config

from fastprefill.errors import ModelNotFoundError

__all__ = ["FAMILIES", "PREFIX", "is_random_spec", "load", "random_model"]

PREFIX = "random:"

_DECODER: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True,
}
_GPT2: dict[str, Any] = {
    "vocab_size": 128, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 512, "bos_token_id": 1,
    "eos_token_id": 2,
}


#: family -> (config class, default fields); ``random_model``'s overrides replace the defaults.
FAMILIES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, _DECODER),
    "qwen2": (Qwen2Config, _DECODER),
    "gpt2": (GPT2Config, _GPT2),
}


def is_random_spec(spec: object) -> bool:
    """Whether ``spec`` names a random model (``"random:<family>"``)."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def random_model(
    family: str, *, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Any:
    """A seeded random causal LM in eval mode (the global torch RNG is left untouched).

    Args:
        family: a key of :data:`FAMILIES`.
        seed: the weights' seed.
        overrides: config fields that replace the defaults (for example ``num_hidden_layers=2``).

    Raises:
        ModelNotFoundError: an unknown family.
    """
    if family not in FAMILIES:
        raise ModelNotFoundError(f"random model family {family!r}: known are {sorted(PREFIX + f for f in FAMILIES)}")
    config_cls, defaults = FAMILIES[family]
    config = config_cls(**{**defaults, **overrides})
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device).eval()


def load(spec: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Any, None]:
    """``(model, None)`` for ``"random:<family>"`` (these models have no tokenizer).

    Raises:
        ModelNotFoundError: ``spec`` does not start with ``random:`` or names an unknown family.
    """
    if not is_random_spec(spec):
        raise ModelNotFoundError(f"{spec!r} is not a random model spec; use random:<family>, one of {sorted(FAMILIES)}")
    return random_model(spec[len(PREFIX):], device=device, dtype=dtype), None

