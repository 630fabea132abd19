"""LazyLLM: equivalence with full prefill, the at-most-once invariant, Aux Cache revival,
positions/masks with non-contiguous kept tokens, schedule validation and token-layer counts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fastprefill.cache import PositionKVCache
from fastprefill.engine import decoder_for, generate
from fastprefill.errors import ConfigError, PromptError, UnsupportedModelError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import DEFAULT_PRESET, PRESETS, LazyLLM
from fastprefill.methods.pruning import (
    AttentionScorer,
    keep_count,
    resolve_depth_schedule,
    schedule_token_layers,
)
from fastprefill.methods.registry import make_method
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.attention import causal_mask


def _decode_n(method, model, ids, n):
    """Prefill then ``n`` greedy decode steps; returns (the pruned prefill and its state, generated ids)."""
    with torch.inference_mode():
        run = method.run(model, ids)
        decoder = decoder_for(model, run.output)
        tokens = [int(run.output.logits.argmax())]
        for _ in range(n):
            tokens.append(int(decoder.step(tokens[-1]).argmax()))
    return run, tokens


# --- equivalence --------------------------------------------------------------------------------
def test_keep_all_counts_every_token_layer_once_and_revives_nothing(tiny_model, make_ids):
    """Logit/token equality with full prefill is in test_method_table.py; here the counts."""
    ids = make_ids(41, 1)
    lazy = generate(tiny_model, None, ids, LazyLLM(preset="keep-all"), max_new_tokens=10, stop_at_eos=False)
    assert lazy.timing.stats.token_layers == lazy.timing.stats.total_token_layers == 41 * 4
    assert "revived_tokens_total" not in lazy.timing.extra  # nothing deferred: the model's own forward decodes


# --- the at-most-once invariant: tests/unit/test_lazyllm_revival.py (every revival policy) --------


# --- revival from the Aux Cache ----------------------------------------------------------------
@dataclass
class _ForcedLazy(LazyLLM):
    """LazyLLM that, once ``force`` is set, always selects that storage index at the pruning layer."""

    force: int = -1

    def select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        if self.force >= 0:
            scores = scores.clone()
            scores[self.force] = 1e30  # below +inf (the new token) and above every real score
        return super().select(scores, k)


def test_revival_resumes_from_aux_cache_at_the_right_layer(tiny_llama, make_ids):
    n = 16
    ids = make_ids(n, 5)
    method = _ForcedLazy(schedule=((0, 0.25), (2, 0.25)))
    with torch.inference_mode():
        out = method.run(tiny_llama, ids)
        st = out.state
        kept = set(st.selected[0].tolist())
        target = min(set(range(n - 1)) - kept)  # a token pruned after layer 0
        counts = st.counter.counts[:, target].tolist()
        assert counts == [1, 0, 0, 0]
        stored = st.aux.take(1, torch.tensor([target]))
        st.aux.put(1, torch.tensor([target]), stored)
        # the stored state is the token's layer-0 output, identical to the full model's
        full = tiny_llama(ids, output_hidden_states=True, use_cache=True)
        torch.testing.assert_close(stored[0, 0], full.hidden_states[1][0, target], atol=1e-5, rtol=0)
        method.force = target  # layer 0 stores positions in order, so storage index == position
        out.output.decoder.step(7)
    assert (0, target, 1) in st.revivals
    assert st.revived_tokens_per_step[0] >= 1
    # resumed at layer 1: layer 0 not recomputed, layers 1.. computed once (layer 2 prunes again:
    # the forced index at layer 2 is not the target, so it may stop after layer 2)
    after = st.counter.counts[:, target].tolist()
    assert after[0] == 1 and after[1] == 1 and after[2] == 1
    assert int(st.counter.counts.max()) == 1
    # its layer-1 key was computed from the stored state: equal to the full model's key at layer 1
    layer1 = st.cache.layers[1]
    row = int((layer1.positions == target).nonzero())
    torch.testing.assert_close(layer1.keys[0, :, row], full.past_key_values.layers[1].keys[0, :, target],
                               atol=1e-5, rtol=0)
    assert target not in st.aux.positions(1)


# --- positions and masks ------------------------------------------------------------------------
def test_pruned_prefill_matches_masked_reference(tiny_model, make_ids):
    """Gathered rows at original positions == all rows computed with pruned keys masked out."""
    n = 30
    ids = make_ids(n, 6)
    method = LazyLLM(schedule=((1, 0.4),))
    with torch.inference_mode():
        run = method.run(tiny_model, ids)
        out, kept = run.output, run.state.selected[0]
        assert kept.numel() == keep_count(0.4, n) and int(kept[-1]) == n - 1
        assert not torch.equal(kept, torch.arange(n - kept.numel(), n))  # non-contiguous
        ad = DecoderAdapter(tiny_model)
        cache = PositionKVCache(ad.num_layers)
        pos = torch.arange(n)
        allowed = torch.zeros(n, dtype=torch.bool)
        allowed[kept] = True
        with ad.attention_scope():
            h = ad.embed(ids)
            for i in range(ad.num_layers):
                cache.stage(i, pos)
                mask = causal_mask(pos, pos)
                if i > 1:
                    mask = mask & allowed[None, None, None, :]
                h = ad.layer(i, h, pos[None], cache, mask=mask)
            ref = ad.head(h[:, -1:])[0, -1]
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
    assert out.stats.extra["kept_per_stage"] == [kept.numel()]


# --- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        (((1, 0.0),), r"\(0, 1\]"),
        (((1, 1.5),), r"\(0, 1\]"),
        (((1, -0.2),), r"\(0, 1\]"),
        (((2, 0.5), (1, 0.4)), "strictly increasing"),
        (((1, 0.5), (1, 0.4)), "strictly increasing"),
        (((0, 0.3), (2, 0.6)), "must not grow"),
        (((-1, 0.5),), ">= 0"),
        (((1.5, 0.5),), "integer"),
        ((1, 0.5), "pairs"),
    ],
)
def test_schedule_validation(schedule, match):
    with pytest.raises(ConfigError, match=match):
        LazyLLM(schedule=schedule)


def test_validation_against_the_model(tiny_llama, make_ids):
    with pytest.raises(ConfigError, match=r"out of range.*allowed 0..2"):
        LazyLLM(schedule=((3, 0.5),)).prefill(tiny_llama, make_ids(8, 0))
    LazyLLM(schedule=((2, 0.5),)).prefill(tiny_llama, make_ids(8, 0))  # the deepest allowed layer
    with pytest.raises(PromptError, match="empty"):  # the engine validates every prompt, before prefill
        generate(tiny_llama, None, torch.zeros(1, 0, dtype=torch.long), LazyLLM(preset="keep-all"))
    with pytest.raises(ConfigError, match=r"out of range.*allowed 0..2"):  # ... and the schedule against the model
        generate(tiny_llama, None, make_ids(8, 0), LazyLLM(schedule=((3, 0.5),)))
    with pytest.raises(ConfigError, match="preset"):
        LazyLLM(preset="fastest")
    with pytest.raises(ConfigError, match="not both"):
        LazyLLM(schedule=((1, 0.5),), depth_schedule=((0.5, 0.5),))
    with pytest.raises(ConfigError, match="depth"):
        LazyLLM(depth_schedule=((1.0, 0.5),))


def test_gemma3_refused(make_ids):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="LazyLLM"):
        LazyLLM(preset="keep-all").prefill(model, make_ids(5, 0) % 64)


def test_presets_and_spec_resolve():
    assert LazyLLM(preset="balanced").resolved(30) == ((7, 0.7), (15, 0.5), (22, 0.3))
    assert PRESETS["default"] == PRESETS[DEFAULT_PRESET] and DEFAULT_PRESET != "default"
    assert LazyLLM(preset="default").describe() == f"lazyllm[{DEFAULT_PRESET}]"
    # on a 4-layer model the deeper pairs collapse onto layer 2 and keep the smaller fraction
    assert resolve_depth_schedule(((0.25, 0.7), (0.5, 0.5), (0.75, 0.3)), 4) == ((1, 0.7), (2, 0.3))
    assert make_method("lazyllm:schedule=8:0.7+16:0.5").schedule == ((8, 0.7), (16, 0.5))
    assert make_method("lazyllm:preset=gentle").preset == "gentle"
    with pytest.raises(ConfigError, match="layer:keep"):
        make_method("lazyllm:schedule=8-0.7")


# --- the cost really shrinks --------------------------------------------------------------------
def test_pruning_reduces_token_layers_by_the_expected_count(tiny_qwen2, make_ids):
    n = 40
    run, _ = _decode_n(LazyLLM(schedule=((0, 0.5), (2, 0.25))), tiny_qwen2, make_ids(n, 7), 0)
    out = run.output
    # layer 0: 40, layers 1-2: 20, layer 3: 10
    assert out.stats.token_layers == 40 + 20 + 20 + 10 == schedule_token_layers(((0, 0.5), (2, 0.25)), 4, n)
    assert out.stats.total_token_layers == 160
    assert out.stats.extra["kept_per_stage"] == [20, 10]
    assert int(run.state.counter.counts.sum()) == 90  # rows really run, not just masked
    full = FullPrefill().prefill(tiny_qwen2, make_ids(n, 7)).stats
    assert out.stats.flops < full.flops
    assert len(run.state.aux) == 20 + 10  # every pruned token is waiting in the Aux Cache


# --- the masked GQA attention path (LazyLLM decode) --------------------------------------------
def _random_attention(h_q, h_kv, t, n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h_q, t, 8, generator=g)
    k, v = torch.randn(2, 1, h_kv, n, 8, generator=g)
    mask = torch.rand(1, 1, t, n, generator=g) > 0.4
    mask[..., -1] = True
    return q, k, v, mask


@pytest.mark.parametrize("t", [1, 2, 5, 32, 40])
@pytest.mark.parametrize("h_q,h_kv", [(6, 2), (4, 1)])
def test_gqa_masked_attention_equals_transformers_sdpa(h_q, h_kv, t):
    """One query row (the new token) or several (revived rows + the new token), each with its own mask."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fastprefill.models.attention import _fastprefill_sdpa, _gqa_with_shared_mask, _packed_gqa_sdpa

    q, k, v, mask = _random_attention(h_q, h_kv, t)
    module = SimpleNamespace(num_key_value_groups=h_q // h_kv, is_causal=True, layer_idx=3)
    assert _gqa_with_shared_mask(q, k, mask)
    sink: dict = {}
    got, _ = _fastprefill_sdpa(module, q, k, v, mask, scaling=0.3, fastprefill_scores=sink,
                               fastprefill_scorer=AttentionScorer())
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert got.shape == ref.shape == (1, t, h_q, 8)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    # the packed layout (taken on CPU up to PACKED_GQA_MAX_QUERIES rows, off CPU always) gives the same
    torch.testing.assert_close(_packed_gqa_sdpa(q, k, v, mask, 0.3), ref, atol=1e-6, rtol=1e-5)
    assert sink[3].shape == (1, 11) and float(sink[3][0, ~mask[0, 0, -1]].abs().max()) == 0.0
    # no GQA (as many KV heads as query heads): transformers' own path
    assert not _gqa_with_shared_mask(q, q, mask)


@pytest.mark.parametrize("t,packed", [(1, True), (32, True), (33, False)])
def test_a_few_query_rows_read_each_kv_head_once(monkeypatch, t, packed):
    """Up to PACKED_GQA_MAX_QUERIES rows (a decode step, a short question over a cached document)
    the query heads of a KV group become rows of one head; more rows use SDPA's enable_gqa."""
    from fastprefill.models import attention

    assert attention.PACKED_GQA_MAX_QUERIES == 32
    calls = []
    real = attention._packed_gqa_sdpa
    monkeypatch.setattr(attention, "_packed_gqa_sdpa", lambda *a: calls.append(a[0].shape) or real(*a))
    q, k, v, mask = _random_attention(6, 2, t)
    out = attention._gqa_masked_sdpa(q, k, v, mask, 0.3)
    assert out.shape == (1, t, 6, 8) and bool(calls) == packed


def test_gqa_masked_attention_does_not_copy_kv_per_query_head():
    """transformers' masked path feeds SDPA keys repeated to every query head; ours never builds them."""
    from types import SimpleNamespace

    from torch.profiler import profile
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fastprefill.models.attention import _fastprefill_sdpa

    h_q, h_kv, n = 6, 2, 37
    q, k, v, mask = _random_attention(h_q, h_kv, 4, n=n)
    module = SimpleNamespace(num_key_value_groups=h_q // h_kv, is_causal=True, layer_idx=0)

    def repeated_shapes(fn) -> int:
        with profile(record_shapes=True) as prof:
            fn(module, q, k, v, mask, scaling=0.3)
        return sum(list(shape) == [1, h_q, n, 8] for ev in prof.events() for shape in ev.input_shapes)

    assert repeated_shapes(sdpa_attention_forward) > 0  # the reference copies: the check can fail
    assert repeated_shapes(_fastprefill_sdpa) == 0
