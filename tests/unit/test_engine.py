"""Engine and full-prefill reference: equality with transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from fastprefill.cache import PositionKVCache
from fastprefill.engine import generate, stream
from fastprefill.errors import ConfigError, PromptError, UnsupportedModelError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.pruning import AttentionScorer
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.attention import causal_mask
from fastprefill.prompt import prepare_request


def _hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


def test_full_prefill_equals_hf_generate_tiny(tiny_model, make_ids):
    ids = make_ids(37, 1)
    res = generate(tiny_model, None, ids, max_new_tokens=12, stop_at_eos=False)
    assert res.token_ids == _hf_greedy(tiny_model, ids, 12)
    t = res.timing
    assert t.prompt_tokens == 37 and t.new_tokens == 12
    assert t.stats.token_layers == t.stats.total_token_layers == 37 * 4
    assert t.ttft_s > 0 and t.decode_s_per_token is not None and t.stats.flops > 0


def test_layer_loop_matches_model_forward(tiny_model, make_ids):
    """The adapter's layer-by-layer run with a position cache reproduces the model's logits."""
    ids = make_ids(29, 2)
    ref = tiny_model(ids).logits[0].float()
    ad = DecoderAdapter(tiny_model)
    cache = PositionKVCache(ad.num_layers)
    pos = torch.arange(29)[None]
    with torch.inference_mode(), ad.attention_scope():
        h = ad.embed(ids)
        rot = ad.rotary(h, pos)
        scores: dict[int, torch.Tensor] = {}
        for i in range(ad.num_layers):
            cache.stage(i, pos[0])
            mask = causal_mask(pos[0], cache.key_positions_after(i, pos[0]))
            h = ad.layer(i, h, pos, cache, mask=mask, rotary=rot, scores=scores, scorer=AttentionScorer())
        logits = ad.head(h)[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    assert sorted(scores) == list(range(ad.num_layers))
    for row in scores.values():
        assert row.shape == (1, 29)
        torch.testing.assert_close(row.sum(), torch.tensor(1.0), atol=1e-5, rtol=0)
    # the exported cache lets the model decode on exactly as from its own prefill
    hf_cache = cache.to_dynamic_cache(tiny_model.config)
    nxt = torch.tensor([[5]])
    got = tiny_model(nxt, past_key_values=hf_cache).logits[0, -1]
    want = tiny_model(torch.cat([ids, nxt], 1)).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_scores_equal_eager_attention_row(tiny_llama, make_ids):
    """The captured score is the last query's eager attention row averaged over all query heads."""
    ids = make_ids(17, 3)
    eager = tiny_llama.config._attn_implementation
    try:
        tiny_llama.config._attn_implementation = "eager"
        att = tiny_llama(ids, output_attentions=True).attentions
    finally:
        tiny_llama.config._attn_implementation = eager
    ad = DecoderAdapter(tiny_llama)
    cache = PositionKVCache(ad.num_layers)
    pos = torch.arange(17)[None]
    scores: dict[int, torch.Tensor] = {}
    with torch.inference_mode(), ad.attention_scope():
        h = ad.embed(ids)
        for i in range(ad.num_layers):
            cache.stage(i, pos[0])
            h = ad.layer(i, h, pos, cache, scores=scores, scorer=AttentionScorer())
    for i in range(ad.num_layers):
        torch.testing.assert_close(scores[i][0], att[i][0, :, -1].mean(0).float(), atol=1e-5, rtol=0)
    assert tiny_llama.config._attn_implementation == eager  # scope restored


def test_stream_yields_each_token_and_final_timing(tiny_llama):
    ids = list(range(3, 20))
    events = list(stream(tiny_llama, None, ids, max_new_tokens=5, stop_at_eos=False))
    assert [e.index for e in events] == [0, 1, 2, 3, 4]
    assert all(e.timing is None for e in events[:-1]) and events[-1].timing is not None
    assert [e.token_id for e in events] == generate(tiny_llama, None, ids, max_new_tokens=5, stop_at_eos=False).token_ids


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_max_new_tokens(tiny_llama, bad):
    with pytest.raises(ConfigError, match="max_new_tokens"):
        generate(tiny_llama, None, [1, 2, 3], max_new_tokens=bad)


def test_empty_and_overlong_prompts(tiny_llama):
    with pytest.raises(PromptError, match="empty"):
        generate(tiny_llama, None, [])
    with pytest.raises(PromptError, match="context"):
        generate(tiny_llama, None, [1] * 510, max_new_tokens=8)
    with pytest.raises(PromptError, match="ids must lie"):
        generate(tiny_llama, None, [1, 500])


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (b"\xff\xfe\x00binary", "not valid UTF-8"),
        ("text with a \x00 NUL", "NUL"),
        ([1, "2", 3], "must be integers"),
        ([1, True], "must be integers"),
        (torch.tensor([[1.0, 2.0]]), "integer tensor"),
        (torch.ones(2, 3, dtype=torch.long), "shape"),
        (3.5, "text or token ids"),
        (b"   ", "empty"),
    ],
)
def test_prepare_request_refuses_bad_prompts(tiny_llama, prompt, match):
    with pytest.raises(PromptError, match=match):
        prepare_request(tiny_llama, None, prompt)[0]


def test_method_support_is_a_static_query():
    from transformers import Gemma3TextConfig, LlamaConfig

    from fastprefill.methods.lazyllm import LazyLLM

    gemma, llama = Gemma3TextConfig(), LlamaConfig()
    assert FullPrefill.supports(gemma) and FullPrefill.supports(llama)
    assert LazyLLM.supports(llama) and not LazyLLM.supports(gemma)


def test_every_cache_meets_the_layer_cache_contract(tiny_llama):
    from transformers import DynamicCache

    from fastprefill.cache import LayerCache, ReplayCache

    kv = [(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16))] * 4
    for cache in (PositionKVCache(4), ReplayCache(kv), DynamicCache(config=tiny_llama.config)):
        assert isinstance(cache, LayerCache)
    assert ReplayCache(kv).get_seq_length(3) == 5


def test_non_causal_model_refused():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32))
    with pytest.raises(UnsupportedModelError, match="causal"):
        generate(bert, None, [1, 2, 3])


def test_bad_method_type(tiny_llama):
    with pytest.raises(ConfigError, match="method"):
        generate(tiny_llama, None, [1, 2, 3], method="lazyllm")


