"""Chunked prefill of one lone long prompt, in process: TTFT whole and in chunks, and the longest chunk.

The server's scheduler (``--prefill-chunk``) prefills a long prompt in chunks, each a prefill of
the next tokens over the K/V of the chunks before (:meth:`fastprefill.engine.Generation.prefill`
with a token budget). This script measures what that costs a lone prompt, without the server
and without anything else running beside it: for each of ``--prompts`` distinct documents it
prefills the same prompt whole (``chunk=None``) and in chunks of each ``--chunks`` size, with
full prefill and no prefix cache, and times

- the TTFT: the engine's clock (:attr:`Generation.ttft_s`) from the first unit of prefill to the
  first token, picked greedily;
- each chunk's own duration (the wall time of one :meth:`Generation.prefill` call: what a short
  request that arrives meanwhile waits for at most, before its own prefill starts).

Prompts: a chat prompt (the model's chat template) whose single user message is a seeded
document of whole sentences and one question, the longest such that fits in ``--tokens``
tokens, so every prompt has at most ``--tokens`` ids. One warm-up prompt runs every setting
once first (excluded). Then each prompt runs every setting in a rotated order (prompt ``i``
starts at setting ``i`` mod the number of settings), so drift and order effects fall on every
setting alike. Every run records its first token and the largest absolute difference of its
first-token logits from the whole prefill's of the same prompt: a chunked prefill is the same
computation, exact in float32; in bfloat16 a chunk boundary rounds differently, so small
differences (and now and then another first token) are expected and recorded, not asserted.

Rows (``<stem>.jsonl``): one per (prompt, setting). Summary (``<stem>.summary.jsonl``, ``.md``;
:func:`summarize`, re-made from the rows by ``python benchmarks/verify.py``): per setting the
median TTFT, the median over prompts of the paired ratio setting / whole, the median and the
maximum of the longest chunk, and the count of runs.

Measured run (alone on the cores)::

    python benchmarks/prefill_chunks.py --model qwen2.5-coder-0.5b --prompts 5 --tokens 4096 --threads 2

Smoke run::

    python benchmarks/prefill_chunks.py --model smollm2-135m --prompts 2 --tokens 512 --chunks 128 256 --out /tmp/chunksmoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fastprefill.bench.records import environment, result_name
from fastprefill.engine import Generation
from fastprefill.host import DTYPES, dtype_name, keep_freed_memory, set_threads
from fastprefill.methods.full import FullPrefill
from fastprefill.models import load as load_model
from fastprefill.prompt import prepare_request
from reporting import write_rows

RESULTS = Path(__file__).resolve().parent / "results"
BENCH = "prefill-chunks"
QUESTION = "\n\nWhich station opened first?"
#: Seeds of the documents: prompt ``i`` uses ``SEED + i``, the warm-up ``SEED + prompts``.
SEED = 30_000


def label(chunk: int | None) -> str:
    """A setting's name in rows and tables: ``whole`` or the chunk size."""
    return "whole" if chunk is None else str(chunk)


def chat_prompt(model: Any, tok: Any, seed: int, tokens: int) -> torch.Tensor:
    """The ``(1, T)`` ids of a chat prompt whose single user message is a seeded document and
    :data:`QUESTION`: the most whole sentences that keep ``T <= tokens``."""
    from serve_load_mixed import _document  # the serving benchmarks' documents (imports openai: only here)

    def ids(sentences: int) -> torch.Tensor:
        text = _document(seed, sentences) + QUESTION
        return prepare_request(model, tok, text, FullPrefill(), max_new_tokens=1, chat=True)[0]

    per = max(1.0, ids(20).shape[1] / 20)
    n = max(1, int(tokens / per))
    while n > 1 and ids(n).shape[1] > tokens:
        n -= 1
    while ids(n + 1).shape[1] <= tokens:
        n += 1
    return ids(n)


def run_setting(model: Any, tok: Any, ids: torch.Tensor, chunk: int | None) -> tuple[dict[str, Any], torch.Tensor]:
    """Prefill ``ids`` whole (``chunk=None``) or in chunks: the row's timings and first token, and
    the first-token logits (float32, on the CPU)."""
    gen = Generation(model, tok, ids, FullPrefill(), 1, stop_at_eos=False)
    chunk_s: list[float] = []
    while not gen.prefilled:
        t0 = time.perf_counter()
        gen.prefill(chunk)
        chunk_s.append(time.perf_counter() - t0)
    assert gen.first_logits is not None
    row = {"setting": label(chunk), "chunk": chunk, "prompt_tokens": gen.n_prompt, "ttft_s": gen.ttft_s,
           "chunk_s": chunk_s, "max_chunk_s": max(chunk_s), "n_chunks": len(chunk_s),
           "first_token": gen.generated[0]}
    return row, gen.first_logits


def rotated(settings: Sequence[int | None], i: int) -> list[int | None]:
    """The settings in prompt ``i``'s order: starting at ``i`` mod their number."""
    k = i % len(settings)
    return [*settings[k:], *settings[:k]]


def measure_prompt(model: Any, tok: Any, ids: torch.Tensor, i: int, settings: Sequence[int | None],
                   bar: Any) -> list[dict[str, Any]]:
    """Prompt ``i`` under every setting in its rotated order; rows in that order, each compared
    with the whole prefill's first token and logits."""
    runs = []
    for position, chunk in enumerate(rotated(settings, i)):
        row, logits = run_setting(model, tok, ids, chunk)
        runs.append(({"prompt": i, "position": position, **row}, logits))
        bar.update()
    whole_row, whole_logits = next((r, lg) for r, lg in runs if r["chunk"] is None)
    for row, logits in runs:
        row["first_token_equals_whole"] = row["first_token"] == whole_row["first_token"]
        row["max_abs_logit_diff_vs_whole"] = float((logits - whole_logits).abs().max())
    return [row for row, _ in runs]


def _setting_key(chunk: int | None) -> tuple[bool, int]:
    return (chunk is not None, chunk or 0)


def summarize(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting (whole first, then the chunks by size): medians over its runs, and
    the median over prompts of the paired TTFT ratio setting / whole (``None`` without a whole
    run of the same prompt)."""
    whole = {r["prompt"]: r for r in rows if r["chunk"] is None}
    out = []
    for chunk in sorted({r["chunk"] for r in rows}, key=_setting_key):
        runs = [r for r in rows if r["chunk"] == chunk]
        ratios = [r["ttft_s"] / whole[r["prompt"]]["ttft_s"] for r in runs if r["prompt"] in whole]
        out.append({
            "kind": "summary", "setting": label(chunk), "chunk": chunk, "n": len(runs), "n_paired": len(ratios),
            "ttft_s_median": statistics.median(r["ttft_s"] for r in runs),
            "ttft_ratio_median": statistics.median(ratios) if ratios else None,
            "ttft_ratio_max": max(ratios) if ratios else None,
            "max_chunk_s_median": statistics.median(r["max_chunk_s"] for r in runs),
            "max_chunk_s_max": max(r["max_chunk_s"] for r in runs),
            "n_chunks_median": statistics.median(r["n_chunks"] for r in runs),
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in runs),
            "first_token_equals_whole": sum(bool(r.get("first_token_equals_whole")) for r in runs),
            "max_abs_logit_diff_vs_whole": max(r.get("max_abs_logit_diff_vs_whole", 0.0) for r in runs),
        })
    return out


def table(summary: Sequence[Mapping[str, Any]], header: Mapping[str, Any]) -> str:
    """The markdown table of a summary (the title from the header)."""
    title = (f"# Chunked prefill of one lone prompt: {header['model']} ({header['dtype']}), chat prompts of at "
             f"most {header['tokens']} tokens, {header['prompts']} prompts, {header['threads']} threads")
    columns = ("| prefill | TTFT median (s) | TTFT / whole (median) | longest chunk median (s) "
               "| longest chunk max (s) | chunks | first token = whole | max abs logit diff | n |")
    lines = [title, "", columns, "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        ratio = "-" if s["ttft_ratio_median"] is None else f"{s['ttft_ratio_median']:.2f}x"
        lines.append(f"| {s['setting']} | {s['ttft_s_median']:.3f} | {ratio} | {s['max_chunk_s_median']:.3f} | "
                     f"{s['max_chunk_s_max']:.3f} | {s['n_chunks_median']:g} | "
                     f"{s['first_token_equals_whole']}/{s['n']} | {s['max_abs_logit_diff_vs_whole']:.3g} | {s['n']} |")
    lines += ["", f"Command: `{header.get('command', '')}`", ""]
    return "\n".join(lines)


def write(out: Path, stem: str, header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """Write the rows, the summary and the table (again after every prompt); the table."""
    summary = summarize(rows)
    write_rows(out / f"{stem}.jsonl", header, rows)
    write_rows(out / f"{stem}.summary.jsonl", header, summary)
    text = table(summary, header)
    (out / f"{stem}.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4096, help="each chat prompt's ids, at most")
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.prompts < 1 or min(args.chunks) < 1:
        p.error("--prompts and every --chunks size must be at least 1")
    set_threads(args.threads)
    keep_freed_memory()
    model, tok = load_model(args.model, dtype=args.dtype)
    settings: list[int | None] = [None, *dict.fromkeys(args.chunks)]
    prompts = [chat_prompt(model, tok, SEED + i, args.tokens) for i in range(args.prompts + 1)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_name(out, f"prefill_chunks_{args.model}_{args.tokens}_{dtype_name(model.dtype)}", name=args.name)
    header = {"bench": BENCH, "model": args.model, "prompts": args.prompts, "tokens": args.tokens,
              "chunks": list(settings[1:]), "prompt_form": "chat (one user message)", "method": "full",
              "prefix_cache": None, "warmup": 1, "order": "rotated per prompt", "dtype_arg": args.dtype,
              "seed": SEED, **environment(args.threads, model)}
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(settings) * (args.prompts + 1), desc=f"prefill chunks {args.model}") as bar:
        measure_prompt(model, tok, prompts[-1], -1, settings, bar)  # warm-up, excluded
        for i, ids in enumerate(prompts[:-1]):
            rows += measure_prompt(model, tok, ids, i, settings, bar)
            text = write(out, stem, header, rows)
    print(text)
    print(f"wrote {out / stem}.{{jsonl,summary.jsonl,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
