"""Prepacked linear layers: the loader packs a bfloat16 model's linear weights for oneDNN where the
CPU multiplies bfloat16 natively; the packed layers compute what ``F.linear`` computes (to bfloat16
rounding), the model's forward and the layer loop stay identical to each other (the same packed
modules), compiled blocks call out to them, a weight changed in place is repacked, and a deep copy
or a pickle of a packed layer works."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fastprefill import models
from fastprefill.bench.records import environment
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.models.adapters import blocks_compiled, fuse_mlps, swiglu_mlps
from fastprefill.models.packed import (
    PackedLinear,
    PackedSwiGLU,
    can_pack,
    linears_packed,
    onednn_bf16,
    pack_linears,
)

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16(), reason="oneDNN has no bfloat16 path here (torch without oneDNN, or a CPU without "
    "AVX512BW/VL/DQ or AVX-NE-CONVERT): nothing packs")


def _layer(seed: int = 0, out: int = 48, inp: int = 32) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inp, out).to(torch.bfloat16)


def _packed_layer() -> PackedLinear:
    layer = _layer()
    assert pack_linears(layer) == 1 and isinstance(layer, PackedLinear)
    return layer


def _assert_bf16_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to bfloat16 rounding: within 2% of the reference's largest magnitude."""
    assert got.shape == ref.shape
    assert float((got.float() - ref.float()).abs().max()) <= 0.02 * float(ref.float().abs().max())


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_packed_layer_computes_what_f_linear_computes(rows):
    plain, packed = _layer(), _packed_layer()
    x = torch.randn(2, rows, 32).to(torch.bfloat16)
    strided = torch.randn(2, 32, rows).to(torch.bfloat16).transpose(1, 2)  # not contiguous
    with torch.inference_mode():
        got = packed(x)
        assert got.shape == (2, rows, 48) and got.dtype == torch.bfloat16
        _assert_bf16_close(got, plain(x))
        _assert_bf16_close(packed(strided), plain(strided))


@needs_onednn_bf16
def test_a_layer_built_as_packed_packs_itself_on_first_use():
    torch.manual_seed(1)
    layer = PackedLinear(32, 48).to(torch.bfloat16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        got, ref = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert layer._packed is not None
    _assert_bf16_close(got, ref)


@needs_onednn_bf16
def test_a_weight_changed_in_place_is_repacked():
    layer = _packed_layer()
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(-1)
    with torch.inference_mode():
        after = layer(x)
        ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert not torch.allclose(after.float(), before.float())
    _assert_bf16_close(after, ref)


@needs_onednn_bf16
def test_autograd_on_the_weight_takes_the_plain_path():
    layer = _packed_layer()
    layer(torch.randn(3, 32).to(torch.bfloat16)).float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (48, 32)


@needs_onednn_bf16
def test_a_packed_layer_deep_copies_and_pickles():
    layer = _packed_layer()
    packed = layer._packed
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.inference_mode():
        ref = layer(x)
        twin = copy.deepcopy(layer)
        assert twin.weight.data_ptr() != layer.weight.data_ptr() and torch.equal(twin(x), ref)
        thawed = pickle.loads(pickle.dumps(layer))
        assert isinstance(thawed, PackedLinear) and torch.equal(thawed(x), ref)
    assert layer._packed is packed  # the original keeps its packed copy


@needs_onednn_bf16
def test_a_packed_model_keeps_the_layer_loop_exact_and_matches_the_plain_model(make_ids, loop_matches_forward):
    packed, _ = models.load("random:qwen2", dtype="bfloat16", pack=True)
    plain, _ = models.load("random:qwen2", dtype="bfloat16")  # random test models are not packed by default
    assert linears_packed(packed) and not linears_packed(plain)
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(packed.model.layers[0].mlp.up_proj, PackedLinear)
    ids = make_ids(40, 3)
    full = loop_matches_forward(packed, ids, new_tokens=6)
    with torch.inference_mode():
        ref = FullPrefill().prefill(plain, ids).logits
    assert float((full - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    assert environment(1, packed)["packed"] is True and environment(1, plain)["packed"] is False


@needs_onednn_bf16
def test_packed_and_compiled_blocks_work_together(make_ids, loop_matches_forward):
    both, _ = models.load("random:llama", dtype="bfloat16", pack=True, compile=True)
    assert linears_packed(both) and blocks_compiled(both)
    assert torch.isfinite(loop_matches_forward(both, make_ids(24, 1))).all()


def test_pack_true_where_it_cannot_apply_says_why(monkeypatch):
    with pytest.raises(ConfigError, match="pack=True needs a bfloat16 or float32 model on the CPU"):
        models.load("random:llama", dtype="float16", pack=True)
    assert not can_pack("cpu", torch.float32) and not can_pack("cpu", torch.float16)  # float32: only when asked
    assert not can_pack("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # an AVX2-only CPU
    assert not onednn_bf16() and not can_pack("cpu", torch.bfloat16)
    with pytest.raises(ConfigError, match="this CPU has no oneDNN bfloat16 path"):
        models.load("random:llama", dtype="bfloat16", pack=True)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_float32_model_packs_when_asked_and_stays_exact_within_itself(make_ids, loop_matches_forward):
    """``pack=True`` on a float32 model: packed and fused like a bfloat16 one, the layer loop equal
    to its own forward, and the logits the plain model's to float32 rounding."""
    packed, _ = models.load("random:qwen2", dtype="float32", pack=True)
    plain, _ = models.load("random:qwen2", dtype="float32")
    assert linears_packed(packed) and isinstance(packed.model.layers[0].mlp, PackedSwiGLU)
    ids = make_ids(40, 3)
    full = loop_matches_forward(packed, ids, new_tokens=6)
    with torch.inference_mode():
        ref = FullPrefill().prefill(plain, ids).logits
    assert float((full - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


@needs_onednn_bf16
def test_auto_packs_a_real_model_only_where_bfloat16_is_native(monkeypatch):
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: models.random_models.load(
        "random:llama", dtype=k.get("dtype", torch.float32)))
    monkeypatch.setattr(models, "can_pack", lambda device, dtype: True)
    model, _ = models.load("smollm2-135m", dtype="bfloat16", compile=False)
    assert linears_packed(model)
    monkeypatch.setattr(models, "can_pack", lambda device, dtype: False)
    model, _ = models.load("smollm2-135m", dtype="bfloat16", compile=False)
    assert not linears_packed(model)


def _op_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@needs_onednn_bf16
def test_a_fused_mlp_computes_the_swiglu_inside_the_products(make_ids):
    """The loader replaces each packed SwiGLU MLP by one whose gate product applies SiLU and whose
    up product multiplies by it (oneDNN post-ops, counted in a profile: no separate element-wise
    op runs); the result is the MLP's to bfloat16 rounding, the state dict's keys are unchanged,
    and with autograd on the weights it computes the formula through its layers exactly."""
    fused, _ = models.load("random:llama", dtype="bfloat16", pack=True)
    plain, _ = models.load("random:llama", dtype="bfloat16")
    assert all(isinstance(layer.mlp, PackedSwiGLU) for layer in fused.model.layers)
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert fuse_mlps(fused) == 0  # already fused
    mlp, ref_mlp = fused.model.layers[0].mlp, plain.model.layers[0].mlp
    x = torch.randn(1, 7, fused.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        got = mlp(x)
        _assert_bf16_close(got, ref_mlp(x))
        names = _op_names(lambda: mlp(x))
    assert "mkldnn::_linear_pointwise" in names and not names & {"aten::silu", "aten::mul"}, names
    with torch.enable_grad():
        grad_path = mlp(x)
        assert torch.equal(grad_path, mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))
    thawed = pickle.loads(pickle.dumps(mlp))
    with torch.inference_mode():
        assert isinstance(thawed, PackedSwiGLU) and torch.equal(thawed(x), got)


@needs_onednn_bf16
def test_only_packed_swiglu_mlps_are_fused():
    """Unpacked layers, a float32 model and a family outside the layer-loop ones keep their MLPs."""
    unpacked, _ = models.load("random:qwen2", dtype="bfloat16")
    assert fuse_mlps(unpacked) == 0 and not isinstance(unpacked.model.layers[0].mlp, PackedSwiGLU)
    gpt2, _ = models.load("random:gpt2", dtype="bfloat16", pack=True)
    assert swiglu_mlps(gpt2) == [] and fuse_mlps(gpt2) == 0
    f32, _ = models.load("random:llama", dtype="float32")
    assert len(swiglu_mlps(f32)) == 4 and fuse_mlps(f32) == 0  # SwiGLUs, but not packed
