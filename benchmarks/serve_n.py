"""``n`` answers from one prefill, as a client sees it: the TTFT of ``n=4`` against ``n=1``.

Starts ``fastprefill serve`` as a subprocess on 127.0.0.1 (no prefix cache: every request is a
cold prefill), then for each of ``--prompts`` distinct documents of about ``--tokens`` tokens
sends the same streamed chat request with ``n=1`` and with ``n=--n`` (in alternating order per
prompt, one at a time, after one warm-up pair), sampling at temperature 0.8 with a seed. TTFT is
the client's clock, from sending the request to the first chunk with content: it includes the
prefill, the forks of the prompt's K/V for the other answers and every answer's first token.
The server's own ``usage.fastprefill.ttft_s`` is recorded beside it. Rows: one per request,
then a ``kind: summary`` row (:func:`summarize`: medians, and the median and maximum over prompts
of the paired ratio ``n`` / ``1``), in ``serve_n_<model>.jsonl``; the summary as a table
(:func:`table`) in ``serve_n_<model>.md``. ``python benchmarks/verify.py`` re-makes both from the
request rows.

Measured run (alone on the cores)::

    python benchmarks/serve_n.py --model qwen2.5-coder-0.5b --prompts 8 --tokens 2048 --n 4 --threads 2

Smoke run::

    python benchmarks/serve_n.py --model smollm2-135m --prompts 2 --tokens 256 --n 2 --out /tmp/serve_n
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from fastprefill.bench.records import environment, result_name
from fastprefill.host import DTYPES, resolve_dtype
from reporting import write_rows
from serve_load import ServerProcess
from serve_load_mixed import _sized_document, _tokenizer


def one(client: Any, model: str, content: str, n: int, seed: int, max_tokens: int) -> dict[str, Any]:
    """One streamed request; its client TTFT, the server's, and the answers' texts."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, n=n, temperature=0.8, seed=seed, stream=True,
                                            stream_options={"include_usage": True})
    ttft, texts, usage = None, [""] * n, None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content is not None and ttft is None:
                ttft = time.perf_counter() - t0
            texts[c.index] += c.delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert ttft is not None and usage is not None
    extra = usage.model_extra.get("fastprefill") or {}
    return {"n": n, "client_ttft_s": ttft, "server_ttft_s": extra.get("ttft_s"), "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "answers": texts}


def _median(values: list[Any]) -> float | None:
    """The median, or ``None`` when a value is missing (a server that reports no TTFT)."""
    return None if not values or None in values else statistics.median(values)


def summarize(rows: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The ``kind: summary`` row of a run's request rows (other rows are ignored): over the
    prompts measured with both ``n=1`` and ``n``, the medians of the client's and the server's
    TTFT for each, the median and maximum of the per-prompt ratio of the client TTFTs
    ``n`` / ``1``, and the median prompt length over every request."""
    requests = [r for r in rows if r.get("kind") != "summary"]
    by = {(r["prompt"], r["n"]): r for r in requests}
    prompts = sorted(p for p, k in by if k == 1 and (p, n) in by)
    ratios = [by[(p, n)]["client_ttft_s"] / by[(p, 1)]["client_ttft_s"] for p in prompts]

    def med(key: str, k: int) -> float | None:
        return _median([by[(p, k)][key] for p in prompts])

    return {"kind": "summary", "pairs": len(prompts),
            "client_ttft_s_n1": med("client_ttft_s", 1), "client_ttft_s_n": med("client_ttft_s", n),
            "ratio_median": _median(ratios), "ratio_max": max(ratios, default=None),
            "server_ttft_s_n1": med("server_ttft_s", 1), "server_ttft_s_n": med("server_ttft_s", n),
            "prompt_tokens_median": _median([r["prompt_tokens"] for r in requests])}


def table(summary: dict[str, Any], header: dict[str, Any]) -> str:
    """The summary as a markdown table (seconds to 3 decimals, ratios to 2)."""
    n = header["n"]

    def s(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}"

    def x(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f}x"

    title = (f"# n answers from one prefill: {header['model']} ({header['dtype']}), n={n} against n=1, "
             f"{header['prompts']} prompts of about {header['tokens']} tokens")
    columns = (f"| pairs | prompt tokens | client TTFT n=1 (s) | client TTFT n={n} (s) | ratio n={n} / 1 "
               f"| ratio max | server TTFT n=1 (s) | server TTFT n={n} (s) |")
    row = (f"| {summary['pairs']} | {summary['prompt_tokens_median']:g} | {s(summary['client_ttft_s_n1'])} "
           f"| {s(summary['client_ttft_s_n'])} | {x(summary['ratio_median'])} | {x(summary['ratio_max'])} "
           f"| {s(summary['server_ttft_s_n1'])} | {s(summary['server_ttft_s_n'])} |")
    note = "Medians over the prompts measured both ways; the ratios are per prompt, of the client's TTFTs."
    return f"{title}\n\n{columns}\n|---|---|---|---|---|---|---|---|\n{row}\n\n{note}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    tok = _tokenizer(args.model)
    docs = [_sized_document(tok, 20_000 + i, args.tokens) + "\nWhich station opened first?"
            for i in range(args.prompts + 1)]
    server = ServerProcess(args.model, args.threads, queue=4, max_tokens=args.max_tokens, dtype=args.dtype)
    rows: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        client = server.client()
        for n in (1, args.n):  # warm-up: the first requests of each shape are slow
            one(client, args.model, docs[-1], n, 0, args.max_tokens)
        for i, doc in enumerate(docs[:-1]):
            order = (1, args.n) if i % 2 == 0 else (args.n, 1)
            for n in order:
                row = one(client, args.model, doc, n, i, args.max_tokens)
                rows.append({"prompt": i, **row})
                print(f"prompt {i} n={n}: client TTFT {row['client_ttft_s']:.3f} s, server {row['server_ttft_s']:.3f} s")
    finally:
        server.close()
    summary = summarize(rows, args.n)
    header = {"bench": "serve-n", **environment(args.threads, resolve_dtype(args.dtype)), "model": args.model,
              **{k: v for k, v in vars(args).items() if k not in ("model", "out", "name", "dtype")},
              "dtype_arg": args.dtype}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_name(out, f"serve_n_{args.model}", name=args.name)
    write_rows(out / f"{stem}.jsonl", header, [*rows, summary])
    (out / f"{stem}.md").write_text(table(summary, header))
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
