"""K/V storage with room (:class:`fastprefill.cache.RoomyLayer`): the same keys and values as
transformers' concatenating ``DynamicLayer`` after any sequence of updates and crops, written in
place while there is room (counted: the storage does not move), never writing a tensor a caller
handed over, and a prefix-cache hit whose suffix and decode steps append without copying the prefix."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from fastprefill.cache import ROOM_TOKENS, RoomyLayer, fork_cache, make_roomy, pad_caches, unpad_row
from fastprefill.cache.dynamic import HIT_STORAGE, StoragePool
from fastprefill.engine import generate
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache

MB = 1 << 20


def _rows(t: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 4, generator=g).to(dtype), torch.randn(1, 2, t, 4, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_updates_and_crops_hold_what_dynamic_layer_holds(dtype):
    """A prompt, decode steps, a crop, a chunk that overflows the room: after each, the keys and
    values equal ``DynamicLayer``'s; the storage moves only when the room runs out."""
    roomy, plain = RoomyLayer(), DynamicLayer()
    moves, last = 0, None
    for seed, (t, crop) in enumerate([(5, 0), (1, 0), (1, 0), (0, -2), (3, 0), (ROOM_TOKENS + 10, 0), (1, 0)]):
        if crop:
            roomy.crop(crop)
            plain.crop(crop)
        else:
            k, v = _rows(t, seed, dtype)
            got = roomy.update(k, v)
            want = plain.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            moves += roomy._kbuf.data_ptr() != last
            last = roomy._kbuf.data_ptr()
        assert torch.equal(roomy.keys, plain.keys) and torch.equal(roomy.values, plain.values)
        assert roomy.get_seq_length() == plain.get_seq_length()
    assert moves == 2  # the first update, and the chunk larger than the room left


def test_tensors_handed_over_are_never_written():
    """Keys set from outside (``make_roomy`` of a cache holding a caller's tensors, or a batch
    writing a row back) move to new storage at the next update; the caller's tensors keep their values."""
    k0, v0 = _rows(6, 0)
    keep_k, keep_v = k0.clone(), v0.clone()
    layer = DynamicLayer()
    layer.lazy_initialization(k0, v0)
    layer.keys, layer.values = k0, v0
    cache = DynamicCache()
    cache.layers = [layer]
    make_roomy(cache)
    roomy = cache.layers[0]
    assert isinstance(roomy, RoomyLayer) and roomy.keys is k0
    k1, v1 = _rows(2, 1)
    keys, _ = roomy.update(k1, v1)
    assert torch.equal(k0, keep_k) and torch.equal(v0, keep_v)
    assert torch.equal(keys, torch.cat([k0, k1], dim=-2))
    outside = keys[:, :, :4].clone()  # as unpad_row sets a row's K/V
    roomy.keys, roomy.values = outside, outside.clone()
    keys, _ = roomy.update(k1, v1)
    assert torch.equal(outside, keys[:, :, :4]) and keys.data_ptr() != outside.data_ptr()


def test_a_fork_and_a_batch_row_are_independent_of_the_original(tiny_llama):
    """``fork_cache`` (one prefill, several answers) copies the storage; a decode batch built by
    ``pad_caches`` appends in place, and writing a row back leaves the other rows' caches alone."""
    config = tiny_llama.config
    layers = config.num_hidden_layers

    def filled(t: int, seed: int) -> DynamicCache:
        cache = make_roomy(DynamicCache(config=config))
        for i in range(layers):
            cache.update(*_rows(t, seed + i), i)
        return cache

    cache = filled(5, 0)
    fork = fork_cache(cache)
    before = cache.layers[0].keys.clone()
    fork.update(*_rows(1, 99), 0)
    assert torch.equal(cache.layers[0].keys, before) and fork.layers[0].get_seq_length() == 6
    other = filled(3, 10)
    batched, pads = pad_caches(config, [cache, other])
    assert pads == [0, 2]
    ptr = batched.layers[0]._kbuf.data_ptr()
    step = torch.randn(2, 2, 1, 4)
    keys, _ = batched.update(step, step, 0)
    assert batched.layers[0]._kbuf.data_ptr() == ptr and keys.shape[2] == 6
    assert torch.equal(keys[0, :, :5], cache.layers[0].keys[0]) and torch.equal(keys[1, :, 2:5], other.layers[0].keys[0])
    for i in range(1, layers):
        batched.update(step, step, i)
    other_keys = other.layers[0].keys.clone()
    unpad_row(batched, 0, pads[0], cache)
    assert torch.equal(cache.layers[0].keys[0, :, :5], before[0]) and cache.layers[0].get_seq_length() == 6
    assert torch.equal(other.layers[0].keys, other_keys)


@pytest.fixture
def hit_setup(tiny_model, make_ids):
    model = tiny_model
    ids = make_ids(80, 3)
    pc = PrefixCache(max_bytes=64 * MB)
    generate(model, None, ids[:, :64], max_new_tokens=2, stop_at_eos=False, prefix_cache=pc)
    return model, ids, pc


def test_a_hit_appends_its_suffix_and_decode_steps_in_place(hit_setup):
    """The hit's 64 cached positions are copied once, into storage with room for the prompt's 80
    and decoding: the suffix prefill and the decode steps never move it, and the logits equal a
    prefill without the cache."""
    model, ids, pc = hit_setup
    with torch.inference_mode():
        hit = pc.lookup(model, ids)
        assert hit.tokens == 64 and all(isinstance(layer, RoomyLayer) for layer in hit.cache.layers)
        ptrs = [layer._kbuf.data_ptr() for layer in hit.cache.layers]
        out = FullPrefill().prefill(model, ids, hit.cache)
        ref = FullPrefill().prefill(model, ids)
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)
        assert [layer._kbuf.data_ptr() for layer in out.cache.layers] == ptrs
        assert out.cache.get_seq_length() == 80
    a = generate(model, None, ids, max_new_tokens=6, stop_at_eos=False, prefix_cache=pc)
    b = generate(model, None, ids, max_new_tokens=6, stop_at_eos=False)
    assert a.timing.cached_tokens == 64 and a.token_ids == b.token_ids


def test_the_hit_storage_pool_reuses_only_storage_no_tensor_uses():
    """A storage comes back only once no view of it is alive, the smallest that fits; one in use is
    never handed out twice; ``keep=0`` keeps nothing; one taken in inference mode can be written outside it."""
    pool = StoragePool(keep=2)
    shape = (2, 3, 2, 40, 4)
    with torch.inference_mode():
        a = pool.take(shape, torch.float32, "cpu")
    a[:, :, :, :5] = 1.0  # a normal tensor: written outside inference mode
    view = a[0, 1]
    b = pool.take(shape, torch.float32, "cpu")
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2 and pool.reused == 0
    del a  # the pool and `view` still hold it
    c = pool.take(shape, torch.float32, "cpu")
    assert c.data_ptr() not in (view.data_ptr() - view.storage_offset() * 4, b.data_ptr()) and pool.reused == 0
    del view, b
    small = pool.take((2, 3, 2, 30, 4), torch.float32, "cpu")  # fits in a free one, reused
    assert pool.reused == 1 and small.shape[3] >= 30 and len(pool._held) == 2
    bigger = pool.take((2, 3, 2, StoragePool.GRANULE + 1, 4), torch.float32, "cpu")  # none fits: a new one
    assert bigger.shape[3] == 2 * StoragePool.GRANULE and pool.allocated == 4
    assert pool.take((2, 3, 2, 40, 4), torch.bfloat16, "cpu").dtype == torch.bfloat16  # another dtype: new
    none = StoragePool(keep=0)
    none.take(shape, torch.float32, "cpu")
    assert none.nbytes == 0 and none.take(shape, torch.float32, "cpu") is not None and none.reused == 0


def test_hits_from_the_pool_hold_their_own_keys_while_alive(hit_setup):
    """Two hits alive at once get two storages, each holding the cached K/V as a hit without the
    pool does; once both are gone the next hit reuses one, and its logits still equal full prefill's."""
    model, ids, pc = hit_setup
    HIT_STORAGE.clear()
    allocated = HIT_STORAGE.allocated
    storage = lambda hit: hit.cache.layers[0]._kbuf.untyped_storage().data_ptr()
    with torch.inference_mode():
        first, second = pc.lookup(model, ids), pc.lookup(model, ids)
        ptrs = {storage(first), storage(second)}
        assert len(ptrs) == 2
        pc.hit_storage = None
        try:
            plain = pc.lookup(model, ids)  # a new tensor, outside the pool
        finally:
            pc.hit_storage = HIT_STORAGE
        assert HIT_STORAGE.allocated == allocated + 2
        assert storage(plain) not in ptrs
        for hit in (first, second):
            for got, want in zip(hit.cache.layers, plain.cache.layers, strict=True):
                assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        del first, second, hit
        reused = HIT_STORAGE.reused
        again = pc.lookup(model, ids)
        assert HIT_STORAGE.reused == reused + 1 and storage(again) in ptrs
        out = FullPrefill().prefill(model, ids, again.cache)
        torch.testing.assert_close(out.logits, FullPrefill().prefill(model, ids).logits, atol=1e-4, rtol=0)


def test_a_finished_generation_leaves_its_hit_storage_to_the_next_hit(hit_setup):
    """``generate`` frees a request's K/V when it returns, without waiting for Python's cycle
    collector (switched off here): the next hit reuses the storage of the one before."""
    model, ids, pc = hit_setup
    HIT_STORAGE.clear()
    gc.disable()
    try:
        first = generate(model, None, ids, max_new_tokens=3, stop_at_eos=False, prefix_cache=pc)
        reused = HIT_STORAGE.reused
        again = generate(model, None, ids, max_new_tokens=3, stop_at_eos=False, prefix_cache=pc)
    finally:
        gc.enable()
    assert first.timing.cached_tokens == 64 and again.timing.cached_tokens == 79  # the first's own blocks too
    assert HIT_STORAGE.reused == reused + 1 and again.token_ids == first.token_ids
