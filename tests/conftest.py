"""Shared fixtures: tiny random decoder models (`random:llama`, `random:qwen2` of
fastprefill.models.random; no download), prompts for them (`make_ids`) and the real
smollm2-135m."""

from __future__ import annotations

import pytest

from fastprefill.models.random import random_ids, random_model


@pytest.fixture(scope="session")
def tiny_llama():
    """A 4-layer random Llama with GQA (4 query heads, 2 KV heads), vocab 128."""
    return random_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    """A 4-layer random Qwen2 (q/k/v biases) with GQA, vocab 128."""
    return random_model("qwen2")


@pytest.fixture(scope="session")
def make_ids():
    """``make_ids(n, seed)``: ``(1, n)`` token ids drawn from the tiny models' vocabulary (128) by a
    generator seeded with ``seed``, the same on every machine (:func:`random_ids`). A helper that
    needs prompts takes it as its first argument."""
    return random_ids


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request, tiny_llama, tiny_qwen2):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32) and its tokenizer, from the model cache."""
    from fastprefill.models import zoo

    return zoo.load("smollm2-135m")
