"""The interleaved scheduler on the real smollm2-135m in float32: chunked prefill (with and
without a prefix-cache hit, chunk boundaries mid-block) and batched decode give the tokens of
an unchunked, one-at-a-time generation; through the server, a short request sent while a long
prompt is being prefilled is answered before the long one's first token, and every answer
equals the sequential one. (In bfloat16 a chunk boundary changes rounding, as a prefix-cache hit
does: exact tokens are asserted in float32.)"""

from __future__ import annotations

import math
import threading
import time

import pytest

from fastprefill.batch import DecodeBatch
from fastprefill.engine import Generation, generate
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache
from fastprefill.prompt import prepare_request
from fastprefill.serve import ServeConfig, background, create_app
from tests.integration.serving import MODEL, is_idle, metric_value, openai_client, wait_health

pytestmark = pytest.mark.integration

DOC = " ".join(f"Station {i} lies {3 * i + 7} km north of the river and opened in {1900 + 4 * i}." for i in range(12))


def _ids(smollm2, text: str):
    model, tok = smollm2
    return prepare_request(model, tok, text, chat=True, max_new_tokens=16)[0]


def _run(gen: Generation, chunk: int | None) -> tuple[list[int], int]:
    """The tokens of ``gen`` run with prefill units of ``chunk``, and the units it counted."""
    tokens = [e.token_id for e in gen.run(chunk)]
    assert gen.out is not None
    return tokens, gen.out.stats.extra.get("prefill_chunks", 1)


def test_chunked_prefill_equals_unchunked_with_and_without_a_prefix_hit(smollm2):
    chunk = 40  # blocks of 16: the hit ends on a block, the chunks do not
    model, tok = smollm2
    first = _ids(smollm2, DOC + "\nWhich station opened in 1940?")
    second = _ids(smollm2, DOC + "\nHow far north is station 5?")
    want = generate(model, tok, second, FullPrefill(), 12).token_ids
    n = int(second.shape[1])
    tokens, units = _run(Generation(model, tok, second, FullPrefill(), 12), chunk)
    assert tokens == want and units == math.ceil(n / chunk)
    cache = PrefixCache(256 << 20)
    generate(model, tok, first, FullPrefill(), 2, prefix_cache=cache)
    gen = Generation(model, tok, second, FullPrefill(), 12, prefix_cache=cache)
    left = gen.lookup()
    assert 0 < left < n - 100
    tokens, units = _run(gen, chunk)
    assert tokens == want and units == math.ceil(left / chunk)


def test_batched_decode_equals_each_stream_alone(smollm2):
    model, tok = smollm2
    prompts = [("Say hello.", 7), ("Tell me a long story about a dragon.", 10), (DOC + "\nSummarise.", 8),
               ("What is 2 + 2?", 4)]
    want = [generate(model, tok, p, FullPrefill(), n, chat=True, stop_at_eos=False).token_ids for p, n in prompts]
    gens = [Generation(model, tok, _ids(smollm2, p), FullPrefill(), n, stop_at_eos=False) for p, n in prompts]
    batch = DecodeBatch(model)
    for gen in gens:
        gen.prefill(None)
        gen.first_events()
    widest = 0
    while live := [g for g in gens if not g.finished]:
        batch.step(live)
        widest = max(widest, len(batch.members))
    assert [g.generated for g in gens] == want and widest == 4


def test_a_short_request_is_answered_during_a_long_prefill(smollm2):
    """A ~1.2k-token prompt prefilled in chunks of 64 and, once its prefill has begun, a one-line
    question: the question's whole answer comes before the long prompt's first token; both
    answers equal the engine's, and the chunks are counted."""
    model, tok = smollm2
    long_prompt = "\n".join([DOC] * 4) + "\nWhich station opened in 1940?"
    config = ServeConfig(MODEL, prefill_chunk=64, prefix_cache_mb=0, timeout_s=600)
    want_long = generate(model, tok, long_prompt, FullPrefill(), 4, chat=True).text
    want_short = generate(model, tok, "Say hello.", FullPrefill(), 3, chat=True).text
    n_long = int(_ids(smollm2, long_prompt).shape[1])
    with background(create_app(model, tok, config)) as url:
        client = openai_client(url)
        wait_health(url, is_idle)
        seen: dict[str, float] = {}
        parts: list[str] = []

        def long_request() -> None:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}],
                                                    max_tokens=4, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content is not None:
                    seen.setdefault("long_first", time.monotonic())
                    parts.append(chunk.choices[0].delta.content)

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 120
        while metric_value(url, "fastprefill_prefill_chunks_total") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                               max_tokens=3)
        seen["short_done"] = time.monotonic()
        thread.join(300)
        assert short.choices[0].message.content == want_short and "".join(parts) == want_long
        assert seen["short_done"] < seen["long_first"]
        assert metric_value(url, "fastprefill_prefill_chunks_total") >= math.ceil(n_long / 64) + 1
        assert metric_value(url, "fastprefill_decode_batch_size_count") >= 1


def test_a_short_request_gets_its_first_token_in_a_pause_of_a_whole_prefill(smollm2):
    """A ~3k-token prompt prefilled as one unit (``prefill_chunk`` above its length) and a
    one-line question sent once that unit has started: the question's first token comes before
    the long prompt's, in a pause of the unit between two layers; both answers equal the
    engine's (the paused unit is the unpaused computation)."""
    model, tok = smollm2
    long_prompt = "\n".join([DOC] * 10) + "\nWhich station opened in 1940?"
    config = ServeConfig(MODEL, prefill_chunk=8192, prefix_cache_mb=0, timeout_s=600)
    want_long = generate(model, tok, long_prompt, FullPrefill(), 4, chat=True).text
    want_short = generate(model, tok, "Say hello.", FullPrefill(), 3, chat=True).text
    with background(create_app(model, tok, config)) as url:
        client = openai_client(url)
        wait_health(url, is_idle)
        seen: dict[str, float] = {}
        texts: dict[str, list[str]] = {"long": [], "short": []}

        def ask(name: str, prompt: str, n: int) -> None:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=n, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content is not None:
                    seen.setdefault(name, time.monotonic())
                    texts[name].append(chunk.choices[0].delta.content)

        thread = threading.Thread(target=ask, args=("long", long_prompt, 4))
        thread.start()
        deadline = time.monotonic() + 120
        while metric_value(url, "fastprefill_queue_wait_seconds_count") < 1:  # its unit has started
            assert time.monotonic() < deadline
            time.sleep(0.005)
        ask("short", "Say hello.", 3)
        thread.join(300)
        assert "".join(texts["short"]) == want_short and "".join(texts["long"]) == want_long
        assert seen["short"] < seen["long"]
        assert metric_value(url, "fastprefill_prefill_pauses_total") >= 1
        assert metric_value(url, "fastprefill_prefill_chunks_total") == 2  # one unit each


def test_a_stream_decodes_inside_the_chunks_of_a_long_prefill_with_mixed_chunks(smollm2):
    """``mixed_chunk=64``: a stream of 40 tokens starts, then a ~1.2k-token prompt arrives; the
    stream's tokens ride in the long prompt's chunks (counted), and both answers equal the
    engine's alone."""
    model, tok = smollm2
    long_prompt = "\n".join([DOC] * 4) + "\nWhich station opened in 1940?"
    story = "Tell me a long story about a dragon."
    config = ServeConfig(MODEL, mixed_chunk=64, prefix_cache_mb=0, timeout_s=600)
    want_long = generate(model, tok, long_prompt, FullPrefill(), 4, chat=True).text
    want_story = generate(model, tok, story, FullPrefill(), 40, chat=True, stop_at_eos=False).text
    with background(create_app(model, tok, config)) as url:
        client = openai_client(url)
        wait_health(url, is_idle)
        texts: dict[str, list[str]] = {"long": [], "story": []}

        def ask(name: str, prompt: str, n: int) -> None:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=n, stream=True,
                                                    extra_body={"fastprefill": {"ignore_eos": name == "story"}})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content is not None:
                    texts[name].append(chunk.choices[0].delta.content)

        thread = threading.Thread(target=ask, args=("story", story, 40))
        thread.start()
        deadline = time.monotonic() + 120
        while not texts["story"]:  # the stream decodes
            assert time.monotonic() < deadline
            time.sleep(0.005)
        ask("long", long_prompt, 4)
        thread.join(300)
        assert "".join(texts["story"]) == want_story and "".join(texts["long"]) == want_long
        assert metric_value(url, "fastprefill_mixed_steps_total") >= 1
