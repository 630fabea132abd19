"""Shared fixtures: tiny random decoder models (`random:llama`, `random:qwen2` of
fastprefill.models.random; no download), prompts for them (`make_ids`), the check that the layer
loop equals the model's forward (`loop_matches_forward`) and the real smollm2-135m. The row floors
``set_row_floor(model, "auto")`` finds go to a file of the test session, not the user's cache."""

from __future__ import annotations

import pytest
import torch

from fastprefill.models.random import random_model
from tests import random_ids


@pytest.fixture(scope="session", autouse=True)
def _session_row_floor_cache(tmp_path_factory):
    from fastprefill.models import row_floor

    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("row-floors") / "row_floors.json"
        mp.setattr(row_floor, "row_floor_cache_path", lambda: path)
        yield path


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
    generator seeded with ``seed``, the same on every machine (:func:`tests.random_ids`). A helper that
    needs prompts takes it as its first argument."""
    return random_ids


def _loop_matches_forward(model, ids: torch.Tensor, new_tokens: int = 0) -> torch.Tensor:
    from fastprefill.engine import generate
    from fastprefill.methods.full import FullPrefill
    from fastprefill.methods.lazyllm import LazyLLM

    with torch.inference_mode():
        full = FullPrefill().prefill(model, ids).logits
        loop = LazyLLM(preset="keep-all").prefill(model, ids).logits
    assert torch.equal(loop, full)  # the same modules on the same shapes
    if new_tokens:  # decode steps too
        a = generate(model, None, ids, max_new_tokens=new_tokens, stop_at_eos=False)
        b = generate(model, None, ids, LazyLLM(preset="keep-all"), max_new_tokens=new_tokens, stop_at_eos=False)
        assert a.token_ids == b.token_ids
    return full


@pytest.fixture(scope="session")
def loop_matches_forward():
    """``check(model, ids, new_tokens=0) -> logits``: asserts that LazyLLM at keep-all (the layer
    loop the methods drive) gives full prefill's logits bit for bit and, with ``new_tokens``, the
    same greedy tokens; returns full prefill's ``(1, T, V)`` float32 logits. For a model whose
    modules the loader changed (compiled blocks, packed weights)."""
    return _loop_matches_forward


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request, tiny_llama, tiny_qwen2):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def tiny_bf16():
    """The tiny Llama and Qwen2 models in bfloat16 (the same seeds), by family."""
    return {family: random_model(family, dtype=torch.bfloat16) for family in ("llama", "qwen2")}


@pytest.fixture(params=["llama/float32", "qwen2/float32", "llama/bfloat16", "qwen2/bfloat16"])
def tiny_model_any_dtype(request, tiny_llama, tiny_qwen2, tiny_bf16):
    """Each tiny model in float32 and in bfloat16: for tests every method must pass in both."""
    family, dtype = request.param.split("/")
    return tiny_bf16[family] if dtype == "bfloat16" else {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct in float32 and its tokenizer, from the model cache: the
    fixture of exactness tests (an exact method equals full prefill to 1e-4 in float32; in
    bfloat16 a different split of the same work rounds differently)."""
    from fastprefill.models import load

    return load("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_auto():
    """SmolLM2-135M-Instruct as the command line and the server load it: in the default dtype
    (``auto``: bfloat16 on a CPU with native bfloat16 units, float32 elsewhere) and compiled where
    inductor can. Tests on it pass either way."""
    from fastprefill.models import load

    return load("smollm2-135m")
