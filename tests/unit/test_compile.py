"""Compiled decoder blocks: the loader compiles each layer's MLP and norms where inductor can, the
model's forward and the layer loop then run the same compiled modules (so the lossless settings
stay exact), the result equals the eager model to float rounding, a call of a few rows runs the
modules' own forwards instead, and without a C++ compiler the model runs uncompiled with a warning."""

from __future__ import annotations

import pytest
import torch

from fastprefill import models
from fastprefill.methods.full import FullPrefill
from fastprefill.models import fused
from fastprefill.models.adapters import blocks_compiled


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_blocks_keep_the_layer_loop_exact_and_match_eager(dtype, make_ids, loop_matches_forward, monkeypatch):
    monkeypatch.setattr(fused, "EAGER_ROWS", 0)  # every call through the compiled graphs, a decode step's too
    compiled, _ = models.load("random:qwen2", dtype=dtype, compile=True)
    eager, _ = models.load("random:qwen2", dtype=dtype)  # random test models are not compiled by default
    assert blocks_compiled(compiled) and not blocks_compiled(eager)
    ids = make_ids(40, 3)
    full = loop_matches_forward(compiled, ids, new_tokens=6)  # decode steps: the T=1 graph
    with torch.inference_mode():
        ref = FullPrefill().prefill(eager, ids).logits
    tol = 1e-4 if dtype == "float32" else 0.05 * float(ref.abs().max())  # fused vs unfused rounding
    assert float((full - ref).abs().max()) <= tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_few_rows_skip_the_compiled_graphs_and_a_prompt_runs_them(dtype, make_ids, monkeypatch):
    """A layer call of at most EAGER_ROWS rows calls its norms' and MLP's own forward (their module
    call, which runs the compiled graph and the hooks, is not made); a longer one makes the calls.
    Both give the eager model's logits to float rounding, and the layer loop stays the forward."""
    model, _ = models.load("random:qwen2", dtype=dtype, compile=True)
    eager, _ = models.load("random:qwen2", dtype=dtype)
    layer = model.model.layers[0]
    calls = []
    for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
        module.register_forward_hook(lambda m, i, o: calls.append(m))
    monkeypatch.setattr(fused, "EAGER_ROWS", 8)
    with torch.inference_mode():
        for n, made in ((8, 0), (9, 3)):
            calls.clear()
            ids = make_ids(n, 5)
            logits = FullPrefill().prefill(model, ids).logits
            assert len(calls) == made, n
            ref = FullPrefill().prefill(eager, ids).logits
            tol = 1e-4 if dtype == "float32" else 0.05 * float(ref.abs().max())
            assert float((logits - ref).abs().max()) <= tol


def test_without_a_cpp_compiler_the_model_runs_uncompiled_and_says_so(monkeypatch):
    monkeypatch.setattr(models.shutil, "which", lambda name: None)
    monkeypatch.setattr(models, "_warned", False)
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: models.random_models.load("random:llama"))
    with pytest.warns(UserWarning, match="no C.. compiler on the PATH"):
        model, _ = models.load("smollm2-135m")
    assert not blocks_compiled(model)
