"""Compiled decoder blocks: the loader compiles each layer's MLP and norms where inductor can, the
model's forward and the layer loop then run the same compiled modules (so the lossless settings
stay exact), the result equals the eager model to float rounding, and without a C++ compiler the
model runs uncompiled with a warning."""

from __future__ import annotations

import pytest
import torch

from fastprefill import models
from fastprefill.methods.full import FullPrefill
from fastprefill.models.adapters import blocks_compiled


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_blocks_keep_the_layer_loop_exact_and_match_eager(dtype, make_ids, loop_matches_forward):
    compiled, _ = models.load("random:qwen2", dtype=dtype, compile=True)
    eager, _ = models.load("random:qwen2", dtype=dtype)  # random test models are not compiled by default
    assert blocks_compiled(compiled) and not blocks_compiled(eager)
    ids = make_ids(40, 3)
    full = loop_matches_forward(compiled, ids, new_tokens=6)  # decode steps: the T=1 graph
    with torch.inference_mode():
        ref = FullPrefill().prefill(eager, ids).logits
    tol = 1e-4 if dtype == "float32" else 0.05 * float(ref.abs().max())  # fused vs unfused rounding
    assert float((full - ref).abs().max()) <= tol


def test_without_a_cpp_compiler_the_model_runs_uncompiled_and_says_so(monkeypatch):
    monkeypatch.setattr(models.shutil, "which", lambda name: None)
    monkeypatch.setattr(models, "_warned", False)
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: models.random_models.load("random:llama"))
    with pytest.warns(UserWarning, match="no C.. compiler on the PATH"):
        model, _ = models.load("smollm2-135m")
    assert not blocks_compiled(model)
