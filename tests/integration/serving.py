"""Helpers for the tests of the server (``test_serve*.py``): the model they serve, an ``openai``
client, raw HTTP, ``/metrics`` samples and polling ``/health``."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import openai
from prometheus_client.parser import text_string_to_metric_families

#: The zoo model every server test serves (the session's ``smollm2`` fixture).
MODEL = "smollm2-135m"


def openai_client(url: str) -> openai.OpenAI:
    """The official client for the server at ``url`` (no retries, a generous timeout)."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def http_request(url: str, method: str, path: str, body: bytes | Iterator[bytes] | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict | str]:
    """``(status, JSON body or text)``; a ``body`` iterator is sent chunked (no Content-Length)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        conn.request(method, path, body=body, headers={**({"Content-Type": "application/json"} if body else {}),
                                                       **(headers or {})},
                     encode_chunked=body is not None and not isinstance(body, bytes))
        resp = conn.getresponse()
        raw = resp.read().decode()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(raw) if ctype.startswith("application/json") else raw
    finally:
        conn.close()


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    _, text = http_request(url, "GET", "/metrics")
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_health(url: str, cond, timeout: float = 240.0) -> dict:
    """Poll ``/health`` until ``cond(health)``."""
    deadline = time.monotonic() + timeout
    while True:
        _, health = http_request(url, "GET", "/health")
        if cond(health):
            return health
        assert time.monotonic() < deadline, f"server never reached the state; last /health: {health}"
        time.sleep(0.05)


def is_idle(h: dict) -> bool:
    """A ``/health`` body of a server with nothing running or waiting."""
    return not h["busy"] and h["queue"]["waiting"] == 0


def user_messages(text: str) -> list[dict]:
    """A chat of one user message."""
    return [{"role": "user", "content": text}]


def leave_mid_stream(client: openai.OpenAI, prompt: str) -> None:
    """Ask for 400 tokens (past the end-of-sequence token), read two, and disconnect."""
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, stream=True,
                                       extra_body={"fastprefill": {"ignore_eos": True}})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got == 2:
            break
    stream.close()
