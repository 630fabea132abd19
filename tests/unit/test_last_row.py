"""A prefill's last decoder layer on the last row only (models.fused.last_row_only).

The reference is the same model with the switch off (``set_last_row_only(model, False)``: the
family's forward, every row through every layer). With it on, full prefill must leave the same
keys and values at every layer, give the last position's logits to float rounding and the same
greedy tokens, and the last layer's query and output projections must see one row, the other
layers' every row (counted with hooks on the products). Where the layers do not have the fused
forward the switch does nothing.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from fastprefill.cache import layer_kv
from fastprefill.engine import generate
from fastprefill.host import cpu_info
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method
from fastprefill.models import fused
from fastprefill.models import load as load_model
from fastprefill.models.shape import ModelShape

DTYPES = ["float32"] + (["bfloat16"] if cpu_info().bf16_native else [])


def _rows_seen(model):
    """Rows each layer's q and o projections are called with, recorded per call: ``{(layer, name): [rows]}``."""
    seen: dict[tuple[int, str], list[int]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "o_proj"):
            def hook(module, args, key=(i, name)):
                seen.setdefault(key, []).append(args[0].shape[1])
            handles.append(getattr(layer.self_attn, name).register_forward_pre_hook(hook))
    return seen, handles


def _prefill(model, ids, prefix_len, on):
    """FullPrefill over ``ids`` ``(1, T)`` (after a cached prefix of ``prefix_len`` positions when
    nonzero, itself prefilled with the switch off) with the switch ``on``; the rows seen too."""
    fused.set_last_row_only(model, False)
    prefix = FullPrefill().prefill(model, ids[:, :prefix_len]).cache if prefix_len else None
    fused.set_last_row_only(model, on)
    seen, handles = _rows_seen(model)
    try:
        with torch.inference_mode():
            out = FullPrefill().prefill(model, ids, prefix)
    finally:
        for h in handles:
            h.remove()
        fused.set_last_row_only(model, True)
    return out, seen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix_len", [0, 40])
def test_the_last_layer_computes_one_row_and_leaves_the_same_cache(family, dtype, prefix_len):
    model, _ = load_model(f"random:{family}", dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(3))
    on, seen_on = _prefill(model, ids, prefix_len, True)
    off, seen_off = _prefill(model, ids, prefix_len, False)
    rows, last = 90 - prefix_len, model.config.num_hidden_layers - 1
    for (layer, name), counts in seen_off.items():
        assert counts == [rows]
        assert seen_on[layer, name] == ([1] if layer == last else [rows])
    for a, b in zip(on.cache.layers, off.cache.layers, strict=True):
        assert torch.equal(a.keys[..., :90, :], b.keys[..., :90, :])
        assert torch.equal(a.values[..., :90, :], b.values[..., :90, :])
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(on.logits, off.logits, atol=tol * float(off.logits.abs().max()), rtol=0)
    shape = ModelShape.from_config(model.config)
    saved = (rows - 1) * (shape.linear_flops_per_token() - shape.kv_flops_per_token()) + shape.attention_flops(
        rows * prefix_len + rows * (rows + 1) // 2 - 90)
    assert off.stats.flops - on.stats.flops == pytest.approx(saved)
    assert on.stats.token_layers == off.stats.token_layers


def test_greedy_tokens_are_the_same_with_the_switch_on_and_off():
    model, tok = load_model("random:qwen2", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(4))
    on = generate(model, tok, ids, max_new_tokens=12, stop_at_eos=False)
    fused.set_last_row_only(model, False)
    try:
        off = generate(model, tok, ids, max_new_tokens=12, stop_at_eos=False)
    finally:
        fused.set_last_row_only(model, True)
    assert list(on.token_ids) == list(off.token_ids)


def test_a_one_row_prompt_and_layers_without_the_fused_forward_compute_every_row():
    model, _ = load_model("random:qwen2", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(5))
    cache = object()
    with fused.last_row_only(model, cache) as applies:
        assert applies
        assert fused._LAST_ROW.get() == (model.model.layers[-1], cache)
    assert fused._LAST_ROW.get() is None  # reset on leaving
    _, seen = _prefill(model, ids[:, :1], 0, True)
    assert all(counts == [1] for counts in seen.values())
    assert fused.fuse_layers(model, fused=False) == model.config.num_hidden_layers
    with fused.last_row_only(model, cache) as applies:
        assert not applies
    out, seen = _prefill(model, ids, 0, True)
    assert all(counts == [30] for counts in seen.values())
    off, _ = _prefill(model, ids, 0, False)
    assert torch.equal(out.logits, off.logits)
    assert out.stats.flops == ModelShape.from_config(model.config).causal_prefill_flops(30)


def test_a_call_over_another_cache_inside_the_scope_computes_every_row():
    """A decode step that runs in a pause of the prefill (its own cache) is not trimmed."""
    model, _ = load_model("random:qwen2", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    seen, handles = _rows_seen(model)
    try:
        with torch.inference_mode(), fused.last_row_only(model, DynamicCache(config=model.config)) as applies:
            assert applies
            out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    assert out.logits.shape[1] == 12
    assert all(counts == [12] for counts in seen.values())


@pytest.mark.parametrize("spec", ["lazyllm", "lazyllm:preset=paper"])
def test_lazyllm_runs_its_last_layer_on_the_last_row_with_the_same_cache_and_tokens(spec):
    model, tok = load_model("random:qwen2", dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(7))
    outs, seen, tokens = {}, {}, {}
    for on in (True, False):
        fused.set_last_row_only(model, on)
        rows, handles = _rows_seen(model)
        try:
            with torch.inference_mode():
                outs[on] = make_method(spec).prefill(model, ids)
        finally:
            for h in handles:
                h.remove()
        seen[on] = rows
        tokens[on] = list(generate(model, tok, ids, make_method(spec), max_new_tokens=8, stop_at_eos=False).token_ids)
    fused.set_last_row_only(model, True)
    last = model.config.num_hidden_layers - 1
    kept = seen[False][last, "q_proj"][0]
    assert kept > 1 and seen[True][last, "q_proj"] == [1] and seen[True][last, "o_proj"] == [1]
    assert all(seen[True][key] == counts for key, counts in seen[False].items() if key[0] != last)
    for layer in range(model.config.num_hidden_layers):
        for a, b in zip(layer_kv(outs[True].cache, layer), layer_kv(outs[False].cache, layer), strict=True):
            assert torch.equal(a, b)
    torch.testing.assert_close(outs[True].logits, outs[False].logits, atol=1e-5 * float(outs[False].logits.abs().max()),
                               rtol=0)
    assert outs[True].stats.token_layers == outs[False].stats.token_layers
    assert outs[True].stats.flops < outs[False].stats.flops
    assert tokens[True] == tokens[False]


def test_the_loader_can_leave_every_row_computed():
    model, _ = load_model("random:qwen2", dtype="float32", last_row=False)
    assert not fused.trims_last_row(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(8))
    seen, handles = _rows_seen(model)
    try:
        with torch.inference_mode():
            FullPrefill().prefill(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert all(counts == [20] for counts in seen.values())
    assert fused.trims_last_row(load_model("random:qwen2", dtype="float32")[0])
