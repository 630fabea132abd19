"""Blending (``blend``) and its chunk store on the tiny random models: moved keys are exact,
the lossless settings equal full prefill, token-layers are counted, bad input is refused."""

from __future__ import annotations

import pytest
import torch

from fastprefill.chunk_store import ChunkEntry, ChunkStore, anchor_digest
from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method
from fastprefill.methods.research.blend import POLICIES, Blend
from tests.blend_helpers import key_shift_error

SPANS = [(5, 20), (22, 40), (41, 50)]  # three passages in a 60-token prompt: lead 5, glue, question 10
N, LAYERS = 60, 4


def _blend(store: ChunkStore, **kw) -> Blend:
    return Blend(store=store, **kw).with_chunks(SPANS)


def _full_logits(model, ids):
    with torch.inference_mode():
        return FullPrefill().prefill(model, ids).logits


@pytest.mark.parametrize("delta", [1, 37, 1000])
def test_moved_keys_equal_keys_computed_there(tiny_model_any_dtype, make_ids, delta):
    """Every layer's keys computed at 0..N-1 and rotated by delta are the keys at delta..delta+N-1."""
    with torch.inference_mode():
        errors = key_shift_error(tiny_model_any_dtype, make_ids(30, 1), delta)
    tolerance = 1e-4 if tiny_model_any_dtype.dtype == torch.float32 else 3e-2
    assert len(errors) == LAYERS and max(errors) <= tolerance


@pytest.mark.parametrize("anchor", ["lead", "zero"])
def test_one_passage_at_the_start_with_no_recompute_is_full_prefill(tiny_model, make_ids, anchor):
    ids = make_ids(N, 2)
    store = ChunkStore(1 << 24)
    method = Blend(budget=0.0, anchor=anchor, store=store).with_chunks([(0, 40)])
    with torch.inference_mode():
        method.prefill(tiny_model, ids)  # computes and stores the passage
        out = method.prefill(tiny_model, ids)  # reuses it: it is the prefix
    assert out.stats.extra["chunk_hits"] == 1 and out.exact_tokens == 40
    assert float((out.logits - _full_logits(tiny_model, ids)).abs().max()) <= 1e-4
    assert out.stats.token_layers == (N - 40) * LAYERS


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("anchor", ["lead", "zero"])
def test_recomputing_everything_is_full_prefill(tiny_model, make_ids, policy, anchor):
    ids = make_ids(N, 3)
    store = ChunkStore(1 << 24)
    with torch.inference_mode():
        _blend(store, budget=0.0, anchor=anchor).prefill(tiny_model, ids)  # fill the store
        out = _blend(store, policy=policy, budget=1.0, anchor=anchor, check_layer=1).prefill(tiny_model, ids)
    assert float((out.logits - _full_logits(tiny_model, ids)).abs().max()) <= 1e-4
    assert out.stats.extra["chunk_hits"] == 3


def test_recomputing_everything_in_bfloat16_keeps_the_first_token(tiny_bf16, make_ids):
    for model in tiny_bf16.values():
        ids = make_ids(N, 4)
        store = ChunkStore(1 << 24)
        with torch.inference_mode():
            _blend(store, budget=0.0).prefill(model, ids)
            out = _blend(store, budget=1.0).prefill(model, ids)
        ref = _full_logits(model, ids)
        assert int(out.logits.argmax()) == int(ref.argmax())
        assert float((out.logits - ref).abs().max()) <= 0.1


@pytest.mark.parametrize("anchor", ["lead", "zero"])
@pytest.mark.parametrize(("policy", "budget"), [("head", 0.0), ("head", 0.3), ("deviation", 0.3),
                                                ("attention", 0.3), ("attention", 1.0)])
def test_token_layers_are_counted(tiny_model, make_ids, anchor, policy, budget):
    """Every row run through a layer counts once: the lead, the glue and question at every layer,
    the selected passage tokens from where they start, the probe's rows."""
    ids = make_ids(N, 5)
    store = ChunkStore(1 << 24)
    with torch.inference_mode():
        first = _blend(store, budget=0.0, anchor=anchor).prefill(tiny_model, ids)
        out = _blend(store, policy=policy, budget=budget, anchor=anchor, check_layer=1).prefill(tiny_model, ids)
    lead, fresh = 5, (22 - 20) + (41 - 40) + (N - 50)
    passages = [e - s for s, e in SPANS]
    exact = passages[0] if anchor == "lead" else 0  # the first passage sits where it was computed
    reused = sum(passages) - exact
    k = round(budget * reused)
    extra = out.stats.extra
    assert (extra["fresh_tokens"], extra["reused_tokens"], extra["selected_tokens"]) == (fresh, reused, k)
    assert (extra["chunk_hits"], extra["chunk_misses"], extra["exact_chunk_tokens"]) == (3, 0, exact)
    assert first.stats.token_layers == (lead + fresh + sum(passages)) * LAYERS  # the misses computed once
    expected = (lead + fresh + k) * LAYERS
    if 0 < k < reused and policy == "deviation":  # rows below the check layer: everything reused
        expected = lead * LAYERS + (fresh + reused) * 1 + (fresh + k) * (LAYERS - 1)
    elif 0 < k < reused and policy == "attention":  # the probe: glue and question through layers 0..1
        expected += fresh * 2
    assert out.stats.token_layers == expected
    assert out.stats.total_token_layers == N * LAYERS
    assert out.exact_tokens == lead + exact


def test_more_budget_computes_more(tiny_llama, make_ids):
    ids = make_ids(N, 6)
    store = ChunkStore(1 << 24)
    with torch.inference_mode():
        counts = [_blend(store, policy="head", budget=b).prefill(tiny_llama, ids).stats.token_layers
                  for b in (0.0, 0.0, 0.2, 0.5, 1.0)][1:]
    assert counts == sorted(counts) and counts[0] < counts[-1]


def test_head_policy_takes_each_passage_first_tokens(tiny_llama, make_ids):
    ids = make_ids(N, 7)
    store = ChunkStore(1 << 24)
    method = Blend(policy="head", budget=0.1, anchor="zero", store=store).with_chunks(SPANS)
    with torch.inference_mode():
        out = method.prefill(tiny_llama, ids)
    assert out.stats.extra["selected_tokens"] == round(0.1 * 42)  # offsets 0 of 3 passages, then offset 1


def test_through_the_engine_with_a_chunked_prompt(tiny_qwen2, make_ids):
    from fastprefill.prompt import ChunkedPrompt

    ids = make_ids(N, 8)[0].tolist()
    prompt = ChunkedPrompt(tuple(ids), tuple(SPANS))
    store = ChunkStore(1 << 24)
    method = Blend(budget=1.0, store=store)
    full = generate(tiny_qwen2, None, prompt, max_new_tokens=6, stop_at_eos=False)
    got = generate(tiny_qwen2, None, prompt, method, max_new_tokens=6, stop_at_eos=False, prefix_cache=store)
    assert got.token_ids == full.token_ids and got.timing.stats.extra["chunks"] == 3
    assert got.timing.stored_tokens == 16  # the exact lead and first passage: one whole block of 20 tokens
    again = generate(tiny_qwen2, None, prompt, method, max_new_tokens=6, stop_at_eos=False, prefix_cache=store)
    assert again.timing.cached_tokens == 16 and again.token_ids == full.token_ids


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"budget": -0.1}, r"budget.*\[0, 1\]"),
    ({"budget": 1.5}, r"budget.*\[0, 1\]"),
    ({"policy": "random"}, r"policy.*deviation"),
    ({"anchor": "middle"}, r"anchor"),
    ({"check_layer": 0}, r"check_layer"),
    ({"chunks": ((5, 3),)}, r"chunks"),
    ({"chunks": ((0, 10), (5, 20))}, r"chunks"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Blend(**kwargs)


def test_no_passages_and_a_passage_at_the_end_are_refused(tiny_llama, make_ids):
    with pytest.raises(ConfigError, match="at least one passage"):
        Blend().with_chunks([])
    with pytest.raises(ConfigError, match="question after the last passage"):
        generate(tiny_llama, None, make_ids(20, 1), Blend().with_chunks([(2, 20)]), max_new_tokens=2)
    with pytest.raises(ConfigError, match="check_layer must be below"):
        generate(tiny_llama, None, make_ids(20, 1), Blend(check_layer=4).with_chunks([(2, 10)]), max_new_tokens=2)
    with pytest.raises(ConfigError, match="unknown method"):
        make_method("blender")


def test_chunk_store_keys_bound_and_persistence(tiny_llama, tmp_path):
    store = ChunkStore(1 << 20)
    kv = torch.randn(2, 4, 2, 5, 16)  # (2, L, H_kv, n, d) of the tiny llama
    anchor = anchor_digest([1, 2, 3])
    assert store.put_chunk(tiny_llama, [7] * 5, anchor, ChunkEntry(kv, 3))
    assert not store.put_chunk(tiny_llama, [7] * 5, anchor, ChunkEntry(kv, 3))  # held: only refreshed
    got = store.get_chunk(tiny_llama, [7] * 5, anchor)
    assert got is not None and got.start == 3 and torch.equal(got.kv, kv)
    assert store.get_chunk(tiny_llama, [7] * 5, b"") is None  # another anchor is another chunk
    assert store.get_chunk(tiny_llama, [7] * 4, anchor) is None
    assert (store.chunk_stats.hits, store.chunk_stats.misses, store.num_chunks) == (1, 2, 1)
    store.save(tmp_path)
    loaded = ChunkStore(1 << 20)
    assert loaded.load(tmp_path, tiny_llama) == 16  # counted in prefix blocks' tokens
    again = loaded.get_chunk(tiny_llama, [7] * 5, anchor)
    assert again is not None and again.start == 3 and torch.equal(again.kv, kv)
    small = ChunkStore(2 * kv.numel() * kv.element_size() + 1, block_tokens=4)  # two chunks fit, not three
    for token in range(3):
        small.put_chunk(tiny_llama, [token] * 5, b"", ChunkEntry(kv, 0))
    assert small.num_chunks == 2 and small.get_chunk(tiny_llama, [0] * 5, b"") is None  # least recent evicted
    with pytest.raises(ValueError, match="chunk of 4 tokens"):
        store.put_chunk(tiny_llama, [1] * 4, b"", ChunkEntry(kv, 0))
