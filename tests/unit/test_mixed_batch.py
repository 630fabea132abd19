"""Mixed batches (:meth:`fastprefill.batch.DecodeBatch.mixed`): a chunk of a full prefill run a
layer at a time with every method's decode rows in the same layer calls. Against references: the
prompt's first-token logits and K/V against the model's own forward, its tokens and every riding
stream's tokens against ``generate`` alone (tiny models, float32 and bfloat16), and one call of
each decoder layer per mixed step (the decode step costs the chunk no pass of its own)."""

from __future__ import annotations

import pytest
import torch

from fastprefill.batch import DecodeBatch
from fastprefill.engine import Generation, generate
from fastprefill.errors import UnsupportedModelError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method
from fastprefill.models.adapters import decoder_layers
from fastprefill.models.random import random_model
from tests.unit.test_batch_methods import _alone, _LayerCalls, _prefilled

#: The riding streams (method spec, prompt length, new tokens): every kind of decode step.
RIDERS = (
    ("full", 23, 9),
    ("lazyllm:schedule=0:0.5;1:0.25;2:0.1,revival=all", 41, 7),
    ("lazyllm:schedule=0:0.5;1:0.25,revival=none", 50, 6),
    ("static:keep=0.5,select_layer=1", 29, 8),
    ("kvp-prefix:layer=2", 27, 9),
)


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_a_prompt_prefilled_in_mixed_chunks_keeps_its_answer_and_every_riders(tiny_model_any_dtype, make_ids, chunk):
    """A 61-token prompt in chunks of ``chunk``, each carrying one decode step of five streams of
    different methods: the prompt's tokens and each stream's equal their tokens alone, each mixed
    step calls the first decoder layer once, and every stream got one token per step."""
    model = tiny_model_any_dtype
    ids = make_ids(61, 3)
    want = generate(model, None, ids, FullPrefill(), 6, stop_at_eos=False)
    riders = _prefilled(model, make_ids, RIDERS)
    prompt = Generation(model, None, ids, FullPrefill(), 6, stop_at_eos=False)
    batch, calls = DecodeBatch(model, max_batch=8), _LayerCalls(model)
    try:
        units = 0
        while not prompt.prefilled:
            before, live = calls.layer, [len(g.live) for g in riders]
            ran, events = batch.mixed(riders, prompt, chunk)
            units += 1
            assert ran == min(chunk, 61 - (units - 1) * chunk) and calls.layer == before + 1
            assert [len(e) for e in events] == live  # one token for each stream still decoding
        assert calls.forward == 0  # no unit ran the model's own forward beside the layer calls
    finally:
        calls.remove()
    assert units == -(-61 // chunk) and prompt.out is not None
    assert prompt.out.stats.token_layers == want.timing.stats.token_layers
    prompt.first_events()
    while live := [g for g in (*riders, prompt) if not g.finished]:
        batch.step(live)
    assert prompt.choices[0].ids == want.token_ids
    assert [g.choices[0].ids for g in riders] == _alone(model, make_ids, RIDERS)
    tol = 1e-4 if model.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(prompt.first_logits, want.first_logits, atol=tol * 10, rtol=tol)


def test_the_mixed_prompts_kv_is_the_forwards(tiny_qwen2, make_ids):
    """float32: the K/V a prompt's mixed chunks left at every layer equal the model's own forward's."""
    ids = make_ids(45, 9)
    riders = _prefilled(tiny_qwen2, make_ids, RIDERS[:2])
    prompt = Generation(tiny_qwen2, None, ids, FullPrefill(), 2, stop_at_eos=False)
    batch = DecodeBatch(tiny_qwen2)
    while not prompt.prefilled:
        batch.mixed(riders, prompt, 10)
    ref = FullPrefill().prefill(tiny_qwen2, ids).cache
    assert prompt.out is not None
    for layer in range(len(decoder_layers(tiny_qwen2))):
        got_k, got_v = prompt.out.cache.layers[layer].keys, prompt.out.cache.layers[layer].values
        want_k, want_v = ref.layers[layer].keys, ref.layers[layer].values
        n = want_k.shape[2]
        torch.testing.assert_close(got_k[:, :, :n], want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v[:, :, :n], want_v, atol=1e-5, rtol=1e-5)


def test_a_chunk_carries_a_single_rider_and_none(tiny_llama, make_ids):
    """One riding stream (a lone decode row beside the chunk) and no rider at all: the same answers."""
    ids = make_ids(30, 4)
    want = generate(tiny_llama, None, ids, FullPrefill(), 4, stop_at_eos=False)
    (rider,) = _prefilled(tiny_llama, make_ids, RIDERS[:1])
    prompt = Generation(tiny_llama, None, ids, FullPrefill(), 4, stop_at_eos=False)
    batch = DecodeBatch(tiny_llama)
    batch.mixed([rider], prompt, 12)
    ran, events = batch.mixed([], prompt, 12)
    assert ran == 12 and events == []
    batch.mixed([rider], prompt, 12)
    prompt.first_events()
    while live := [g for g in (rider, prompt) if not g.finished]:
        batch.step(live)
    assert prompt.choices[0].ids == want.token_ids and rider.choices[0].ids == _alone(tiny_llama, make_ids, RIDERS[:1])[0]


def test_what_cannot_prefill_a_layer_at_a_time_says_so_before_running(tiny_llama, make_ids):
    """A method without a layered prefill (LazyLLM's is whole) and a model without a layer loop
    are refused with UnsupportedModelError, and nothing ran: the riders step afterwards as before."""
    (rider,) = _prefilled(tiny_llama, make_ids, RIDERS[:1])
    lazy = Generation(tiny_llama, None, make_ids(30, 5), make_method("lazyllm"), 2, stop_at_eos=False)
    with pytest.raises(UnsupportedModelError, match="lazyllm does not prefill a layer at a time"):
        DecodeBatch(tiny_llama).mixed([rider], lazy, 16)
    assert len(rider.choices[0].ids) == 1 and lazy.done_tokens == 0
    assert lazy._started is None  # its TTFT clock starts with the prefill that runs, not the refused one
    gpt2 = random_model("gpt2")
    prompt = Generation(gpt2, None, make_ids(20, 6), FullPrefill(), 2, stop_at_eos=False)
    with pytest.raises(UnsupportedModelError, match="runs no layer loop"):
        DecodeBatch(gpt2).mixed([], prompt, 8)
    assert prompt.done_tokens == 0 and prompt._started is None
