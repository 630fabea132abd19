"""Blending on the real SmolLM2-135M: the per-model check that moved keys are the keys computed
at the new position, a lone first passage without recompute is the prefix itself, recomputing
everything is full prefill, and reordered cached passages are reused through the engine."""

from __future__ import annotations

import pytest
import torch

from fastprefill.bench.records import FULL
from fastprefill.bench.runner import PromptSample, Unscored, run_samples
from fastprefill.chunk_store import ChunkStore
from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.research.blend import Blend
from fastprefill.prompt import ChunkedPrompt, Passage
from research.seams import SeamPrompt, SeamRecorder
from tests.blend_helpers import key_shift_error

MB = 1 << 20
PASSAGES = [
    "The Rhine rises in the Swiss Alps and flows north through Germany to the North Sea at Rotterdam.",
    "Mount Kilimanjaro, in Tanzania, is the highest mountain in Africa and a dormant volcano.",
    "The Danube flows east from the Black Forest through ten countries into the Black Sea.",
]


def _prompt(tok, order, question="Where does the Danube end?"):
    parts: list[str] = ["Answer from the passages.\n"]
    for i in order:
        parts += ["\nPassage:\n", Passage(PASSAGES[i])]
    return ChunkedPrompt.from_parts(tok, [*parts, f"\n\nQuestion: {question}\nAnswer:"], chat=True)


def _logits(model, prompt, method):
    with torch.inference_mode():
        method = method.with_chunks(prompt.chunks)
        return method.prefill(model, torch.tensor([prompt.ids]))


@pytest.mark.parametrize("fixture", ["smollm2", "smollm2_auto"])
def test_moved_keys_are_the_keys_computed_there(request, fixture):
    model, tok = request.getfixturevalue(fixture)
    ids = torch.tensor([tok(PASSAGES[0])["input_ids"]])
    with torch.inference_mode():
        errors = key_shift_error(model, ids, 1500)
    # layer 0's keys differ only by the rotation (bfloat16: one rounding, 2^-8); deeper layers add
    # the rounding of the whole computation done at other positions
    first, every = (1e-4, 1e-3) if model.dtype == torch.float32 else (1e-2, 6e-2)
    assert len(errors) == model.config.num_hidden_layers
    assert errors[0] <= first and max(errors) <= every, errors


def test_chunked_prompt_spans_are_the_passages(smollm2):
    _, tok = smollm2
    prompt = _prompt(tok, [2, 0])
    assert [tok.decode(prompt.ids[s:e]) for s, e in prompt.chunks] == [PASSAGES[2], PASSAGES[0]]
    assert tok.decode(prompt.ids).startswith("<|im_start|>system")


def test_chunked_prompt_refuses_no_passage_and_an_empty_one(smollm2):
    _, tok = smollm2
    with pytest.raises(ConfigError, match="at least one passage"):
        ChunkedPrompt.from_parts(tok, ["Answer:", " no passages here"])
    with pytest.raises(ConfigError, match="is empty"):
        ChunkedPrompt.from_parts(tok, ["Answer:", Passage("  "), "?"])


def test_one_passage_at_the_start_without_recompute_is_the_prefix(smollm2):
    model, tok = smollm2
    ids = tok(PASSAGES[1], add_special_tokens=False)["input_ids"]
    question = tok("\nWhich country is Kilimanjaro in?", add_special_tokens=False)["input_ids"]
    prompt = ChunkedPrompt(tuple(ids + question), ((0, len(ids)),))
    store = ChunkStore(64 * MB)
    _logits(model, prompt, Blend(budget=0.0, anchor="zero", store=store))
    out = _logits(model, prompt, Blend(budget=0.0, anchor="zero", store=store))
    with torch.inference_mode():
        ref = FullPrefill().prefill(model, torch.tensor([prompt.ids])).logits
    assert out.stats.extra["chunk_hits"] == 1 and out.exact_tokens == len(ids)
    assert float((out.logits - ref).abs().max()) <= 1e-4


@pytest.mark.parametrize("policy", ["deviation", "head", "attention"])
def test_recomputing_everything_is_full_prefill(smollm2, policy):
    model, tok = smollm2
    store = ChunkStore(64 * MB)
    _logits(model, _prompt(tok, [0, 1, 2]), Blend(budget=0.0, store=store))  # cache the passages in one order
    prompt = _prompt(tok, [2, 0, 1])
    out = _logits(model, prompt, Blend(policy=policy, budget=1.0, store=store))
    with torch.inference_mode():
        ref = FullPrefill().prefill(model, torch.tensor([prompt.ids])).logits
    assert out.stats.extra["chunk_hits"] == 3 and out.stats.extra["chunk_misses"] == 0
    assert float((out.logits - ref).abs().max()) <= 1e-3


def test_reordered_passages_through_the_engine(smollm2):
    """Passages cached in one order are reused in another: no miss, every token-layer counted,
    and with a quarter recomputed the greedy answer is full prefill's on this prompt."""
    model, tok = smollm2
    store = ChunkStore(64 * MB)
    generate(model, tok, _prompt(tok, [0, 1, 2]), Blend(budget=0.0, store=store), max_new_tokens=1)
    prompt = _prompt(tok, [1, 2, 0])
    full = generate(model, tok, prompt, max_new_tokens=8)
    floor = generate(model, tok, prompt, Blend(budget=0.0, store=store), max_new_tokens=8)
    blend = generate(model, tok, prompt, Blend(budget=0.25, store=store), max_new_tokens=8)
    stats = floor.timing.stats
    assert stats.extra["chunk_hits"] == 3 and stats.extra["selected_tokens"] == 0
    assert stats.token_layers < full.timing.stats.token_layers
    assert blend.timing.stats.token_layers > stats.token_layers
    assert blend.timing.method.startswith("blend:policy=deviation,budget=0.25")
    assert blend.token_ids[0] == full.token_ids[0]


def test_the_seams_of_reordered_passages(smollm2):
    """The gate's seam record on the real model: the floor's first passage (where it was computed)
    is exact, its moved passages are off from their first token on and so is the question;
    recomputing everything gives full prefill's K/V."""
    model, tok = smollm2
    store = ChunkStore(64 * MB)
    generate(model, tok, _prompt(tok, [0, 1, 2]), Blend(budget=0.0, store=store), max_new_tokens=1)
    prompt = _prompt(tok, [1, 2, 0])
    recorder = SeamRecorder({"p": SeamPrompt(prompt.ids, prompt.chunks, (3,))})
    methods = {FULL: recorder.full(), "floor": recorder.blend("floor", budget=0.0, store=store),
               "all": recorder.blend("all", budget=1.0, store=store)}
    records = run_samples(model, tok, Unscored(), [PromptSample("p", prompt)], methods, length=None, max_new_tokens=4,
                          progress=False, on_record=recorder.annotate)
    seams = {r.method: r.extra.get("seam") for r in records}
    floor, everything = seams["floor"], seams["all"]
    assert seams[FULL] is None and floor["passage"]["moved"] == [False, True, True]
    assert sum(floor["offset"]["tokens"]) == sum(floor["passage"]["tokens"][1:])
    assert max(floor["passage"]["k"][0], floor["passage"]["v"][0]) <= 1e-3
    assert min(floor["offset"]["k"][:3] + floor["offset"]["v"][:3]) > 1e-2
    assert floor["question"]["k"] > 1e-2 and floor["layers"]["v"][0] <= 1e-5  # layer 0's values see no context
    worst = max(x for part in ("offset", "passage", "layers") for key in ("k", "v") for x in everything[part][key]
                if isinstance(x, float))
    assert worst <= 1e-3 and max(everything["question"]["k"], everything["glue"]["v"]) <= 1e-3
