"""Sampling without a real model: :class:`SamplingParams` validation, :class:`Sampler` over a
logits row (greedy is argmax, a seed fixes the draw, the penalties follow their definitions,
log-probabilities are the raw row's), stop strings across token boundaries, and the engine's
``n`` answers from one prefill on the tiny random models, against transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch

from fastprefill.engine import generate, stream
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.registry import make_method
from fastprefill.sampling import Choice, Sampler, SamplingParams
from fastprefill.text import StopStrings

V = 50


def row(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed))  # (V,)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0), ("top_p", 1.5), ("top_k", -1),
    ("top_k", 2.0), ("min_p", 2), ("seed", 2**64), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("logit_bias", ((1, 200.0),)), ("logit_bias", ((-1, 1.0),)), ("stop", ("",)),
    ("max_tokens", 0), ("min_tokens", -1), ("ignore_eos", 1), ("logprobs", 21), ("prompt_logprobs", -1),
    ("n", 0), ("n", 17), ("n", True),
])
def test_sampling_params_refuse_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


def test_sampling_params_normalise_and_relate_fields():
    p = SamplingParams(stop="END", logit_bias={3: -100})
    assert p.stop == ("END",) and p.logit_bias == ((3, -100),) and p.greedy
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ConfigError, match="token id 60 is not in the model's vocabulary"):
        SamplingParams(logit_bias={60: 1.0}).check_vocab(V)
    assert SamplingParams(seed=5).for_choice(2).seed == 7 and SamplingParams(seed=2**64 - 1).for_choice(1).seed == 0
    assert not SamplingParams(temperature=0.5).greedy and SamplingParams(temperature=0.5, top_k=1).greedy


def test_greedy_is_argmax_and_a_seed_fixes_the_draw():
    logits = row()
    greedy = Sampler(SamplingParams(), [1, 2])
    assert greedy.processors is None and greedy.pick(logits) == (int(logits.argmax()), None)
    draws = [[Sampler(SamplingParams(temperature=1.5, seed=s), [1]).pick(logits)[0] for _ in range(2)]
             for s in (0, 0, 1)]
    assert draws[0] == draws[1]
    many = {Sampler(SamplingParams(temperature=5.0, seed=s), [1]).pick(logits)[0] for s in range(40)}
    assert len(many) > 5  # a high temperature spreads the draws
    # the draw is torch.multinomial over the softmax of the processed row, with the request's generator
    torch.manual_seed(3)
    want = int(torch.multinomial(torch.softmax(logits.reshape(1, -1) / 0.7, -1), 1))
    assert Sampler(SamplingParams(temperature=0.7, seed=3), [1]).pick(logits)[0] == want
    # temperature 1 and nothing else runs no processor, and still draws from the model's distribution
    plain = Sampler(SamplingParams(temperature=1.0, seed=3), [1])
    torch.manual_seed(3)
    assert plain.processors is None and plain.pick(logits)[0] == int(torch.multinomial(torch.softmax(logits, -1), 1))
    assert len({Sampler(SamplingParams(temperature=1.0, seed=s), [1]).pick(logits)[0] for s in range(40)}) > 5


def test_top_k_top_p_min_p_keep_only_the_allowed_tokens():
    logits = row(1)
    order = torch.argsort(logits, descending=True).tolist()
    for s in range(30):
        assert Sampler(SamplingParams(temperature=3.0, top_k=3, seed=s), [0]).pick(logits)[0] in order[:3]
        assert Sampler(SamplingParams(temperature=3.0, top_p=1e-6, seed=s), [0]).pick(logits)[0] == order[0]
        assert Sampler(SamplingParams(temperature=3.0, min_p=1.0, seed=s), [0]).pick(logits)[0] == order[0]


def test_penalties_follow_their_definitions():
    logits = torch.zeros(V)
    logits[7], logits[8] = 1.0, 0.9
    # presence/frequency count generated tokens only: 7 in the prompt is not penalised
    s = Sampler(SamplingParams(presence_penalty=0.5), [7])
    assert s.pick(logits)[0] == 7
    assert s.pick(logits)[0] == 8  # 7 now generated once: 1.0 - 0.5 < 0.9
    f = Sampler(SamplingParams(frequency_penalty=0.2), [1])
    assert [f.pick(logits)[0] for _ in range(2)] == [7, 8]  # 1.0 - 0.2 < 0.9
    # repetition penalty covers the prompt too (transformers' and vLLM's definition)
    assert Sampler(SamplingParams(repetition_penalty=1.5), [7]).pick(logits)[0] == 8
    assert Sampler(SamplingParams(logit_bias={3: 100}), [1]).pick(logits)[0] == 3
    # min_tokens holds the end token back
    eos = torch.zeros(V)
    eos[5] = 10.0
    m = Sampler(SamplingParams(min_tokens=2), [1], eos_ids=[5])
    assert [m.pick(eos)[0] for _ in range(3)] == [0, 0, 5]


def test_logprobs_are_those_of_the_unprocessed_row():
    logits = row(2)
    token, entry = Sampler(SamplingParams(temperature=0.3, top_k=2, repetition_penalty=1.3, logprobs=3, seed=0),
                           [int(logits.argmax())]).pick(logits)
    raw = torch.log_softmax(logits, -1)
    assert entry.token_id == token and entry.logprob == pytest.approx(float(raw[token]))
    best = torch.topk(raw, 3)
    assert [t for t, _ in entry.top] == best.indices.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist())
    assert Sampler(SamplingParams(logprobs=0), [1]).pick(logits)[1].top == ()


def test_stop_strings_are_found_across_deltas_and_never_streamed():
    st = StopStrings(("END", "\n\n"))
    assert st.feed("Hello E") == "Hello "  # "E" may start "END"
    assert st.feed("x") == "Ex"
    assert st.feed(" wor") == " wor"
    assert st.feed("ld\n") == "ld"
    assert st.feed("\nrest") == "" and st.hit and st.matched == "\n\n"
    assert st.cut("Hello Ex world\n\nrest") == "Hello Ex world"
    split = StopStrings(("STOP",))
    assert [split.feed(d) for d in ("aS", "T", "O", "Pb")] == ["a", "", "", ""] and split.stop_at == 1
    tail = StopStrings(("END",))
    assert tail.feed("abcEN") == "abc" and tail.flush() == "EN" and not tail.hit
    assert StopStrings(()).feed("anything") == "anything"
    unarmed = StopStrings(("ab",))
    assert unarmed.feed("xab", armed=False) == "xab" and not unarmed.hit
    assert unarmed.feed("cab") == "c" and unarmed.stop_at == 4


class _Chars:
    """A tokenizer whose token ``i`` is the character ``chr(97 + i)``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def test_choice_ends_on_a_stop_string_spread_over_tokens_with_the_text_cut():
    one_hot = [torch.nn.functional.one_hot(torch.tensor(i), V).float() for i in range(V)]
    c = Choice(SamplingParams(stop=("cd",)), 0, [0], eos_ids=[], budget=10, tokenizer=_Chars())
    texts = []
    for tid in (0, 1, 2, 3, 4):  # a b c d e
        texts.append(c.push(c.pick(one_hot[tid])))
        if c.finish_reason:
            break
    assert texts == ["a", "b", "", ""] and c.finish_reason == "stop" and c.ids == [0, 1, 2, 3]
    assert c.text("abcd") == "ab"
    # before min_tokens a stop string does not end the answer: "b" of the first two tokens is kept
    held = Choice(SamplingParams(stop=("b",), min_tokens=2), 0, [0], eos_ids=[], budget=10, tokenizer=_Chars())
    assert [held.push(held.pick(one_hot[i])) for i in (0, 1, 2, 1)] == ["a", "b", "c", ""]
    assert held.finish_reason == "stop" and held.text("abcb") == "abc"
    short = Choice(SamplingParams(), 0, [0], eos_ids=[], budget=2, tokenizer=_Chars())
    assert [short.push(short.pick(one_hot[i])) for i in (0, 1)] == ["a", "b"] and short.finish_reason == "length"


def test_greedy_engine_is_transformers_greedy_generate(tiny_model, make_ids):
    ids = make_ids(24, 5)
    res = generate(tiny_model, None, ids, FullPrefill(), 8, stop_at_eos=False, sampling=SamplingParams())
    hf = tiny_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert res.token_ids == hf[0, 24:].tolist()


@pytest.mark.parametrize("kw", [{"temperature": 0.9, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.2},
                                {"temperature": 1.0, "top_k": 0}], ids=["processed", "plain"])
def test_seeded_sampling_is_transformers_sampling_and_reproducible(tiny_model, make_ids, kw):
    """The same processors in the same order, and the same draw: ``generate(do_sample=True)``
    after ``torch.manual_seed(seed)`` (``top_k=0``: off in both, not transformers' default 50)."""
    ids = make_ids(24, 5)
    params = SamplingParams(seed=11, min_tokens=8, **kw)
    res = generate(tiny_model, None, ids, FullPrefill(), 8, sampling=params)
    torch.manual_seed(11)
    hf = tiny_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=True, **kw)
    assert res.token_ids == hf[0, 24:].tolist()
    assert generate(tiny_model, None, ids, FullPrefill(), 8, sampling=params).token_ids == res.token_ids
    other = generate(tiny_model, None, ids, FullPrefill(), 8, sampling=SamplingParams(seed=12, min_tokens=8, **kw))
    assert other.token_ids != res.token_ids  # the seed decides the draw


def test_n_answers_share_one_prefill(tiny_llama, make_ids, monkeypatch):
    ids = make_ids(20, 3)
    calls = []
    method = FullPrefill()
    real = FullPrefill.prefill
    monkeypatch.setattr(FullPrefill, "prefill", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    params = SamplingParams(temperature=1.0, seed=4, n=3, logprobs=1)
    res = generate(tiny_llama, None, ids, method, 6, stop_at_eos=False, sampling=params)
    assert len(calls) == 1 and len(res.answers) == 3
    assert res.timing.prompt_tokens == 20 and res.timing.new_tokens == 18
    # answer i is the one-answer request with seed + i: the forked caches decode independently
    for i, answer in enumerate(res.answers):
        alone = generate(tiny_llama, None, ids, method, 6, stop_at_eos=False,
                         sampling=SamplingParams(temperature=1.0, seed=4 + i))
        assert answer.token_ids == alone.token_ids and len(answer.logprobs) == 6
    assert len({tuple(a.token_ids) for a in res.answers}) == 3  # temperature 1 samples: the answers differ
    events = list(stream(tiny_llama, None, ids, method, 2, stop_at_eos=False, sampling=SamplingParams(n=2)))
    assert [(e.choice, e.index) for e in events] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [e.finish_reason for e in events] == [None, None, "length", "length"] and events[-1].timing is not None


@pytest.mark.parametrize("spec", ["full", "lazyllm:preset=default,revival=none", "random:keep=0.5"])
def test_each_of_n_answers_is_the_one_answer_request_with_its_seed(tiny_llama, make_ids, spec):
    """Over every kind of cache a method leaves (whole, ragged, pruned), the forked copies decode
    independently: answer ``i`` is what a request with ``seed + i`` alone gives."""
    ids = make_ids(40, 6)
    res = generate(tiny_llama, None, ids, make_method(spec), 6, sampling=SamplingParams(temperature=1.0, seed=21, n=3))
    alone = [generate(tiny_llama, None, ids, make_method(spec), 6,
                      sampling=SamplingParams(temperature=1.0, seed=21 + i)).token_ids for i in range(3)]
    assert [a.token_ids for a in res.answers] == alone
    assert len({tuple(a) for a in alone}) > 1  # the seeds differ, and so do the answers


def test_n_answers_are_refused_before_the_prefill_of_a_method_that_decodes_itself(tiny_llama, make_ids,
                                                                                  monkeypatch):
    ids = make_ids(40, 7)
    revival = make_method("lazyllm:preset=default,revival=all")
    assert revival.prefill(tiny_llama, ids).decoder is not None and revival.own_decoder(tiny_llama)
    plain = make_method("lazyllm:preset=default,revival=none")
    assert plain.prefill(tiny_llama, ids).decoder is None and not plain.own_decoder(tiny_llama)
    assert not FullPrefill().own_decoder(tiny_llama)
    monkeypatch.setattr(LazyLLM, "run", lambda *a, **k: pytest.fail("the prefill ran"))
    with pytest.raises(ConfigError, match="n=2: several answers"):
        generate(tiny_llama, None, ids, revival, 3, sampling=SamplingParams(n=2))
