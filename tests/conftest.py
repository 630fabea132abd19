"""Shared fixtures: tiny random decoder configs (no download) and the real smollm2-135m."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config


def _tiny(config_cls, **overrides):
    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    config = config_cls(**cfg)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """A 4-layer random Llama with GQA (4 query heads, 2 KV heads), vocab 128."""
    return _tiny(LlamaConfig)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """A 4-layer random Qwen2 (q/k/v biases) with GQA, vocab 128."""
    return _tiny(Qwen2Config)


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request, tiny_llama, tiny_qwen2):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32) and its tokenizer, from the model cache."""
    from fastprefill.models import zoo

    return zoo.load("smollm2-135m")


@pytest.fixture(scope="session")
def load_bench():
    """Import a script of ``benchmarks/`` by its stem (they are not a package): ``load_bench("kvp_bench")``."""

    def load(stem: str):
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{stem}.py"
        spec = importlib.util.spec_from_file_location(stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[stem] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
