"""Every method's streams decode in one batched step: full prefill, LazyLLM under each revival
policy, static pruning, random drop, GemFilter and kvp-prefix, prompts of different lengths and
budgets, in one :class:`~fastprefill.batch.DecodeBatch` (tiny models, float32 and bfloat16). Each
stream's tokens equal its tokens decoded alone (``generate``), and each step calls every decoder
layer once whatever the mix (a stream decoded outside the batch would call them again)."""

from __future__ import annotations

import pytest
import torch

from fastprefill.batch import DecodeBatch
from fastprefill.engine import Generation, generate
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method
from fastprefill.models.adapters import decoder_layers
from fastprefill.models.random import random_model

#: (method spec, prompt length, new tokens): the mixed batch; the policies' schedules cut the
#: tiny models' 4 layers.
MIXED = (
    ("full", 23, 12),
    ("lazyllm:schedule=0:0.5;1:0.25;2:0.1,revival=all", 41, 9),
    ("lazyllm:schedule=0:0.5;2:0.25,revival=budget:1", 35, 14),
    ("lazyllm:schedule=0:0.5;1:0.25,revival=none", 50, 8),
    ("lazyllm:schedule=0:0.5;2:0.3,revival=catch-up", 44, 11),
    ("static:keep=0.5,select_layer=1", 29, 10),
    ("gemfilter:keep=0.5,select_layer=1", 38, 13),
    ("random:keep=0.6", 31, 7),
    ("kvp-prefix:layer=2", 27, 12),
)


def _prefilled(model, make_ids, cases) -> list[Generation]:
    """Each case's generation over ``make_ids(n, 20 + i)``, prefilled to its first token."""
    gens = [Generation(model, None, make_ids(n, 20 + i), make_method(spec), budget, stop_at_eos=False)
            for i, (spec, n, budget) in enumerate(cases)]
    for gen in gens:
        gen.prefill(None)
        gen.first_events()
    return gens


def _alone(model, make_ids, cases) -> list[list[int]]:
    """Each case's tokens decoded alone (``generate``), over the same ids as :func:`_prefilled`."""
    return [generate(model, None, make_ids(n, 20 + i), make_method(spec), budget, stop_at_eos=False).token_ids
            for i, (spec, n, budget) in enumerate(cases)]


class _LayerCalls:
    """Counts the calls of the model's first decoder layer and of its whole forward."""

    def __init__(self, model) -> None:
        self.layer = self.forward = 0
        self._hooks = [decoder_layers(model)[0].register_forward_pre_hook(self._on_layer),
                       model.register_forward_pre_hook(self._on_forward)]

    def _on_layer(self, *_: object) -> None:
        self.layer += 1

    def _on_forward(self, *_: object) -> None:
        self.forward += 1

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def test_every_methods_streams_decode_together_with_their_tokens_alone(tiny_model_any_dtype, make_ids):
    """The mixed batch: every stream a row of every step until it ends, its tokens its own."""
    model = tiny_model_any_dtype
    want = _alone(model, make_ids, MIXED)
    gens = _prefilled(model, make_ids, MIXED)
    batch, sizes = DecodeBatch(model, max_batch=16), []
    while live := [g for g in gens if not g.finished]:
        events = batch.step(live)
        assert all(len(stepped) == 1 for stepped in events)
        sizes.append(len(batch.members))
    assert [g.choices[0].ids for g in gens] == want
    budgets = sorted(budget for _, _, budget in MIXED)
    assert sizes[0] == len(MIXED) and sizes[budgets[0] - 2] == len(MIXED) - 1  # the 7-token stream leaves after 6 steps
    assert batch.members == []
    revived = gens[1].branches[0].decoder.stats()  # LazyLLM revival=all: the batch revived its tokens
    assert revived["revived_tokens_total"] > 0


def test_each_step_calls_every_layer_once_for_the_whole_mix(tiny_llama, make_ids):
    """A stream decoded outside the batch (alone, a forward of its own) would call the first layer
    once more per step: the count is one call per step, never the model's own forward."""
    gens = _prefilled(tiny_llama, make_ids, MIXED)
    batch, calls = DecodeBatch(tiny_llama, max_batch=16), _LayerCalls(tiny_llama)
    try:
        steps = 0
        while len(live := [g for g in gens if not g.finished]) > 1:
            before = calls.layer
            batch.step(live)
            steps += 1
            assert calls.layer == before + 1, f"step {steps}: {calls.layer - before} calls of layer 0 for {len(live)} streams"
        assert calls.forward == 0  # and no stream ran the model's own forward beside the batch
        before = calls.layer
        batch.step(live)  # the last stream (LazyLLM's own step), alone
        assert calls.layer == before + 1 and batch.members == []
    finally:
        calls.remove()


def test_a_pruned_stream_joining_and_leaving_keeps_every_answer(tiny_qwen2, make_ids):
    """LazyLLM (revival=all) joins a running batch of full prefill and static pruning, the full
    stream leaves first; every stream's tokens are its own, and a batch capped below the streams
    decodes the rest alone, in the same step."""
    cases = (MIXED[0], MIXED[5], MIXED[1])
    want = _alone(tiny_qwen2, make_ids, cases)
    full, static, lazy = _prefilled(tiny_qwen2, make_ids, cases)
    batch = DecodeBatch(tiny_qwen2, max_batch=2)
    for _ in range(3):
        batch.step([full, static])
    while live := [g for g in (full, static, lazy) if not g.finished]:
        batch.step(live)
        assert len(batch.members) <= 2
    assert [g.choices[0].ids for g in (full, static, lazy)] == want


def test_answers_of_one_pruned_request_decode_as_rows_of_the_batch(tiny_llama, make_ids):
    """``n`` answers of a static-pruning request (the model's forward over copies of its ragged
    cache) are rows of the batch beside a LazyLLM stream, each answer its own alone."""
    from fastprefill.sampling import SamplingParams

    ids, params = make_ids(33, 5), SamplingParams(temperature=1.0, seed=3, n=3)
    static = make_method("static:keep=0.5,select_layer=1")
    want = [a.token_ids for a in generate(tiny_llama, None, ids, static, 8, stop_at_eos=False, sampling=params).answers]
    gen = Generation(tiny_llama, None, ids, static, 8, stop_at_eos=False, sampling=params)
    (lazy,) = _prefilled(tiny_llama, make_ids, (MIXED[4],))
    gen.prefill(None)
    gen.first_events()
    batch, widest = DecodeBatch(tiny_llama), 0
    while live := [g for g in (gen, lazy) if not g.finished]:
        batch.step(live)
        widest = max(widest, len(batch.members))
    assert [c.ids for c in gen.choices] == want and widest == 4
    assert lazy.choices[0].ids == _alone(tiny_llama, make_ids, (MIXED[4],))[0]


def test_another_family_batches_full_prefill_over_padded_rows(make_ids):
    """A model outside the layer-loop families (GPT-2) decodes full prefill's streams as padded
    rows of one forward, each stream's tokens its own."""
    model = random_model("gpt2")
    prompts = [(make_ids(n, n), budget) for n, budget in ((5, 9), (33, 4), (17, 12))]
    want = [generate(model, None, ids, FullPrefill(), budget, stop_at_eos=False).token_ids for ids, budget in prompts]
    gens = [Generation(model, None, ids, FullPrefill(), budget, stop_at_eos=False) for ids, budget in prompts]
    for gen in gens:
        gen.prefill(None)
        gen.first_events()
    batch, sizes = DecodeBatch(model), []
    while live := [g for g in gens if not g.finished]:
        batch.step(live)
        sizes.append(len(batch.members))
    assert batch.adapter is None and [g.choices[0].ids for g in gens] == want
    assert sizes[:3] == [3, 3, 2] and batch.members == []


@pytest.mark.parametrize("steps", [0, 1])
def test_a_stream_whose_steps_break_the_layer_contract_is_refused(tiny_llama, steps):
    """Steps that end before the last layer, or ask for rows past it, raise and name what was wrong."""
    from fastprefill.methods.layer_steps import Rows, run_layers
    from fastprefill.models.adapters import DecoderAdapter

    ad = DecoderAdapter(tiny_llama)
    cache = make_method("full").prefill(tiny_llama, torch.tensor([[1, 2, 3]])).cache

    def broken():
        hidden = ad.embed(torch.tensor([[4]]))
        positions = torch.tensor([3])
        rotary = ad.rotary(hidden, positions[None])
        for _ in range(ad.num_layers - 1 + 2 * steps):
            (hidden,) = yield [Rows(cache, hidden, positions, rotary)]
        return hidden

    with pytest.raises(RuntimeError, match="past the model's last layer" if steps else "ended before"):
        run_layers(ad, [broken()])
