"""Exact prefix caching: the block index, LRU eviction under a byte bound, persistence, and each
method over a cached prefix against its reference (full prefill's logits, transformers'
``generate``, a masked reference for LazyLLM, counted token-layers)."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch

from fastprefill.cache import Block, BlockIndex, PositionKVCache, block_keys
from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.baselines import RandomDrop
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction.prefix import KVPrefix
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.runahead import KVRunahead
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.attention import _suffix_causal_sdpa, causal_mask
from fastprefill.models.random import random_model
from fastprefill.prefix_cache import PrefixCache, PrefixCacheError

MB = 1 << 20


def _shared(make_ids, base: torch.Tensor, keep: int, total: int, seed: int) -> torch.Tensor:
    """``base[:, :keep]`` followed by fresh tokens up to ``total``."""
    return torch.cat([base[:, :keep], make_ids(total - keep, seed)], dim=1)


# --------------------------------------------------------------------------- exactness (tiny models)
@pytest.mark.parametrize("prefix", [1, 5, 16, 30])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_suffix_attention_equals_the_masked_reference(prefix, heads):
    """A suffix of 16 queries over ``prefix`` cached keys, padded-causal (short prefix) or
    lower-right masked (long prefix), with and without grouped heads: the explicitly masked SDPA;
    given a forward's memo, the mask is built once and reused."""
    h_q, h_kv = heads
    g = torch.Generator().manual_seed(prefix)
    q = torch.randn(1, h_q, 16, 8, generator=g)
    k, v = (torch.randn(1, h_kv, prefix + 16, 8, generator=g) for _ in range(2))
    pos = torch.arange(prefix + 16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(h_q // h_kv, 1), v.repeat_interleave(h_q // h_kv, 1),
        attn_mask=causal_mask(pos[prefix:], pos),
    ).transpose(1, 2)
    torch.testing.assert_close(_suffix_causal_sdpa(q, k, v, None), ref, atol=1e-6, rtol=0)
    memo: dict = {}
    for _ in range(2):  # two layers of one forward
        torch.testing.assert_close(_suffix_causal_sdpa(q, k, v, None, memo), ref, atol=1e-6, rtol=0)
    assert list(memo) == ([] if prefix < 16 else [(16, prefix + 16)])


@pytest.mark.parametrize(("share", "expect_hit"), [(0, 0), (10, 8), (28, 24), (47, 40), (48, 47), (60, 47)])
def test_full_prefill_over_a_cached_prefix_is_exact(tiny_model_any_dtype, share, expect_hit, make_ids):
    """Prompts of 48 tokens sharing 0, 10 (a short hit: the suffix runs with padded causal
    attention), 28 (the shared part ends mid-block: the hit is its 3 whole blocks), 47 or all 48 tokens with a cached 48-token prompt, or being a strict prefix of a cached
    64-token one (``share=60``): the logits equal full prefill's, the tokens transformers'
    ``generate``, and only the uncached part is computed (at least the last token). In float32
    and in bfloat16 (the cache holds K/V in the model's dtype)."""
    tiny_model = tiny_model_any_dtype
    cache = PrefixCache(64 * MB, block_tokens=8)
    first = make_ids(64 if share == 60 else 48, 1)
    generate(tiny_model, None, first, max_new_tokens=1, prefix_cache=cache)
    prompt = first[:, :48] if share == 60 else _shared(make_ids, first, share, 48, 2)
    with torch.inference_mode():
        ref = FullPrefill().prefill(tiny_model, prompt).logits
        hit = cache.lookup(tiny_model, prompt)
        got = FullPrefill().prefill(tiny_model, prompt, hit.cache).logits
    assert hit.tokens == expect_hit
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    res = generate(tiny_model, None, prompt, max_new_tokens=8, stop_at_eos=False, prefix_cache=cache)
    hf = tiny_model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 48:].tolist()
    assert res.token_ids == hf
    assert res.timing.cached_tokens == expect_hit
    assert res.timing.prefix_cache == ("hit" if expect_hit else "miss")
    assert res.timing.stats.token_layers == (48 - expect_hit) * 4 and res.timing.stats.total_token_layers == 48 * 4


def test_generated_tokens_are_cached_for_the_next_turn(tiny_llama, make_ids):
    """Full prefill's decoding is exact too: the next turn (prompt + answer + more) hits past the prompt."""
    cache = PrefixCache(64 * MB, block_tokens=4)
    prompt = make_ids(21, 3)
    first = generate(tiny_llama, None, prompt, max_new_tokens=12, stop_at_eos=False, prefix_cache=cache)
    assert first.timing.stored_tokens == 32  # 21 + 11 fed tokens = 32 whole blocks of 4
    follow = torch.cat([prompt, torch.tensor([first.token_ids]), make_ids(5, 4)], dim=1)  # 21 + 12 + 5
    res = generate(tiny_llama, None, follow, max_new_tokens=6, stop_at_eos=False, prefix_cache=cache)
    assert res.timing.cached_tokens == 32
    plain = generate(tiny_llama, None, follow, max_new_tokens=6, stop_at_eos=False)
    assert res.token_ids == plain.token_ids


def _reference_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's ``(K, V)`` ``(H_kv, T, d)`` of a whole prefill of ``ids`` by the model's own forward."""
    with torch.inference_mode():
        past = model(ids, use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in past.layers]


def _blocks_equal_reference(cache: PrefixCache, model, ids: torch.Tensor) -> int:
    """Check that every cached block is a whole block of ``ids`` (in order from the start) whose K/V
    is the whole prefill's; returns the tokens they cover."""
    ref = _reference_kv(model, ids)
    with cache._lock:
        blocks = [block for _, block in cache._index.items()]
    b = cache.block_tokens
    covered = 0
    for i in range(len(blocks)):  # the chain from the root: block i holds tokens [i*b, (i+1)*b)
        block = next(blk for blk in blocks if blk.tokens == tuple(ids[0, i * b:(i + 1) * b].tolist()))
        assert block.kv.shape[3] == b == len(block.tokens)
        for layer, (k, v) in enumerate(ref):
            torch.testing.assert_close(block.kv[0, layer], k[:, i * b:(i + 1) * b], atol=1e-5, rtol=0)
            torch.testing.assert_close(block.kv[1, layer], v[:, i * b:(i + 1) * b], atol=1e-5, rtol=0)
        covered += b
    return covered


@pytest.mark.parametrize("chunk", [None, 20])
def test_a_prompts_blocks_are_visible_once_its_prefill_reaches_them(tiny_llama, make_ids, chunk):
    """The blocks of each chunk of prefill (of 20 tokens) are in the cache as soon as the chunk is
    done, the last unit's (or the whole prefill's) once the first token is out, before any decode
    step: a follow-up over the same prompt then hits, and its tokens are the uncached ones
    (float32); the first answer is unchanged and stores only its fed tokens at the end."""
    from fastprefill.engine import Generation

    cache = PrefixCache(64 * MB, block_tokens=8)
    prompt = make_ids(45, 21)
    gen = Generation(tiny_llama, None, prompt, FullPrefill(), 6, stop_at_eos=False, prefix_cache=cache)
    seen = []
    while not gen.prefilled:
        gen.prefill(chunk)
        seen.append(cache.held_tokens)
    assert seen == ([0] if chunk is None else [16, 40, 40])  # whole blocks of 20, 40 tokens; the last unit's:
    tokens = [e.token_id for e in gen.first_events()]
    gen.publish()  # once the first token is out
    assert _blocks_equal_reference(cache, tiny_llama, prompt) == 40
    follow = torch.cat([prompt, make_ids(7, 22)], dim=1)
    hit = generate(tiny_llama, None, follow, max_new_tokens=6, stop_at_eos=False, prefix_cache=cache)
    assert hit.timing.cached_tokens == 40 and cache.stats.hits == 1
    assert hit.token_ids == generate(tiny_llama, None, follow, max_new_tokens=6, stop_at_eos=False).token_ids
    while not gen.finished:
        events = gen.step()
        tokens += [e.token_id for e in events]
    assert tokens == generate(tiny_llama, None, prompt, max_new_tokens=6, stop_at_eos=False).token_ids
    assert events[-1].timing.stored_tokens == 48  # 40 at prefill, then the block completed by fed tokens


def test_a_cancelled_prefill_leaves_only_the_whole_checked_blocks_it_finished(tiny_llama, make_ids):
    """Closed after its first chunk of 21 tokens (of 60): the cache holds the two whole blocks of
    that chunk, each equal to a whole prefill's K/V, and nothing of the rest; a bad store
    (a cache shorter than its tokens, an out-of-range count) is refused and stores nothing."""
    from fastprefill.engine import Generation

    cache = PrefixCache(64 * MB, block_tokens=8)
    prompt = make_ids(60, 23)
    gen = Generation(tiny_llama, None, prompt, FullPrefill(), 6, prefix_cache=cache)
    gen.prefill(21)
    gen.close()
    assert cache.num_blocks == 2 and cache.held_tokens == 16
    assert _blocks_equal_reference(cache, tiny_llama, prompt) == 16
    with torch.inference_mode():
        short = FullPrefill().prefill(tiny_llama, prompt[:, :30]).cache
    before = (cache.num_blocks, cache.nbytes, cache.stats.stored_tokens)
    for ids, exact, words in ((prompt[0].tolist(), 60, "no single sequence of 56 positions"),
                              (prompt[0, :30].tolist(), 31, "exact_tokens"),
                              (prompt[0, :30].tolist(), -1, "exact_tokens"),
                              (prompt[0, :30].tolist(), 2.5, "exact_tokens")):
        with pytest.raises(ValueError, match=words):
            cache.store(tiny_llama, ids, short, exact)
    assert (cache.num_blocks, cache.nbytes, cache.stats.stored_tokens) == before


def _masked_lazy_reference(model, ids, p, kept, cut):
    """Every row through every layer; after layer ``cut`` a row attends only the prefix
    (positions < ``p``) and the kept rows."""
    ad = DecoderAdapter(model)
    n = int(ids.shape[1])
    pos = torch.arange(n)
    allowed = pos < p
    allowed[kept] = True
    cache = PositionKVCache(ad.num_layers)
    with torch.inference_mode(), ad.attention_scope():
        h = ad.embed(ids)
        for i in range(ad.num_layers):
            cache.stage(i, pos)
            mask = causal_mask(pos, pos)
            if i > cut:
                mask = mask & allowed[None, None, None, :]
            h = ad.layer(i, h, pos[None], cache, mask=mask)
        return ad.head(h[:, -1:])[0, -1]


def test_lazyllm_prunes_only_the_suffix_and_stores_nothing_it_pruned(tiny_model, make_ids):
    cache = PrefixCache(64 * MB, block_tokens=8)
    first = make_ids(40, 5)
    generate(tiny_model, None, first, max_new_tokens=1, prefix_cache=cache)  # full prefill stores 40
    prompt = _shared(make_ids, first, 32, 56, 6)  # 32 cached, 24 new
    lazy = LazyLLM(schedule=((1, 0.4),))
    with torch.inference_mode():
        hit = cache.lookup(tiny_model, prompt)
        run = lazy.run(tiny_model, prompt, hit.cache)
    kept = run.state.selected[0]
    assert hit.tokens == 32 and bool((kept >= 32).all())  # cached positions are context, never rows
    assert kept.numel() == 10  # ceil(0.4 * 24)
    ref = _masked_lazy_reference(tiny_model, prompt, 32, kept, cut=1)
    torch.testing.assert_close(run.output.logits, ref, atol=1e-4, rtol=0)
    assert run.output.stats.token_layers == 24 * 2 + 10 * 2 and run.output.exact_tokens == 32
    before = cache.num_blocks
    res = generate(tiny_model, None, prompt, lazy, max_new_tokens=5, stop_at_eos=False, prefix_cache=cache)
    assert res.timing.cached_tokens == 32 and res.timing.stored_tokens == 0 and cache.num_blocks == before
    # keep-all LazyLLM over the prefix is full prefill
    with torch.inference_mode():
        full = FullPrefill().prefill(tiny_model, prompt).logits
        keep_all = LazyLLM(preset="keep-all").prefill(tiny_model, prompt, cache.lookup(tiny_model, prompt).cache)
    torch.testing.assert_close(keep_all.logits, full, atol=1e-5, rtol=0)


def test_kvp_prefix_over_a_cached_prefix(tiny_model, make_ids):
    """l = L is exact (stored back); l < L predicts only the uncached rows (nothing new stored)."""
    cache = PrefixCache(64 * MB, block_tokens=8)
    first = make_ids(40, 7)
    generate(tiny_model, None, first, max_new_tokens=1, prefix_cache=cache)
    prompt = _shared(make_ids, first, 24, 44, 8)
    with torch.inference_mode():
        full = FullPrefill().prefill(tiny_model, prompt).logits
        exact = KVPrefix(layer=4).prefill(tiny_model, prompt, cache.lookup(tiny_model, prompt).cache)
        approx = KVPrefix(layer=1, tail=4).prefill(tiny_model, prompt, cache.lookup(tiny_model, prompt).cache)
    torch.testing.assert_close(exact.logits, full, atol=1e-5, rtol=0)
    assert exact.exact_tokens == 44 and exact.stats.token_layers == 20 * 4
    assert approx.exact_tokens == 24 and approx.stats.token_layers == 20 * 1 + 4 * 3
    assert float((approx.logits - full).abs().max()) > 1e-3  # the maps really stand in for layers 1..3


def test_methods_without_prefix_support_run_the_whole_prompt(tiny_llama, make_ids):
    """Random drop takes no prefix (nothing looked up, nothing stored); single-rank KV-Runahead is
    exact: it computes the whole prompt and its cache is stored."""
    cache = PrefixCache(64 * MB, block_tokens=8)
    prompt = make_ids(33, 9)
    generate(tiny_llama, None, prompt, max_new_tokens=1, prefix_cache=cache)
    res = generate(tiny_llama, None, prompt, RandomDrop(keep=0.5), max_new_tokens=3, prefix_cache=cache)
    assert res.timing.cached_tokens == 0 and res.timing.stored_tokens == 0
    assert res.timing.prefix_cache == "not used: random takes no cached prefix"
    cache.clear()
    res = generate(tiny_llama, None, prompt, KVRunahead(procs=1), max_new_tokens=3, stop_at_eos=False,
                   prefix_cache=cache)
    assert res.timing.cached_tokens == 0 and res.timing.stored_tokens == 32
    with pytest.raises(ConfigError, match="does not take a cached prefix"):
        RandomDrop(keep=0.5).prefill(tiny_llama, prompt, cache.lookup(tiny_llama, prompt).cache)


# --------------------------------------------------------------------------- index and eviction
def test_lookup_walks_blocks_and_checks_tokens(tiny_llama, make_ids):
    cache = PrefixCache(64 * MB, block_tokens=4)
    a = make_ids(16, 10)
    generate(tiny_llama, None, a, max_new_tokens=1, prefix_cache=cache)
    assert cache.num_blocks == 4
    b = a.clone()
    b[0, 9] = (int(b[0, 9]) + 1) % 128  # differs in block 2
    assert cache.lookup(tiny_llama, b).tokens == 8
    assert cache.lookup(tiny_llama, make_ids(16, 11)).tokens == 0
    assert cache.stats.lookups == 3 and cache.stats.hits == 1  # generate's own lookup missed
    assert cache.stats.hit_tokens == 8 and cache.stats.miss_tokens == 16 + 8 + 16


def test_eviction_drops_least_recently_used_leaves_under_the_bound(tiny_llama, make_ids):
    probe = PrefixCache(64 * MB, block_tokens=4)
    generate(tiny_llama, None, make_ids(8, 0), max_new_tokens=1, prefix_cache=probe)
    block = probe.nbytes // 2  # bytes of one block of this model
    cache = PrefixCache(6 * block, block_tokens=4)
    root = make_ids(8, 12)  # two blocks shared by both branches
    branch_a = torch.cat([root, make_ids(8, 13)], dim=1)
    branch_b = torch.cat([root, make_ids(8, 14)], dim=1)
    generate(tiny_llama, None, branch_a, max_new_tokens=1, prefix_cache=cache)
    generate(tiny_llama, None, branch_b, max_new_tokens=1, prefix_cache=cache)
    assert cache.num_blocks == 6 and cache.nbytes == 6 * block
    cache.lookup(tiny_llama, branch_a)  # branch a is now the more recent
    generate(tiny_llama, None, make_ids(8, 15), max_new_tokens=1, prefix_cache=cache)  # 2 more blocks: evict 2
    assert cache.nbytes <= 6 * block and cache.stats.evicted_blocks == 2
    assert cache.lookup(tiny_llama, branch_a).tokens == 15  # whole, capped at T - 1
    assert cache.lookup(tiny_llama, branch_b).tokens == 8  # its leaves went; the shared root stayed


def test_bad_bounds_and_other_models_are_refused(tiny_llama, tiny_qwen2, make_ids):
    with pytest.raises(ConfigError, match="max_bytes"):
        PrefixCache(0)
    with pytest.raises(ConfigError, match="block_tokens"):
        PrefixCache(MB, block_tokens=0)
    tiny = PrefixCache(100, block_tokens=16)
    with pytest.raises(ConfigError, match="cannot hold one block of 16 tokens"):
        generate(tiny_llama, None, make_ids(20, 0), max_new_tokens=1, prefix_cache=tiny)
    cache = PrefixCache(64 * MB)
    generate(tiny_llama, None, make_ids(20, 0), max_new_tokens=1, prefix_cache=cache)
    with pytest.raises(ConfigError, match="another model"):
        generate(tiny_qwen2, None, make_ids(20, 0), max_new_tokens=1, prefix_cache=cache)


def test_sliding_window_models_are_refused(make_ids):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ConfigError, match="sliding-window"):
        generate(model, None, make_ids(9, 0) % 64, max_new_tokens=1, prefix_cache=PrefixCache(MB))


# --------------------------------------------------------------------------- persistence
def test_save_and_load_round_trip(tmp_path, tiny_llama, make_ids):
    cache = PrefixCache(64 * MB, block_tokens=4)
    prompt = make_ids(19, 16)
    generate(tiny_llama, None, prompt, max_new_tokens=1, prefix_cache=cache)
    cache.save(tmp_path)
    again = PrefixCache(64 * MB, block_tokens=4)
    assert again.load(tmp_path, tiny_llama) == 16
    with torch.inference_mode():
        hit = again.lookup(tiny_llama, prompt)
        got = FullPrefill().prefill(tiny_llama, prompt, hit.cache).logits
        ref = FullPrefill().prefill(tiny_llama, prompt).logits
    assert hit.tokens == 16
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_corrupt_or_mismatched_files_are_refused_and_not_loaded(tmp_path, tiny_llama, make_ids):
    cache = PrefixCache(64 * MB, block_tokens=4)
    generate(tiny_llama, None, make_ids(19, 17), max_new_tokens=1, prefix_cache=cache)
    path = cache.save(tmp_path)
    other = random_model("llama", seed=1)  # same architecture, other weights
    with pytest.raises(PrefixCacheError, match="another model"):
        PrefixCache(64 * MB, block_tokens=4).load(tmp_path, other)
    with pytest.raises(PrefixCacheError, match="blocks of 4 tokens"):
        PrefixCache(64 * MB, block_tokens=8).load(tmp_path, tiny_llama)
    half = copy.deepcopy(tiny_llama).to(torch.float64)
    with pytest.raises(PrefixCacheError, match="float32"):
        PrefixCache(64 * MB, block_tokens=4).load(tmp_path, half)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = PrefixCache(64 * MB, block_tokens=4)
    with pytest.raises(PrefixCacheError, match="corrupt"):
        fresh.load(tmp_path, tiny_llama)
    assert fresh.num_blocks == 0


# --------------------------------------------------------------------------- the real model


def test_block_keys_name_the_whole_prefix():
    a = block_keys(list(range(10)), 4)
    assert [tokens for _, tokens in a] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # the partial last block has no key
    assert block_keys([*range(8), 99], 4) == a  # the same whole blocks, the same keys
    other = block_keys([99, *range(1, 8)], 4)
    assert other[1][1] == a[1][1] and other[1][0] != a[1][0]  # same tokens after another first block


def test_block_keys_are_the_digests_saved_caches_hold():
    """A key is BLAKE2b-128 of the parent's key and the tokens as int64 bytes, as a torch int64
    tensor holds them: the keys of caches saved before stay valid."""
    ids = [5, 151643, 0, 2**31 + 7, 42, 9, 13, 77]
    parent, want = b"", []
    for start in (0, 4):
        block = torch.tensor(ids[start:start + 4], dtype=torch.int64).numpy().tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        want.append(parent)
    assert [key for key, _ in block_keys(ids, 4)] == want


def test_block_index_evicts_least_recent_leaves_first_and_protected_ones_last():
    def block(tokens, parent):
        return Block(tokens, parent, torch.zeros(2, 1, 1, 4, 2))  # 64 bytes

    chain = block_keys(list(range(12)), 4)
    index = BlockIndex(max_bytes=3 * 64)
    for i, (key, tokens) in enumerate(chain):
        index.insert(key, block(tokens, chain[i - 1][0] if i else None))
    index.insert(b"lone", block((9,), None))
    index.refresh([key for key, _ in chain])  # the chain the most recent: the lone root the oldest leaf
    assert index.nbytes == 4 * 64 and index.depth(chain[2][0]) == 2
    assert index.evict() == 1 and b"lone" not in index and index.nbytes == 3 * 64
    index.max_bytes = 64
    assert index.evict(protect={chain[2][0]}) == 2  # only leaves go: the protected leaf, then its parent
    assert [key for key, _ in index.items()] == [chain[0][0]] and index.get(chain[0][0]).children == 0

