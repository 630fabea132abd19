"""The server's prefix cache, through the real ``openai`` client: cached tokens in the usage block
and in ``/metrics``, answers equal to the engine's without a cache (alone, concurrent, and a
follow-up sent while the first answer streams), off with ``prefix_cache_mb=0``, only whole
prefilled blocks left by a cancelled request, and persistence across a restart, with a corrupt
file refused and ignored."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import openai
import pytest

from fastprefill.engine import generate
from fastprefill.prefix_cache import PrefixCache
from fastprefill.serve import ServeConfig, background, create_app
from tests.integration.serving import MODEL, is_idle, metric_value, openai_client, wait_health

pytestmark = pytest.mark.integration

DOC = " ".join(f"Station {i} lies {3 * i + 7} km north of the river and opened in {1900 + 4 * i}." for i in range(24))
QUESTIONS = ["Which station opened in 1940?", "How far north is station 5?", "Name the first station.",
             "When did station 20 open?"]


def _prompt(question: str) -> str:
    return f"{DOC}\n\nQuestion: {question}\nAnswer:"


@pytest.fixture(scope="module")
def uncached(smollm2):
    """The engine's greedy answer with no cache: ``uncached(question) -> text``."""
    model, tok = smollm2
    memo: dict[str, str] = {}

    def answer(question: str) -> str:
        if question not in memo:
            memo[question] = generate(model, tok, _prompt(question), max_new_tokens=12).text
        return memo[question]

    return answer


def _ask(client: openai.OpenAI, question: str):
    return client.completions.create(model=MODEL, prompt=_prompt(question), max_tokens=12)


def test_a_shared_prefix_is_served_from_the_cache_and_counted(smollm2, uncached):
    model, tok = smollm2
    app = create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64))
    with background(app) as url:
        client = openai_client(url)
        first = _ask(client, QUESTIONS[0])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert first.usage.model_extra["fastprefill"]["prefix_cache"] == "miss"
        second = _ask(client, QUESTIONS[1])
        cached = second.usage.prompt_tokens_details.cached_tokens
        doc_tokens = len(tok(DOC)["input_ids"])
        assert doc_tokens - 16 <= cached <= doc_tokens + 16 and cached % 16 == 0  # whole blocks of the document
        assert second.usage.model_extra["fastprefill"]["prefix_cache"] == "hit"
        assert [first.choices[0].text, second.choices[0].text] == [uncached(q) for q in QUESTIONS[:2]]
        assert metric_value(url, "fastprefill_prompt_tokens_cached_total", method="full") == cached
        assert metric_value(url, "fastprefill_prompt_tokens_computed_total", method="full") == (
            first.usage.prompt_tokens + second.usage.prompt_tokens - cached)
        server = app.state.server
        assert metric_value(url, "fastprefill_prefix_cache_bytes") == server.prefix_cache.nbytes > 0
        assert metric_value(url, "fastprefill_prefix_cache_blocks") == server.prefix_cache.num_blocks


@pytest.mark.parametrize("scheduler", ["fifo", "interleaved"])
def test_concurrent_requests_sharing_a_prefix_get_the_uncached_answers(smollm2, uncached, scheduler):
    """Four questions over one new document at once: the answers are the uncached ones, and the
    document is computed once. One at a time (fifo) the first computes it and the three others
    hit; interleaved, a request admitted while another prefills the document waits for its
    blocks (counted in /metrics as shared) and prefills only its question."""
    model, tok = smollm2
    with background(create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64, scheduler=scheduler))) as url:
        client = openai_client(url)
        got: dict[str, tuple[str, int]] = {}
        shared_by: dict[str, int] = {}

        def ask(q: str) -> None:
            stream = client.completions.create(model=MODEL, prompt=_prompt(q), max_tokens=12, stream=True,
                                               stream_options={"include_usage": True})
            text, cached = "", -1
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens
                    shared_by[q] = chunk.usage.model_extra["fastprefill"]["shared_tokens"]
            got[q] = (text, cached)

        threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert {q: text for q, (text, _) in got.items()} == {q: uncached(q) for q in QUESTIONS}
        cached = sorted(c for _, c in got.values())
        doc_tokens = len(tok(DOC)["input_ids"])
        assert cached[0] == 0 and all(doc_tokens - 16 <= c <= doc_tokens + 16 for c in cached[1:])  # the first computes it
        prompts = sum(len(tok(_prompt(q))["input_ids"]) for q in QUESTIONS)
        assert metric_value(url, "fastprefill_prompt_tokens_computed_total", method="full") == prompts - sum(cached)
        shared = metric_value(url, "fastprefill_prompt_tokens_shared_total", method="full")
        assert shared <= sum(cached) and (scheduler == "interleaved" or shared == 0)
        assert sum(shared_by.values()) == shared and all(shared_by[q] <= got[q][1] for q in QUESTIONS)


def test_off_with_zero_megabytes(smollm2, uncached):
    model, tok = smollm2
    app = create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=0))
    assert app.state.server.prefix_cache is None
    with background(app) as url:
        client = openai_client(url)
        for q in QUESTIONS[:2]:
            res = _ask(client, q)
            assert res.usage.prompt_tokens_details.cached_tokens == 0 and res.choices[0].text == uncached(q)
            assert res.usage.model_extra["fastprefill"]["prefix_cache"] == "off"


def _first_token(client: openai.OpenAI, max_tokens: int):
    """A stream of ``max_tokens`` tokens (past the end-of-sequence token) for the first question,
    read up to its first token (its prefill is done); the stream and its chunk iterator."""
    stream = client.completions.create(model=MODEL, prompt=_prompt(QUESTIONS[0]), max_tokens=max_tokens, stream=True,
                                       extra_body={"fastprefill": {"ignore_eos": True}})
    chunks = iter(stream)
    next(chunks)
    return stream, chunks


def test_a_follow_up_sent_while_the_first_answer_streams_hits(smollm2, uncached):
    """The document's blocks enter the cache when the first request's prefill reaches them, not
    after its last token: a follow-up sent while the first answer still streams hits (the cache's
    own counters say so) and gets the uncached answer (float32), and the first stream goes on."""
    model, tok = smollm2
    app = create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64))
    cache = app.state.server.prefix_cache
    with background(app) as url:
        client = openai_client(url)
        stream, chunks = _first_token(client, 400)  # its decoding goes on
        hits = cache.stats.hits
        follow = _ask(client, QUESTIONS[1])
        doc_tokens = len(tok(DOC)["input_ids"])
        assert follow.usage.prompt_tokens_details.cached_tokens >= doc_tokens - 16
        assert cache.stats.hits == hits + 1
        assert follow.choices[0].text == uncached(QUESTIONS[1])
        assert next(chunks).choices[0].text is not None  # the first answer was still streaming
        stream.close()
        wait_health(url, is_idle)


def test_a_cancelled_request_leaves_only_the_whole_blocks_it_prefilled(smollm2, uncached):
    """A request cancelled after its first token leaves its prompt's whole blocks (none of its
    generated tokens, no partial block); the next request over that prompt hits them and gets the
    uncached answer."""
    model, tok = smollm2
    app = create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64))
    cache = app.state.server.prefix_cache
    with background(app) as url:
        client = openai_client(url)
        stream, _ = _first_token(client, 200)
        stream.close()
        wait_health(url, is_idle)
        prompt_tokens = len(tok(_prompt(QUESTIONS[0]))["input_ids"])
        assert cache.held_tokens == cache.stats.stored_tokens == prompt_tokens // 16 * 16
        res = _ask(client, QUESTIONS[0])
        assert res.usage.prompt_tokens_details.cached_tokens == prompt_tokens // 16 * 16
        assert res.choices[0].text == uncached(QUESTIONS[0])


def test_the_cache_persists_across_a_restart_and_a_corrupt_file_is_ignored(smollm2, uncached, tmp_path, caplog):
    model, tok = smollm2
    folder = tmp_path / "pc"
    with background(create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64, prefix_cache_dir=str(folder)))) as url:
        _ask(openai_client(url), QUESTIONS[0])
    saved = folder / "prefix-cache.safetensors"
    assert saved.exists()  # written at shutdown
    with background(create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64, prefix_cache_dir=str(folder)))) as url:
        res = _ask(openai_client(url), QUESTIONS[2])
        assert res.usage.prompt_tokens_details.cached_tokens > 0 and res.choices[0].text == uncached(QUESTIONS[2])
    data = bytearray(Path(saved).read_bytes())
    data[-5] ^= 0xFF
    saved.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="fastprefill.serve.app"):
        app = create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64, prefix_cache_dir=str(folder)))
    assert any("prefix cache not loaded" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    assert app.state.server.prefix_cache.num_blocks == 0
    with background(app) as url:
        res = _ask(openai_client(url), QUESTIONS[3])
        assert res.usage.prompt_tokens_details.cached_tokens == 0 and res.choices[0].text == uncached(QUESTIONS[3])


def _other_model(folder: Path, smollm2) -> None:
    from fastprefill.models.random import random_model

    cache = PrefixCache(16 << 20, block_tokens=16)
    generate(random_model("llama"), None, [(3 * i) % 128 for i in range(40)], max_new_tokens=1, prefix_cache=cache)
    cache.save(folder)


def _other_blocks(folder: Path, smollm2) -> None:
    model, tok = smollm2
    cache = PrefixCache(16 << 20, block_tokens=8)
    generate(model, tok, _prompt(QUESTIONS[0]), max_new_tokens=1, prefix_cache=cache)
    cache.save(folder)


@pytest.mark.parametrize(("save", "why"), [(_other_model, "another model"), (_other_blocks, "blocks of 8 tokens")])
def test_a_cache_saved_for_another_model_or_block_size_is_refused_and_the_server_answers(
        smollm2, uncached, tmp_path, caplog, save, why):
    model, tok = smollm2
    save(tmp_path, smollm2)
    with caplog.at_level(logging.WARNING, logger="fastprefill.serve.app"):
        app = create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=64, prefix_cache_dir=str(tmp_path)))
    refused = [r.getMessage() for r in caplog.records if "prefix cache not loaded" in r.getMessage()]
    assert len(refused) == 1 and why in refused[0] and str(tmp_path / "prefix-cache.safetensors") in refused[0]
    assert app.state.server.prefix_cache.num_blocks == 0
    with background(app) as url:
        res = _ask(openai_client(url), QUESTIONS[1])
        assert res.usage.prompt_tokens_details.cached_tokens == 0 and res.choices[0].text == uncached(QUESTIONS[1])
