"""The few-row products (``kernels/rows.cpp``): a decode step's linear layers computed one weight
row at a time, in bfloat16 (AVX512-BF16 CPUs, up to 4 rows) and float32 (any AVX2 CPU, up to 64
rows in tiles). Against float64
products (within the dtype's rounding), each row's result the same whatever the row count, the
merged and SwiGLU forms, the input checks, and the packed layers' choice between them and oneDNN
(a row floor keeps oneDNN; without the kernel oneDNN runs)."""

from __future__ import annotations

import shutil

import pytest
import torch

from fastprefill import kernels, models
from fastprefill.bench.records import environment
from fastprefill.host import cpu_info
from fastprefill.models import packed
from fastprefill.models.packed import (
    FEW_ROWS,
    PROMPT_ROWS,
    PackedSwiGLU,
    few_rows_used,
    onednn_bf16,
    pack_linears,
    set_few_rows,
    streams_as_rows,
)
from fastprefill.models.row_floor import set_row_floor

ISA = torch.backends.cpu.get_cpu_capability()
CAN_RUN = ISA in ("AVX512", "AVX512_BF16", "AMX") and cpu_info().bf16_native  # bfloat16
CAN_RUN_F32 = ISA in ("AVX512", "AVX512_BF16", "AMX", "AVX2")
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="f32")]


def _module(dtype: torch.dtype = torch.bfloat16):
    """The built kernel for ``dtype``, failing where a compiler exists but it is not built (setup builds it)."""
    if not (CAN_RUN if dtype == torch.bfloat16 else CAN_RUN_F32):
        pytest.skip(f"this CPU lacks the ISA the few-row {dtype} products need")
    module, reason = kernels._load(kernels._variant_for_cpu(), "rows")
    if module is None:
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(f"the few-row products are not built: {reason}")
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    return module


def _weights(k: int, sizes: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype) for n in sizes]


def _assert_within_bf16(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Each output within bfloat16's rounding of the float64 reference (and the float32 sums' order)."""
    tol = 2 ** -7 * ref.abs() + 1e-3
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert bool(((got.double() - ref).abs() <= tol).all()), float((got.double() - ref).abs().max())


def _assert_within(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Within ``dtype``'s rounding of the float64 reference: bfloat16's, or float32 sums over K."""
    if dtype == torch.bfloat16:
        _assert_within_bf16(got, ref)
        return
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert bool(((got.double() - ref).abs() <= 1e-5 * ref.abs() + 1e-5).all()), float((got.double() - ref).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [64, 200, 896, 4864])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_products_match_float64_and_each_row_is_computed_alone(k, rows, dtype):
    mod = _module(dtype)
    weights = _weights(k, (96, 16, 16), dtype=dtype)  # a merged q, k, v
    gen = torch.Generator().manual_seed(1)
    biases = [torch.randn(96, generator=gen).to(dtype), None, torch.randn(16, generator=gen).to(dtype)]
    x = torch.randn(rows, k, generator=gen).to(dtype)
    out = mod.products(x, weights, biases)
    bias = torch.cat([biases[0].double(), torch.zeros(16, dtype=torch.float64), biases[2].double()])
    _assert_within(out, x.double() @ torch.cat(weights).double().T + bias, dtype)
    alone = torch.cat([mod.products(x[i:i + 1], weights, biases) for i in range(rows)])
    assert torch.equal(out, alone)  # a row's bits do not depend on the other rows
    one_by_one = torch.cat([mod.products(x, [w], [b]) for w, b in zip(weights, biases, strict=True)], dim=1)
    assert torch.equal(out, one_by_one)  # merging the layers changes no bit


@pytest.mark.parametrize("k", [13, 200, 896])
def test_float32_tiles_give_each_row_its_bits_alone_up_to_the_limit(k):
    """float32 products of up to ``max_float_rows`` rows (tiles of 4 rows by 3 weight rows, a tile
    spanning two merged layers, 1-2 columns left at the end) are within float32's rounding of
    float64's, and each row's output is the bits it gets alone, whatever the row count."""
    mod = _module(torch.float32)
    limit = mod.max_float_rows
    assert limit >= FEW_ROWS[torch.float32]
    weights = _weights(k, (37, 5, 64), seed=4, dtype=torch.float32)  # 106 columns: blocks cross layers
    gen = torch.Generator().manual_seed(5)
    biases = [torch.randn(37, generator=gen), None, torch.randn(64, generator=gen)]
    x = torch.randn(limit, k, generator=gen)
    full = mod.products(x, weights, biases)
    bias = torch.cat([biases[0].double(), torch.zeros(5, dtype=torch.float64), biases[2].double()])
    _assert_within(full, x.double() @ torch.cat(weights).double().T + bias, torch.float32)
    alone = torch.cat([mod.products(x[i:i + 1], weights, biases) for i in range(limit)])
    assert torch.equal(full, alone)
    for rows in (2, 5, 7, 17, limit - 1):
        assert torch.equal(mod.products(x[:rows], weights, biases), full[:rows])
    with pytest.raises(RuntimeError, match=f"few-row float32 products take 1 to {limit} input rows, got {limit + 1}"):
        mod.products(torch.randn(limit + 1, k), weights, biases)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_swiglu_is_the_activation_of_the_two_products_rounded_as_onednn_rounds_it(rows):
    mod = _module()
    gate, up = _weights(896, (300, 300), seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 896, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    out = mod.swiglu(x, gate, bias, up, None)
    u = x.double() @ up.double().T
    _assert_within_bf16(out, torch.nn.functional.silu(x.double() @ gate.double().T + bias.double()) * u)
    assert torch.equal(out, torch.cat([mod.swiglu(x[i:i + 1], gate, bias, up, None) for i in range(rows)]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_inputs_are_refused_with_what_was_wrong(dtype):
    mod = _module(dtype)
    name = "float32" if dtype == torch.float32 else "bfloat16"
    w = _weights(64, (8,), dtype=dtype)[0]
    x = torch.randn(1, 64).to(dtype)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    cases = [
        ((x.half(), [w], [None]), "bfloat16 or float32 CPU tensor"),
        ((x.to(other), [w], [None]), "contiguous 2-D .* CPU tensor \\(N, K\\), as x is"),
        ((torch.randn(1, 32).to(dtype), [w], [None]), "must be the weights' K"),
        ((torch.randn(65 if dtype == torch.float32 else 5, 64).to(dtype), [w], [None]),
         "1 to 64 input rows" if dtype == torch.float32 else "1 to 4 input rows"),
        ((x, [w.t().contiguous().t()], [None]), f"contiguous 2-D {name}"),
        ((x, [w, _weights(32, (8,), dtype=dtype)[0]], [None, None]), "K = 64"),
        ((x, [w], [torch.zeros(9).to(dtype)]), "weight's N"),
        ((x, [w], [torch.zeros(8).to(other)]), f"contiguous {name} vector"),
        ((x, [w], []), "one bias"),
    ]
    if not CAN_RUN:  # an AVX2 build: its bfloat16 refusal says why
        cases[1] = ((x.bfloat16(), [w.bfloat16()], [None]), "no AVX512-BF16 code: float32 only")
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            mod.products(*args)
    with pytest.raises(RuntimeError, match="one shape" if dtype == torch.bfloat16 else "bfloat16 CPU tensors only"):
        mod.swiglu(x, w, None, _weights(64, (9,), dtype=dtype)[0], None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_on_load_passes_and_the_status_names_the_build(dtype):
    _module(dtype)
    status = kernels.rows_status(dtype)
    assert status.available and status.variant == kernels._variant_for_cpu() and status.reason == ""
    assert kernels.row_products(dtype) is not None


def test_a_dtype_or_cpu_the_kernel_cannot_run_is_named():
    assert "float16" in kernels.rows_status(torch.float16).reason
    assert kernels.row_products(torch.float16) is None
    if not CAN_RUN:
        assert "AVX512-BF16" in kernels.rows_status(torch.bfloat16).reason
        assert kernels.row_products(torch.bfloat16) is None


needs_kernel = pytest.mark.skipif(not (CAN_RUN and onednn_bf16()), reason="no AVX512-BF16 here")


def _needs(dtype: torch.dtype) -> None:
    """Skip unless the packed layers run ``dtype`` and the few-row kernel can run it on this CPU."""
    if not packed.packable("cpu", dtype) or not (CAN_RUN if dtype == torch.bfloat16 else CAN_RUN_F32):
        pytest.skip(f"the few-row {dtype} products do not run here")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_model_runs_few_rows_on_the_kernel_and_more_on_onednn(dtype):
    """Up to FEW_ROWS rows of one position go to the kernel (bit for bit its output; a row's bits the
    same for any count), a prompt's positions too in float32 (to oneDNN in bfloat16), one row more
    to oneDNN; ``set_few_rows(False)`` keeps oneDNN for all."""
    _needs(dtype)
    mod = _module(dtype)
    limit = FEW_ROWS[dtype]
    layer = torch.nn.Linear(896, 300).to(dtype)
    pack_linears(layer)
    x = torch.randn(limit + 1, 896).to(dtype)
    onednn = lambda t: torch.ops.mkldnn._linear_pointwise(t, layer.packed_weight(), layer.bias, "none", [None], "")
    with torch.inference_mode():
        for rows in range(1, limit + 1):
            assert torch.equal(layer(x[:rows]), mod.products(x[:rows], [layer.weight], [layer.bias]))
        assert torch.equal(layer(x[None, :1]), layer(x[:2])[None, :1])  # (1, 1, K): a decode step's shape
        assert torch.equal(layer(x[:2, None]), layer(x[:2])[:, None])  # (2, 1, K): two streams' step
        prompt = mod.products(x[:2], [layer.weight], [layer.bias])[None] if dtype in PROMPT_ROWS else onednn(x[None, :2])
        assert torch.equal(layer(x[None, :2]), prompt)  # (1, 2, K): a prompt's two positions (float32: the kernel)
        with streams_as_rows():  # (1, R, K) as R streams' decode rows (a batched step's layer call)
            assert torch.equal(layer(x[None, :limit]), layer(x[:limit])[None])
            assert torch.equal(layer(x[None]), onednn(x[None]))  # one row more: oneDNN all the same
        assert torch.equal(layer(x), onednn(x))
        layer.few_rows = False
        assert torch.equal(layer(x[:1]), onednn(x[:1]))


@needs_kernel
def test_the_models_fused_mlp_and_merged_projections_use_it_and_stay_close_to_onednn():
    model, _ = models.load("random:qwen2", dtype="bfloat16", pack=True)
    assert isinstance(model.model.layers[0].mlp, PackedSwiGLU)
    assert few_rows_used(model) == (True, "")
    assert environment(1, model)["few_rows"] is True
    ids = torch.randint(0, model.config.vocab_size, (1, 1))
    with torch.inference_mode():
        fast = model(ids).logits
        set_few_rows(model, False)
        assert few_rows_used(model)[0] is False and "turned off" in few_rows_used(model)[1]
        slow = model(ids).logits
    assert float((fast.float() - slow.float()).abs().max()) <= 0.05 * float(slow.float().abs().max())
    set_few_rows(model, True)
    set_row_floor(model, 2)
    assert few_rows_used(model)[0] is False
    set_row_floor(model, 1)
    assert few_rows_used(model) == (True, "")


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_the_kernel_onednn_computes_every_product(monkeypatch, dtype):
    """The fallback: where the kernel does not load, the packed layers run oneDNN's products, and
    the model says why."""
    _needs(dtype)
    layer = torch.nn.Linear(64, 8).to(dtype)
    pack_linears(layer)
    x = torch.randn(1, 64).to(dtype)
    monkeypatch.setattr(packed, "row_products", lambda dtype: None)
    monkeypatch.setattr(packed, "rows_status", lambda dtype: kernels.KernelStatus(dtype, None, False, "not built"))
    with torch.inference_mode():
        want = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight(), layer.bias, "none", [None], "")
        assert torch.equal(layer(x), want)
    assert few_rows_used(layer) == (False, "not built")


def test_a_model_the_kernel_cannot_serve_says_why():
    plain, _ = models.load("random:llama", dtype="float32")
    assert few_rows_used(plain) == (False, "its linear layers are not packed")
    if packed.packable("cpu", torch.float32):
        f32, _ = models.load("random:llama", dtype="float32", pack=True)
        status = kernels.rows_status(torch.float32)
        assert few_rows_used(f32) == (status.available, status.reason)
        set_few_rows(f32, False)
        assert few_rows_used(f32)[0] is False and "turned off" in few_rows_used(f32)[1]


def test_norm_kernels_round_as_the_family_norm_does():
    """``rms_norm`` and ``add_rms_norm`` against transformers' Qwen2 RMSNorm (float32 statistics,
    rounded, times the weight): the residual sum bit for bit, the norm within one bfloat16 step
    (the float32 sum of squares is taken in another order)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    mod = _module()
    norm = Qwen2RMSNorm(896, eps=1e-6).bfloat16()
    gen = torch.Generator().manual_seed(4)
    norm.weight.data = torch.randn(896, generator=gen).bfloat16()
    x, r = (torch.randn(1, 2, 896, generator=gen).bfloat16() * 3 for _ in range(2))
    with torch.inference_mode():
        got = mod.rms_norm(x, norm.weight, 1e-6)
        assert got.shape == x.shape
        _assert_within_bf16(got, norm(x).double())
        total, normed = mod.add_rms_norm(r, x, norm.weight, 1e-6)
        assert torch.equal(total, r + x)
        _assert_within_bf16(normed, norm(r + x).double())
    with pytest.raises(RuntimeError, match="one shape"):
        mod.add_rms_norm(r[:, :1], x, norm.weight, 1e-6)
    with pytest.raises(RuntimeError, match="norm's weight"):
        mod.rms_norm(x, norm.weight.float(), 1e-6)


@needs_kernel
@pytest.mark.parametrize("family", ["random:qwen2", "random:llama"])
def test_the_fused_decoder_layer_runs_a_decode_steps_norms_on_the_kernel(family, monkeypatch):
    """One or two rows go through the kernel's norms (counted) and stay within bfloat16 rounding of
    the family's own forward; three rows, a row floor or ``fuse_layers(False)`` run the family's own
    forward, bit for bit; the layer's hooks still fire."""
    from fastprefill.models import fused
    from fastprefill.models.fused import FusedDecoderLayer, fuse_layers, layers_fused

    model, _ = models.load(family, dtype="bfloat16", pack=True)
    assert layers_fused(model) and environment(1, model)["layers_fused"] is True
    calls = []
    real = fused.few_row_kernel

    def counted(x, layers):
        kernel = real(x, layers)
        if kernel is not None:
            calls.append(1)
        return kernel

    monkeypatch.setattr(fused, "few_row_kernel", counted)
    fired = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: fired.append(1))
    ids = torch.randint(0, model.config.vocab_size, (1, 2))
    with torch.inference_mode():
        few, many = model(ids[:, :1]).logits, model(torch.cat([ids, ids[:, :1]], dim=1)).logits
        assert len(calls) == model.config.num_hidden_layers and len(fired) == 2
        assert fuse_layers(model, fused=False) == model.config.num_hidden_layers
        assert not layers_fused(model) and not isinstance(model.model.layers[0], FusedDecoderLayer)
        own_few, own_many = model(ids[:, :1]).logits, model(torch.cat([ids, ids[:, :1]], dim=1)).logits
        fuse_layers(model)
        set_row_floor(model, 2)
        floored = model(ids[:, :1]).logits
        set_row_floor(model, 1)
    assert torch.equal(many, own_many)
    assert float((few.float() - own_few.float()).abs().max()) <= 0.05 * float(own_few.float().abs().max())
    assert len(calls) == model.config.num_hidden_layers  # not called again: three rows, own forward, a floor
    assert floored.shape == few.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_streams_decoding_together_run_the_kernel_and_get_their_lone_bits(monkeypatch, dtype):
    """A batched step of up to FEW_ROWS streams (``run_layers``: their rows as one ``(1, R, D)``
    layer call; two in bfloat16, forty in float32) runs its products (and bfloat16's norms) on the
    kernel, as each stream's step alone does, so each stream's logits in the batch equal its logits
    alone bit for bit; one stream more takes oneDNN."""
    from fastprefill.batch import DecodeBatch
    from fastprefill.engine import Generation
    from fastprefill.methods.full import FullPrefill

    _needs(dtype)
    limit = FEW_ROWS[dtype]
    model, _ = models.load("random:qwen2", dtype=str(dtype).removeprefix("torch."), pack=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (1, 7 + 5 * i % 8), generator=gen) for i in range(limit + 1)]
    calls = []
    real = packed.few_row_kernel

    def counted(x, layers):
        kernel = real(x, layers)
        calls.append(kernel is not None)
        return kernel

    monkeypatch.setattr(packed, "few_row_kernel", counted)
    seen: dict[str, list[torch.Tensor]] = {}

    def recording(choice, key):  # a stream's logits as its sampler sees them, step by step
        pick = choice.pick

        def pick_and_keep(logits, top=None):
            seen.setdefault(key, []).append(logits.clone())
            return pick(logits, top)

        choice.pick = pick_and_keep

    def decode(name, chosen, steps=4):
        gens = [Generation(model, None, ids, FullPrefill(), steps + 1, stop_at_eos=False) for ids in chosen]
        for i, g in enumerate(gens):
            g.prefill(None)
            g.first_events()
            recording(g.branches[0].choice, f"{name}{i}")
        batch = DecodeBatch(model, max_batch=len(gens))
        calls.clear()
        for _ in range(steps):
            batch.step(gens)
        used = list(calls)
        batch.release()
        for g in gens:
            g.close()
        return used

    alone = [decode(f"alone{i}-", [ids]) for i, ids in enumerate(prompts[:limit])]
    together = decode("pair", prompts[:limit])
    three = decode("three", prompts)
    assert all(u and all(u) for u in alone) and together and all(together)
    assert three and not any(three)
    for i in range(limit):
        assert len(seen[f"pair{i}"]) == len(seen[f"alone{i}-0"]) == 4
        for got, want in zip(seen[f"pair{i}"], seen[f"alone{i}-0"], strict=True):
            assert torch.equal(got, want)
