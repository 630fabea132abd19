"""Honest health on ``fastprefill serve``: how soon ``/health`` answers 503 after a rank of the
default runahead method dies.

Each trial starts a fresh ``fastprefill serve --method runahead:procs=P`` (``--procs``, default
2; the server cannot restart a lost pool) as a subprocess on 127.0.0.1 (a free port; ``--threads``
for its own process, ``--threads-per-rank`` for each rank, ``--dtype``, uncompiled unless
``--compile``: compilation changes how fast a prefill runs, not how soon a death is seen, and
adds minutes to every start), waits until it listens and ``/health`` says 200 ``ok`` with every
rank up, and sends one chat request that must be answered (200, by runahead), so the ranks
serve. Then it reads the ranks' pids from ``/health`` (``ranks.pids``), kills one rank with
SIGKILL (trial ``i`` kills rank ``i mod P``), and polls ``/health`` every ``--poll`` seconds
until it answers 503: the seconds from just before the kill to the first 503's arrival (this
process's clock), that body's ``status`` and ``reason``, and the polls it took. A trial that
sees no 503 within ``--give-up`` seconds (or whose server failed) has no time and is failed,
never a fast one. Right after the 503 one chat request (no method: the default) is sent with a
``--request-timeout``: its HTTP status (expected 503 with a message naming the rank pool, never
a hang), its message and its seconds.

One more trial, ``degraded``: ``--method full --allow-method runahead:procs=P``, a rank killed the
same way; ``/health`` must turn to 200 ``degraded`` (not 503: the default method still runs), a
chat request with no method must get 200 and one naming runahead 503.

Rows in ``serve_health_<model>.jsonl``: the header (machine, dtype, threads, the exact command),
one ``kind: trial`` row per trial (``method``: ``default`` or ``allowed``), then the ``kind:
summary`` row (:func:`summarize`): the median and the slowest seconds to 503 over the default
trials (a failed trial counts as slower than any: with one, the slowest is none), whether every
trial got its 503 and whether its chat request got a 503, whether the slowest is within
:data:`GOAL_S`, and whether the degraded trial said what it should. The ``.md`` is
:func:`markdown` of them; ``python benchmarks/verify.py`` re-makes the summary and the ``.md``
from the trial rows.

Measured run (the lead schedules it; alone on the cores)::

    python benchmarks/serve_health.py --model qwen2.5-coder-0.5b --trials 5
    python benchmarks/serve_health.py --model qwen2.5-coder-1.5b --trials 5

Smoke run (a few minutes)::

    python benchmarks/serve_health.py --model smollm2-135m --trials 2 --out /tmp/health_smoke
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from fastprefill.host import DTYPES
from serve_load import ServerProcess, save_serve_record, serve_header
from serve_shared_doc import _num  # a table cell: "—" for none, yes / no, floats to 3 places

#: the goal: seconds from a rank's death to ``/health``'s first 503, at most
GOAL_S = 1.0
#: what every chat request asks (short: the answer is not what is measured)
PROMPT = "Say hello in one word."


# ------------------------------------------------------------------------------------------------ HTTP
def _call(url: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    """One GET (``body`` None) or JSON POST: ``status`` (None when no answer came: ``error`` says
    why), the parsed ``body`` (None if not JSON) and ``seconds``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, TimeoutError) as exc:  # refused, reset, timed out: no answer
        return {"status": None, "body": None, "seconds": time.perf_counter() - t0,
                "error": f"{type(exc).__name__}: {exc}"}
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    return {"status": status, "body": parsed, "seconds": time.perf_counter() - t0}


def health(server: ServerProcess, timeout: float = 5.0) -> dict[str, Any]:
    """``GET /health``: its HTTP status, body and seconds (see :func:`_call`)."""
    return _call(server.url.removesuffix("/v1") + "/health", None, timeout)


def chat(server: ServerProcess, model: str, timeout: float, max_tokens: int,
         method: str | None = None) -> dict[str, Any]:
    """One non-streamed chat request (``method``: the ``fastprefill`` field's, else the server's
    default): ``status`` (None: no answer in ``timeout`` s), ``seconds``, the method that answered
    (a 200's usage block) or the error's message."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens}
    if method is not None:
        body["fastprefill"] = {"method": method}
    r = _call(server.url + "/chat/completions", body, timeout)
    out = {"status": r["status"], "seconds": r["seconds"]}
    b = r["body"] if isinstance(r["body"], dict) else {}
    if r["status"] == 200:
        return {**out, "method": (b.get("usage") or {}).get("fastprefill", {}).get("method")}
    return {**out, "message": r.get("error") or (b.get("error") or {}).get("message")}


# ------------------------------------------------------------------------------------------------ trials
def _ready(server: ServerProcess, args: argparse.Namespace, named: str | None) -> list[int]:
    """Wait for the server, check ``/health`` says ``ok`` with every rank up and that a request on
    the ranks (``named``: the method it names, None: the default) is answered; the ranks' pids.

    Raises:
        RuntimeError: what is not as it should be.
    """
    server.wait_ready()
    h = health(server)
    body = h["body"] or {}
    ranks = body.get("ranks") or {}
    if h["status"] != 200 or body.get("status") != "ok" or not ranks.get("up"):
        raise RuntimeError(f"/health before the kill: {h['status']} {h['body']}")
    pids = ranks.get("pids") or []
    if len(pids) != args.procs or not all(isinstance(p, int) for p in pids):
        raise RuntimeError(f"/health names the ranks' pids {pids}, not {args.procs} local processes")
    warm = chat(server, args.model, args.request_timeout, args.max_tokens, method=named)
    if warm["status"] != 200 or not str(warm.get("method", "")).startswith("runahead"):
        raise RuntimeError(f"the request before the kill was not answered by runahead: {warm}")
    return pids


def _poll(server: ServerProcess, args: argparse.Namespace, t0: float,
          until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll ``/health`` every ``--poll`` s from ``t0`` until ``until(answer)`` or ``--give-up`` s:
    the seconds to that answer (None if it never came), its status and body, and the polls."""
    polls, last, tick = 0, None, t0
    while time.perf_counter() - t0 < args.give_up:
        last = health(server, timeout=max(args.poll, args.give_up - (time.perf_counter() - t0)))
        polls += 1
        if until(last):
            return {"seconds": time.perf_counter() - t0, "polls": polls, "http": last["status"], "body": last["body"]}
        tick += args.poll
        time.sleep(max(0.0, tick - time.perf_counter()))
    return {"seconds": None, "polls": polls, "http": None if last is None else last["status"],
            "body": None if last is None else last["body"]}


def trial(args: argparse.Namespace, i: int, allowed: bool) -> dict[str, Any]:
    """One server, one rank killed (rank ``i mod --procs``): the trial's row. ``allowed``: runahead
    only allowed beside ``full`` (the degraded trial), else the default method. Any failure is
    recorded in the row (``error``), never raised."""
    runahead = f"runahead:procs={args.procs}"
    methods = ["--method", "full", "--allow-method", runahead] if allowed else ["--method", runahead]
    extra = [*methods, "--threads-per-rank", str(args.threads_per_rank), *([] if args.compile else ["--no-compile"]),
             *args.server_arg]
    rank = i % args.procs
    row: dict[str, Any] = {"kind": "trial", "trial": i, "method": "allowed" if allowed else "default",
                           "spec": runahead, "rank": rank}
    server = ServerProcess(args.model, args.threads, queue=4, max_tokens=args.max_tokens, extra=extra, dtype=args.dtype)
    row["server_cmd"] = " ".join(server.cmd[1:])
    try:
        pids = _ready(server, args, runahead if allowed else None)
        row["pid"] = pids[rank]
        want = "degraded" if allowed else "unavailable"
        t0 = time.perf_counter()
        os.kill(pids[rank], signal.SIGKILL)
        seen = _poll(server, args, t0, lambda h: (h["body"] or {}).get("status") == want if allowed
                     else h["status"] == 503)
        body = seen["body"] or {}
        row |= {"seconds": seen["seconds"], "polls": seen["polls"], "health_http": seen["http"],
                "health_status": body.get("status"), "reason": body.get("reason"),
                "ranks_up": (body.get("ranks") or {}).get("up")}
        after = chat(server, args.model, args.request_timeout, args.max_tokens)
        row |= {"chat_http": after["status"], "chat_s": after["seconds"],
                "chat_said": after.get("message") or after.get("method")}
        if allowed:
            named = chat(server, args.model, args.request_timeout, args.max_tokens, method=runahead)
            row |= {"runahead_chat_http": named["status"], "runahead_chat_said": named.get("message")}
        row["error"] = None
    except Exception as exc:  # noqa: BLE001 - any failure is a result: the row says which
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        server.close()
    return row


# ------------------------------------------------------------------------------------------------ summary
def got_503(row: dict[str, Any]) -> bool:
    """A default trial that saw its 503 (a time, and the body ``unavailable``)."""
    return row.get("error") is None and row.get("seconds") is not None and row.get("health_http") == 503 \
        and row.get("health_status") == "unavailable"


def degraded_ok(row: dict[str, Any]) -> bool:
    """The degraded trial said what it should: 200 ``degraded``, the default answered, runahead 503."""
    return (row.get("error") is None and row.get("seconds") is not None and row.get("health_http") == 200
            and row.get("health_status") == "degraded" and row.get("chat_http") == 200
            and row.get("runahead_chat_http") == 503)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``kind: summary`` row of a run's trial rows (other rows are ignored). A default trial
    without its 503 counts as slower than every other: the median is none when half or more
    failed, and the slowest is none when any did, so ``within_goal`` is then False."""
    trials = [r for r in rows if r.get("kind") == "trial" and r["method"] == "default"]
    allowed = [r for r in rows if r.get("kind") == "trial" and r["method"] == "allowed"]
    times = sorted(r["seconds"] if got_503(r) else float("inf") for r in trials)
    median = statistics.median(times) if times else None
    slowest = times[-1] if times else None
    finite = (lambda x: None if x is None or x == float("inf") else x)
    every = bool(trials) and all(got_503(r) for r in trials)
    return {"kind": "summary", "trials": len(trials), "got_503": sum(got_503(r) for r in trials),
            "all_503": every, "median_s": finite(median), "max_s": finite(slowest),
            "within_goal": every and slowest <= GOAL_S,
            "chats_503": sum(r.get("chat_http") == 503 for r in trials),
            "all_chats_503": bool(trials) and all(r.get("chat_http") == 503 for r in trials),
            "degraded_trials": len(allowed), "degraded_ok": bool(allowed) and all(degraded_ok(r) for r in allowed)}


def _cell(text: Any) -> str:
    return _num(text).replace("|", "/").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], header: dict[str, Any]) -> str:
    """The run's tables: one row per trial, then the summary against :data:`GOAL_S`."""
    lines = [f"# Honest health: {header['model']}", "",
             (f"Each trial a fresh `fastprefill serve` ({header['threads']} thread(s), {header['procs']} ranks of "
              f"{header['threads_per_rank']} thread(s), {header.get('dtype')}); one rank killed with SIGKILL and "
              f"`/health` polled every {header['poll']} s until it answered 503 (default: runahead) or 200 "
              f"`degraded` (allowed: `--method full`, runahead allowed), giving up after {header['give_up']} s. "
              "Seconds: from just before the kill to that answer, this process's clock. Chat after: a request "
              "with no method sent right after; runahead chat: one naming runahead."), "",
             ("| trial | method | rank | seconds | polls | /health | status | reason | chat after | chat s "
              "| runahead chat | failed |"), "|---" * 12 + "|"]
    for r in (r for r in rows if r.get("kind") == "trial"):
        ok = got_503(r) if r["method"] == "default" else degraded_ok(r)
        cells = [r["trial"], r["method"], r["rank"], r.get("seconds"), r.get("polls"), r.get("health_http"),
                 r.get("health_status"), r.get("reason"), r.get("chat_http"), r.get("chat_s"),
                 r.get("runahead_chat_http"), "" if ok else (r.get("error") or "yes")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    s = summary
    lines += ["", f"Summary over {s['trials']} default trials (goal: 503 within {GOAL_S:g} s):", "",
              "| trials | got 503 | median s | slowest s | within goal | chats 503 | degraded trial ok |",
              "|---|---|---|---|---|---|---|",
              (f"| {s['trials']} | {s['got_503']} | {_num(s['median_s'])} | {_num(s['max_s'])} | "
               f"{_num(s['within_goal'])} | {s['chats_503']} | {_num(s['degraded_ok'])} |")]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ run
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--trials", type=int, default=5, help="servers whose default runahead loses a rank")
    p.add_argument("--procs", type=int, default=2, help="ranks of runahead:procs=N")
    p.add_argument("--poll", type=float, default=0.01, help="seconds between two /health polls")
    p.add_argument("--give-up", type=float, default=10.0, help="seconds after the kill a trial waits for its 503")
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds a chat request may take")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens each chat request may generate")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server's own process")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--compile", action="store_true", help="compile the model (default: --no-compile)")
    p.add_argument("--server-arg", action="append", default=[], help="an extra flag for fastprefill serve (repeatable)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file stem (default serve_health_<model>)")
    args = p.parse_args(argv)
    if min(args.trials, args.max_tokens, args.threads, args.threads_per_rank) < 1 or args.procs < 2:
        p.error("--trials, --max-tokens, --threads and --threads-per-rank must be >= 1, --procs >= 2")
    if not 0 < args.poll < args.give_up or args.request_timeout <= 0:
        p.error("--poll must be > 0 and below --give-up, --request-timeout > 0")
    rows = []
    for i in range(args.trials + 1):
        rows.append(trial(args, i, allowed=i == args.trials))
        print(f"trial {i}: {rows[-1]}", file=sys.stderr)
    header = serve_header(args, "serve-health", goal_s=GOAL_S)
    summary = summarize(rows)
    save_serve_record(args, header, [*rows, summary], markdown(rows, summary, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
