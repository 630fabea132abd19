"""The C++ attention kernel (fastprefill.kernels) against SDPA, and the backend choice around it.

The kernel computes causal attention of the last T of N positions. Its reference is float64
SDPA with the lower-right causal mask; the kernel must be within SDPA's own error of it (SDPA
run in the same dtype), on grouped-query shapes with 64- and 128-wide heads, a whole prefill, a
suffix over cached keys and a decode step, in float32 and (where the CPU has bfloat16 units)
bfloat16.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from fastprefill import kernels
from fastprefill.errors import ConfigError
from fastprefill.host import cpu_info
from fastprefill.models import attention as attn
from fastprefill.models import load as load_model

CAN_RUN = {"avx512": torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX"),
           "avx2": torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")}
DTYPES = [torch.float32] + ([torch.bfloat16] if cpu_info().bf16_native else [])
# (B, H_q, H_kv, T, N, d): whole prefills, suffixes over cached keys, decode steps, odd lengths
SHAPES = [(1, 14, 2, 300, 300, 64), (2, 12, 2, 130, 130, 128), (1, 9, 3, 37, 37, 64), (1, 14, 2, 33, 700, 64),
          (2, 12, 2, 5, 600, 128), (1, 12, 2, 1, 513, 128), (1, 4, 4, 257, 1000, 64), (1, 14, 2, 1, 1, 64),
          (1, 8, 2, 19, 531, 80)]  # 80-wide heads: pairs past the packing's 16 x 16 tiles


def _variant_module(variant: str):
    """The built module of ``variant`` (imported under its own name), failing where a compiler
    exists but the build does not (setup builds it), skipping where none could have built it."""
    if not CAN_RUN[variant]:
        pytest.skip(f"this CPU cannot run the {variant} build")
    so = kernels.kernel_dir(variant) / f"fastprefill_attention_{variant}.so"
    if not so.exists():
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(f"the {variant} attention kernel is not built ({so}): run python -m fastprefill.kernels build")
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    module, reason = kernels._load(variant)
    assert module is not None, reason
    return module


def _inputs(shape, dtype, seed=0):
    b, hq, hkv, t, n, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=gen).to(dtype).transpose(1, 2)  # (B, H_q, T, d), as a layer makes it
    k, v = (torch.randn(b, hkv, n, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v):
    t, n = q.shape[2], k.shape[2]
    allowed = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]  # (T, N): lower-right causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_T{}_N{}_d{}".format(*s))
def test_kernel_matches_sdpa_within_its_own_error(variant, dtype, shape):
    mod = _variant_module(variant)
    q, k, v = _inputs(shape, dtype)
    ref = _sdpa(q.double(), k.double(), v.double())
    out = mod.causal_attention(q, k, v, 1 / math.sqrt(shape[-1]))
    assert out.shape == (shape[0], shape[3], shape[1], shape[5]) and out.dtype == dtype and out.is_contiguous()
    sdpa_err = (_sdpa(q, k, v).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    floor = 2e-6 if dtype == torch.float32 else 4e-3
    assert err <= max(1.5 * sdpa_err, floor), f"kernel error {err:.3g} vs SDPA's {sdpa_err:.3g}"


def _masked_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_T{}_N{}_d{}".format(*s))
@pytest.mark.parametrize("broadcast", ["full", "batch", "rows"])
def test_a_masked_call_matches_sdpa_within_its_own_error(variant, dtype, shape, broadcast):
    """A boolean (B, 1, T, N) mask (a pruned cache's keys, rows over a prefix, a padded batch): every
    row attends exactly the keys its mask row allows, the mask shared by the heads; B or T may be 1."""
    mod = _variant_module(variant)
    q, k, v = _inputs(shape, dtype, seed=1)
    b, _, _, t, n, d = shape
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(1 if broadcast == "batch" else b, 1, 1 if broadcast == "rows" else t, n, generator=gen) < 0.6
    mask[..., -1] = True  # no row hidden entirely (SDPA's answer for one is NaN)
    ref = _masked_sdpa(q.double(), k.double(), v.double(), mask)
    out = mod.causal_attention(q, k, v, 1 / math.sqrt(d), mask=mask)
    assert out.shape == (b, t, shape[1], d) and out.dtype == dtype
    sdpa_err = (_masked_sdpa(q, k, v, mask).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    floor = 2e-6 if dtype == torch.float32 else 4e-3
    assert err <= max(1.5 * sdpa_err, floor), f"kernel error {err:.3g} vs SDPA's {sdpa_err:.3g}"


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 14, 2, 300, 300, 64), (1, 14, 2, 23, 531, 64), (2, 12, 2, 1, 600, 128)],
                         ids=["prefill", "suffix", "decode"])
def test_keys_and_values_with_any_row_stride_give_the_contiguous_answer(variant, dtype, shape):
    """K and V read where they lie: token-major (B, N, H, d) viewed head-major, and a cache's first
    N rows of a longer buffer, give the bits of contiguous copies, whether the heads are packed
    whole (a prefill's row blocks) or block by block (a decode step, a short suffix; float32
    values read in place)."""
    mod = _variant_module(variant)
    q, k, v = _inputs(shape, dtype, seed=3)
    b, _, hkv, _, n, d = shape
    want = mod.causal_attention(q, k, v, 1 / math.sqrt(d))
    token_major = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v)]  # row stride H * d
    roomy = [torch.cat([x, torch.randn(b, hkv, 40, d).to(dtype)], dim=2)[:, :, :n] for x in (k, v)]  # head stride (N + 40) d
    for kk, vv in (token_major, roomy, (token_major[0], roomy[1])):
        assert kk.stride(2) != d or kk.stride(1) != n * d or vv.stride(2) != d or vv.stride(1) != n * d
        assert torch.equal(mod.causal_attention(q, kk, vv, 1 / math.sqrt(d)), want)


def test_a_row_its_mask_hides_entirely_gets_zeros():
    mod = _variant_module("avx2")
    q, k, v = _inputs((1, 4, 2, 6, 300, 64), torch.float32)
    mask = torch.ones(1, 1, 6, 300, dtype=torch.bool)
    mask[0, 0, 2] = False
    out = mod.causal_attention(q, k, v, 0.125, mask=mask)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))
    torch.testing.assert_close(out[0, 3], _masked_sdpa(q, k, v, mask)[0, 3])


def test_kernel_rejects_bad_inputs_with_a_message():
    mod = _variant_module("avx2")
    q, k, v = _inputs((1, 4, 2, 8, 8, 64), torch.float32)
    with pytest.raises(RuntimeError, match="multiple of H_kv"):
        mod.causal_attention(q[:, :3], k, v, 0.125)
    with pytest.raises(RuntimeError, match="more queries than keys"):
        mod.causal_attention(q, k[:, :, :4], v[:, :, :4], 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        mod.causal_attention(q, k.double(), v, 0.125)
    with pytest.raises(RuntimeError, match="4-D"):
        mod.causal_attention(q[0], k, v, 0.125)
    with pytest.raises(RuntimeError, match="positive"):
        mod.causal_attention(q, k, v, 0.0)
    with pytest.raises(RuntimeError, match="boolean"):
        mod.causal_attention(q, k, v, 0.125, mask=torch.zeros(1, 1, 8, 8))
    with pytest.raises(RuntimeError, match=r"\(B, 1, T, N\)"):
        mod.causal_attention(q, k, v, 0.125, mask=torch.ones(1, 4, 8, 8, dtype=torch.bool))


def test_backend_choice_is_validated_and_sdpa_never_calls_the_kernel(monkeypatch):
    model, _ = load_model("random:qwen2", dtype="float32")
    with pytest.raises(ConfigError, match="choose one of auto, kernel, sdpa"):
        attn.set_attention_backend(model, "flash")
    calls = []
    real = attn.attention_kernel

    def counting(dtype):
        fn = real(dtype)
        return None if fn is None else (lambda *a, **kw: calls.append(1) or fn(*a, **kw))

    monkeypatch.setattr(attn, "attention_kernel", counting)
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.inference_mode():
        assert attn.set_attention_backend(model, "sdpa") == "sdpa"
        with attn.fastprefill_attention(model):
            sdpa_logits = model(input_ids=ids).logits
        assert calls == []
        if attn.attention_backend(model)[0] == "sdpa" and attn.set_attention_backend(model, "auto") == "sdpa":
            pytest.skip(f"kernel unavailable: {attn.attention_backend(model)[1]}")
        with attn.fastprefill_attention(model):
            kernel_logits = model(input_ids=ids).logits
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(kernel_logits, sdpa_logits, atol=1e-4, rtol=1e-4)


def test_kernel_refused_where_it_cannot_run():
    model, _ = load_model("random:llama", dtype="float16")
    backend, why = attn.attention_backend(model)
    assert backend == "sdpa" and "float16" in why
    with pytest.raises(ConfigError, match="cannot run here"):
        attn.set_attention_backend(model, "kernel")
    assert attn.attention_backend(model)[0] == "sdpa"  # the refused choice left nothing behind


def test_load_chooses_the_backend_and_refuses_a_bad_choice_before_loading(monkeypatch):
    model, _ = load_model("random:llama", dtype="float32", attention="sdpa")
    assert attn.attention_backend(model) == ("sdpa", "")
    with pytest.raises(ConfigError, match="cannot run here"):
        load_model("random:llama", dtype="float16", attention="kernel")
    monkeypatch.setattr("fastprefill.models.random_models.load", lambda *a, **kw: pytest.fail("loaded"))
    with pytest.raises(ConfigError, match="attention='flash': choose one of auto, kernel, sdpa"):
        load_model("random:llama", attention="flash")


def test_an_unbuilt_kernel_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTPREFILL_CACHE_DIR", str(tmp_path))
    kernels._load.cache_clear()
    try:
        module, reason = kernels._load("avx2")
        assert module is None and "python -m fastprefill.kernels build" in reason
    finally:
        kernels._load.cache_clear()


@pytest.mark.parametrize(("isa", "expected"), [
    ("AVX2", {"attention avx2", "rows avx2"}),
    ("AVX512", {"attention avx512", "attention avx2", "rows avx512", "rows avx2"}),
    ("DEFAULT", set()),
])
def test_the_build_compiles_only_what_this_cpu_can_load(monkeypatch, isa, expected):
    """cpp_extension imports what it compiles, and an AVX-512 build dies on import on an AVX2 CPU
    (an illegal instruction, the whole setup with it): the build must leave such variants alone,
    and refuse one asked for by name."""
    built = []
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
    monkeypatch.setattr(kernels, "_build_one", lambda kernel, source, variant, verbose: built.append(
        f"{kernel} {variant}") or "built")
    assert set(kernels.build()) == expected and set(built) == expected
    if isa == "AVX2":
        with pytest.raises(ValueError, match="cannot run the avx512 kernels"):
            kernels.build(["avx512"])
        assert set(built) == expected  # refused before compiling anything


def test_the_build_finds_the_packaged_ninja_without_an_activated_venv(monkeypatch):
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/nonexistent")
    kernels._ninja_on_path()
    assert shutil.which("ninja", path=None) is not None
    assert os.environ["PATH"].split(os.pathsep)[0] == str(ninja.BIN_DIR)


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
def test_the_kernel_runs_on_torchs_threads(variant):
    """ATen's parallel_for is inline OpenMP: built without -fopenmp the kernel would run on one thread
    whatever torch.set_num_threads says (a silent 2x on two cores). It must use torch's pool."""
    module = _variant_module(variant)
    before = torch.get_num_threads()
    try:
        for threads in sorted({1, min(2, os.cpu_count() or 1)}):
            torch.set_num_threads(threads)
            assert module.threads_used(64) == threads
    finally:
        torch.set_num_threads(before)


def test_a_masked_layer_runs_on_the_kernel_and_matches_sdpa(monkeypatch):
    """A layer-loop call with a boolean mask (what LazyLLM passes over a prefix or a pruned cache)
    goes to the kernel under ``auto`` and gives SDPA's output."""
    from transformers import DynamicCache

    from fastprefill.models.adapters import DecoderAdapter

    model, _ = load_model("random:qwen2", dtype="float32")
    ad = DecoderAdapter(model)
    calls = []
    real = attn.attention_kernel

    def counting(dtype):
        fn = real(dtype)
        return None if fn is None else (lambda *a, **kw: calls.append(kw.get("mask") is not None) or fn(*a, **kw))

    monkeypatch.setattr(attn, "attention_kernel", counting)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=gen)
    positions = torch.arange(40)[None]
    mask = attn.causal_mask(positions[0], positions[0]) & (torch.rand(40, 40, generator=gen) < 0.7)
    mask |= torch.eye(40, dtype=torch.bool)[None, None]
    outs = {}
    with torch.inference_mode():
        for backend in ("sdpa", "auto"):
            if attn.set_attention_backend(model, backend) == "sdpa" and backend == "auto":
                pytest.skip(f"kernel unavailable: {attn.attention_backend(model)[1]}")
            with ad.attention_scope():
                outs[backend] = ad.layer(0, ad.embed(ids), positions, DynamicCache(config=model.config), mask=mask)
    attn.set_attention_backend(model, "auto")
    assert calls == [True]
    torch.testing.assert_close(outs["auto"], outs["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 37, 14, 2, 64), (2, 5, 12, 2, 128), (1, 1, 4, 4, 64), (1, 9, 2, 1, 10)],
                         ids=lambda s: "B{}_T{}_Hq{}_Hkv{}_d{}".format(*s))
def test_the_rotary_kernel_gives_eagers_bits(variant, dtype, shape):
    """x * cos + rotate_half(x) * sin with every operation rounded as eager rounds it, read from a
    column slice of a merged q/k/v product, written head-major."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    mod = _variant_module(variant)
    b, t, hq, hkv, d = shape
    gen = torch.Generator().manual_seed(4)
    qkv = (3 * torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen)).to(dtype)
    q, k = qkv[..., :hq * d], qkv[..., hq * d:(hq + hkv) * d]
    angles = 10 * torch.randn(b, t, d, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.view(b, t, hq, d).transpose(1, 2), k.view(b, t, hkv, d).transpose(1, 2),
                                          cos, sin)
    got_q, got_k = mod.rotary(q, cos, sin, hq), mod.rotary(k, cos, sin, hkv)
    assert got_q.is_contiguous() and torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_the_rotary_kernel_rejects_bad_inputs_with_a_message():
    mod = _variant_module("avx2")
    x, cos = torch.randn(1, 4, 128), torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="heads of even size"):
        mod.rotary(x, cos, cos, 3)
    with pytest.raises(RuntimeError, match=r"\(B or 1, T, d\)"):
        mod.rotary(x, cos[:, :2], cos[:, :2], 2)
    with pytest.raises(RuntimeError, match="one dtype"):
        mod.rotary(x, cos.double(), cos, 2)


def test_attention_as_sets_every_config_and_finds_them_once_per_model(monkeypatch):
    """``attention_as`` sets the attention implementation of every config of the model's modules
    and restores it after; the modules are walked once per model (not on every decode step), and
    again when ``model.config`` is another object."""
    model, _ = load_model("random:qwen2", dtype="float32")
    before = attn.attention_choices(model)
    walks = []
    real = torch.nn.Module.modules

    def counted(self):
        if self is model:
            walks.append(1)
        return real(self)

    monkeypatch.setattr(torch.nn.Module, "modules", counted)
    for _ in range(3):
        with attn.attention_as(model, "eager"):
            assert set(attn.attention_choices(model).values()) == {"eager"}
        assert attn.attention_choices(model) == before
    assert len(walks) <= 1  # at most the first call here (an earlier one may have found them)
    walks.clear()
    model.config = type(model.config).from_dict(model.config.to_dict())  # another config object
    with attn.attention_as(model, "eager"):
        assert model.config._attn_implementation == "eager"
    assert len(walks) == 1
