"""Many users, one document, on ``fastprefill serve``: questions over the same new document
arriving together, and a follow-up sent while the first answer still streams.

Starts ``fastprefill serve`` as a subprocess on 127.0.0.1 (a free port; its defaults: the
interleaved scheduler, the prefix cache on; ``--threads``, ``--dtype`` and every
``--server-arg``), sends one discarded warm-up question and its follow-up, then runs
``--rounds`` rounds. Each round takes three new documents (SQuAD v2 articles cut to about
``--tokens`` tokens, :func:`fastprefill.data.tasks.sessions.document_sessions`, test split; each
prompt the document then one of its questions, :func:`question_prompt`, sent as one user
message, which the server renders with the chat template). No document is sent in two cells or
two rounds, so every "new" document is new to the server's cache. Every request is a streamed
chat completion through the real ``openai`` client; TTFT is the client's clock, from sending it
to its first content chunk; the usage block's cached tokens and the server's own TTFT are
recorded beside it.

- **together**: ``--requests`` requests, each another question over one new document, request
  ``i`` sent at ``i * --spread / --requests`` seconds, each in its own thread. ``/metrics`` is
  read before and after: the prompt tokens the server prefilled (``computed``), served from its
  cache (``cached``) and got by in-flight sharing (``shared``) in the burst.
- **alone**: one question over another new document of about the same length on the idle
  server (a cold prompt). Rounds alternate which of together and alone goes first.
- **follow-up**: request A over a third new document generates ``--follow-tokens`` tokens
  (``ignore_eos``); ``--follow-delay`` seconds after A's first token, B (another question over
  the document) is sent while A still streams. Once both are done, C (a third question) is a
  prefix-cache hit on the idle server.

Goals (docs: the server's "many users, one document" goals), each a ratio per round, reported
as the median and min-max over rounds (:func:`summarize`): the burst's prefilled tokens / (the
document's tokens + each question's own tokens) <= 1.1; the burst's median TTFT / alone's <=
1.3 and its slowest / alone's <= 2; TTFT(B) / TTFT(C) <= 1.5. A request that failed (or is
missing) makes its round's ratios empty and is listed as failed, never counted as a fast one.

Rows in ``serve_shared_doc_<model>.jsonl``: the header (machine, dtype, threads, the exact
command), one ``kind: request`` row per request, a ``kind: cell`` row per cell (its ``/metrics``
deltas and the prompts' token counts), then the ``kind: summary`` rows; the ``.md`` is
:func:`markdown` of them. ``python benchmarks/verify.py`` re-makes both from the request and cell
rows.

Measured run (the lead schedules it; alone on the cores)::

    python benchmarks/serve_shared_doc.py --model qwen2.5-coder-0.5b --tokens 4096 --requests 8 --rounds 3
    python benchmarks/serve_shared_doc.py --model qwen2.5-coder-1.5b --tokens 4096 --requests 8 --rounds 3

Smoke run (a few minutes)::

    python benchmarks/serve_shared_doc.py --model smollm2-135m --tokens 512 --requests 4 --rounds 1 \\
        --out /tmp/shared_smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fastprefill.data.tasks.sessions import DocumentSession, document_sessions, question_prompt
from fastprefill.errors import ConfigError
from fastprefill.host import DTYPES
from serve_load import ServerProcess, ask_chat, save_serve_record, serve_header
from serve_load_mixed import _tokenizer

#: ratio -> its goal (at most)
GOALS = {"prefill_ratio": 1.1, "median_ratio": 1.3, "slowest_ratio": 2.0, "followup_ratio": 1.5}
#: the ``/metrics`` counters read around each cell (summed over the method label)
COUNTERS = {"computed": "fastprefill_prompt_tokens_computed_total",
            "cached": "fastprefill_prompt_tokens_cached_total",
            "shared": "fastprefill_prompt_tokens_shared_total"}
#: the documents of a round: together, alone, follow-up
PER_ROUND = 3


def pick_sessions(tok: Any, tokens: int, count: int, questions: int, seed: int = 0) -> list[DocumentSession]:
    """``count`` distinct sessions of at most ``tokens`` document tokens with ``questions``
    questions each: the longest ``count`` of a somewhat larger pool when the split has one (so
    the documents are about equally long), in the pool's seeded order.

    Raises:
        ConfigError: the test split has fewer than ``count`` such articles.
    """
    try:
        pool = document_sessions(tok, tokens, count + max(2, count // 2), questions, split="test", seed=seed)
    except ConfigError:
        try:
            pool = document_sessions(tok, tokens, count, questions, split="test", seed=seed)
        except ConfigError as exc:
            raise ConfigError(f"not enough new documents of about {tokens} tokens with {questions} questions "
                              f"for this run ({count} documents): {exc}") from None
    length = {s.id: len(tok(s.document, add_special_tokens=False)["input_ids"]) for s in pool}
    keep = {s.id for s in sorted(pool, key=lambda s: -length[s.id])[:count]}
    return [s for s in pool if s.id in keep]


def _prompt_ids(tok: Any, content: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def token_counts(tok: Any, contents: list[str]) -> dict[str, Any]:
    """The prompts' token counts as the chat template renders them: ``document_tokens`` (the
    prefix they all share: the document; a lone prompt's whole length) and each one's
    ``own_tokens`` (the rest: its question)."""
    ids = [_prompt_ids(tok, c) for c in contents]
    common = len(os.path.commonprefix(ids)) if len(ids) > 1 else len(ids[0])
    return {"document_tokens": common, "own_tokens": [len(x) - common for x in ids]}


def prompt_counters(base_url: str) -> dict[str, float]:
    """The server's prompt-token counters of :data:`COUNTERS` (summed over methods)."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    totals = dict.fromkeys(COUNTERS, 0.0)
    names = {name: key for key, name in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                totals[names[s.name]] += s.value
    return totals


def _request(client: Any, model: str, where: dict[str, Any], session: DocumentSession, q: int, max_tokens: int,
             **kw: Any) -> dict[str, Any]:
    """One request's row; a request that raised is recorded with ``ok: False`` and its error."""
    row = {"kind": "request", **where, "session": session.id, "question": q}
    try:
        return {**row, "ok": True, **ask_chat(client, model, question_prompt(session, q), max_tokens, **kw)}
    except Exception as exc:  # noqa: BLE001 - any failure is a result: the row says which
        return {**row, "ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _cell_row(rnd: int, cell: str, before: dict[str, float], after: dict[str, float],
              counts: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "cell", "round": rnd, "cell": cell, "requests": len(counts["own_tokens"]), **counts,
            **{f"{k}_tokens": int(after[k] - before[k]) for k in COUNTERS}}


def together(server: ServerProcess, tok: Any, rnd: int, session: DocumentSession, n: int,
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """``n`` questions over ``session``'s document, request ``i`` at ``i * spread / n`` seconds."""
    client, rows = server.client(), [None] * n
    before = prompt_counters(server.url)
    start = time.perf_counter() + 0.2

    def one(i: int) -> None:
        time.sleep(max(0.0, start + i * args.spread / n - time.perf_counter()))
        rows[i] = _request(client, args.model, {"round": rnd, "cell": "together", "i": i}, session, i,
                           args.max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = token_counts(tok, [question_prompt(session, i) for i in range(n)])
    return [*rows, _cell_row(rnd, "together", before, prompt_counters(server.url), counts)]


def alone(server: ServerProcess, tok: Any, rnd: int, session: DocumentSession,
          args: argparse.Namespace) -> list[dict[str, Any]]:
    """One question over a new document on the idle server."""
    before = prompt_counters(server.url)
    row = _request(server.client(), args.model, {"round": rnd, "cell": "alone", "i": 0}, session, 0, args.max_tokens)
    return [row, _cell_row(rnd, "alone", before, prompt_counters(server.url),
                           token_counts(tok, [question_prompt(session, 0)]))]


def followup(server: ServerProcess, tok: Any, rnd: int, session: DocumentSession,
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """A streams ``--follow-tokens`` tokens; B is sent ``--follow-delay`` s after A's first token;
    C once both are done (a hit on the idle server)."""
    client, first, marks, a_row = server.client(), threading.Event(), {}, {}
    before = prompt_counters(server.url)

    def run_a() -> None:
        try:
            a_row.update(_request(client, args.model, {"round": rnd, "cell": "followup_a", "i": 0}, session, 0,
                                  args.follow_tokens, ignore_eos=True,
                                  on_first=lambda t: (marks.setdefault("a_first", t), first.set())))
        finally:
            marks["a_done"] = time.perf_counter()
            first.set()  # also when A failed before its first token

    thread = threading.Thread(target=run_a)
    thread.start()
    first.wait()
    where = {"round": rnd, "cell": "followup_b", "i": 1}
    if "a_first" in marks:
        time.sleep(max(0.0, marks["a_first"] + args.follow_delay - time.perf_counter()))
        sent = time.perf_counter()
        b_row = {**_request(client, args.model, where, session, 1, args.max_tokens),
                 "sent_after_a_first_s": sent - marks["a_first"]}
    else:
        b_row = {"kind": "request", **where, "session": session.id, "question": 1, "ok": False,
                 "error": "not sent: A gave no first token"}
    thread.join()
    if "a_first" in marks:
        b_row["a_streaming_when_sent"] = marks["a_done"] > marks["a_first"] + b_row["sent_after_a_first_s"]
    c_row = _request(client, args.model, {"round": rnd, "cell": "followup_c", "i": 2}, session, 2, args.max_tokens)
    counts = token_counts(tok, [question_prompt(session, q) for q in range(3)])
    return [a_row, b_row, c_row, _cell_row(rnd, "followup", before, prompt_counters(server.url), counts)]


# ------------------------------------------------------------------------------------------------ summary
def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def round_summary(rows: list[dict[str, Any]], rnd: int) -> dict[str, Any]:
    """One round's figures and ratios; a failed or missing request empties what depends on it
    and is listed in ``failed``."""
    cells = {r["cell"]: r for r in rows if r.get("kind") == "cell" and r["round"] == rnd}
    requests = [r for r in rows if r.get("kind") == "request" and r["round"] == rnd]
    failed: list[str] = []

    def ttfts(cell: str, expected: int) -> list[float] | None:
        ok = [r["ttft_s"] for r in requests if r["cell"] == cell and r.get("ok")]
        if len(ok) < expected:
            failed.append(f"{cell}: {expected - len(ok)} of {expected} failed or missing")
            return None
        return ok

    cell = cells.get("together")
    burst = ttfts("together", cell["requests"]) if cell is not None else None
    if cell is None:
        failed.append("together: no cell row")
    lone = ttfts("alone", 1)
    a, b, c = ttfts("followup_a", 1), ttfts("followup_b", 1), ttfts("followup_c", 1)
    out: dict[str, Any] = {"kind": "summary", "round": rnd}
    if burst is not None and cell is not None:
        ideal = cell["document_tokens"] + sum(cell["own_tokens"])
        out |= {"prefilled_tokens": cell["computed_tokens"], "ideal_tokens": ideal,
                "shared_tokens": cell["shared_tokens"], "prefill_ratio": cell["computed_tokens"] / ideal,
                "together_ttft_median_s": statistics.median(burst), "together_ttft_max_s": max(burst)}
    else:
        out |= dict.fromkeys(("prefilled_tokens", "ideal_tokens", "shared_tokens", "prefill_ratio",
                              "together_ttft_median_s", "together_ttft_max_s"))
    out["alone_ttft_s"] = lone[0] if lone else None
    out["median_ratio"] = _ratio(out["together_ttft_median_s"], out["alone_ttft_s"])
    out["slowest_ratio"] = _ratio(out["together_ttft_max_s"], out["alone_ttft_s"])
    b_row = next((r for r in requests if r["cell"] == "followup_b" and r.get("ok")), None)
    out |= {"followup_b_ttft_s": b[0] if b else None, "followup_c_ttft_s": c[0] if c else None,
            "followup_b_cached_tokens": b_row["cached_tokens"] if b_row else None,
            "followup_b_while_a_streams": b_row.get("a_streaming_when_sent") if b_row else None}
    out["followup_ratio"] = _ratio(out["followup_b_ttft_s"], out["followup_c_ttft_s"]) if a else None
    out["failed"] = "; ".join(failed) or None
    return out


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``kind: summary`` rows of a run's request and cell rows (other rows are ignored): one
    per round (:func:`round_summary`), then ``round: "all"``: per goal of :data:`GOALS`, the median,
    min and max of the rounds' ratios (the rounds that have it) and whether the median meets it."""
    rounds = sorted({r["round"] for r in rows if r.get("kind") in ("request", "cell")})
    per = [round_summary(rows, rnd) for rnd in rounds]
    total: dict[str, Any] = {"kind": "summary", "round": "all", "rounds": len(per),
                             "rounds_failed": sum(p["failed"] is not None for p in per)}
    for key, goal in GOALS.items():
        values = [p[key] for p in per if p[key] is not None]
        med = statistics.median(values) if values else None
        total |= {f"{key}_median": med, f"{key}_min": min(values, default=None),
                  f"{key}_max": max(values, default=None), f"{key}_n": len(values),
                  f"{key}_met": None if med is None else med <= goal}
    return [*per, total]


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(summary: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The run's tables: one row per round, then the goals (median and min-max over rounds)."""
    per = [s for s in summary if s["round"] != "all"]
    total = next(s for s in summary if s["round"] == "all")
    server = " ".join(header.get("server_args") or []) or "none"
    lines = [f"# Many users, one document: {header['model']}", "",
             (f"{header['requests']} questions over one new document of ~{header['tokens']} tokens sent within "
             f"{header['spread']} s (together), one over another new document alone, and a follow-up B sent "
             f"{header['follow_delay']} s after the first token of A (which streams {header['follow_tokens']} "
             f"tokens) against C, a hit on the idle server. {header['threads']} threads, {header.get('dtype')}, "
             f"extra server flags: {server}. TTFT: the client's clock, seconds. Prefilled: the server's "
             "`fastprefill_prompt_tokens_computed_total` over the burst; ideal: the document once plus each "
             "question's own tokens."), "",
             ("| round | prefilled | ideal | prefilled / ideal | shared | together median | together slowest "
             "| alone | median / alone | slowest / alone | B | C | B / C | B cached | failed |"),
             "|---" * 15 + "|"]
    for s in per:
        cells = [s["round"], s["prefilled_tokens"], s["ideal_tokens"], _num(s["prefill_ratio"], 2),
                 s["shared_tokens"], _num(s["together_ttft_median_s"]), _num(s["together_ttft_max_s"]),
                 _num(s["alone_ttft_s"]), _num(s["median_ratio"], 2), _num(s["slowest_ratio"], 2),
                 _num(s["followup_b_ttft_s"]), _num(s["followup_c_ttft_s"]), _num(s["followup_ratio"], 2),
                 s["followup_b_cached_tokens"], s["failed"] or ""]
        lines.append("| " + " | ".join(_num(c) for c in cells) + " |")
    lines += ["", f"Goals over {total['rounds']} rounds ({total['rounds_failed']} with a failed request):", "",
              "| ratio | goal | median | min | max | rounds | met |", "|---|---|---|---|---|---|---|"]
    for key, goal in GOALS.items():
        lines.append(f"| {key} | <= {goal} | {_num(total[f'{key}_median'], 2)} | {_num(total[f'{key}_min'], 2)} | "
                     f"{_num(total[f'{key}_max'], 2)} | {total[f'{key}_n']} | {_num(total[f'{key}_met'])} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ run
def run(args: argparse.Namespace, tok: Any, sessions: list[DocumentSession]) -> list[dict[str, Any]]:
    """The warm-up, then every round (``sessions``: the warm-up's, then three per round)."""
    server = ServerProcess(args.model, args.threads, queue=args.requests + 8, max_tokens=max(args.max_tokens,
                           args.follow_tokens), extra=args.server_arg, prefix_cache_mb=args.prefix_cache_mb,
                           dtype=args.dtype)
    rows: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        warm = sessions[0]
        for q in (0, 1):  # discarded: a cold prompt, then a hit on it
            ask_chat(server.client(), args.model, question_prompt(warm, q), 2)
        for rnd in range(args.rounds):
            docs = sessions[1 + PER_ROUND * rnd: 1 + PER_ROUND * (rnd + 1)]
            order = ["together", "alone"] if rnd % 2 == 0 else ["alone", "together"]
            rows.append({"kind": "round", "round": rnd, "order": [*order, "followup"],
                         "sessions": {"together": docs[0].id, "alone": docs[1].id, "followup": docs[2].id}})
            for cell in order:
                rows += (together(server, tok, rnd, docs[0], args.requests, args) if cell == "together"
                         else alone(server, tok, rnd, docs[1], args))
            rows += followup(server, tok, rnd, docs[2], args)
            print(f"round {rnd}: {round_summary(rows, rnd)}", file=sys.stderr)
    finally:
        server.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=4096, help="document tokens (at most; whole paragraphs)")
    p.add_argument("--requests", type=int, default=8, help="questions over one new document sent together")
    p.add_argument("--spread", type=float, default=1.0, help="seconds over which the together requests are sent")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each answer may generate")
    p.add_argument("--follow-tokens", type=int, default=64, help="tokens the follow-up cell's A streams")
    p.add_argument("--follow-delay", type=float, default=0.5, help="seconds after A's first token B is sent")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--prefix-cache-mb", type=float, default=1024.0, help="the server's prefix cache bound")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra flag for fastprefill serve (repeatable), e.g. --server-arg=--method=lazyllm")
    p.add_argument("--seed", type=int, default=0, help="the documents' order")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file stem (default serve_shared_doc_<model>)")
    args = p.parse_args(argv)
    if min(args.tokens - 64, args.requests - 1, args.rounds, args.max_tokens, args.follow_tokens) < 1:
        p.error("--tokens must be > 64, --requests >= 2, --rounds, --max-tokens and --follow-tokens >= 1")
    if args.spread < 0 or args.follow_delay < 0 or args.prefix_cache_mb <= 0:
        p.error("--spread and --follow-delay must be >= 0 and --prefix-cache-mb > 0 (the cache is what is measured)")
    tok = _tokenizer(args.model)
    try:
        sessions = pick_sessions(tok, args.tokens, 1 + PER_ROUND * args.rounds, max(args.requests, 3), args.seed)
    except ConfigError as exc:
        p.error(str(exc))
    rows = run(args, tok, sessions)
    header = serve_header(args, "serve-shared-doc", split="test")
    summary = summarize(rows)
    save_serve_record(args, header, [*rows, *summary], markdown(summary, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
