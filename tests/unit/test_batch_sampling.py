"""Seeded sampling is a property of the request, not of how the server ran it: the same text
alone, as a row of a decode batch (with other requests and with its own ``n`` answers), after a
prefix-cache hit and on a chunked prefill (tiny models, float32, against ``generate``)."""

from __future__ import annotations

import pytest
import torch

from fastprefill.batch import DecodeBatch
from fastprefill.engine import Generation, generate
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache
from fastprefill.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11, frequency_penalty=0.3, logprobs=2)


def _alone(model, ids, params: SamplingParams, budget: int) -> list[list[int]]:
    res = generate(model, None, ids, FullPrefill(), budget, stop_at_eos=False, sampling=params)
    return [a.token_ids for a in res.answers]


def _batched(model, prompts, max_batch: int = 8) -> tuple[list[list[list[int]]], int]:
    """Every prompt's answers decoded through one :class:`DecodeBatch`; the widest step's rows."""
    gens = [Generation(model, None, ids, FullPrefill(), budget, stop_at_eos=False, sampling=params)
            for ids, params, budget in prompts]
    for gen in gens:
        gen.prefill(None)
        gen.first_events()
    batch, widest = DecodeBatch(model, max_batch=max_batch), 0
    while live := [g for g in gens if not g.finished]:
        batch.step(live)
        widest = max(widest, len(batch.members))
    return [[c.ids for c in g.choices] for g in gens], widest


def test_seeded_requests_in_a_batch_give_their_text_alone(tiny_model, make_ids):
    prompts = [(make_ids(9, 1), SAMPLED, 10), (make_ids(30, 2), SamplingParams(), 7),
               (make_ids(17, 3), SamplingParams(temperature=1.3, seed=5, n=3), 8),
               (make_ids(4, 4), SamplingParams(temperature=0.7, min_p=0.1, seed=99), 12)]
    want = [_alone(tiny_model, ids, params, budget) for ids, params, budget in prompts]
    got, widest = _batched(tiny_model, prompts)
    assert got == want
    assert widest == 6  # every answer a row: 1 + 1 + 3 + 1
    assert len({tuple(a) for a in want[2]}) > 1  # the n answers differ: the test sees the seeds


def test_a_different_seed_changes_the_batched_answer(tiny_llama, make_ids):
    ids = make_ids(12, 7)
    a, _ = _batched(tiny_llama, [(ids, SamplingParams(temperature=1.0, seed=1), 12), (ids, SamplingParams(), 4)])
    b, _ = _batched(tiny_llama, [(ids, SamplingParams(temperature=1.0, seed=2), 12), (ids, SamplingParams(), 4)])
    assert a[0] != b[0] and a[1] == b[1]


@pytest.mark.parametrize("chunk", [5, 16])
def test_a_seeded_request_is_the_same_chunked_and_after_a_prefix_hit(tiny_model, make_ids, chunk):
    first = make_ids(40, 1)
    second = torch.cat([first[:, :37], make_ids(30, 2)], dim=1)
    params = SamplingParams(temperature=0.8, seed=3, n=2)
    want = _alone(tiny_model, second, params, 9)
    gen = Generation(tiny_model, None, second, FullPrefill(), 9, stop_at_eos=False, sampling=params)
    chunked = [e for e in gen.run(chunk)]
    assert [[e.token_id for e in chunked if e.choice == i] for i in range(2)] == want
    cache = PrefixCache(64 << 20, block_tokens=8)
    generate(tiny_model, None, first, FullPrefill(), 2, stop_at_eos=False, prefix_cache=cache)
    hit = generate(tiny_model, None, second, FullPrefill(), 9, stop_at_eos=False, prefix_cache=cache, sampling=params)
    assert hit.timing.cached_tokens == 32 and [a.token_ids for a in hit.answers] == want


def test_an_answer_leaving_the_batch_early_keeps_the_others_and_the_prefix_store(tiny_llama, make_ids):
    """Answers of one request that end at different steps leave the batch one by one; the first answer's K/V (stored into the prefix cache after the
    last answer) is the one its tokens were decoded over."""
    ids = make_ids(20, 5)
    params = SamplingParams(temperature=1.0, seed=8, n=3)
    cache = PrefixCache(64 << 20, block_tokens=4)
    gen = Generation(tiny_llama, None, ids, FullPrefill(), 9, stop_at_eos=False, sampling=params, prefix_cache=cache)
    gen.choices[1].budget = 3  # this answer ends after 3 tokens, the others after 9
    gen.prefill(None)
    gen.first_events()
    batch, sizes = DecodeBatch(tiny_llama), []
    while not gen.finished:
        events = batch.step([gen])
        sizes.append(len(batch.members))
    assert events[0][-1].timing is not None and sizes[0] == 3 and sizes[-1] == 0
    want = _alone(tiny_llama, ids, params, 9)
    assert gen.choices[0].ids == want[0] and gen.choices[2].ids == want[2] and gen.choices[1].ids == want[1][:3]
    follow = torch.cat([ids, torch.tensor([gen.choices[0].ids[:-1]])], dim=1)
    again = generate(tiny_llama, None, follow, FullPrefill(), 1, stop_at_eos=False, prefix_cache=cache)
    assert again.timing.cached_tokens == follow.shape[1] - 1  # all but the last token, which must run
    assert again.token_ids == generate(tiny_llama, None, follow, FullPrefill(), 1, stop_at_eos=False).token_ids
