"""KV-Runahead behind the server: a warm pool of 2 ranks (smollm2-135m) through the real ``openai`` client.

Every answer is compared with :func:`fastprefill.engine.generate` with full prefill in this
process (greedy: token-identical text). Prompts are short and answers a few tokens, to stay fast.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from fastprefill.engine import generate
from fastprefill.sampling import SamplingParams
from fastprefill.serve import ServeConfig, background, create_app
from fastprefill.serve.ranks import ServedPool
from tests.integration.serving import (
    MODEL,
    http_request,
    is_idle,
    leave_mid_stream,
    metric_value,
    openai_client,
    user_messages,
    wait_health,
)

pytestmark = pytest.mark.integration

RUNAHEAD = "runahead:procs=2"
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colours are"]
N = 6


def _pool() -> ServedPool:
    return ServedPool(MODEL, 2, dtype="float32", timeout_s=60, start_method="fork")  # as the smollm2 fixture


def _app(smollm2, ranks: ServedPool, **config):
    model, tok = smollm2
    return create_app(model, tok, ServeConfig(MODEL, method=RUNAHEAD, timeout_s=120, **config), ranks)


@pytest.fixture(scope="module")
def served(smollm2):
    """A server whose default method is runahead on a warm 2-rank pool (``full`` per request runs
    in the server's process); its URL and its pool."""
    ranks = _pool()
    app = _app(smollm2, ranks)
    app.state.server.warm_up()
    with background(app) as url:
        yield url, ranks


def _full(smollm2, prompt: str, n: int = N, chat: bool = False):
    model, tok = smollm2
    return generate(model, tok, prompt, None, n, chat=chat)


@pytest.mark.timeout(300)
def test_runahead_answers_equal_full_prefill_whole_and_streamed(served, smollm2):
    url, _ = served
    client = openai_client(url)
    _, health = http_request(url, "GET", "/health")
    assert health["ranks"]["procs"] == 2 and health["ranks"]["up"] and health["method"].startswith("runahead")
    for prompt in PROMPTS:
        want = _full(smollm2, prompt).text
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N)
        assert r.choices[0].text == want
        fp = r.usage.fastprefill
        assert fp["method"].startswith("runahead(procs=2") and fp["ttft_s"] > 0
        assert fp["prefix_cache"] == "not used: runahead takes no cached prefix"
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    chat_want = _full(smollm2, PROMPTS[0], chat=True).text
    chat = client.chat.completions.create(model=MODEL, messages=user_messages(PROMPTS[0]), max_tokens=N, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == chat_want
    # per request: full prefill in the server's process, beside the ranks
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N,
                                     extra_body={"fastprefill": {"method": "full"}})
    assert full.choices[0].text == _full(smollm2, PROMPTS[1]).text and full.usage.fastprefill["method"] == "full"
    for name in ("fastprefill_ttft_seconds_count", "fastprefill_decode_seconds_per_token_count"):
        assert metric_value(url, name, method="runahead") >= 7 and metric_value(url, name, method="full") == 1


@pytest.mark.timeout(300)
def test_sampling_settings_and_answers_cross_the_rank_protocol(served, smollm2):
    """Seeded sampling, ``n`` answers, log-probabilities and a stop string go to the last rank and
    come back per answer: each is the engine's with full prefill in this process on the same settings."""
    url, _ = served
    client = openai_client(url)
    model, tok = smollm2
    kw = {"temperature": 1.2, "top_p": 0.95, "seed": 3, "n": 2}
    ref = generate(model, tok, PROMPTS[2], None, N, sampling=SamplingParams(logprobs=1, **kw))
    assert ref.answers[0].token_ids != ref.answers[1].token_ids
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, logprobs=1, **kw)
    assert [c.text for c in r.choices] == [a.text for a in ref.answers]
    for choice, answer in zip(r.choices, ref.answers, strict=True):
        assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in answer.logprobs], abs=1e-4)
    stop = ref.answers[1].text.split()[1]
    cut = generate(model, tok, PROMPTS[2], None, N, sampling=SamplingParams(stop=(stop,), **kw)).answers
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, stop=[stop], stream=True,
                                            **kw))
    for i, answer in enumerate(cut):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == answer.text
    assert cut[1].finish_reason == "stop" and stop not in cut[1].text


@pytest.mark.timeout(300)
def test_a_request_for_another_rank_count_or_a_table_is_refused(served):
    url, _ = served
    client = openai_client(url)
    for spec, words in (("runahead:procs=3", "rank pool has 2"), ("tsp:procs=3", "rank pool has 2"),
                        ("runahead:procs=2,table=/etc/passwd", "table")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                      extra_body={"fastprefill": {"method": spec}})
        assert words in info.value.body["message"], info.value.body
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2,
                                  extra_body={"fastprefill": {"method": "runahead:procs=2,partition=even"}})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.timeout(300)
def test_a_client_that_disconnects_stops_the_decode_on_the_ranks(served, smollm2):
    url, ranks = served
    client = openai_client(url)
    stopped = ranks.stopped_early
    leave_mid_stream(client, PROMPTS[0])
    wait_health(url, is_idle, timeout=60)
    assert ranks.stopped_early == stopped + 1  # the last rank stopped before its 400th token
    assert client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N).choices[0].text == \
        _full(smollm2, PROMPTS[2]).text  # the pool is still warm and usable


@pytest.mark.timeout(300)
def test_a_dead_rank_ends_the_request_with_a_503_and_multi_rank_requests_are_refused_after(smollm2):
    ranks = _pool()
    with background(_app(smollm2, ranks, allow_methods=("full",))) as url:
        client = openai_client(url)
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, stream=True,
                                           extra_body={"fastprefill": {"ignore_eos": True}})
        chunks = iter(stream)
        next(c for c in chunks if c.choices and c.choices[0].text)  # decoding on the last rank now
        t0 = time.monotonic()
        os.kill(ranks.pids[1], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="rank 1 died") as info:
            for _ in chunks:
                pass
        assert time.monotonic() - t0 < 30, "the dead rank was not noticed in time"
        assert info.value.body["code"] == 503 and info.value.body["type"] == "server_error"
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2)
        assert refused.value.status_code == 503 and "rank 1 died" in refused.value.body["message"]
        health = wait_health(url, is_idle)
        assert not health["ranks"]["up"] and "rank 1" in health["ranks"]["failure"]
        full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N,
                                         extra_body={"fastprefill": {"method": "full"}})
        assert full.choices[0].text == _full(smollm2, PROMPTS[1]).text
        assert metric_value(url, "fastprefill_requests_total", method="runahead", outcome="error") == 2
    assert all(not link.alive() for link in ranks._links)


@pytest.mark.timeout(300)
def test_a_hung_rank_ends_the_request_with_a_503_after_the_method_timeout(smollm2):
    ranks = _pool()
    with background(_app(smollm2, ranks)) as url:
        stream = openai_client(url).completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=400, stream=True,
            extra_body={"fastprefill": {"method": "runahead:procs=2,timeout_s=3", "ignore_eos": True}})
        chunks = iter(stream)
        next(c for c in chunks if c.choices and c.choices[0].text)
        os.kill(ranks.pids[1], signal.SIGSTOP)  # alive, silent
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match=r"ranks \[1\] did not answer within 3 s"):
            for _ in chunks:
                pass
        assert 2 < time.monotonic() - t0 < 30
        assert not wait_health(url, is_idle)["ranks"]["up"]
    assert all(not link.alive() for link in ranks._links)


def _time_to_503(url: str, limit_s: float = 5.0) -> tuple[float, dict]:
    """Seconds from now until ``/health`` answers 503 (polled every 10 ms), and that body."""
    t0 = time.monotonic()
    while True:
        status, health = http_request(url, "GET", "/health")
        if status == 503:
            return time.monotonic() - t0, health
        assert time.monotonic() - t0 < limit_s, f"/health still answers {status}: {health}"
        time.sleep(0.01)


@pytest.mark.timeout(300)
def test_health_answers_503_within_a_second_of_a_default_ranks_death(smollm2):
    """An idle server whose default method is runahead: one rank killed, ``/health`` answers 503
    ``unavailable`` within a second, naming the rank, while the allowed ``full`` stays ``ok`` and
    answers; a runahead request gets the 503 too."""
    ranks = _pool()
    with background(_app(smollm2, ranks, allow_methods=("full",))) as url:
        status, health = http_request(url, "GET", "/health")
        assert status == 200 and health["status"] == "ok" and health["reason"] is None
        assert {spec: m["state"] for spec, m in health["methods"].items()} == {RUNAHEAD: "ok", "full": "ok"}
        assert health["methods"][RUNAHEAD]["default"] and not health["methods"]["full"]["default"]
        os.kill(ranks.pids[1], signal.SIGKILL)
        took, health = _time_to_503(url)
        assert took < 1.0, f"/health took {took:.2f} s to see the dead rank"
        assert health["status"] == "unavailable" and "rank 1" in health["reason"] and RUNAHEAD in health["reason"]
        assert health["methods"][RUNAHEAD]["state"] == "unavailable" and health["methods"]["full"]["state"] == "ok"
        assert not health["ranks"]["up"]
        client = openai_client(url)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2)
        assert refused.value.status_code == 503 and "rank 1" in refused.value.body["message"]
        full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N,
                                         extra_body={"fastprefill": {"method": "full"}})
        assert full.choices[0].text == _full(smollm2, PROMPTS[1]).text
        # the watcher shuts the idle pool down; /health keeps saying why
        health = wait_health(url, lambda h: h["ranks"]["failure"] and "died" in h["ranks"]["failure"], timeout=30)
        assert health["status"] == "unavailable" and "rank 1 died" in health["reason"]
    assert all(not link.alive() for link in ranks._links)


@pytest.mark.timeout(300)
def test_health_is_degraded_when_only_an_allowed_methods_rank_dies(smollm2):
    """Default ``full``, ``runahead`` allowed: a dead rank leaves ``/health`` at 200 ``degraded``,
    with the reason, and ``full`` still answers."""
    model, tok = smollm2
    ranks = _pool()
    app = create_app(model, tok, ServeConfig(MODEL, method="full", allow_methods=(RUNAHEAD,), timeout_s=120), ranks)
    with background(app) as url:
        assert http_request(url, "GET", "/health")[1]["status"] == "ok"
        os.kill(ranks.pids[0], signal.SIGKILL)
        wait_health(url, lambda h: h["status"] != "ok", timeout=5)
        status, health = http_request(url, "GET", "/health")
        assert status == 200 and health["status"] == "degraded"
        assert "rank 0" in health["reason"] and RUNAHEAD in health["reason"] and "'full' answers" in health["reason"]
        assert health["methods"]["full"]["state"] == "ok" and health["methods"][RUNAHEAD]["state"] == "unavailable"
        r = openai_client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N)
        assert r.choices[0].text == _full(smollm2, PROMPTS[0]).text
