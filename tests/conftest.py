"""Shared fixtures: tiny random decoder models (`random:llama`, `random:qwen2` of
fastprefill.models.random; no download) and the real smollm2-135m."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fastprefill.models.random import random_model


def _tiny(config_cls, **overrides):
    """The seeded random model of ``config_cls``'s family (:func:`fastprefill.models.random.random_model`)."""
    return random_model(config_cls.model_type, **overrides)


@pytest.fixture(scope="session")
def tiny_llama():
    """A 4-layer random Llama with GQA (4 query heads, 2 KV heads), vocab 128."""
    return random_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    """A 4-layer random Qwen2 (q/k/v biases) with GQA, vocab 128."""
    return random_model("qwen2")


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
