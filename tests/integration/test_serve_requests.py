"""The request processor: a request is prepared once, tokenized once, its method resolved once
and its backend chosen once, after the method (counted on the real model's tokenizer, no server)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

import fastprefill.serve.requests as requests_module
from fastprefill.serve.backends import Backends
from fastprefill.serve.config import ServeConfig
from fastprefill.serve.method_table import MethodTable
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.protocol import CompletionRequest
from fastprefill.serve.requests import Refused, RequestProcessor

BODIES = {
    "text": (False, {"prompt": "The sky is", "echo": True}),
    "ids": (False, {"prompt": [504, 3733, 314], "echo": True}),
    "one message": (True, {"messages": [{"role": "user", "content": "The sky is"}]}),
    "conversation": (True, {"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "The sky is"}]}),
}


@pytest.fixture
def processor(smollm2):
    model, tok = smollm2
    backends = Backends(model, tok, None, None)
    config = ServeConfig(model_name="m", prefix_cache_mb=0)
    proc = RequestProcessor(model, tok, config, MethodTable(model, "full", (), backends), backends, ServeMetrics())
    yield proc
    proc.close()


def _process(proc: RequestProcessor, chat: bool, fields: dict) -> object:
    body = json.dumps({"model": "m", "max_tokens": 2, **fields}).encode()
    return asyncio.run(proc.process(body, chat, 0.0))


@pytest.mark.integration
@pytest.mark.parametrize("kind", list(BODIES))
def test_a_request_is_prepared_once_and_its_backend_chosen_after_its_method(processor, smollm2, kind, monkeypatch):
    _, tok = smollm2
    calls: Counter[str] = Counter()
    order: list[str] = []

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            order.append(name)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(requests_module, "prepare_request", counted("prepare", requests_module.prepare_request))
    monkeypatch.setattr(Backends, "for_method", counted("backend", Backends.for_method))
    monkeypatch.setattr(CompletionRequest, "single_prompt", counted("single_prompt", CompletionRequest.single_prompt))
    monkeypatch.setattr(type(tok), "__call__", counted("tokenize", type(tok).__call__))
    monkeypatch.setattr(type(tok), "apply_chat_template", counted("template", type(tok).apply_chat_template))
    chat, fields = BODIES[kind]
    job = _process(processor, chat, fields)
    assert calls["prepare"] == 1 and calls["backend"] == 1
    assert order.index("prepare") < order.index("backend")  # the backend of the method as resolved
    assert calls["tokenize"] == (0 if kind == "ids" else 1)
    assert calls["template"] == (1 if chat else 0) and calls["single_prompt"] == (0 if chat else 1)
    assert job.input_ids.shape[0] == 1 and job.backend is processor.backends.local
    assert job.name == "full" and job.label == "full"
    if kind == "text":
        assert job.echo == "The sky is"
    elif kind == "ids":
        assert job.echo == tok.decode([504, 3733, 314])


@pytest.mark.integration
def test_every_refusal_comes_from_the_processor_with_the_label_of_the_method(processor):
    cases = [
        (False, {"prompt": "x", "temperature": -1}, "invalid", 400, "temperature"),
        (False, {"prompt": "x", "model": "other"}, "invalid", 404, "model"),
        (False, {"prompt": "x", "fastprefill": {"method": "nope"}}, "invalid", 400, "fastprefill.method"),
        (False, {"prompt": "\x00"}, "full", 400, "prompt"),
        (False, {"prompt": [1, 10**9]}, "full", 400, "prompt"),
        (True, {"messages": [{"role": "user", "content": "a " * 9000}]}, "full", 400, "messages"),
    ]
    for chat, fields, label, status, param in cases:
        body = {"model": "m", "max_tokens": 2, **fields}
        with pytest.raises(Refused) as info:
            asyncio.run(processor.process(json.dumps(body).encode(), chat, 0.0))
        assert (info.value.label, info.value.error.status, info.value.error.param) == (label, status, param), fields
