"""fastprefill's attention forward (models.fused.FusedAttention) against the model's own.

The reference is the same model with its attention modules' own class (transformers' forward):
the fused forward must give the same logits bit for bit where the projections are plain (the
rotary kernel rounds as eager does), and within oneDNN's rounding where q, k and v are packed
and run as one product; the same with the rotary kernel unavailable (eager's formula); and it
must leave the module's parameters, names and state_dict as they were.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from fastprefill.host import cpu_info
from fastprefill.models import fused
from fastprefill.models import load as load_model
from fastprefill.models.attention import fastprefill_attention, set_attention_backend
from fastprefill.models.packed import MergedProduct

DTYPES = ["float32"] + (["bfloat16"] if cpu_info().bf16_native else [])


def _own_class(model):
    """A copy of ``model`` whose attention modules run their own class's forward again."""
    plain = copy.deepcopy(model)
    assert fused.fuse_attention(plain, fused=False) == plain.config.num_hidden_layers
    return plain


def _prefill_then_step(model, ids):
    """Logits of a prefill of ``ids[:, :-1]`` and of one decode step over its cache."""
    with torch.inference_mode(), fastprefill_attention(model):
        cache = DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True).logits
        step = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits
    return first, step


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_the_fused_forward_gives_the_models_own_bits(family, dtype, backend):
    model, _ = load_model(f"random:{family}", dtype=dtype)
    assert fused.attention_fused(model)
    set_attention_backend(model, backend)
    plain = _own_class(model)
    assert not fused.attention_fused(plain)
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    for got, want in zip(_prefill_then_step(model, ids), _prefill_then_step(plain, ids)):
        assert torch.equal(got, want)
    set_attention_backend(model, "auto")


def test_without_the_rotary_kernel_eagers_formula_runs(monkeypatch):
    model, _ = load_model("random:qwen2", dtype="float32")
    plain = _own_class(model)
    monkeypatch.setattr(fused, "rotary_kernel", lambda dtype: None)
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    for got, want in zip(_prefill_then_step(model, ids), _prefill_then_step(plain, ids)):
        assert torch.equal(got, want)


def test_packed_projections_run_as_one_product_and_match_three(monkeypatch):
    model, _ = load_model("random:qwen2", dtype="float32", pack=True)
    plain = _own_class(model)
    calls = []
    real = MergedProduct.__call__
    monkeypatch.setattr(MergedProduct, "__call__", lambda self, x: calls.append(x.shape) or real(self, x))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    got, want = _prefill_then_step(model, ids), _prefill_then_step(plain, ids)
    assert len(calls) == 2 * model.config.num_hidden_layers  # every layer, prefill and step
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    clone = copy.deepcopy(model)  # the merged packed copy is re-made, not copied
    for g, w in zip(_prefill_then_step(clone, ids), got):
        assert torch.equal(g, w)


def test_fusing_changes_no_parameter_and_is_done_once():
    model, _ = load_model("random:llama", dtype="float32")
    keys = list(model.state_dict())
    assert fused.fuse_attention(model) == 0  # load did it
    assert list(model.state_dict()) == keys == list(_own_class(model).state_dict())
    gpt2, _ = load_model("random:gpt2", dtype="float32")
    assert fused.fuse_attention(gpt2) == 0 and not fused.attention_fused(gpt2)
