"""``n`` answers from one prefill, as a client sees it: the TTFT of ``n=4`` against ``n=1``.

Starts ``fastprefill serve`` as a subprocess on 127.0.0.1 (no prefix cache: every request is a
cold prefill), then for each of ``--prompts`` distinct documents of about ``--tokens`` tokens
sends the same streamed chat request with ``n=1`` and with ``n=--n`` (in alternating order per
prompt, one at a time, after one warm-up pair), sampling at temperature 0.8 with a seed. TTFT is
the client's clock, from sending the request to the first chunk with content: it includes the
prefill, the forks of the prompt's K/V for the other answers and every answer's first token.
The server's own ``usage.fastprefill.ttft_s`` is recorded beside it. Rows: one per request;
the summary: medians, and the median over prompts of the paired ratio ``n`` / ``1``.

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

from fastprefill.bench.records import environment, result_name, write_rows
from fastprefill.host import DTYPES, resolve_dtype
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
    by = {(r["prompt"], r["n"]): r for r in rows}
    ratios = [by[(i, args.n)]["client_ttft_s"] / by[(i, 1)]["client_ttft_s"] for i in range(args.prompts)]
    summary = {"kind": "summary", "pairs": args.prompts,
               "client_ttft_s_n1": statistics.median(by[(i, 1)]["client_ttft_s"] for i in range(args.prompts)),
               "client_ttft_s_n": statistics.median(by[(i, args.n)]["client_ttft_s"] for i in range(args.prompts)),
               "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
               "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows)}
    header = {**environment(args.threads, resolve_dtype(args.dtype)), "model": args.model,
              **{k: v for k, v in vars(args).items() if k not in ("model", "out", "name", "dtype")},
              "dtype_arg": args.dtype}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_name(out, f"serve_n_{args.model}", name=args.name)
    write_rows(out / f"{stem}.jsonl", header, [*rows, summary])
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
