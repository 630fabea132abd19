"""Prefix-cache benchmarks: TTFT with and without exact prefix reuse, on the same prompts.

Subcommands (each writes ``<name>.jsonl`` records, ``<name>.summary.jsonl`` paired rows and a
``<name>.md`` table into ``--out``; ``python benchmarks/verify.py`` re-summarizes them):

- ``questions``: many questions over the same document. Per session (a SQuAD article cut to
  ``--lengths`` tokens, :mod:`fastprefill.data.tasks.sessions`), each of ``--questions``
  questions is a chat prompt with the document first. ``full`` runs every prompt without a
  cache; ``cache-miss`` is the session's first question with a fresh cache (lookup and store
  overhead on a miss), ``cache-hit`` every later question (the document is cached). ``length``
  in the records is the document budget.
- ``chat``: multi-turn conversations: the document and question 1 in turn 1, one follow-up
  question per later turn (:func:`chat_turn`, :func:`messages_for`), the model's own answers in between (those of the run without a
  cache, so both runs see the same prompts). ``length`` in the records is the turn (1, 2, ...);
  ``cache`` is the run with a prefix cache carried across the conversation's turns.
- ``evict``: the ``questions`` workload with a cache bounded to ``--cache-docs`` documents'
  K/V, sessions interleaved so the cache is full and evicting (``cache-evicting``); the header
  records bytes per cached token against the model's K/V size per token.

Every run is full prefill (exact); answers must equal the run without a cache. Runs alternate
their order prompt by prompt; one warm-up generation per method is excluded; threads fixed; the
model in ``--dtype`` (default ``auto``: :func:`fastprefill.host.resolve_dtype`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fastprefill.bench.records import FULL, Record, RecordLog, environment, result_name, save_records
from fastprefill.bench.report import markdown_table
from fastprefill.bench.runner import first_token_kl
from fastprefill.bench.summary import summarize
from fastprefill.data.metrics import exact_match, qa_f1
from fastprefill.data.tasks.sessions import DocumentSession, document_sessions, question_prompt
from fastprefill.engine import GenerationResult, generate
from fastprefill.host import DTYPES, keep_freed_memory, set_threads
from fastprefill.models.shape import ModelShape
from fastprefill.prefix_cache import PrefixCache
from reporting import prefix_overhead_table, write_paired_rows

RESULTS = Path(__file__).resolve().parent / "results"
MATCH = ("kind", "model", "lengths", "n", "questions", "turns", "max_new_tokens", "threads", "block_tokens",
         "cache_mb", "cache_docs", "split", "seed", "dtype")


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def chat_turn(session: DocumentSession, index: int) -> str:
    """The user message of chat turn ``index``: turn 0 is :func:`question_prompt`; later turns ask
    the next question alone."""
    if index == 0:
        return question_prompt(session, 0)
    return f"Question: {session.questions[index][0]}\nAnswer:"


def score_answer(session: DocumentSession, index: int, text: str) -> dict[str, float]:
    """F1 and exact match of ``text`` against question ``index``'s answers."""
    answers = session.questions[index][1]
    f1 = qa_f1(text, answers)
    return {"score": f1, "f1": f1, "em": exact_match(text, answers)}


def messages_for(session: DocumentSession, answers: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages of turn ``len(answers)``: every earlier turn with its answer, then the
    next question."""
    out: list[dict[str, str]] = []
    for i, answer in enumerate(answers):
        out += [{"role": "user", "content": chat_turn(session, i)}, {"role": "assistant", "content": answer}]
    out.append({"role": "user", "content": chat_turn(session, len(answers))})
    return out


def _record(method: str, length: int, sample_id: str, res: GenerationResult, metrics: dict[str, float],
            reference: GenerationResult | None) -> Record:
    t = res.timing
    extra: dict[str, Any] = {"first_token": res.token_ids[0], "cached_tokens": t.cached_tokens,
                             "stored_tokens": t.stored_tokens, "prefix_lookup_s": t.prefix_lookup_s,
                             "prefix_store_s": t.prefix_store_s}
    if reference is not None:
        extra["first_token_kl"] = first_token_kl(reference.first_logits, res.first_logits)
    return Record(method=method, length=length, sample_id=sample_id, prompt_tokens=t.prompt_tokens,
                  ttft_s=t.ttft_s, decode_s_per_token=t.decode_s_per_token, total_s=t.total_s,
                  new_tokens=t.new_tokens, token_layer_fraction=t.stats.fraction,
                  prefill_flops=t.stats.flops, peak_mem_mb=0.0, score=float(metrics["score"]),
                  metrics={k: float(v) for k, v in metrics.items()}, output=res.text, extra=extra)


class Bench:
    """One model, one result file: the runs of a subcommand, appended as they finish."""

    def __init__(self, args: argparse.Namespace, kind: str) -> None:
        from fastprefill.models import load as load_model

        set_threads(args.threads)
        self.args = args
        self.model, self.tok = load_model(args.model, dtype=args.dtype)
        self.max_new = args.max_new_tokens
        name = result_name(args.out, f"prefix_{kind}_{args.model}", name=args.name, resume=args.resume)
        header = {"task": f"prefix-{kind} (SQuAD v2 documents)", "warmup": 1, "kind": kind, "model": args.model, "lengths": args.lengths, "n": args.n,
                  "questions": args.questions, "turns": args.turns, "max_new_tokens": args.max_new_tokens,
                  "block_tokens": args.block_tokens, "cache_mb": args.cache_mb, "cache_docs": args.cache_docs,
                  "split": args.split, "seed": args.seed, **environment(args.threads, self.model)}
        self.out = Path(args.out)
        self.name = name
        self.log = RecordLog(self.out / f"{name}.jsonl", header, resume=args.resume, overwrite=False, match=MATCH)
        self.done = {(r.length, r.sample_id, r.method) for r in self.log.records}
        generate(self.model, self.tok, "Warm up.", max_new_tokens=2)  # excluded: one-time costs
        generate(self.model, self.tok, "Warm up.", max_new_tokens=2, prefix_cache=self.cache())

    def cache(self, max_bytes: int | None = None) -> PrefixCache:
        return PrefixCache(max_bytes or self.args.cache_mb << 20, block_tokens=self.args.block_tokens)

    def run(self, ids: torch.Tensor, cache: PrefixCache | None) -> GenerationResult:
        return generate(self.model, self.tok, ids, max_new_tokens=self.max_new, prefix_cache=cache)

    def pair(self, length: int, sample_id: str, ids: torch.Tensor, method: str, cache: PrefixCache,
             score: Callable[[str], dict[str, float]], flip: bool) -> GenerationResult:
        """Run ``ids`` without a cache (``full``) and with ``cache`` (``method``), in an order that
        alternates with ``flip``; append both records. Returns the run without a cache."""
        runs: dict[str, GenerationResult] = {}
        for name in ((method, FULL) if flip else (FULL, method)):
            runs[name] = self.run(ids, cache if name == method else None)
        for name in (FULL, method):
            if (length, sample_id, name) not in self.done:
                ref = None if name == FULL else runs[FULL]
                self.log.append(_record(name, length, sample_id, runs[name], score(runs[name].text), ref))
        return runs[FULL]

    def session_done(self, length: int, sample_ids: list[str], method_of: Callable[[int], str]) -> bool:
        """Whether every pair of a session is already in a resumed file."""
        return all({(length, sid, FULL), (length, sid, method_of(i))} <= self.done for i, sid in enumerate(sample_ids))

    def finish(self, extra_header: dict[str, Any] | None = None) -> None:
        if extra_header:
            self.log.header.update(extra_header)
            save_records(self.log.path, self.log.header, self.log.records)
        header, records = self.log.header, self.log.records
        summaries = summarize(records)
        write_paired_rows(self.out / f"{self.name}.summary.jsonl", header, summaries)
        text = markdown_table(summaries, header) + "\n" + prefix_overhead_table(records)
        (self.out / f"{self.name}.md").write_text(text)
        print(text)


def cmd_questions(args: argparse.Namespace, kind: str = "questions", evict: bool = False) -> None:
    bench = Bench(args, kind)
    extra: dict[str, Any] = {}
    for length in args.lengths:
        sessions = document_sessions(bench.tok, length, args.n, args.questions, args.split, args.seed)
        shape = ModelShape.from_config(bench.model.config)
        per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * bench.model.dtype.itemsize
        if evict:  # one cache for every session, bounded to cache_docs documents: full and evicting
            bound = int(args.cache_docs * length * per_token)
            shared = bench.cache(bound)
            plan = [(s, q) for q in range(args.questions) for s in range(len(sessions))]
        else:  # one cache per session
            plan = [(s, q) for s in range(len(sessions)) for q in range(args.questions)
                    if not bench.session_done(length, [f"{sessions[s].id}/q{i}" for i in range(args.questions)],
                                              lambda i: "cache-miss" if i == 0 else "cache-hit")]
        caches: dict[int, PrefixCache] = {}
        for i, (s, q) in enumerate(tqdm(plan, desc=f"{kind} {length}", unit="prompt")):
            session: DocumentSession = sessions[s]
            ids = _chat_ids(bench.tok, [{"role": "user", "content": question_prompt(session, q)}])
            cache = shared if evict else caches.setdefault(s, bench.cache())
            method = "cache-evicting" if evict else ("cache-miss" if q == 0 else "cache-hit")
            bench.pair(length, f"{session.id}/q{q}", ids, method, cache,
                       lambda text, s=session, q=q: score_answer(s, q, text), flip=bool(i % 2))
        if evict:
            extra[str(length)] = {"bytes_per_cached_token": shared.nbytes / max(1, shared.held_tokens),
                                  "model_kv_bytes_per_token": per_token, "cache_bytes_bound": bound,
                                  "evicted_blocks": shared.stats.evicted_blocks, "cache_bytes_end": shared.nbytes}
    bench.finish({"cache_memory": extra} if evict else None)


def cmd_chat(args: argparse.Namespace) -> None:
    bench = Bench(args, "chat")
    length = args.lengths[0]
    sessions = document_sessions(bench.tok, length, args.n, args.turns, args.split, args.seed)
    bar = tqdm(total=len(sessions) * args.turns, desc="chat", unit="turn")
    for i, session in enumerate(sessions):
        cache = bench.cache()  # a conversation's turns share one cache (a resumed one starts again)
        answers: list[str] = []
        for turn in range(args.turns):
            ids = _chat_ids(bench.tok, messages_for(session, answers))
            ref = bench.pair(turn + 1, session.id, ids, "cache", cache,
                             lambda text, s=session, q=turn: score_answer(s, q, text), flip=bool((i + turn) % 2))
            answers.append(ref.text)
            bar.update(1)
    bar.close()
    bench.finish()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["questions", "chat", "evict"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048],
                   help="document budgets in tokens (chat: the first one)")
    p.add_argument("--n", type=int, default=4, help="sessions (documents / conversations)")
    p.add_argument("--questions", type=int, default=4, help="questions per document (questions, evict)")
    p.add_argument("--turns", type=int, default=7, help="turns per conversation (chat)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--cache-mb", type=int, default=4096, help="the cache bound (questions, chat)")
    p.add_argument("--cache-docs", type=float, default=2.5,
                   help="evict: the cache bound in documents' worth of K/V at the length")
    p.add_argument("--split", default="test", choices=["dev", "test"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES), help="the model's dtype (default auto)")
    p.add_argument("--name", default=None, help="result file stem (default prefix_<command>_<model>)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--resume", action="store_true")
    return p


def main() -> None:
    args = build_parser().parse_args()
    keep_freed_memory()
    started = time.monotonic()
    if args.command == "chat":
        cmd_chat(args)
    else:
        cmd_questions(args, args.command, evict=args.command == "evict")
    print(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
