"""Soak of ``fastprefill serve``: minutes of mixed good and bad requests, disconnects and 10 MB
bodies, with the server's memory sampled. Goal: every request answered or refused (2xx, 4xx,
429; never a 500 or no answer at all) and the server's RSS flat within 10% after warm-up.

The script starts ``fastprefill serve`` as a subprocess on 127.0.0.1 (a free port; loopback
only) with a small ``--queue`` (so that 429s happen), ``--threads`` torch threads and a prefix
cache bounded by ``--prefix-cache-mb`` (small, so that it fills during warm-up and then evicts:
a flat RSS afterwards says its bound holds). Then, for ``--duration`` seconds, ``--clients``
threads send requests as fast as they are answered (a pause of up to ``--pause`` s between two),
drawn from a seeded deck holding every kind of :data:`KINDS` by its weight (reshuffled when
empty, so every kind comes up in each pass through the deck):

- good: chat completions whole and streamed, completions with token ids, and chat with LazyLLM
  (``extra_body={"fastprefill": {"method": "lazyllm"}}``), all through the ``openai`` client,
  on prompts from a small pool (a shared system preamble and a few documents): repeats hit
  the prefix cache; an answer's hash is kept, and the prompts whose greedy answer changed are
  counted (informative: a cached prefix may round differently);
- disconnects (deliberate): a stream the client closes after 1-3 tokens, and a raw request the
  client leaves after a moment or while sending its body;
- bad: invalid JSON, JSON nested 5000 deep, wrong field types, temperature NaN, a token id of
  2**70, an unknown route, GET on a POST route, an unknown model, a prompt longer than the
  model's context (raw HTTP, so the body is exactly the bad one);
- every ``--big-every`` s, a 10 MiB body (a completion whose prompt is 10 MiB of text).

Each request is a row: kind, HTTP status (``null``: no answer), latency, the error when there
was no answer. Every ``--sample-every`` s a row of the server process's RSS (its children
included), open descriptors and threads. A last row holds the server's request counters (its
``/metrics``), its exit code after SIGINT and the tracebacks in its log. :func:`summarize`
makes the verdict from those rows alone: 0 answers with a 500, 0 other 5xx but 503, 0
requests without an answer (deliberate disconnects aside), 0 streams cut short, 0 statuses
outside the kind's expected set, exit code 0 and no traceback in the server's log, and RSS
growth = max RSS after ``--warmup`` / RSS at the end of warm-up <= 1.10. psutil comes with
accelerate, a dependency of the package.

Result files (``benchmarks/results/serve_soak_<model>.*``: the rows as JSON lines under a header
with the command, the verdict as ``.summary.json``, a markdown table and a plot of RSS over time);
a rerun writes ``-run2``, ... unless ``--name STEM`` or ``--out FILE.jsonl`` names the file.

Measured run (the lead schedules it, alone on the machine; ten minutes)::

    python benchmarks/serve_soak.py --model smollm2-135m --duration 600 --threads 1

Smoke run (a minute)::

    python benchmarks/serve_soak.py --duration 45 --warmup 15 --sample-every 2 --big-every 10 --out /tmp/serve_soak
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import random
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

from fastprefill.bench.records import environment, result_name
from fastprefill.errors import FastprefillError
from fastprefill.host import DTYPES, resolve_dtype
from reporting import write_json, write_rows
from serve_load import ServerProcess

GOAL_GROWTH = 1.10
BIG_BODY_MIB = 10

#: Each kind's weight in the deck and the statuses it may get (``None``: the client leaves
#: without an answer, on purpose). A good request may find the queue full (429).
KINDS: dict[str, tuple[int, frozenset[int | None]]] = {
    "chat": (5, frozenset({200, 429})),
    "chat_stream": (4, frozenset({200, 429})),
    "completion_ids": (3, frozenset({200, 429})),
    "lazyllm": (3, frozenset({200, 429})),
    "disconnect_stream": (2, frozenset({200, 429})),
    "abandon": (2, frozenset({None})),
    "invalid_json": (1, frozenset({400})),
    "deep_json": (1, frozenset({400})),
    "wrong_types": (1, frozenset({400})),
    "nan_temperature": (1, frozenset({400})),
    "huge_token_id": (1, frozenset({400})),
    "unknown_route": (1, frozenset({404})),
    "wrong_http_method": (1, frozenset({405})),
    "unknown_model": (1, frozenset({404})),
    "long_prompt": (1, frozenset({400})),
}
#: Not in the deck: sent every ``--big-every`` seconds.
BIG = "big_body"
EXPECTED: dict[str, frozenset[int | None]] = {**{k: ok for k, (_, ok) in KINDS.items()}, BIG: frozenset({413})}
#: Kinds whose request is valid (a 2xx answer is right); the others must be refused.
GOOD = frozenset({"chat", "chat_stream", "completion_ids", "lazyllm", "disconnect_stream"})

WORDS = ("river", "stone", "light", "garden", "market", "winter", "paper", "window", "silver", "orange",
         "music", "engine", "forest", "letter", "harbor", "candle", "bridge", "mountain", "island",
         "cloud", "signal", "museum", "violin", "planet", "copper", "meadow", "lantern", "compass",
         "library", "village", "thunder", "quiet", "ancient", "bright", "narrow", "gentle", "distant",
         "hidden", "golden", "careful", "sudden", "early", "late", "open", "simple", "heavy", "small",
         "wide")


# --- the traffic --------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one request got: ``status`` (``None``: no answer), and for good ones the answer."""

    status: int | None
    answer: str | None = None
    complete: bool | None = None  # a stream: whether it ended with a finish reason
    error: str | None = None
    deliberate: bool = False  # the client left on purpose
    key: str | None = None  # (method, prompt, max_tokens): the same key must give the same greedy answer
    retry_after: float | None = None  # a 429 / 503: the seconds its Retry-After header asks for


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


class Prompts:
    """The pool of good prompts: a system preamble every chat shares and ``n`` documents."""

    def __init__(self, seed: int, n: int) -> None:
        rng = random.Random(f"prompts-{seed}")
        self.system = "You answer questions about short notes. " + " ".join(_sentence(rng, 12) for _ in range(8))
        self.docs = [" ".join(_sentence(rng, rng.randint(8, 16)) for _ in range(rng.randint(3, 10)))
                     for _ in range(n)]
        self.ids = [[rng.randrange(100, 5000) for _ in range(rng.randint(16, 160))] for _ in range(n)]

    def messages(self, i: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": f"Note: {self.docs[i]}\nWhat is the note about? Answer briefly."}]


class Traffic:
    """One client thread's requests against the server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, model: str, context: int, prompts: Prompts, args: argparse.Namespace) -> None:
        self.url, self.model, self.context, self.prompts = url, model, context, prompts
        self.max_tokens, self.timeout = args.max_tokens, args.client_timeout
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.client_timeout)
        u = urlparse(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80

    def send(self, kind: str, rng: random.Random) -> Outcome:
        """Send one request of ``kind``; the status it got, ``None`` for no answer."""
        try:
            return getattr(self, f"_{kind}")(rng)
        except openai.APIStatusError as exc:
            retry = exc.response.headers.get("retry-after")
            return Outcome(exc.status_code, retry_after=float(retry) if retry else None)
        except openai.APIConnectionError as exc:  # includes the client's timeout
            return Outcome(None, error=f"{type(exc).__name__}: {exc} ({exc.__cause__!r})")
        except openai.APIError as exc:  # an error event inside a stream: its code is the status
            code = exc.body.get("code") if isinstance(exc.body, Mapping) else None
            return Outcome(code if isinstance(code, int) else None, error=exc.message)
        except (OSError, http.client.HTTPException) as exc:
            return Outcome(None, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - e.g. an answer the client cannot parse: counted, not fatal
            return Outcome(None, error=f"unexpected on the client's side: {type(exc).__name__}: {exc}")

    # good -------------------------------------------------------------------------------------
    def _chat_common(self, rng: random.Random, stream: bool, method: str | None) -> Outcome:
        i, n = rng.randrange(len(self.prompts.docs)), rng.randint(1, self.max_tokens)
        extra = {"fastprefill": {"method": method}} if method else None
        key = f"chat {method or 'default'} prompt {i} max_tokens {n}"
        kwargs = {"model": self.model, "messages": self.prompts.messages(i), "max_tokens": n, "extra_body": extra}
        if not stream:
            r = self.client.chat.completions.create(**kwargs)
            return Outcome(200, r.choices[0].message.content or "", True, key=key)
        parts, finish = [], None
        for chunk in self.client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kwargs):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return Outcome(200, "".join(parts), finish is not None, key=key)

    def _chat(self, rng: random.Random) -> Outcome:
        return self._chat_common(rng, False, None)

    def _chat_stream(self, rng: random.Random) -> Outcome:
        return self._chat_common(rng, True, None)

    def _lazyllm(self, rng: random.Random) -> Outcome:
        return self._chat_common(rng, rng.random() < 0.5, "lazyllm")

    def _completion_ids(self, rng: random.Random) -> Outcome:
        i, n = rng.randrange(len(self.prompts.ids)), rng.randint(1, self.max_tokens)
        r = self.client.completions.create(model=self.model, prompt=self.prompts.ids[i], max_tokens=n)
        return Outcome(200, r.choices[0].text, True, key=f"ids prompt {i} max_tokens {n}")

    # disconnects ------------------------------------------------------------------------------
    def _disconnect_stream(self, rng: random.Random) -> Outcome:
        """A stream of 64 tokens the client closes after 1-3 of them."""
        stream = self.client.chat.completions.create(
            model=self.model, messages=self.prompts.messages(rng.randrange(len(self.prompts.docs))), max_tokens=64,
            stream=True, extra_body={"fastprefill": {"ignore_eos": True}})
        want, got = rng.randint(1, 3), 0
        try:
            for chunk in stream:
                got += bool(chunk.choices and chunk.choices[0].delta.content)
                if got >= want:
                    break
        finally:
            stream.close()
        return Outcome(200, deliberate=True)

    def _abandon(self, rng: random.Random) -> Outcome:
        """A raw completion the client leaves without reading: after a moment, or halfway through its body."""
        body = json.dumps({"model": self.model, "prompt": self.prompts.docs[rng.randrange(len(self.prompts.docs))],
                           "max_tokens": 32, "fastprefill": {"ignore_eos": True}}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
            if rng.random() < 0.3:  # gone while sending the body
                sock.sendall(head + body[: len(body) // 2])
                time.sleep(rng.uniform(0.0, 0.2))
            else:  # gone while the answer is on its way
                sock.sendall(head + body)
                time.sleep(rng.uniform(0.0, 0.5))
        return Outcome(None, deliberate=True)

    # bad ----------------------------------------------------------------------------------------
    def _raw(self, method: str, path: str, body: bytes | None = None) -> Outcome:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
            resp = conn.getresponse()
            resp.read()
            return Outcome(resp.status)
        finally:
            conn.close()

    def _json(self, path: str, doc: dict[str, Any]) -> Outcome:
        return self._raw("POST", path, json.dumps(doc).encode())

    def _invalid_json(self, rng: random.Random) -> Outcome:
        return self._raw("POST", "/v1/chat/completions",
                         f'{{"model": "{self.model}", "messages": [{{"role": "user", "content": "hi"}}'.encode())

    def _deep_json(self, rng: random.Random) -> Outcome:
        depth = rng.randint(2000, 8000)
        return self._raw("POST", "/v1/completions",
                         f'{{"model": "{self.model}", "prompt": '.encode() + b"[" * depth + b"]" * depth + b"}")

    def _wrong_types(self, rng: random.Random) -> Outcome:
        doc = rng.choice([{"messages": "hello", "max_tokens": 4}, {"messages": [{"role": "user", "content": 7}]},
                          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
                          {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}])
        return self._json("/v1/chat/completions", {"model": self.model, **doc})

    def _nan_temperature(self, rng: random.Random) -> Outcome:
        return self._raw("POST", "/v1/completions",
                         f'{{"model": "{self.model}", "prompt": "x", "temperature": NaN}}'.encode())

    def _huge_token_id(self, rng: random.Random) -> Outcome:
        return self._raw("POST", "/v1/completions", f'{{"model": "{self.model}", "prompt": [1, {2**70}]}}'.encode())

    def _unknown_route(self, rng: random.Random) -> Outcome:
        return self._raw(*rng.choice([("GET", "/v1/nope"), ("POST", "/v2/chat/completions"), ("POST", "/v1/engines")]),
                         b"{}")

    def _wrong_http_method(self, rng: random.Random) -> Outcome:
        return self._raw("GET", rng.choice(["/v1/chat/completions", "/v1/completions"]))

    def _unknown_model(self, rng: random.Random) -> Outcome:
        return self._json("/v1/chat/completions", {"model": "gpt-4o", "messages": self.prompts.messages(0)})

    def _long_prompt(self, rng: random.Random) -> Outcome:
        """A prompt of more tokens than the model's context (one token a word, and then some)."""
        return self._json("/v1/completions", {"model": self.model, "prompt": "word " * (self.context + 64),
                                              "max_tokens": 1})

    def _big_body(self, rng: random.Random) -> Outcome:
        """A completion whose body is 10 MiB, through the openai client (above the server's 8 MiB limit)."""
        self.client.completions.create(model=self.model, prompt="word " * (BIG_BODY_MIB * 2**20 // 5), max_tokens=1)
        return Outcome(200)


# --- the run ------------------------------------------------------------------------------------
class Rows:
    """The result file: the header, then each row appended (and flushed) as it comes."""

    def __init__(self, path: Path, header: Mapping[str, Any]) -> None:
        self.path, self.rows, self._lock = path, [], threading.Lock()
        write_rows(path, header, [])

    def add(self, row: dict[str, Any]) -> None:
        with self._lock, self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            self.rows.append(row)


class Deck:
    """Kinds to send, drawn in a seeded order from a deck of every kind by its weight; the
    10 MiB body every ``big_every`` seconds."""

    def __init__(self, seed: int, big_every: float, t0: float) -> None:
        self.rng = random.Random(f"deck-{seed}")
        self.cards: list[str] = []
        self.drawn = 0
        self.big_every, self.next_big = big_every, t0 + big_every
        self._lock = threading.Lock()

    def draw(self) -> tuple[int, str]:
        with self._lock:
            self.drawn += 1
            if self.big_every > 0 and time.monotonic() >= self.next_big:
                self.next_big += self.big_every
                return self.drawn, BIG
            if not self.cards:
                self.cards = [k for k, (w, _) in KINDS.items() for _ in range(w)]
                self.rng.shuffle(self.cards)
            return self.drawn, self.cards.pop()


def _sample(proc: psutil.Process, t: float) -> dict[str, Any] | None:
    """The server's memory now (``None`` once it has exited)."""
    try:
        children = proc.children(recursive=True)
        own = proc.memory_info().rss
        fds, threads = proc.num_fds(), proc.num_threads()
    except psutil.Error:
        return None
    rss = own
    for child in children:
        try:
            rss += child.memory_info().rss
        except psutil.Error:  # ended meanwhile
            pass
    return {"row": "sample", "t": round(t, 3), "rss_mb": rss / 2**20, "server_rss_mb": own / 2**20,
            "children": len(children), "fds": fds, "threads": threads}


def _request_counts(url: str) -> dict[str, float]:
    """The server's ``fastprefill_requests_total`` by outcome (empty if it does not answer)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return {}
    finally:
        conn.close()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "fastprefill_requests_total":
                counts[s.labels["outcome"]] += s.value
    return dict(counts)


def soak(args: argparse.Namespace, rows: Rows, server: ServerProcess) -> None:
    """Send the traffic for ``args.duration`` seconds and sample the server; rows go to ``rows``."""
    base = server.url.removesuffix("/v1")
    context = int(server.client().models.list().data[0].model_extra.get("context_length") or 8192)
    prompts = Prompts(args.seed, args.prompts)
    proc = psutil.Process(server.proc.pid)
    t0 = time.monotonic()
    end = t0 + args.duration
    deck = Deck(args.seed, args.big_every, t0)
    stop = threading.Event()

    def sampler() -> None:
        while (row := _sample(proc, time.monotonic() - t0)) is not None:
            rows.add(row)
            if stop.wait(args.sample_every):
                return

    def client(c: int) -> None:
        traffic = Traffic(base, server.model, context, prompts, args)
        pause = random.Random(f"pause-{args.seed}-{c}")
        while time.monotonic() < end:
            n, kind = deck.draw()
            start = time.monotonic()
            out = traffic.send(kind, random.Random(f"request-{args.seed}-{n}"))
            latency = time.monotonic() - start
            row = {"row": "request", "n": n, "client": c, "t": round(start - t0, 3), "kind": kind,
                   "status": out.status, "latency_s": round(latency, 4), "deliberate": out.deliberate}
            if out.complete is not None:
                row["complete"] = out.complete
            if out.answer is not None and out.key is not None:
                row["key"] = out.key
                row["answer"] = hashlib.sha1(out.answer.encode()).hexdigest()[:12]
            if out.error is not None:
                row["error"] = out.error[:300]
            rows.add(row)
            # a refused client waits as the server asks (not for long), as a well-behaved one does
            time.sleep(min(out.retry_after or 0.0, 5.0) + pause.uniform(0.0, args.pause))

    sampling = threading.Thread(target=sampler, name="soak-sampler", daemon=True)
    sampling.start()
    # daemons: an interrupted soak stops its server and exits without waiting for the clients
    clients = [threading.Thread(target=client, args=(c,), name=f"soak-client-{c}", daemon=True)
               for c in range(args.clients)]
    for t in clients:
        t.start()
    last_report = t0
    while any(t.is_alive() for t in clients):
        for t in clients:
            t.join(1.0)
        if time.monotonic() - last_report >= 30:
            last_report = time.monotonic()
            done = sum(r["row"] == "request" for r in rows.rows)
            rss = next((r["rss_mb"] for r in reversed(rows.rows) if r["row"] == "sample"), 0.0)
            print(f"{last_report - t0:6.0f} s: {done} requests, server RSS {rss:.0f} MB", file=sys.stderr, flush=True)
    stop.set()
    sampling.join()
    if (row := _sample(proc, time.monotonic() - t0)) is not None:
        rows.add(row)


# --- report ------------------------------------------------------------------------------------
def _nearest(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values``, one of them (nearest rank)."""
    return float(np.percentile(values, q, method="nearest"))


def _status_name(row: Mapping[str, Any]) -> str:
    if row["status"] is None:
        return "left" if row.get("deliberate") else "no answer"
    return str(row["status"])


#: The request counts a soak must keep at 0.
ZERO = ("status_500", "other_5xx", "no_answer", "streams_cut_short", "bad_accepted", "unexpected_status")


def summarize(header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The verdict of a soak from its rows (see the module doc): counts, checks, RSS growth."""
    reqs = [r for r in rows if r["row"] == "request"]
    samples = [r for r in rows if r["row"] == "sample"]
    end = next((r for r in rows if r["row"] == "end"), {})
    by_kind: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    latency: dict[str, list[float]] = defaultdict(list)
    for r in reqs:
        by_kind[r["kind"]][_status_name(r)] += 1
        if r["status"] is not None and r["status"] != 429:  # a full queue's refusals come at once
            latency[r["kind"]].append(r["latency_s"])
    answers: dict[str, set[str]] = defaultdict(set)
    for r in reqs:
        if r["status"] == 200 and "answer" in r:
            answers[r["key"]].add(r["answer"])
    checks = {
        "status_500": sum(r["status"] == 500 for r in reqs),
        "other_5xx": sum(r["status"] is not None and r["status"] >= 500 and r["status"] not in (500, 503)
                         for r in reqs),
        "no_answer": sum(r["status"] is None and not r.get("deliberate") for r in reqs),
        "streams_cut_short": sum(r["status"] == 200 and r.get("complete") is False for r in reqs),
        "bad_accepted": sum(r["kind"] not in GOOD and r["status"] is not None and r["status"] < 300 for r in reqs),
        "unexpected_status": sum(r["status"] not in EXPECTED.get(r["kind"], ()) for r in reqs),
        "server_exit_code": end.get("server_exit_code"),
        "server_tracebacks": end.get("server_tracebacks"),
    }
    warmup = header["warmup_s"]
    after = [s for s in samples if s["t"] >= warmup]
    rss: dict[str, Any] = {"samples": len(samples), "warmup_s": warmup}
    if samples:
        rss["start_mb"] = samples[0]["rss_mb"]
        rss["warmup_peak_mb"] = max(s["rss_mb"] for s in samples if s["t"] < warmup) if samples[0]["t"] < warmup \
            else None
    if len(after) >= 2:
        base = after[0]
        rss.update(baseline_mb=base["rss_mb"], baseline_t=base["t"], max_mb=max(s["rss_mb"] for s in after),
                   last_mb=after[-1]["rss_mb"], last_t=after[-1]["t"])
        rss["growth_max"] = rss["max_mb"] / base["rss_mb"]
        rss["growth_last"] = rss["last_mb"] / base["rss_mb"]
        ts, ms = [s["t"] for s in after], [s["rss_mb"] for s in after]
        rss["slope_mb_per_min"] = 60 * statistics.linear_regression(ts, ms).slope if len(set(ts)) > 1 else 0.0
        rss["fds_baseline"], rss["fds_max"], rss["fds_last"] = base["fds"], max(s["fds"] for s in after), after[-1]["fds"]
        rss["threads_baseline"], rss["threads_last"] = base["threads"], after[-1]["threads"]
    failures = [f"{k} = {checks[k]}" for k in ZERO if checks[k]]
    if checks["server_exit_code"] != 0:
        failures.append(f"server exit code {checks['server_exit_code']}")
    if checks["server_tracebacks"]:
        failures.append(f"{checks['server_tracebacks']} tracebacks in the server's log")
    if "growth_max" not in rss:
        failures.append("fewer than 2 RSS samples after warm-up")
    elif rss["growth_max"] > header["goal_growth"]:
        failures.append(f"RSS grew {rss['growth_max']:.3f}x after warm-up (goal <= {header['goal_growth']})")
    return {
        "pass": not failures, "failures": failures,
        "duration_s": max((r["t"] + r["latency_s"] for r in reqs), default=0.0),
        "requests": len(reqs),
        "statuses": dict(sorted(Counter(_status_name(r) for r in reqs).items())),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "latency_s": {k: {"p50": _nearest(v, 50), "p95": _nearest(v, 95), "max": max(v)} for k, v in sorted(latency.items())},
        "checks": checks,
        "rss": rss,
        "answers_varying": sorted(k for k, v in answers.items() if len(v) > 1),
        "answer_keys": len(answers),
        "server_requests_total": end.get("server_requests_total", {}),
    }


def _num(d: Mapping[str, float] | None, key: str) -> str:
    return "" if d is None else f"{d[key]:.3f}"


def markdown(summary: Mapping[str, Any], header: Mapping[str, Any], plot: str | None = None) -> str:
    s, rss, c = summary, summary["rss"], summary["checks"]
    ok = {True: "✓", False: "✗"}
    lines = [
        f"# fastprefill serve soak: {'PASS' if s['pass'] else 'FAIL'} ({header['started']})", "",
        f"`{header['command']}`", "",
        (f"{header['model']} behind `fastprefill serve` ({header['threads']} torch thread(s), queue {header['queue']}, "
         f"timeout {header['server_timeout_s']:g} s, prefix cache {header['prefix_cache_mb']:g} MiB), "
         f"{header['clients']} client threads for {s['duration_s']:.0f} s (seeded mix, seed {header['seed']}; "
         f"a {BIG_BODY_MIB} MiB body every {header['big_every_s']:g} s), RSS of the server (children included) "
         f"every {header['sample_every_s']:g} s; {header['cpu']}, torch {header['torch']}, commit "
         f"{header['git_commit']}. {s['requests']} requests."), "",
        "| check | value | goal | |", "|---|---|---|---|",
    ]
    for key, what in (("status_500", "answered with a 500"), ("other_5xx", "answered with another 5xx but 503"),
                      ("no_answer", "no answer (connection error or timeout; deliberate disconnects aside)"),
                      ("streams_cut_short", "200 streams that ended without a finish reason"),
                      ("bad_accepted", "bad requests answered 2xx"),
                      ("unexpected_status", "statuses outside the kind's expected set"),
                      ("server_tracebacks", "tracebacks in the server's log"), ("server_exit_code", "server exit code (SIGINT)")):
        lines.append(f"| {what} | {c[key]} | 0 | {ok[c[key] == 0]} |")
    if "growth_max" in rss:
        lines.append(f"| RSS max after warm-up / RSS at its end | {rss['growth_max']:.3f} | <= {header['goal_growth']} | "
                     f"{ok[rss['growth_max'] <= header['goal_growth']]} |")
        lines += ["", (f"RSS: {rss['start_mb']:.0f} MB once ready, {rss['baseline_mb']:.0f} MB at the end of warm-up "
                       f"(t = {rss['baseline_t']:.0f} s), max {rss['max_mb']:.0f} MB after it, {rss['last_mb']:.0f} MB "
                       f"at the end (x{rss['growth_last']:.3f}); trend after warm-up {rss['slope_mb_per_min']:+.2f} "
                       f"MB/min. Open descriptors {rss['fds_baseline']} -> {rss['fds_last']} (max {rss['fds_max']}), "
                       f"threads {rss['threads_baseline']} -> {rss['threads_last']}.")]
    if plot:
        lines += ["", f"![RSS over time]({plot})"]
    statuses = sorted({st for v in s["by_kind"].values() for st in v}, key=lambda x: (not x.isdigit(), x))
    lines += ["", f"| kind | n | {' | '.join(statuses)} | expected | latency p50 (s; 429s aside) | p95 (s) |",
              "|---|---|" + "---|" * len(statuses) + "---|---|---|"]
    for kind, counts in s["by_kind"].items():
        lat = s["latency_s"].get(kind)
        expected = ", ".join("left" if x is None else str(x) for x in sorted(EXPECTED[kind], key=lambda x: x or 0))
        lines.append(f"| {kind} | {sum(counts.values())} | " + " | ".join(str(counts.get(st, "")) for st in statuses)
                     + f" | {expected} | {_num(lat, 'p50')} | {_num(lat, 'p95')} |")
    lines += ["", (f"Greedy answers: {s['answer_keys']} (method, prompt, max_tokens) keys answered 200, "
                   f"{len(s['answers_varying'])} with more than one answer (informative: a prompt served from the "
                   "prefix cache may round differently). Server counters (fastprefill_requests_total): "
                   + ", ".join(f"{k} {v:g}" for k, v in sorted(s["server_requests_total"].items())) + ".")]
    if s["failures"]:
        lines += ["", "Failures: " + "; ".join(s["failures"]) + "."]
    return "\n".join(lines) + "\n"


def plot_rss(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], header: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [r for r in rows if r["row"] == "sample"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([s["t"] for s in samples], [s["rss_mb"] for s in samples], marker=".", label="server RSS")
    ax.axvline(header["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    if "baseline_mb" in summary["rss"]:
        ax.axhline(summary["rss"]["baseline_mb"] * header["goal_growth"], color="red", linestyle="--",
                   label=f"baseline x {header['goal_growth']}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(f"fastprefill serve soak, {header['model']}: {'PASS' if summary['pass'] else 'FAIL'}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------
def _files(args: argparse.Namespace) -> tuple[Path, str]:
    """``(folder, stem)``: ``--out FILE.jsonl`` names the file (replaced), ``--name`` the stem in
    ``--out`` (replaced); otherwise a stem no earlier run has (``result_name``)."""
    out = Path(args.out)
    if out.suffix == ".jsonl":
        return out.parent, out.name.removesuffix(".jsonl")
    return out, result_name(out, f"serve_soak_{args.model}", name=args.name)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """The soak: its summary and the result folder (files ``<stem>.*`` written)."""
    folder, stem = _files(args)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="serve_soak_") as tmp:
        log = Path(tmp) / "server.log"
        server = ServerProcess(args.model, args.threads, args.queue, args.max_tokens, timeout_s=args.server_timeout,
                               prefix_cache_mb=args.prefix_cache_mb, log=log, dtype=args.dtype)
        header = {**environment(args.threads, resolve_dtype(args.dtype)), "bench": "serve-soak",
                  "model": args.model, "duration_s": args.duration, "warmup_s": args.warmup,
                  "clients": args.clients, "queue": args.queue,
                  "max_tokens": args.max_tokens, "server_timeout_s": args.server_timeout,
                  "client_timeout_s": args.client_timeout, "prefix_cache_mb": args.prefix_cache_mb,
                  "prompts": args.prompts, "big_every_s": args.big_every, "big_body_mib": BIG_BODY_MIB,
                  "sample_every_s": args.sample_every, "pause_s": args.pause, "seed": args.seed,
                  "goal_growth": GOAL_GROWTH, "kinds": {k: w for k, (w, _) in KINDS.items()},
                  "server_command": " ".join(["fastprefill", *server.cmd[3:]])}
        rows = Rows(folder / f"{stem}.jsonl", header)
        try:
            server.wait_ready()
            soak(args, rows, server)
            counts = _request_counts(server.url.removesuffix("/v1"))
        finally:
            server.close()
        text = log.read_text(errors="replace")
        tracebacks = len(re.findall(r"^Traceback", text, flags=re.MULTILINE))
        rows.add({"row": "end", "server_exit_code": server.proc.returncode, "server_tracebacks": tracebacks,
                  "server_requests_total": counts,
                  "server_log_tail": text[-3000:] if tracebacks or server.proc.returncode else ""})
    summary = summarize(header, rows.rows)
    write_json(folder / f"{stem}.summary.json", summary)
    plot_rss(rows.rows, summary, header, folder / f"{stem}.png")
    (folder / f"{stem}.md").write_text(markdown(summary, header, f"{stem}.png"))
    return summary, folder / f"{stem}.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the RSS baseline")
    p.add_argument("--clients", type=int, default=4, help="client threads")
    p.add_argument("--queue", type=int, default=2, help="the server's --queue (small: 429s happen)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES), help="the server's --dtype (default auto)")
    p.add_argument("--max-tokens", type=int, default=16, help="a good request asks for 1 to this many tokens")
    p.add_argument("--server-timeout", type=float, default=60.0, help="the server's --timeout (s)")
    p.add_argument("--client-timeout", type=float, default=300.0, help="the clients' timeout (s)")
    p.add_argument("--prefix-cache-mb", type=float, default=64.0, help="the server's --prefix-cache-mb")
    p.add_argument("--prompts", type=int, default=12, help="good prompts in the pool (repeats hit the prefix cache)")
    p.add_argument("--big-every", type=float, default=30.0, help="seconds between two 10 MiB bodies (0: none)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between two RSS samples")
    p.add_argument("--pause", type=float, default=0.2, help="a client waits up to this long between two requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results", help="folder, or FILE.jsonl (then replaced)")
    p.add_argument("--name", default=None, help="file stem in --out (replaced; default serve_soak_<model>, or "
                                                "-run2, ... when taken)")
    args = p.parse_args(argv)
    if args.duration <= 0 or not 0 <= args.warmup < args.duration:
        p.error("--duration must be > 0 and --warmup in [0, --duration)")
    if min(args.clients, args.queue, args.max_tokens, args.prompts) < 1 or args.sample_every <= 0:
        p.error("--clients, --queue, --max-tokens, --prompts must be >= 1 and --sample-every > 0")
    if args.client_timeout <= args.server_timeout:
        p.error("--client-timeout must be above --server-timeout (the server answers a timeout with 504 first)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        summary, md = run(parse_args(argv))
    except FastprefillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(md.read_text())
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped soak still stops its server
    sys.exit(main())
