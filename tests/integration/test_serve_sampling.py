"""What real clients send, through the official ``openai`` client on 127.0.0.1: sampling fields,
seeds, ``n`` from one prefill, log-probabilities (chat) and ``echo`` with ``logprobs``
(completions, the prompt's tokens included), vLLM's extensions (``ignore_eos``, ``min_tokens``,
``stream_options.continuous_usage_stats``). Each answer is compared with the engine's on the
same settings."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from fastprefill.engine import generate
from fastprefill.methods.full import FullPrefill
from fastprefill.sampling import SamplingParams
from fastprefill.serve import ServeConfig, background, create_app
from tests.integration.serving import MODEL, is_idle, metric_value, openai_client, user_messages, wait_health

PROMPT = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[str]:
    model, tok = smollm2
    with background(create_app(model, tok, ServeConfig(MODEL, queue_size=8, timeout_s=600, prefix_cache_mb=0))) as url:
        yield url


@pytest.fixture
def client(served) -> openai.OpenAI:
    wait_health(served, is_idle)
    return openai_client(served)


@pytest.mark.integration
def test_seeded_chat_is_reproducible_and_the_engines(client, smollm2):
    model, tok = smollm2
    kw = {"temperature": 0.9, "top_p": 0.9, "seed": 5, "presence_penalty": 0.4, "frequency_penalty": 0.2}
    extra = {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1}
    answers = [client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=10,
                                              extra_body=extra, **kw).choices[0].message.content for _ in range(2)]
    ref = generate(model, tok, PROMPT, FullPrefill(), 10, chat=True, sampling=SamplingParams(**kw, **extra))
    assert answers == [ref.text, ref.text]


@pytest.mark.integration
def test_logit_bias_reaches_the_sampler(client, smollm2):
    tok = smollm2[1]
    sea = tok(" sea")["input_ids"][-1]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices[0].text
    biased = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logit_bias={str(sea): 100})
    assert plain != tok.decode([sea] * 3) and biased.choices[0].text == tok.decode([sea] * 3)


@pytest.mark.integration
def test_n_answers_count_the_prompt_once(client, served, smollm2):
    model, tok = smollm2
    ttfts = metric_value(served, "fastprefill_ttft_seconds_count")
    r = client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=6, n=3,
                                       temperature=1.0, seed=9)
    one = client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    ref = generate(model, tok, PROMPT, FullPrefill(), 6, chat=True, sampling=SamplingParams(temperature=1.0, seed=9, n=3))
    assert [c.message.content for c in r.choices] == [a.text for a in ref.answers]
    assert r.usage.completion_tokens == sum(len(a.token_ids) for a in ref.answers)
    assert metric_value(served, "fastprefill_ttft_seconds_count") - ttfts == 2  # one prefill per request
    chunks = list(client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=6, n=2,
                                                 temperature=1.0, seed=9, stream=True))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == ref.answers[i].text
    assert {c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason} == {
        a.finish_reason for a in ref.answers[:2]}


@pytest.mark.integration
def test_chat_logprobs_are_the_engines(client, smollm2):
    model, tok = smollm2
    r = client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=5, logprobs=True,
                                       top_logprobs=2)
    ref = generate(model, tok, PROMPT, FullPrefill(), 5, chat=True, sampling=SamplingParams(logprobs=2))
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in ref.token_ids]
    for got, want in zip(content, ref.answers[0].logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-5)
        assert got.top_logprobs[0].logprob >= got.logprob  # greedy: the token is the best one
    chunks = list(client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=5,
                                                 logprobs=True, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)


@pytest.mark.integration
def test_completions_echo_with_logprobs_scores_the_prompt(client, smollm2):
    """lm-eval's ``local-completions`` log-likelihood request: token ids, ``echo``, ``logprobs=1``,
    ``max_tokens=1``, temperature 0."""
    model, tok = smollm2
    ids = tok("The capital of France is Paris")["input_ids"]
    r = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0,
                                  seed=1234)
    lp = r.choices[0].logprobs
    ref = generate(model, tok, ids, FullPrefill(), 1, sampling=SamplingParams(logprobs=1, prompt_logprobs=1))
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    want = [None] + [e.logprob for e in ref.prompt_logprobs[1:]] + [ref.answers[0].logprobs[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-5)
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    assert r.choices[0].text == tok.decode(ids) + ref.text
    assert all(tok_lp <= max(top.values()) + 1e-6 for tok_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:],
                                                                          strict=True))
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.integration
def test_streamed_echo_logprobs_add_up_to_the_whole_answers(client, smollm2):
    """A stream's ``logprobs`` lists, joined, are the non-streamed ones: the prompt's first, then
    each token's, with ``text_offset`` counting on from the echoed prompt."""
    model_ids = smollm2[1]("The capital of France is")["input_ids"]
    body = {"model": MODEL, "prompt": [model_ids], "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0}
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in joined:
            joined[key] += getattr(c.logprobs, key) if c.logprobs else []
    lp = whole.logprobs
    assert len(lp.tokens) == len(model_ids) + 4 and joined["tokens"] == lp.tokens
    assert joined["text_offset"] == lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert joined["token_logprobs"][0] is None and joined["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:])
    assert "".join(c.text for c in chunks) == whole.text


@pytest.mark.integration
def test_n_answers_with_a_method_that_decodes_itself_are_refused_before_any_work(client, served):
    ttfts = metric_value(served, "fastprefill_ttft_seconds_count")
    revival = {"fastprefill": {"method": "lazyllm:preset=default,revival=all"}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="n=2: several answers") as info:
            client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=3, n=2,
                                           stream=stream, extra_body=revival)
        assert info.value.status_code == 400
    assert metric_value(served, "fastprefill_ttft_seconds_count") == ttfts  # no prefill ran
    one = client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=3, extra_body=revival)
    assert "revival=all" in one.usage.fastprefill["method"]


@pytest.mark.integration
def test_load_generator_extensions_are_honoured(client, smollm2):
    """guidellm's defaults: ``ignore_eos``, ``min_tokens`` and continuous usage in a stream, on
    prompts whose greedy answers end on their own well before ``max_tokens``."""
    model, tok = smollm2
    ended = generate(model, tok, "Say OK.", FullPrefill(), 24)
    assert ended.answers[0].finish_reason == "stop" and len(ended.token_ids) < 24
    chunks = list(client.completions.create(
        model=MODEL, prompt="Say OK.", max_tokens=24, stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    with_text = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_text)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in with_text if c.choices[0].finish_reason] == ["length"]
    assert "".join(c.choices[0].text for c in with_text).startswith(ended.text)
    assert len(generate(model, tok, "Hi", FullPrefill(), 24, chat=True).token_ids) < 12
    ref = generate(model, tok, "Hi", FullPrefill(), 24, chat=True, sampling=SamplingParams(min_tokens=12))
    r = client.chat.completions.create(model=MODEL, messages=user_messages("Hi"), max_tokens=24,
                                       extra_body={"min_tokens": 12})
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids) > 12


@pytest.mark.integration
def test_concurrent_seeded_requests_decode_in_one_batch_and_keep_their_answers(client, served, smollm2):
    """Three seeded requests (one with n=2) sent at once are admitted together and decode as rows
    of one batch (the decode-batch histogram sees steps of more than one row); each answer is
    the engine's alone."""
    from concurrent.futures import ThreadPoolExecutor

    model, tok = smollm2
    asks = [("Name a colour.", 0.8, 1, 1), ("Write one sentence about the sea.", 1.1, 7, 2), ("Count to five.", 0.6, 3, 1)]

    def shared_steps() -> float:  # decode steps that ran more than one stream
        return (metric_value(served, "fastprefill_decode_batch_size_count")
                - metric_value(served, "fastprefill_decode_batch_size_bucket", le="1.0"))

    before = shared_steps()

    def ask(a):
        prompt, temperature, seed, n = a
        r = client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_tokens=12, n=n,
                                           temperature=temperature, seed=seed, extra_body={"ignore_eos": True})
        return [c.message.content for c in r.choices]

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, asks))
    want = [[a.text for a in generate(model, tok, p, FullPrefill(), 12, chat=True,
                                      sampling=SamplingParams(temperature=t, seed=s, n=n, ignore_eos=True)).answers]
            for p, t, s, n in asks]
    assert got == want
    assert shared_steps() > before
