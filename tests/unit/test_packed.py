"""Prepacked linear layers: the loader packs a bfloat16 model's linear weights for oneDNN where the
CPU multiplies bfloat16 natively; the packed layers compute what ``F.linear`` computes (to bfloat16
rounding), the model's forward and the layer loop stay identical to each other (the same packed
modules), compiled blocks call out to them, a weight changed in place is repacked, and a deep copy
or a pickle of a packed layer works."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch

from fastprefill import kernels, models
from fastprefill.bench.records import environment
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.models import packed as packed_module
from fastprefill.models import row_floor
from fastprefill.models.adapters import blocks_compiled, fuse_mlps, swiglu_mlps
from fastprefill.models.packed import (
    FEW_ROWS,
    SILU_IN_PRODUCT,
    MergedProduct,
    PackedLinear,
    PackedSwiGLU,
    can_pack,
    linears_packed,
    onednn_bf16,
    pack_linears,
    packable,
    set_wide_rows,
)
from fastprefill.models.row_floor import ROW_FLOORS, chunked, row_floor_for, set_row_floor

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
    assert not can_pack("cpu", torch.float16)
    assert not can_pack("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # an AVX2-only CPU
    assert not onednn_bf16() and not can_pack("cpu", torch.bfloat16)
    with pytest.raises(ConfigError, match="this CPU has no oneDNN bfloat16 path"):
        models.load("random:llama", dtype="bfloat16", pack=True)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_float32_packs_by_default_where_the_copy_fits_in_memory(monkeypatch):
    assert can_pack("cpu", torch.float32, 1 << 20)
    assert not can_pack("cpu", torch.float32, 1 << 50)  # a copy larger than a third of any machine's memory
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: models.random_models.load(
        "random:llama", dtype=k.get("dtype", torch.float32)))
    model, _ = models.load("smollm2-135m", dtype="float32", compile=False)
    assert linears_packed(model) and not isinstance(model.model.layers[0].mlp, PackedSwiGLU)  # its MLP as it was
    with pytest.warns(UserWarning, match=r"in 1000000000 process\(es\)"):  # runahead's ranks: a copy each
        model, _ = models.load("smollm2-135m", dtype="float32", compile=False, processes=10**9)
    assert not linears_packed(model)
    monkeypatch.setattr(packed_module, "FLOAT32_PACK_SHARE", 0.0)
    with pytest.warns(UserWarning, match="float32 model not packed: its packed copies"):
        model, _ = models.load("smollm2-135m", dtype="float32", compile=False)
    assert not linears_packed(model)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_float32_product_runs_on_the_kernel_then_packed_and_plain_only_above_wide_rows(monkeypatch):
    """Up to FEW_ROWS rows (a decode step's, a prompt's few positions) on the few-row kernel where it
    runs here, more on oneDNN's packed copy at any row count by default; with ``set_wide_rows(n)``
    more than n on the plain weight (MKL). Counted by the oneDNN calls each makes; all equal the
    plain product to float32 rounding. A row floor keeps every product packed."""
    layer = torch.nn.Linear(64, 48).float()
    plain = copy.deepcopy(layer)
    pack_linears(layer)
    calls = {"packed": 0}
    real = torch.ops.mkldnn._linear_pointwise

    class Counting:
        def __call__(self, *a, **k):
            calls["packed"] += 1
            return real(*a, **k)

        def __getattr__(self, name):
            return getattr(real, name)

    def packed_calls(shape: tuple[int, ...]) -> int:
        calls["packed"] = 0
        x = torch.randn(*shape)
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
        return calls["packed"]

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Counting())
    with torch.inference_mode():
        few = 0 if kernels.row_products(torch.float32) is not None else 1
        limit = FEW_ROWS[torch.float32]
        assert layer.wide_rows is None
        for shape, expected in (((1, 1, 64), few), ((1, 2, 64), few), ((1, limit, 64), few), ((1, limit + 1, 64), 1),
                                ((1, 129, 64), 1), ((2, 700, 64), 1)):
            assert packed_calls(shape) == expected, shape
        assert set_wide_rows(layer, 128) == 1
        for shape, expected in (((1, limit, 64), few), ((1, 128, 64), 1), ((1, 129, 64), 0), ((2, 700, 64), 0)):
            assert packed_calls(shape) == expected, shape
        set_row_floor(layer, 2)
        assert packed_calls((1, 129, 64)) == 1
        set_row_floor(layer, 1)
        set_wide_rows(layer, None)
        assert packed_calls((1, 129, 64)) == 1


@pytest.mark.parametrize("rows", [-1, 1.5, "128", True])
def test_set_wide_rows_refuses_what_is_not_a_row_count(rows):
    layer = torch.nn.Linear(8, 8)
    pack_linears(layer)
    with pytest.raises(ValueError, match="non-negative number of rows"):
        set_wide_rows(layer, rows)
    assert layer.wide_rows is None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_load_sets_wide_rows_on_every_packed_layer_and_refuses_what_cannot_apply(make_ids):
    """``load(..., wide_rows=n)``: every packed layer of a float32 model routes above n rows to the
    plain weight, and the model's logits are the default's to float32 rounding; a bad count,
    another dtype or pack=False is a ConfigError before anything loads, and a model left unpacked
    one after it loads."""
    model, _ = models.load("random:qwen2", dtype="float32", pack=True, wide_rows=16)
    default, _ = models.load("random:qwen2", dtype="float32", pack=True)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.wide_rows == 16 for m in layers)
    assert all(m.wide_rows is None for m in default.modules() if isinstance(m, PackedLinear))
    ids = make_ids(40, 1)
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, default(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    for bad in (-1, 2.0, "64", True):
        with pytest.raises(ConfigError, match="non-negative number of rows"):
            models.load("random:qwen2", dtype="float32", wide_rows=bad)
    with pytest.raises(ConfigError, match="wide_rows applies to float32"):
        models.load("random:qwen2", dtype="bfloat16", wide_rows=64)
    with pytest.raises(ConfigError, match="pack=False packs none"):
        models.load("random:qwen2", dtype="float32", pack=False, wide_rows=64)
    with pytest.raises(ConfigError, match="no linear layer was packed here"):  # random: models pack only when asked
        models.load("random:qwen2", dtype="float32", wide_rows=64)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_float32_model_packs_when_asked_and_stays_exact_within_itself(make_ids, loop_matches_forward):
    """``pack=True`` on a float32 model: packed (its MLPs unfused), the layer loop equal to its own
    forward, and the logits the plain model's to float32 rounding."""
    packed, _ = models.load("random:qwen2", dtype="float32", pack=True)
    plain, _ = models.load("random:qwen2", dtype="float32")
    assert linears_packed(packed) and not isinstance(packed.model.layers[0].mlp, PackedSwiGLU)
    ids = make_ids(40, 3)
    full = loop_matches_forward(packed, ids, new_tokens=6)
    with torch.inference_mode():
        ref = FullPrefill().prefill(plain, ids).logits
    assert float((full - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


@needs_onednn_bf16
def test_auto_packs_a_real_model_only_where_bfloat16_is_native(monkeypatch):
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: models.random_models.load(
        "random:llama", dtype=k.get("dtype", torch.float32)))
    monkeypatch.setattr(models, "can_pack", lambda device, dtype, copy_bytes=0: True)
    model, _ = models.load("smollm2-135m", dtype="bfloat16", compile=False)
    assert linears_packed(model)
    monkeypatch.setattr(models, "can_pack", lambda device, dtype, copy_bytes=0: False)
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


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_float32_fused_mlp_gives_a_few_rows_their_unfused_bits_and_a_prompt_the_formula():
    """A float32 model keeps its MLPs unfused; fused on request (``fuse_mlps``), up to FEW_ROWS
    rows take the few-row kernel (gate and up in one call) and get the bits of the unfused formula over the same layers, each row
    whatever the row count; more rows take the gate's plain product, torch's SiLU over it (float32
    is not in SILU_IN_PRODUCT: counted in a profile, no swish post-op) and the up product's ``mul``
    post-op, the formula to float32 rounding; with ``wide_rows`` set, a product above it is the
    formula on the plain weights exactly."""
    model, _ = models.load("random:llama", dtype="float32", pack=True)
    assert torch.float32 not in SILU_IN_PRODUCT and not isinstance(model.model.layers[0].mlp, PackedSwiGLU)
    assert fuse_mlps(model) == len(model.model.layers)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, PackedSwiGLU)

    def formula(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    limit = FEW_ROWS[torch.float32]
    x = torch.randn(1, limit + 60, model.config.hidden_size)
    on_kernel = kernels.row_products(torch.float32) is not None
    with torch.inference_mode():
        for rows in (1, 3, limit):
            got = mlp(x[:, :rows])
            if on_kernel:
                assert torch.equal(got, formula(x[:, :rows])), rows
                assert torch.equal(got[:, :1], mlp(x[:, :1])), rows  # a row's bits do not depend on the count
            else:  # oneDNN's post-ops round once
                torch.testing.assert_close(got, formula(x[:, :rows]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp(x), formula(x), rtol=1e-5, atol=1e-5)
        names = _op_names(lambda: mlp(x))
        assert {"mkldnn::_linear_pointwise", "aten::silu_"} <= names and "aten::mul" not in names, names
        set_wide_rows(mlp, limit)
        plain = torch.nn.functional.linear
        want = mlp.down_proj(mlp.act_fn(plain(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
                             * plain(x, mlp.up_proj.weight, mlp.up_proj.bias))
        assert torch.equal(mlp(x), want)


@needs_onednn_bf16
def test_only_packed_swiglu_mlps_are_fused():
    """Unpacked layers, an unpacked float32 model and a family outside the layer-loop ones keep their MLPs."""
    unpacked, _ = models.load("random:qwen2", dtype="bfloat16")
    assert fuse_mlps(unpacked) == 0 and not isinstance(unpacked.model.layers[0].mlp, PackedSwiGLU)
    gpt2, _ = models.load("random:gpt2", dtype="bfloat16", pack=True)
    assert swiglu_mlps(gpt2) == [] and fuse_mlps(gpt2) == 0
    f32, _ = models.load("random:llama", dtype="float32")
    assert len(swiglu_mlps(f32)) == 4 and fuse_mlps(f32) == 0  # SwiGLUs, but not packed


def _padded_row(product, x: torch.Tensor, floor: int) -> torch.Tensor:
    """``product`` of the one row ``x`` ``(1, D)`` stacked over ``floor - 1`` zero rows, its first row."""
    return product(torch.cat([x, x.new_zeros(floor - 1, x.shape[-1])]))[:1]


@needs_onednn_bf16
def test_a_row_floor_computes_fewer_rows_inside_a_product_of_the_floor():
    """Below the floor a packed layer pads its rows with zero rows (any leading shape) and returns
    only its own; at or above it the product is the plain packed one."""
    layer = _packed_layer()
    one, many = torch.randn(1, 1, 32).to(torch.bfloat16), torch.randn(2, 3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        want = _padded_row(layer, one[0], 4)
        free = layer(many)
        layer.row_floor = 4
        got = layer(one)
        assert got.shape == (1, 1, 48) and torch.equal(got[0], want)
        assert torch.equal(layer(many), free)  # 6 rows: no padding


@needs_onednn_bf16
def test_a_models_merged_and_fused_products_follow_its_row_floor():
    """``set_row_floor`` reaches every packed layer; the merged q/k/v product and the fused SwiGLU
    MLP pad as their layers do. Bad floors and ``auto`` without packed layers are refused."""
    model, _ = models.load("random:llama", dtype="bfloat16", pack=True)
    assert set_row_floor(model, 3) == 3
    assert {m.row_floor for m in model.modules() if isinstance(m, PackedLinear)} == {3}
    layer = model.model.layers[0]
    x = torch.randn(1, model.config.hidden_size).to(torch.bfloat16)
    merged = MergedProduct([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
    with torch.inference_mode():
        assert torch.equal(layer.mlp(x), _padded_row(layer.mlp, x, 3))
        for got, want in zip(merged(x), merged(torch.cat([x, x.new_zeros(2, x.shape[-1])])), strict=True):
            assert torch.equal(got, want[:1])
    assert set_row_floor(model, 1) == 1
    for bad in (0, -2, 1.5, True, "two"):
        with pytest.raises(ConfigError, match="row floor must be"):
            set_row_floor(model, bad)
    plain, _ = models.load("random:llama", dtype="float32")
    with pytest.raises(ConfigError, match="needs packed linear layers"):
        set_row_floor(plain, "auto")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_found_floor_makes_a_real_sized_product_row_invariant(dtype):
    """At the floor :func:`row_floor_for` finds for Qwen2.5-0.5B's down projection (4864 -> 896, whose
    one-row product rounds differently from a wider one on some CPUs), 48 rows of other random
    inputs computed 1, 2, 3, 4 and 8 at a time equal bit for bit their rows inside a 768-row product."""
    if not packable("cpu", dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    floor = row_floor_for([(4864, 896)], dtype)
    assert floor in ROW_FLOORS
    layer = torch.nn.Sequential(torch.nn.Linear(4864, 896, bias=False)).to(dtype)
    pack_linears(layer)
    assert set_row_floor(layer, "auto") == floor  # "auto" keeps every product on oneDNN, a floor of 1 too
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(768, 4864, generator=gen).to(dtype)
    with torch.inference_mode():
        whole = layer[0](x)[:48]
        for m in (1, 2, 3, 4, 8):
            assert torch.equal(chunked(layer[0], x[:48], m), whole), m


def _counting_checks(monkeypatch, path):
    """Floors kept in ``path``; returns the list of shapes :func:`row_floor_for` is asked about."""
    monkeypatch.setattr(row_floor, "row_floor_cache_path", lambda: path)
    asked, check = [], row_floor.row_floor_for

    def counting(shapes, dtype, **kwargs):
        asked.extend(tuple(s) for s in shapes)
        return check(shapes, dtype, **kwargs)

    monkeypatch.setattr(row_floor, "row_floor_for", counting)
    return asked


def _floors(model) -> list[int]:
    return [m.row_floor for m in model.modules() if isinstance(m, PackedLinear)]


@needs_onednn_bf16
def test_auto_floors_are_checked_once_per_machine_and_read_back(monkeypatch, tmp_path):
    """The first ``auto`` checks each distinct product shape once (a layer's own and the merged
    q/k/v product's) and files the floors under this machine's key; a second model of the same
    shapes reads them back without a check and gets the same floors; another thread count is
    another key, checked again; ``cache=False`` neither reads nor writes the file."""
    path = tmp_path / "floors.json"
    asked = _counting_checks(monkeypatch, path)
    model, _ = models.load("random:llama", dtype="bfloat16", pack=True)
    top = set_row_floor(model, "auto")
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, PackedLinear)}
    attn = model.model.layers[0].self_attn
    shapes.add((attn.q_proj.in_features, attn.q_proj.out_features + 2 * attn.k_proj.out_features))
    assert sorted(asked) == sorted(shapes)
    machines = json.loads(path.read_text())
    assert len(machines) == 1
    (entry,) = machines.values()
    assert entry["threads"] == torch.get_num_threads()
    assert {tuple(map(int, k.split()[1].split("x"))) for k in entry["floors"]} == shapes
    assert all(k.startswith("bfloat16 ") and v in ROW_FLOORS for k, v in entry["floors"].items())

    again, _ = models.load("random:llama", dtype="bfloat16", pack=True)
    asked.clear()
    assert set_row_floor(again, "auto") == top and _floors(again) == _floors(model)
    assert asked == []

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        set_row_floor(again, "auto")
        assert sorted(asked) == sorted(shapes) and len(json.loads(path.read_text())) == 2
    finally:
        torch.set_num_threads(threads)
    asked.clear()
    other = tmp_path / "untouched.json"
    monkeypatch.setattr(row_floor, "row_floor_cache_path", lambda: other)
    set_row_floor(again, "auto", cache=False)
    assert sorted(asked) == sorted(shapes) and not other.exists()


@needs_onednn_bf16
@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"k": {"floors": 3}}'])
def test_a_broken_floor_file_is_warned_about_checked_again_and_rewritten(monkeypatch, tmp_path, content):
    path = tmp_path / "floors.json"
    path.write_text(content)
    asked = _counting_checks(monkeypatch, path)
    model, _ = models.load("random:llama", dtype="bfloat16", pack=True)
    with pytest.warns(RuntimeWarning, match="ignoring the row floor cache .*floors.json"):
        set_row_floor(model, "auto")
    assert asked and all(v in ROW_FLOORS for entry in json.loads(path.read_text()).values()
                         for v in entry["floors"].values())


@needs_onednn_bf16
def test_a_floor_the_file_cannot_hold_is_checked_again(monkeypatch, tmp_path):
    """A filed value that is not one of :data:`ROW_FLOORS` (a hand-edited or older file) is not
    trusted: that shape is checked again and its floor rewritten; the others are read."""
    path = tmp_path / "floors.json"
    asked = _counting_checks(monkeypatch, path)
    model, _ = models.load("random:llama", dtype="bfloat16", pack=True)
    set_row_floor(model, "auto")
    data = json.loads(path.read_text())
    (entry,) = data.values()
    bad = min(entry["floors"])
    entry["floors"][bad] = 3
    path.write_text(json.dumps(data))
    asked.clear()
    set_row_floor(model, "auto")
    assert asked == [tuple(map(int, bad.split()[1].split("x")))]
    assert json.loads(path.read_text())[next(iter(data))]["floors"][bad] in ROW_FLOORS


@needs_onednn_bf16
def test_a_floor_file_that_cannot_be_written_is_warned_about(monkeypatch, tmp_path):
    """Where the cache cannot be written (here its folder is a file), the floors are still set
    and the warning names the file."""
    (tmp_path / "blocked").write_text("a file, not a folder")
    _counting_checks(monkeypatch, tmp_path / "blocked" / "floors.json")
    model, _ = models.load("random:llama", dtype="bfloat16", pack=True)
    with pytest.warns(RuntimeWarning, match="could not write the row floor cache .*floors.json"):
        top = set_row_floor(model, "auto")
    assert top in ROW_FLOORS and max(_floors(model)) == top


@needs_onednn_bf16
def test_the_row_floor_option_loads_the_model_packed_with_its_floor():
    """``--row-floor`` on the commands that load a model: ``auto`` or a number (anything else is
    refused by the parser); the loader then packs the model (float32 too) and sets the floor."""
    from fastprefill.cli import build_parser
    from fastprefill.cli.common import _load

    parse = build_parser().parse_args
    assert parse(["generate", "x", "--row-floor", "auto"]).row_floor == "auto"
    assert parse(["serve", "--row-floor", "2"]).row_floor == 2 and parse(["serve"]).row_floor is None
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parse(["serve", "--row-floor", bad])
    model, _ = _load("random:llama", "cpu", "float32", None, 3)
    assert linears_packed(model) and {m.row_floor for m in model.modules() if isinstance(m, PackedLinear)} == {3}
    plain, _ = _load("random:llama", "cpu", "float32")
    assert not linears_packed(plain)
