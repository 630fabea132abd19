"""Mixed load on ``fastprefill serve``: short chat requests (some prefix-cache follow-ups) with
long cold prompts arriving among them, under ``--scheduler interleaved`` and ``fifo``.

For each scheduler the script starts ``fastprefill serve`` as a subprocess on 127.0.0.1 (a free
port; the real ``openai`` client; the prefix cache on, ``--prefill-chunk`` as given) and runs:

- **mixed**: ``--n`` short requests arrive at fixed intervals (``--rate`` per second): one-line
  questions, and every third one a follow-up question over a document sent once before the load
  starts (a prefix-cache hit). ``--long`` cold prompts of about ``--long-tokens`` tokens (distinct
  documents, never cached) arrive at evenly spaced moments among them. Every request is a
  streamed chat completion in a thread of its own; TTFT is the client's clock, from sending it to
  the first token's chunk. Short, follow-up and long requests are summarised apart (TTFT p50 and
  p99), with the long requests' TTFT against the same prompts sent alone (``long_alone``: one at a
  time to an idle server of the same scheduler, after the load).
- **decode**: 1, 4 and 8 (``--concurrency``) concurrent streams of one short prompt, each
  generating exactly ``--decode-tokens`` tokens (``ignore_eos``); tokens/s = all tokens / wall time.

The reference answers come from a ``fifo`` server sent every mixed request one at a time, in
arrival order (the one-at-a-time server, sequentially); ``same_answers`` counts the mixed
answers equal to it. Exact in float32; in bfloat16 a chunk boundary or a prefix-cache hit
changes rounding (docs/prefix-cache.md), so a few answers may differ there.

Measured run (the lead schedules it; on a quiet machine, nothing else on the cores)::

    python benchmarks/serve_load_mixed.py --model qwen2.5-coder-0.5b --n 40 --long 4 --threads 2
    python benchmarks/serve_load_mixed.py --model smollm2-135m --n 40 --long 4 --threads 2

Smoke run (a few minutes)::

    python benchmarks/serve_load_mixed.py --model smollm2-135m --n 2 --long 1 --long-tokens 512 \\
        --concurrency 1 2 --decode-tokens 8 --out /tmp/serve_mixed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from fastprefill.bench.records import environment, result_name
from fastprefill.host import DTYPES, resolve_dtype
from fastprefill.serve.config import ServeConfig
from reporting import write_rows
from serve_load import ServerProcess, ask_chat

QUESTIONS = ["What is the capital of France?", "Say hello in Spanish.", "What is 12 times 7?",
             "Name a primary colour.", "What does CPU stand for?", "Give one word for happy.",
             "Which planet is largest?", "How many days are in a week?"]


def _document(seed: int, sentences: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"Record {seed}-{i}: station {int(rng.integers(1000))} lies {int(rng.integers(500))} km from "
                    f"the river and opened in {1800 + int(rng.integers(220))}." for i in range(sentences))


def _sized_document(tok: Any, seed: int, tokens: int) -> str:
    """A document of about ``tokens`` tokens (whole sentences)."""
    per = max(1, len(tok(_document(seed, 20))["input_ids"]) / 20)
    return _document(seed, max(1, int(tokens / per)))


def _tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    from fastprefill.models.zoo import entry_dir, is_prepared, list_models

    zoo = {entry.name for entry in list_models()}
    return AutoTokenizer.from_pretrained(str(entry_dir(name)) if name in zoo and is_prepared(name) else name)


def _plan(tok: Any, args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """The cached document and the mixed requests: ``kind``, ``at`` (seconds after the start), ``content``."""
    doc = _document(10_000, 40)
    plan = []
    for i in range(args.n):
        q = QUESTIONS[i % len(QUESTIONS)]
        kind, content = ("followup", f"{doc}\n\nQuestion: {q}") if i % 3 == 2 else ("short", q)
        plan.append({"kind": kind, "i": i, "at": i / args.rate, "content": content})
    span = args.n / args.rate
    for j in range(args.long):
        text = _sized_document(tok, j, args.long_tokens) + "\n\nWhich station opened first?"
        plan.append({"kind": "long", "i": j, "at": span * (j + 0.5) / max(1, args.long), "content": text})
    return doc, sorted(plan, key=lambda r: r["at"])


def _mixed(server: ServerProcess, model: str, plan: list[dict[str, Any]], args: argparse.Namespace) -> list[dict]:
    client, out, lock = server.client(), [], threading.Lock()
    start = time.perf_counter() + 0.5

    def one(req: dict[str, Any]) -> None:
        time.sleep(max(0.0, start + req["at"] - time.perf_counter()))
        budget = args.long_max_tokens if req["kind"] == "long" else args.short_max_tokens
        rec = {"kind": req["kind"], "i": req["i"], **ask_chat(client, model, req["content"], budget)}
        with lock:
            out.append(rec)

    threads = [threading.Thread(target=one, args=(req,)) for req in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _decode(server: ServerProcess, model: str, conc: int, args: argparse.Namespace) -> dict[str, Any]:
    client, results = server.client(), []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda: results.append(ask_chat(client, model, QUESTIONS[0], args.decode_tokens,
                                                                   ignore_eos=True))) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    return {"kind": "decode", "concurrency": conc, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def run_scheduler(scheduler: str, model: str, doc: str, plan: list[dict[str, Any]], args: argparse.Namespace,
                  sequential_only: bool = False) -> list[dict[str, Any]]:
    """One server: the mixed load, the long prompts alone and the decode cells (``sequential_only``:
    every mixed request one at a time, the reference)."""
    extra = server_flags(scheduler, args.prefill_chunk) + ["--max-running", str(max(args.concurrency))]
    server = ServerProcess(model, args.threads, queue=len(plan) + 8, max_tokens=args.short_max_tokens, extra=extra,
                           prefix_cache_mb=1024, dtype=args.dtype)
    try:
        server.wait_ready()
        client = server.client()
        ask_chat(client, model, QUESTIONS[1], 2)  # warm-up, discarded
        ask_chat(client, model, f"{doc}\n\nQuestion: {QUESTIONS[0]}", 2)  # the follow-ups' document is now cached
        rows: list[dict[str, Any]] = []
        if sequential_only:
            for req in plan:
                budget = args.long_max_tokens if req["kind"] == "long" else args.short_max_tokens
                rows.append({"phase": "sequential", "kind": req["kind"], "i": req["i"],
                             **ask_chat(client, model, req["content"], budget)})
            return [{"scheduler": scheduler, **r} for r in rows]
        rows += [{"phase": "mixed", **r} for r in _mixed(server, model, plan, args)]
        for j, req in enumerate(r for r in plan if r["kind"] == "long"):
            alone = ask_chat(client, model, f"(alone {j})\n" + req["content"], args.long_max_tokens)  # cold: new first block
            rows.append({"phase": "long_alone", "kind": "long", "i": req["i"], **alone})
        rows += [{"phase": "decode", **_decode(server, model, c, args)} for c in args.concurrency]
        return [{"scheduler": scheduler, **r} for r in rows]
    finally:
        server.close()


def server_flags(spec: str, chunk: int) -> list[str]:
    """The server's flags for a scheduler spec: ``fifo`` or ``interleaved``, optionally with
    ``:chunk=N`` (else ``--prefill-chunk``), ``:nopause`` (``--no-prefill-pauses``) and
    ``:decode=S`` (``--decode-interval S``)."""
    name, *options = spec.split(":")
    if name not in ("interleaved", "fifo"):
        raise ValueError(f"scheduler spec {spec!r}: it starts with interleaved or fifo")
    flags = ["--scheduler", name]
    for option in options:
        if option.startswith("chunk=") and option[6:].isdigit():
            chunk = int(option[6:])
        elif option == "nopause":
            flags.append("--no-prefill-pauses")
        elif option.startswith("decode=") and option[7:].replace(".", "", 1).isdigit():
            flags += ["--decode-interval", option[7:]]
        else:
            raise ValueError(f"scheduler spec {spec!r}: unknown option {option!r} "
                             "(chunk=N, nopause or decode=S)")
    return flags + ["--prefill-chunk", str(chunk)]


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(rows: list[dict[str, Any]], schedulers: list[str]) -> list[dict[str, Any]]:
    """Per scheduler: TTFT p50/p99 by kind, the short streams' longest wait between two tokens
    (where recorded), the long requests' TTFT growth against alone, decode tokens/s by
    concurrency, answers equal to the sequential reference."""
    ref = {(r["kind"], r["i"]): r["text"] for r in rows if r["phase"] == "sequential"}
    out = []
    for s in schedulers:
        mine = [r for r in rows if r["scheduler"] == s]
        row: dict[str, Any] = {"scheduler": s}
        for kind in ("short", "followup", "long"):
            ttft = [r["ttft_s"] for r in mine if r["phase"] == "mixed" and r["kind"] == kind]
            row[f"{kind}_ttft_p50_s"], row[f"{kind}_ttft_p99_s"] = _pct(ttft, 50), _pct(ttft, 99)
        gaps = [r["max_gap_s"] for r in mine if r["phase"] == "mixed" and r["kind"] != "long"
                and r.get("max_gap_s") is not None]
        if gaps:  # recorded since the decode interval was varied
            row["short_max_gap_p50_s"], row["short_max_gap_p99_s"] = _pct(gaps, 50), _pct(gaps, 99)
        alone = [r["ttft_s"] for r in mine if r["phase"] == "long_alone"]
        row["long_alone_ttft_p50_s"] = _pct(alone, 50)
        if alone and row["long_ttft_p50_s"] is not None:
            row["long_ttft_growth"] = row["long_ttft_p50_s"] / statistics.median(alone)
        for r in mine:
            if r["phase"] == "decode":
                row[f"decode_tok_s_c{r['concurrency']}"] = r["tokens_per_s"]
        mixed = [r for r in mine if r["phase"] == "mixed"]
        row["same_answers"] = f"{sum(ref.get((r['kind'], r['i'])) == r['text'] for r in mixed)}/{len(mixed)}"
        out.append(row)
    return out


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    def num(x: Any) -> str:
        return "—" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    keys = [k for k in rows[0] if k != "scheduler"] if rows else []
    lines = [f"# Mixed load on fastprefill serve: {header['model']}", "",
             (f"{header['n']} short requests at {header['rate']}/s (every third a prefix-cache follow-up), "
             f"{header['long']} cold prompts of ~{header['long_tokens']} tokens among them, prefill chunk "
             f"{header['prefill_chunk']} (unless the scheduler names its own), {header['threads']} threads, {header.get('dtype')}. TTFT: the client's "
             "clock. `same_answers`: mixed answers equal to the fifo server's, sent one at a time."
              + (" `short_max_gap`: each short stream's longest wait between two tokens." if any(
                  "short_max_gap_p50_s" in r for r in rows) else "")), "",
             "| scheduler | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += ["| " + r["scheduler"] + " | " + " | ".join(num(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--schedulers", nargs="+", default=["interleaved", "fifo"],
                   help="scheduler specs: interleaved or fifo, with :chunk=N (its own --prefill-chunk) and "
                        ":nopause (--no-prefill-pauses) and :decode=S (--decode-interval), e.g. interleaved:decode=1")
    p.add_argument("--n", type=int, default=40, help="short requests in the mixed load")
    p.add_argument("--rate", type=float, default=2.0, help="short requests per second")
    p.add_argument("--long", type=int, default=4, help="long cold prompts among them")
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--short-max-tokens", type=int, default=16)
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file stem (default serve_mixed_<model>)")
    args = p.parse_args(argv)
    if min(args.n, args.long, args.long_tokens, args.decode_tokens, min(args.concurrency)) < 1 or args.rate <= 0:
        p.error("--n, --long, --long-tokens, --decode-tokens and --concurrency must be >= 1, --rate > 0")
    try:
        for spec in args.schedulers:
            server_flags(spec, args.prefill_chunk)
    except ValueError as exc:
        p.error(str(exc))
    tok = _tokenizer(args.model)
    doc, plan = _plan(tok, args)
    rows = run_scheduler("fifo", args.model, doc, plan, args, sequential_only=True)
    for s in args.schedulers:
        rows += run_scheduler(s, args.model, doc, plan, args)
    header = {**environment(args.threads, resolve_dtype(args.dtype)), "model": args.model,
              **{k: v for k, v in vars(args).items() if k not in ("model", "out", "name", "dtype")},
              "dtype_arg": args.dtype, "decode_interval_s": ServeConfig.decode_interval_s}  # without :decode=
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_name(out, f"serve_mixed_{args.model}", name=args.name)
    write_rows(out / f"{stem}.jsonl", header, rows)
    text = markdown(summarize(rows, args.schedulers), header)
    (out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
