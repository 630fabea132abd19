"""The OpenAI-compatible server, through the official ``openai`` client and raw HTTP.

Every answer is compared with :func:`fastprefill.engine.generate` on the same prompt and method
(the reference). Servers run in a thread of the test process on 127.0.0.1 (a free port), over
the session's smollm2-135m; references are computed while the server is idle, never beside it.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import unicodedata
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import openai
import pytest
from fastapi import FastAPI

from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.base import DistributedMethod
from fastprefill.methods.registry import METHODS, make_method
from fastprefill.runtime import free_port
from fastprefill.serve import ServeConfig, background, create_app
from fastprefill.serve.app import EXIT_GRACE_S
from fastprefill.serve.backends import Backends
from fastprefill.serve.config import PER_REQUEST_METHODS, serving_method
from fastprefill.serve.limits import NFC_MERGE, NFKC_MERGE, longest_token_chars, prompt_char_limit
from fastprefill.serve.protocol import APIError, ChatRequest, CompletionRequest, parse_request, prompt_bytes
from tests import REPO
from tests.integration.serving import (
    MODEL,
    http_request,
    is_idle,
    metric_value,
    openai_client,
    user_messages,
    wait_health,
)

LAZY = "lazyllm:preset=default"


@pytest.fixture(scope="module")
def ref(smollm2):
    """``ref(prompt, n, spec="full", chat=True)``: the engine's greedy answer (cached)."""
    model, tok = smollm2
    cache: dict = {}

    def reference(prompt, n: int, spec: str = "full", chat: bool = True, **kw):
        key = (json.dumps(prompt), n, spec, chat, json.dumps(kw))
        if key not in cache:
            cache[key] = generate(model, tok, prompt, serving_method(spec), n, chat=chat, **kw)
        return cache[key]

    return reference


@pytest.fixture(scope="module")
def served_app(smollm2) -> FastAPI:
    """The main server's app: default method full, a queue of 32, a generous timeout, the
    default limits."""
    model, tok = smollm2
    return create_app(model, tok, ServeConfig(MODEL, queue_size=32, timeout_s=600))


@pytest.fixture(scope="module")
def served(served_app) -> Iterator[str]:
    """The main server's URL."""
    with background(served_app) as url:
        yield url


@pytest.fixture
def client(served) -> openai.OpenAI:
    wait_health(served, is_idle)
    return openai_client(served)


# --- unit: no model ----------------------------------------------------------------------------
def test_parse_request_refuses_with_400_and_names_the_field():
    def refused(body: bytes, schema=ChatRequest) -> APIError:
        with pytest.raises(APIError) as info:
            parse_request(body, schema).sampling(49152)
        assert info.value.status == 400
        return info.value

    assert "not valid JSON" in refused(b"{nope").message
    assert "JSON object" in refused(b"[1, 2]").message
    assert "unsupported field" in refused(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                                          b'"tools": []}').message
    assert refused(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}').param \
        == "max_tokens"
    assert refused(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                   b'"presence_penalty": 2.5}').param == "presence_penalty"
    assert refused(b'{"model": "m", "prompt": "x", "n": 17}', CompletionRequest).param == "n"
    assert refused(b'{"model": "m", "prompt": "x", "logit_bias": {"49152": 1}}', CompletionRequest).param \
        == "logit_bias"
    assert refused(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}').param \
        == "top_logprobs"
    assert refused(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                   b'"response_format": {"type": "json_schema", "json_schema": {}}}').param == "response_format"
    assert refused(b'{"model": "m", "prompt": "x", "best_of": 3}', CompletionRequest).param == "best_of"
    ok = parse_request(b'{"model": "m", "prompt": "x", "temperature": 0.7, "top_p": 0.5, "top_k": -1, "seed": 1, '
                       b'"logprobs": 2, "echo": true, "n": 2, "ignore_eos": true, "min_tokens": 1, '
                       b'"stream_options": {"include_usage": true, "continuous_usage_stats": true}}', CompletionRequest)
    params = ok.sampling(49152)
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.n) == (0.7, 0.5, 0, 1, 2)
    assert (params.logprobs, params.prompt_logprobs, params.ignore_eos, params.min_tokens) == (2, 2, True, 1)
    assert ok.single_prompt() == "x"
    assert parse_request(b'{"model": "m", "prompt": "x"}', CompletionRequest).sampling(49152).greedy


def test_prompt_bytes_keeps_invalid_input_invalid():
    assert prompt_bytes("héllo") == "héllo".encode()
    assert prompt_bytes(b"a\xffb".decode("utf-8", "surrogateescape")) == b"a\xffb"
    with pytest.raises(UnicodeDecodeError):
        prompt_bytes("\ud800").decode("utf-8")


def test_serve_config_refuses_bad_limits():
    for bad in ({"queue_size": 0}, {"timeout_s": 0}, {"max_tokens": True}, {"max_body_mb": 0},
                {"max_body_mb": math.inf}, {"drain_timeout_s": -1}, {"drain_timeout_s": math.nan}):
        with pytest.raises(ConfigError):
            ServeConfig(MODEL, **bad)
    assert ServeConfig(MODEL, max_body_mb=0.5, drain_timeout_s=0).max_body_bytes == 2**19


def test_cheap_malformed_bodies_are_400s_with_a_clear_message():
    def refused(body: bytes) -> APIError:
        with pytest.raises(APIError) as info:
            req = parse_request(body, CompletionRequest)
            req.sampling(49152)
            req.single_prompt(49152)
        assert info.value.status == 400
        return info.value

    deep = b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "nested too deeply" in refused(deep).message
    assert "nested too deeply" in refused(b"[" * 100_000).message
    assert "not valid JSON" in refused(b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}").message
    huge = refused(b'{"model": "m", "prompt": [1, %d]}' % 2**70)
    assert huge.param == "prompt" and "prompt ids must lie in [0, 49152)" in huge.message
    assert "[0, 49152)" in refused(b'{"model": "m", "prompt": [[5, -1]]}').message
    for field, value in (("temperature", b"NaN"), ("temperature", b"Infinity"), ("top_p", b"NaN"),
                         ("presence_penalty", b"-Infinity")):
        err = refused(b'{"model": "m", "prompt": "x", "%s": %s}' % (field.encode(), value))
        assert err.param == field and "finite number" in err.message, err.message
    assert parse_request(b'{"model": "m", "prompt": [1, 2]}', CompletionRequest).single_prompt(3) == [1, 2]


def test_the_multi_rank_methods_are_the_distributed_ones():
    """A method's class says whether it runs on ranks; the server's backends ask it, and no method a
    request may name by itself runs on ranks."""
    multi = {name for name, entry in METHODS.items() if entry.cls.on_ranks}
    assert multi == {"runahead", "tsp"} and not multi & PER_REQUEST_METHODS
    assert all(isinstance(m := make_method(name), DistributedMethod) and Backends.on_ranks(m) for name in multi)
    assert not any(Backends.on_ranks(make_method(name)) for name in PER_REQUEST_METHODS)
    assert make_method("tsp:procs=3").ranks == 3 and make_method("full").ranks == 1


def _table(model, default: str, allowed=()):
    from fastprefill.serve.method_table import MethodTable

    return MethodTable(model, default, allowed, Backends(model, None, None, None))


def test_the_merge_factors_are_the_longest_unicode_decompositions():
    chars = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000]
    assert max(len(unicodedata.normalize("NFD", c)) for c in chars) == NFC_MERGE
    assert max(len(unicodedata.normalize("NFKD", c)) for c in chars) == NFKC_MERGE


def test_tokenizers_that_drop_or_fuse_text_get_no_character_bound():
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE, WordLevel
    from transformers import PreTrainedTokenizerFast

    def fast(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)

    vocab = {"[UNK]": 0, "a": 1, "ab": 2, "b": 3}
    words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # drops spaces: "a" + a million spaces is 1 token
    assert longest_token_chars(fast(words)) is None
    byte_bpe = Tokenizer(BPE(vocab, [("a", "b")], byte_fallback=True))
    assert longest_token_chars(fast(byte_bpe)) == 5  # "[UNK]"
    byte_bpe.normalizer = normalizers.NFKC()
    assert longest_token_chars(fast(byte_bpe)) == 5 * NFKC_MERGE
    byte_bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.StripAccents()])
    assert longest_token_chars(fast(byte_bpe)) is None  # "a" + any number of combining marks is "a"
    assert longest_token_chars(fast(Tokenizer(BPE(vocab, [("a", "b")], unk_token="[UNK]", fuse_unk=True)))) is None


def test_a_multi_rank_default_method_is_refused_at_start(tiny_llama):
    for spec in ("runahead:procs=2", "tsp:procs=2"):
        with pytest.raises(ConfigError, match="several ranks"):
            _table(tiny_llama, spec)
    assert _table(tiny_llama, "gemfilter:keep=0.5,select_layer=1").get(None)[0] == "gemfilter"


ADVERSARIAL = [  # texts that pack many characters into few tokens, or that a normalizer shrinks
    " " * 5000, "\n" * 5000, "\t" * 3000, "#" * 5000, "-" * 5000, "=" * 5000, "0" * 5000,
    "e\u0301" * 2000, "\u1100\u1161\u11a8" * 1000, "\u1f82" * 500, "ﬃ" * 1000, "🎉" * 1000, "龘𠀀" * 500,
    "<|im_start|>" * 300, "the " * 2000,
]


@pytest.mark.integration
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_no_text_has_more_characters_than_its_tokens_times_the_bound(name, smollm2):
    from transformers import AutoTokenizer

    from fastprefill.models import zoo

    if name == MODEL:
        tok = smollm2[1]
    elif zoo.is_prepared(name):
        tok = AutoTokenizer.from_pretrained(str(zoo.entry_dir(name)))
    else:
        pytest.skip(f"{name} is not prepared (scripts/setup.sh --models)")
    longest = longest_token_chars(tok)
    assert longest is not None and prompt_char_limit(tok, 100) == 100 * longest
    vocab_longest = max(tok.get_vocab(), key=len)
    texts = [*ADVERSARIAL, tok.convert_tokens_to_string([vocab_longest]) * 50]
    for text in texts:
        n = len(tok(text)["input_ids"])
        assert len(text) <= n * longest, (text[:20], len(text), n, longest)
        assert len(tok(text, add_special_tokens=False)["input_ids"]) * longest >= len(text)


# --- integration -------------------------------------------------------------------------------
@pytest.mark.integration
def test_chat_whole_and_streamed_equal_the_engine(client, ref):
    prompt = "What is the capital of France?"
    want = ref(prompt, 6)
    r = client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_tokens=6)
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("length" if len(want.token_ids) == 6 else "stop")
    assert r.usage.prompt_tokens == want.timing.prompt_tokens
    assert r.usage.completion_tokens == len(want.token_ids)
    fp = r.usage.fastprefill
    assert fp["method"] == "full" and fp["ttft_s"] > 0 and fp["token_layer_fraction"] == 1.0

    chunks = list(client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_completion_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.fastprefill["method"] == "full"


def _split_characters(tok, ids: list[int], text: str) -> set[str]:
    """Characters of ``text`` that the tokens ``ids`` spread over more than one token: where a
    prefix of ``ids`` decodes to text ending in U+FFFD that the whole decode has as a real character."""
    split = set()
    for k in range(1, len(ids)):
        prefix = tok.decode(ids[:k], skip_special_tokens=True)
        whole = len(prefix.rstrip("\ufffd"))
        if whole < len(prefix) and whole < len(text) and text[whole] != "\ufffd":
            split.add(text[whole])
    return split


NON_ASCII = [  # (prompt, max_tokens): answers with characters smollm2-135m spreads over tokens
    ("Напиши одно предложение", 4),
    ("Reply with three emoji only: 🎉🔥", 6),
    ("Write the characters 龘 and 𠀀 and 鬱 twice.", 6),
]


@pytest.mark.integration
@pytest.mark.parametrize(("prompt", "n"), NON_ASCII, ids=["russian", "emoji", "cjk"])
def test_streamed_non_ascii_text_equals_the_whole_answer(client, ref, smollm2, prompt, n):
    _, tok = smollm2
    want = ref(prompt, n)
    assert _split_characters(tok, want.token_ids, want.text), want.text  # else the test proves nothing
    whole = client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_tokens=n)
    assert whole.choices[0].message.content == want.text
    chunks = list(client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_tokens=n, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == want.text, deltas
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stream=True)
    assert "".join(c.choices[0].text for c in text) == ref(prompt, n, chat=False).text


@pytest.mark.integration
def test_per_request_method_in_the_fastprefill_field(client, ref, served, smollm2):
    prompt = "The three primary colours are"
    want = ref(prompt, 5, LAZY, chat=False)
    body = {"fastprefill": {"method": LAZY}}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body=body)
    assert r.choices[0].text == want.text
    fp = r.usage.fastprefill
    assert fp["method"] == serving_method(LAZY).served_name() == "lazyllm[four-stage revival=none]"
    assert "revival=none" in fp["method"]  # the server's LazyLLM decodes with the model's own forward
    assert fp["token_layer_fraction"] == pytest.approx(want.timing.stats.fraction)
    assert fp["token_layer_fraction"] < 1.0
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body=body, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text
    # the server's default is untouched by the request before
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert plain.choices[0].text == ref(prompt, 5, chat=False).text
    assert plain.usage.fastprefill["method"] == "full"
    # a request may ask for the paper's Aux-Cache revival by name
    revived = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                        extra_body={"fastprefill": {"method": LAZY + ",revival=all"}})
    assert revived.usage.fastprefill["method"] == "lazyllm[four-stage revival=all]"
    assert revived.choices[0].text == generate(*smollm2, prompt, make_method(LAZY), 5).text


@pytest.mark.integration
def test_conversation_with_a_system_message_uses_the_chat_template(client, ref, smollm2):
    _, tok = smollm2
    turns = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}]
    ids = tok(tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    want = ref(ids, 4)
    r = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=4)
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.integration
def test_stop_strings_cut_the_answer_whole_and_streamed(client, ref):
    prompt = "Tell me a long story."
    full = ref(prompt, 12).text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # straddles streamed tokens, most likely
    want = full[: full.find(stop)]
    assert stop and len(want) < len(full) // 2 + 1, full
    r = client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_tokens=12, stop=[stop])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_tokens=12, stop=stop,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


BAD = [  # (create kwargs, status, words in the message)
    ({"temperature": -1}, 400, "temperature"),
    ({"n": 17}, 400, "n:"),
    ({"presence_penalty": 3}, 400, "presence_penalty must be"),
    ({"top_logprobs": 3}, 400, "logprobs: true"),
    ({"logit_bias": {"999999": 1}}, 400, "not a token id"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools: unsupported field"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10**6}, 400, "context"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"extra_body": {"frobnicate": 1}}, 400, "unsupported field"),
    ({"extra_body": {"fastprefill": {"method": "nosuch"}}}, 400, "unknown method"),
    ({"extra_body": {"fastprefill": {"method": "lazyllm:preset=nosuch"}}}, 400, "preset"),
    ({"extra_body": {"fastprefill": {"method": "kvp:predictor=/tmp"}}}, 400, "--allow-method"),
    ({"extra_body": {"fastprefill": {"method": "runahead"}}}, 400, "not available in this server"),
    ({"extra_body": {"fastprefill": {"method": "tsp:procs=2"}}}, 400, "not available in this server"),
    ({"extra_body": {"fastprefill": {"speed": "max"}}}, 400, "unsupported field"),
    ({"messages": user_messages("")}, 400, "empty"),
    ({"messages": user_messages("nul \x00 inside")}, 400, "NUL"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": "gpt-4o"}, 404, "not served"),
]


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_refused_with_a_message_and_leave_no_trace(client, served, ref, stream):
    prompt = "Name a fruit."
    before = metric_value(served, "fastprefill_requests_total", outcome="bad_request")
    for overrides, status, words in BAD:
        kwargs = {"model": MODEL, "messages": user_messages(prompt), "max_tokens": 3, "stream": stream, **overrides}
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**kwargs)
        err = info.value
        assert err.status_code == status, (overrides, err)
        assert words in err.body["message"], (overrides, err.body)
    assert metric_value(served, "fastprefill_requests_total", outcome="bad_request") - before == len(BAD)
    r = client.chat.completions.create(model=MODEL, messages=user_messages(prompt), max_tokens=3)
    assert r.choices[0].message.content == ref(prompt, 3).text


@pytest.mark.integration
def test_invalid_utf8_and_broken_bodies_get_400_never_500(served, client, ref):
    cases = [
        (b'{"model": "smollm2-135m", "prompt": "caf\xe9 au lait"}', "/v1/completions", "UTF-8"),
        (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff\xfe\x80\x81"}]}',
         "/v1/chat/completions", "UTF-8"),
        (b'{"model": "smollm2-135m", "prompt": "raw \x00 in a string"}', "/v1/completions", "not valid JSON"),
        ((b'{"model": "smollm2-135m", "messages": [{"role": "system", "content": "ok"}, '
          b'{"role": "user", "content": "bad \xc3\x28"}]}'), "/v1/chat/completions", "UTF-8"),
        (b'{"model": "smollm2-135m", "prompt": "lone \\ud800 surrogate"}', "/v1/completions", "UTF-8"),
        (b'\x89PNG\r\n\x1a\n\x00\x00', "/v1/completions", "JSON"),
        (b'', "/v1/chat/completions", "JSON"),
        (b'{"model": "smollm2-135m", "prompt": [1, 2, 99999999]}', "/v1/completions", "prompt ids"),
        (b'{"model": "smollm2-135m", "prompt": ["a", "b"]}', "/v1/completions", "one prompt"),
        (b'{"model": "smollm2-135m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "/v1/completions",
         "nested too deeply"),
        (b'{"model": "smollm2-135m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "/v1/chat/completions",
         "nested too deeply"),
        (b'{"model": "smollm2-135m", "prompt": [1, %d]}' % 2**70, "/v1/completions", "prompt ids must lie in"),
        (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", "/v1/completions",
         "not valid JSON"),
        (b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}', "/v1/completions", "finite number"),
    ]
    errors = metric_value(served, "fastprefill_requests_total", outcome="error")
    bad = metric_value(served, "fastprefill_requests_total", outcome="bad_request")
    for body, path, words in cases:
        status, answer = http_request(served, "POST", path, body)
        assert status == 400, (body[:80], answer)
        assert words in answer["error"]["message"], (body[:80], answer)
    assert metric_value(served, "fastprefill_requests_total", outcome="error") == errors
    assert metric_value(served, "fastprefill_requests_total", outcome="bad_request") - bad == len(cases)
    r = client.completions.create(model=MODEL, prompt="café au lait is", max_tokens=3)
    assert r.choices[0].text == ref("café au lait is", 3, chat=False).text


@pytest.mark.integration
def test_multi_rank_methods_are_refused_by_a_server_without_a_rank_pool(client):
    for spec in ("runahead", "runahead:procs=2,partition=searched", "tsp"):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                      extra_body={"fastprefill": {"method": spec}})
        message = info.value.body["message"]
        assert "several processes" in message and "not available in this server" in message, message
        assert "without a rank pool" in message and ":procs=N" in message and "fastprefill.launch" in message


@pytest.mark.integration
def test_models_retrieve_and_unknown_ids(client, served):
    listed = client.models.list().data[0]
    got = client.models.retrieve(MODEL)
    assert got.id == MODEL and got.model_dump() == listed.model_dump()
    assert got.context_length == 8192
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["type"] == "not_found_error" and "not served here" in info.value.body["message"]
    status, body = http_request(served, "GET", "/v1/models/org/" + MODEL)  # ids with a slash are ids, not routes
    assert status == 404 and body["error"]["param"] == "model"


@pytest.mark.integration
def test_an_idle_connection_outlives_the_clients_pool_timeout(served):
    """A keep-alive connection left idle past httpx's 5 s (the ``openai`` client's pool) is still
    open: the server never closes one the client may be reusing at that moment."""
    from fastprefill.serve.runner import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > 5
    parts = urlparse(served)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        for pause in (0.0, 6.0):
            time.sleep(pause)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200 and resp.getheader("connection", "keep-alive") != "close"
            sock = conn.sock
            assert sock is not None
        # the same socket answered both: http.client reopens only a connection it saw closed
        conn.request("GET", "/health")
        conn.getresponse().read()
        assert conn.sock is sock
    finally:
        conn.close()


@pytest.mark.integration
def test_unknown_routes_wrong_methods_and_bad_parameters_answer_in_openai_shape(served, served_app):
    def openai_error(status: int, body: object, code: int) -> dict:
        assert status == code, body
        assert isinstance(body, dict) and set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
        return body["error"]

    status, body = http_request(served, "GET", "/v1/nope")
    assert "no such route" in openai_error(status, body, 404)["message"]
    assert "POST /v1/chat/completions" in body["error"]["message"]
    status, body = http_request(served, "POST", "/v2/chat/completions", b"{}")
    openai_error(status, body, 404)
    u = urlparse(served)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("GET", "/v1/chat/completions")
        resp = conn.getresponse()
        error = openai_error(resp.status, json.loads(resp.read()), 405)
        assert resp.getheader("Allow") == "POST" and "use POST" in error["message"]
    finally:
        conn.close()

    @served_app.get("/v1/probe/{n}")  # a typed path parameter: FastAPI's own validation
    async def probe(n: int) -> dict:
        return {"n": n}

    assert http_request(served, "GET", "/v1/probe/3") == (200, {"n": 3})
    status, body = http_request(served, "GET", "/v1/probe/three")
    assert "integer" in openai_error(status, body, 400)["message"]


@pytest.mark.integration
def test_an_unexpected_failure_is_a_counted_500_in_openai_shape(client, served, served_app, monkeypatch):
    server = served_app.state.server

    def broken(*_):
        raise RuntimeError("a bug")

    errors = metric_value(served, "fastprefill_requests_total", outcome="error")
    monkeypatch.setattr(server.processor, "_on_thread", broken)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, stream=stream)
        assert info.value.body == {"message": "internal error (RuntimeError); the server log has the details",
                                   "type": "server_error", "param": None, "code": 500}
    assert metric_value(served, "fastprefill_requests_total", outcome="error", method="full") - errors == 2
    monkeypatch.setattr(server, "health", broken)  # outside the completion routes too
    status, body = http_request(served, "GET", "/health")
    assert status == 500 and body["error"]["type"] == "server_error"
    assert metric_value(served, "fastprefill_requests_total", outcome="error") - errors == 3
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].finish_reason == "length"


def test_the_server_decodes_lazyllm_without_revival_unless_a_spec_names_it(tiny_llama):
    assert serving_method("lazyllm").options.revival.kind == "none"
    assert serving_method("lazyllm:revival=all").options.revival.kind == "all"
    table = _table(tiny_llama, "lazyllm:schedule=1:0.5")
    label, default = table.get(None)
    assert label == "lazyllm[revival=none]" and default.options.revival.kind == "none"
    assert default.served_name() == "lazyllm[1:0.5 revival=none]"
    label, paper = table.get("lazyllm:schedule=1:0.5,revival=all")
    assert label == "lazyllm[revival=all]" and paper.served_name() == "lazyllm[1:0.5 revival=all]"
    assert table.get("lazyllm:schedule=1:0.5,revival=budget:2")[0] == "lazyllm[revival=budget]"  # a bounded label
    assert table.get("full") == ("full", table.get("full")[1]) and table.get("full")[1].served_name() == "full"


@pytest.mark.integration
def test_metrics_report_decode_seconds_per_token_by_method(client, served, ref):
    name = "fastprefill_decode_seconds_per_token"
    labels = ("full", "lazyllm[revival=none]", "lazyllm[revival=all]")
    before = {m: (metric_value(served, name + "_count", method=m), metric_value(served, name + "_sum", method=m))
              for m in labels}
    for spec, label, policy in ((LAZY, labels[1], "revival=none"), (LAZY + ",revival=all", labels[2], "revival=all")):
        r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4,
                                      extra_body={"fastprefill": {"method": spec, "ignore_eos": True}})
        assert r.choices[0].text == ref("The sky is", 4, spec, chat=False, stop_at_eos=False).text
        assert policy in r.usage.fastprefill["method"], r.usage.fastprefill
        per_token = r.usage.fastprefill["decode_s_per_token"]
        assert per_token > 0
        assert metric_value(served, name + "_count", method=label) - before[label][0] == 1
        assert metric_value(served, name + "_sum", method=label) - before[label][1] == pytest.approx(per_token)
    assert metric_value(served, name + "_count", method="full") == before["full"][0]  # the other method's untouched


@pytest.mark.integration
def test_a_10mb_prompt_is_refused_at_once_while_a_small_request_is_answered(client, served, ref):
    too_large = metric_value(served, "fastprefill_requests_total", outcome="too_large")
    refused: list = []

    def huge() -> None:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            openai_client(served).completions.create(model=MODEL, prompt="word " * (2 * 2**20), max_tokens=1)
        refused.append((time.monotonic() - t0, info.value))

    thread = threading.Thread(target=huge)
    thread.start()
    small = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2)
    thread.join(60)
    assert small.choices[0].text == ref("The sky is", 2, chat=False).text
    (seconds, err), = refused
    assert err.status_code == 413 and "--max-body-mb" in err.body["message"] and seconds < 1.0, (seconds, err)
    assert metric_value(served, "fastprefill_requests_total", outcome="too_large") - too_large == 1


@pytest.mark.integration
def test_the_body_limit_holds_for_chunked_uploads_and_passes_what_fits(smollm2, ref):
    model, tok = smollm2
    with background(create_app(model, tok, ServeConfig(MODEL, max_body_mb=0.25))) as url:
        over = [b'{"model": "smollm2-135m", "prompt": "', *[b"x" * 65536] * 5, b'"}']
        status, body = http_request(url, "POST", "/v1/completions", iter(over))  # no Content-Length: counted as it comes
        assert status == 413 and "262144 bytes" in body["error"]["message"], body
        status, body = http_request(url, "POST", "/v1/completions", b"".join(over))
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        fits = [b'{"model": "smollm2-135m", ', b'"prompt": "The sky is", ', b'"max_tokens": 2}']
        status, body = http_request(url, "POST", "/v1/completions", iter(fits))
        assert status == 200 and body["choices"][0]["text"] == ref("The sky is", 2, chat=False).text
        assert metric_value(url, "fastprefill_requests_total", outcome="too_large") == 2


@pytest.mark.integration
def test_a_prompt_the_context_cannot_hold_is_refused_without_tokenizing(client, served, served_app, monkeypatch):
    import fastprefill.serve.requests as prompts_module

    limit = served_app.state.server.processor.max_prompt_chars
    assert limit is not None and limit < 2**20
    real = prompts_module.prepare_request
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(prompts_module, "prepare_request", counted)
    over = "a" * (limit + 1)
    for send in (lambda: client.completions.create(model=MODEL, prompt=over, max_tokens=1),
                 lambda: client.chat.completions.create(model=MODEL, messages=user_messages(over), max_tokens=1),
                 lambda: client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                     {"role": "system", "content": "Be brief."}, {"role": "user", "content": over}])):
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as info:
            send()
        assert "characters" in info.value.body["message"] and time.monotonic() - t0 < 1.0, info.value.body
    assert calls == []  # refused on the character count alone
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context"):  # under the bound: tokenized
        client.completions.create(model=MODEL, prompt="a " * 9000, max_tokens=1)
    assert calls


@pytest.mark.integration
def test_a_long_tokenization_does_not_hold_up_other_requests(client, served, ref, monkeypatch):
    import fastprefill.serve.requests as prompts_module

    real = prompts_module.prepare_request
    slow_started = threading.Event()

    def slow_for_long_prompts(model, tok, prompt, *args, **kwargs):
        if len(prompt) > 10_000:  # stands for a tokenization that takes seconds
            slow_started.set()
            time.sleep(4)
        return real(model, tok, prompt, *args, **kwargs)

    monkeypatch.setattr(prompts_module, "prepare_request", slow_for_long_prompts)
    long_done = threading.Event()

    def long_request() -> None:
        with pytest.raises(openai.BadRequestError):
            openai_client(served).completions.create(model=MODEL, prompt="a " * 20_000, max_tokens=1)
        long_done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    assert slow_started.wait(60)
    small = [client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2) for _ in range(2)]
    assert not long_done.is_set()  # answered while the long one was still being checked
    thread.join(60)
    assert long_done.is_set() and all(r.choices[0].text == ref("The sky is", 2, chat=False).text for r in small)


@pytest.mark.integration
def test_models_health_and_metrics(client, served, smollm2):
    assert [m.id for m in client.models.list()] == [MODEL]
    status, health = http_request(served, "GET", "/health")
    assert status == 200 and health["model"] == MODEL and health["method"] == "full"
    assert health["queue"]["capacity"] == 32
    client.chat.completions.create(model=MODEL, messages=user_messages("Hi"), max_tokens=2)
    for name in ("fastprefill_ttft_seconds_count", "fastprefill_decode_seconds_per_token_count",
                 "fastprefill_queue_wait_seconds_count", "fastprefill_prompt_tokens_sum",
                 "fastprefill_prompt_token_layers_computed_total", "fastprefill_completion_tokens_total"):
        assert metric_value(served, name, method="full") > 0, name
    # full prefill computes every prompt token at every layer, but those the prefix cache served
    layers = smollm2[0].config.num_hidden_layers
    assert metric_value(served, "fastprefill_prompt_token_layers_computed_total", method="full") + layers * metric_value(
        served, "fastprefill_prompt_tokens_cached_total", method="full") == \
        metric_value(served, "fastprefill_prompt_token_layers_total", method="full")


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_sixteen_clients_four_requests_each_all_equal_the_sequential_answers(served, client, ref):
    prompts = ["The sky is", "Dogs are", "Hello, my name", "One plus one is"]
    specs = ["full", LAZY]
    jobs = [(c, k) for c in range(16) for k in range(4)]

    def case(c: int, k: int) -> tuple[str, str]:
        return prompts[(c + k) % 4], specs[(c * 4 + k) % 2]

    want = {case(c, k): ref(case(c, k)[0], 2, case(c, k)[1], chat=False).text for c, k in jobs}
    assert len(set(want.values())) > 1  # the answers differ, so a mix-up would show
    ok_before = metric_value(served, "fastprefill_requests_total", outcome="ok")

    def one_client(c: int) -> list[tuple[tuple[str, str], str]]:
        cl = openai_client(served)
        out = []
        for k in range(4):
            prompt, spec = case(c, k)
            r = cl.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      extra_body={"fastprefill": {"method": spec}})
            out.append(((prompt, spec), r.choices[0].text))
        return out

    with ThreadPoolExecutor(16) as pool:
        answers = [a for res in pool.map(one_client, range(16)) for a in res]
    assert len(answers) == 64
    assert all(text == want[key] for key, text in answers), [(k, t, want[k]) for k, t in answers if t != want[k]]
    assert metric_value(served, "fastprefill_requests_total", outcome="ok") - ok_before == 64


@pytest.mark.integration
def test_a_client_that_disconnects_stops_its_generation(served, client, ref):
    tokens = "fastprefill_completion_tokens_total"
    before = metric_value(served, tokens)
    cancelled = metric_value(served, "fastprefill_requests_total", outcome="cancelled")
    stream = client.chat.completions.create(model=MODEL, messages=user_messages("Tell me a long story."), max_tokens=400,
                                            stream=True, extra_body={"fastprefill": {"ignore_eos": True}})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 2:
            break
    stream.close()
    wait_health(served, is_idle)
    generated = metric_value(served, tokens) - before
    assert 2 <= generated < 100, generated  # 400 if the generation had run on
    assert metric_value(served, "fastprefill_requests_total", outcome="cancelled") - cancelled == 1
    r = client.chat.completions.create(model=MODEL, messages=user_messages("Say hello."), max_tokens=3)
    assert r.choices[0].message.content == ref("Say hello.", 3).text


@pytest.mark.integration
def test_a_full_queue_answers_429_and_the_queued_request_still_completes(smollm2, ref):
    model, tok = smollm2
    # one request runs at a time (max_running=1), so the second waits and the third finds the queue full
    with background(create_app(model, tok, ServeConfig(MODEL, queue_size=1, timeout_s=600, max_running=1))) as url:
        cl = openai_client(url)
        long = cl.chat.completions.create(model=MODEL, messages=user_messages("Tell me a long story."), max_tokens=400,
                                          stream=True, extra_body={"fastprefill": {"ignore_eos": True}})
        next(c for c in long if c.choices and c.choices[0].delta.content)  # generating now
        waiting: list = []
        t = threading.Thread(target=lambda: waiting.append(
            cl.chat.completions.create(model=MODEL, messages=user_messages("Say hello."), max_tokens=3)))
        t.start()
        wait_health(url, lambda h: h["queue"]["waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as info:
            cl.chat.completions.create(model=MODEL, messages=user_messages("Say hello."), max_tokens=3)
        assert "queue of 1 is full" in info.value.body["message"]
        long.close()
        t.join(300)
        assert waiting and waiting[0].choices[0].message.content == ref("Say hello.", 3).text
        assert metric_value(url, "fastprefill_requests_total", outcome="queue_full") == 1
        after = cl.chat.completions.create(model=MODEL, messages=user_messages("Say hello."), max_tokens=3)
        assert after.choices[0].message.content == ref("Say hello.", 3).text


@pytest.mark.integration
def test_a_request_over_its_timeout_gets_504_and_the_generation_stops(smollm2):
    """A request past the server's timeout gets a 504 (whole: the status; streamed: an error
    event), at the deadline and never before it, and its generation stops short of max_tokens.

    Whatever the load: the 504 comes from the server's event loop at the deadline, not from the
    worker, and the client waits 150 times the server's timeout, so the server always answers
    first; each request goes to an idle server (under load, a prefill the timeout cut runs on to
    its first token and would eat the next request's time in the queue); time is bounded
    relative to the server's timeout and tokens by max_tokens, not by the machine's speed.
    """
    model, tok = smollm2
    timeout_s, max_tokens, tokens = 2.0, 500, "fastprefill_completion_tokens_total"
    with background(create_app(model, tok, ServeConfig(MODEL, timeout_s=timeout_s))) as url:
        kwargs = {"model": MODEL, "messages": user_messages("Tell me a long story."), "max_tokens": max_tokens,
                  "extra_body": {"fastprefill": {"ignore_eos": True}}}
        for stream in (False, True):
            cl = openai_client(url)  # a new connection each time: none the first request left idle is reused
            assert cl.timeout >= 100 * timeout_s  # no client-side timeout before the server's
            wait_health(url, is_idle)
            before, received = metric_value(url, tokens), 0
            sent = time.monotonic()
            with pytest.raises(openai.APIError) as info:
                if stream:
                    for chunk in cl.chat.completions.create(stream=True, **kwargs):
                        received += bool(chunk.choices and chunk.choices[0].delta.content)
                else:
                    cl.chat.completions.create(**kwargs)
            answered = time.monotonic() - sent
            err = info.value
            # whole: the status; streamed: the stream has begun (200), the 504 is its last event
            assert isinstance(err.body, dict), (stream, type(err).__name__, err, err.__cause__)  # an answer, not a lost connection
            assert isinstance(err, openai.APIStatusError) != stream and err.body["code"] == 504, (stream, err)
            assert "timeout of 2 s" in err.body["message"], err.body
            assert timeout_s <= answered < timeout_s + 30, (stream, answered)  # the deadline, plus the loop's poll
            wait_health(url, is_idle)
            generated = metric_value(url, tokens) - before
            assert received <= generated < max_tokens, (stream, received, generated)
        assert metric_value(url, "fastprefill_requests_total", outcome="timeout") == 2
        assert metric_value(url, "fastprefill_requests_total", outcome="ok") == 0


def _sse_data(resp: http.client.HTTPResponse) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream, as they arrive."""
    while line := resp.readline():
        text = line.decode().strip()
        if text.startswith("data: "):
            yield text[len("data: "):]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_sigterm_drains_the_stream_answers_the_waiting_and_exits_in_time(tmp_path):
    drain_s, n = 3.0, 1000
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    src = str(REPO / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "fastprefill.cli", "serve", "--port", str(port), "--threads", "1",
                             "--queue", "2", "--max-running", "1", "--drain-timeout", str(drain_s), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if http_request(url, "GET", "/health")[0] == 200:
                    break
            except ConnectionError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": n, "stream": True,
            "stream_options": {"include_usage": True}, "fastprefill": {"ignore_eos": True}}).encode(),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = _sse_data(resp)
        first = json.loads(next(events))
        assert first["choices"][0]["text"] is not None  # generating now
        waiting: list = []
        body = json.dumps({"model": MODEL, "prompt": "Say hello.", "max_tokens": 3}).encode()
        waiter = threading.Thread(target=lambda: waiting.append(http_request(url, "POST", "/v1/completions", body)))
        waiter.start()
        wait_health(url, lambda h: h["queue"]["waiting"] == 1)

        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        waiter.join(30)
        (status, answer), = waiting
        assert status == 503 and "shutting down" in answer["error"]["message"], answer
        status, answer = http_request(url, "POST", "/v1/completions", body)  # a new request while the stream drains
        assert status == 503 and "shutting down" in answer["error"]["message"], answer
        status, health = http_request(url, "GET", "/health")
        assert status == 503 and health["status"] == "draining"

        rest = list(events)
        conn.close()
        assert rest and rest[-1] == "[DONE]", rest[-3:]
        last = json.loads(rest[-2])
        if "error" in last:  # cut at the drain timeout: an error event, then [DONE]
            assert last["error"]["code"] == 503 and "shut down before" in last["error"]["message"]
        else:  # or finished in time: every token
            assert last["usage"]["completion_tokens"] == n
        proc.wait(drain_s + EXIT_GRACE_S)
        exited = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    output = (tmp_path / "server.log").read_text()
    assert proc.returncode == 0, output
    assert exited <= drain_s + EXIT_GRACE_S and "Traceback" not in output, (exited, output)


def test_load_benchmark_summary_counts_overhead_and_throughput():
    import serve_load as bench
    rec = bench.LoadRecord

    def server(sid, conc, ttft, wall=None):
        return rec("m", 512, "full", "server", conc, sid, 500, ttft, ttft + 1.0, 4, ttft * 0.9, 0.01, "a",
                   {"wall_s": wall} if wall else {})

    records = [
        rec("m", 512, "full", "inproc", 1, "s1", 500, 1.0, 2.0, 4, text="a"),
        rec("m", 512, "full", "inproc", 1, "s2", 500, 2.0, 3.0, 4, text="a"),
        server("s1", 1, 1.1), server("s2", 1, 2.0),
        server("s1", 2, 3.0, wall=5.0), server("s2", 2, 4.0, wall=5.0),
    ]
    one, two = bench.summarize(records)
    assert (one["concurrency"], two["concurrency"]) == (1, 2)
    assert one["inproc_ttft_p50_s"] == pytest.approx(1.5)
    assert one["overhead"] == pytest.approx(1.55 / 1.5)
    assert one["overhead_paired_median"] == pytest.approx((1.1 + 1.0) / 2)
    assert one["same_text"] is True
    assert one["transport_overhead"] == pytest.approx(1 / 0.9)
    assert one["requests_per_s"] == pytest.approx(2 / (2.1 + 3.0))  # one client: summed request times
    assert two["requests_per_s"] == pytest.approx(2 / 5.0) and two["tokens_per_s"] == pytest.approx(8 / 5.0)
    assert two["ttft_p50_s"] == pytest.approx(3.5) and "overhead" not in two
    table = bench.markdown([one, two], {"started": "t", "command": "c", "cpu": "x", "threads": 2, "torch": "t",
                                        "transformers": "t", "git_commit": "g", "requests": 2, "max_tokens": 4})
    assert "| m | 512 | full | 1 | 2 |" in table and "1.033 (1.050) | 1.111 |" in table


def test_committed_load_figures_reproduce_from_their_records():
    """Every committed ``serve_load_*`` and ``serve_runahead_load_*`` ``.summary.json`` equals
    ``summarize`` over its own records."""
    import serve_load as bench
    from fastprefill.bench.records import read_rows
    results = REPO / "benchmarks" / "results"
    committed = sorted([*results.glob("serve_load_*.summary.json"), *results.glob("serve_runahead_load_*.summary.json")])
    assert committed, "no committed serve_load summary"
    for path in committed:
        _, rows = read_rows(path.with_name(path.name.replace(".summary.json", ".jsonl")))
        recomputed = bench.summarize([bench.LoadRecord(**row) for row in rows])
        assert json.loads(json.dumps(recomputed)) == json.loads(path.read_text()), path.name
