"""The dev gate of blending (``blend``): reordered cached passages against full prefill.

multidoc-qa dev prompts (default 2048 tokens, n = 48) are rebuilt as chunked prompts (each
passage tokenized on its own, so its K/V can be reused; full prefill runs the same ids). Before
any of them runs, one chunk store is warmed by *other* prompts: every passage of the gate's
prompts, shuffled together and regrouped into prompts of the same size (another order, other
neighbours, another question), prefilled once with ``blend`` at budget 0 (which computes and
stores each passage). Then every gate prompt runs full prefill, the floor (plain reuse, no
recompute: ``blend-floor``), each policy at each budget (``blend-<policy>-<percent>``) and
LazyLLM comparators, in the same process, paired per prompt (the bench's runner: threads fixed,
warm-up discarded, order rotated, TTFT from the engine's window, selection inside it).

Summary per method against full prefill: the TTFT ratio (median of per-prompt ratios, 95%
bootstrap interval of that median), first-token agreement and identical answers (95% Wilson
intervals), the F1 change in points (95% bootstrap interval of the mean), the token-layer
fraction, the share of passages found in the store, and whether the gate passes: a median ratio
>= 3 with first-token agreement >= 0.9 and its interval's lower end >= 0.8.

Which seams fail (``research/seams.py``, outside TTFT): every record names its gold passages
(HotpotQA's supporting facts); every blend record holds its blended K/V's error against full
prefill's on the same prompt, binned by offset in the passage, per passage, for the glue and the
question, and at three layers. The ``.md`` adds those errors per method, the gold passages'
against the others', and first-token agreement by where the gold passages sit.

    python benchmarks/blend_gate.py --model qwen2.5-coder-1.5b --n 48
    python benchmarks/blend_gate.py --model smollm2-135m --n 2 --out /tmp/blend-smoke   # a smoke run

Writes ``<out>/blend_gate_<model>_<length>_<dtype>.jsonl`` (resumable with ``--resume``; the
store is warmed again), ``.summary.jsonl`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastprefill.bench.records import FULL, Record, RecordLog, environment, result_name
from fastprefill.bench.runner import run_samples
from fastprefill.bench.summary import bootstrap_ci
from fastprefill.chunk_store import ChunkStore
from fastprefill.data.tasks import get_task
from fastprefill.engine import generate
from fastprefill.host import DTYPES, dtype_name, keep_freed_memory, set_threads
from fastprefill.methods.registry import make_method
from fastprefill.methods.research.blend import POLICIES, Blend
from fastprefill.models import load as load_model
from fastprefill.prompt import ChunkedPrompt, Passage
from fastprefill.tune import wilson
from reporting import write_rows
from research.seams import SeamPrompt, SeamRecorder, seam_row, seam_tables

RESULTS = Path(__file__).resolve().parent / "results"
MATCH = ("task", "split", "seed", "n", "length", "max_new_tokens", "model", "dtype", "methods")
INSTRUCTION = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
LAZYLLM = ("lazyllm-cut30k20-snap=lazyllm:preset=cut30k20+snap",
           "lazyllm-d15k10-snap=lazyllm:depth_schedule=0.15:0.1,selection=snap")
GATE = {"ttft_ratio": 3.0, "first_token_agreement": 0.9, "agreement_low": 0.8}


def passages_of(prompt: str) -> list[str]:
    """The ``title\\ntext`` passages of a multidoc-qa prompt, in order."""
    mark = "The following are given passages.\n"
    context = prompt[prompt.index(mark) + len(mark):prompt.rindex("\n\n" + INSTRUCTION)]
    return re.split(r"(?:^|\n)Passage \d+:\n", context)[1:]


def chunked(tok: Any, passages: list[str], question: str) -> ChunkedPrompt:
    """The multidoc-qa prompt over ``passages`` (the task's own text), each passage a chunk."""
    parts: list[str] = [f"{INSTRUCTION}\n\nThe following are given passages.\n"]
    for i, text in enumerate(passages, 1):
        parts += [f"{'' if i == 1 else chr(10)}Passage {i}:\n", Passage(text)]
    parts.append(f"\n\n{INSTRUCTION}\n\nQuestion: {question}\nAnswer:")
    return ChunkedPrompt.from_parts(tok, parts, chat=True)


@dataclass(frozen=True)
class GateSample:
    """A gate prompt: the task's sample (scored as the task scores it) as a chunked prompt."""

    id: str
    input_ids: ChunkedPrompt
    source: Any


class Scored:
    """The task's score of a gate sample (nothing else of the task: no gold-token spans)."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def score(self, sample: GateSample, text: str) -> dict[str, float]:
        return self.task.score(sample.source, text)


def gate_samples(tok: Any, task: Any, args: argparse.Namespace) -> list[GateSample]:
    out = []
    for sample in task.build(tok, args.length, args.n, split=args.split, seed=args.seed):
        passages = passages_of(sample.prompt)
        prompt = chunked(tok, passages, sample.meta["question"])
        if tok.decode(list(prompt.ids)) != sample.prompt:
            raise SystemExit(f"sample {sample.id}: the rebuilt prompt is not the task's; fix passages_of")
        out.append(GateSample(str(sample.id), prompt, sample))
    return out


def warm(model: Any, tok: Any, samples: list[GateSample], store: ChunkStore, seed: int) -> dict[str, Any]:
    """Store every passage of ``samples`` through other prompts: all passages shuffled together,
    regrouped into prompts of the median size, each prefilled once with the floor."""
    lists = [passages_of(s.source.prompt) for s in samples]
    pool = list(dict.fromkeys(p for passages in lists for p in passages))
    rng = random.Random(f"blend-gate-warm/{seed}")
    rng.shuffle(pool)
    size = int(statistics.median(len(p) for p in lists))
    groups = [pool[i:i + size] for i in range(0, len(pool), size)]
    slot = {p: (g, i) for g, group in enumerate(groups) for i, p in enumerate(group)}
    same_slot = sum(slot[p][1] == i for passages in lists for i, p in enumerate(passages))
    started = time.perf_counter()
    floor = Blend(budget=0.0, store=store)
    for group in groups:
        question = samples[rng.randrange(len(samples))].source.meta["question"]
        generate(model, tok, chunked(tok, group, question), floor, max_new_tokens=1)
    return {"prompts": len(groups), "passages": len(pool), "passages_per_prompt": size,
            "same_slot_share": same_slot / sum(map(len, lists)), "seconds": time.perf_counter() - started,
            "store_bytes": store.nbytes, "chunks_stored": store.num_chunks}


def median_ci(values: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the median."""
    arr = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(arr[rng.integers(0, arr.size, size=(n_boot, arr.size))], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(lo), float(hi)


def summarize_gate(records: list[Record]) -> list[dict[str, Any]]:
    """One row per method, paired with full prefill on the same prompts (see the module docstring)."""
    full = {r.sample_id: r for r in records if r.method == FULL}
    rows = []
    for method in dict.fromkeys(r.method for r in records if r.method != FULL):
        pairs = [(full[r.sample_id], r) for r in records if r.method == method and r.sample_id in full]
        if not pairs:
            continue
        n = len(pairs)
        ratios = [f.ttft_s / r.ttft_s for f, r in pairs]
        agree = sum(f.extra["first_token"] == r.extra["first_token"] for f, r in pairs)
        same = sum(f.output.strip() == r.output.strip() for f, r in pairs)
        diffs = [100 * (r.score - f.score) for f, r in pairs]
        chunks = [(r.extra.get("chunk_hits", 0), r.extra.get("chunks", 0)) for _, r in pairs]
        row = {
            "method": method, "n": n,
            "ttft_full_s_median": statistics.median(f.ttft_s for f, _ in pairs),
            "ttft_s_median": statistics.median(r.ttft_s for _, r in pairs),
            "ttft_ratio_median": statistics.median(ratios), "ttft_ratio_ci95": list(median_ci(ratios)),
            "first_token_agreement": agree / n, "first_token_agreement_ci95": list(wilson(agree, n)),
            "identical_answers": same / n, "identical_answers_ci95": list(wilson(same, n)),
            "f1_change": statistics.mean(diffs), "f1_change_ci95": list(bootstrap_ci(diffs)),
            "token_layer_fraction": statistics.mean(r.token_layer_fraction for _, r in pairs),
            "chunk_hit_share": sum(h for h, _ in chunks) / max(1, sum(c for _, c in chunks)),
            "select_s_median": statistics.median(r.extra.get("select_s", 0.0) for _, r in pairs),
        }
        row["passes_gate"] = bool(method.startswith("blend") and row["ttft_ratio_median"] >= GATE["ttft_ratio"]
                                  and row["first_token_agreement"] >= GATE["first_token_agreement"]
                                  and row["first_token_agreement_ci95"][0] >= GATE["agreement_low"])
        rows.append({**row, **seam_row(pairs)})
    return rows


def table(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    def ci(row: dict[str, Any], key: str, fmt: str) -> str:
        lo, hi = row[f"{key}_ci95"]
        return f"{row[key]:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    title = (f"# blend gate: {header['model']} ({header['dtype']}), {header['task']} {header['split']} "
             f"{header['length']} tokens, n={header['n']}")
    columns = ("| method | TTFT full → method (s) | TTFT ratio [95%] | first token = full [95%] "
               "| identical answers [95%] | F1 change [95%] | token-layers | passages cached | gate |")
    lines = [title, "", columns, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['ttft_full_s_median']:.2f} → {r['ttft_s_median']:.2f} | "
                     f"{r['ttft_ratio_median']:.2f}x [{r['ttft_ratio_ci95'][0]:.2f}, {r['ttft_ratio_ci95'][1]:.2f}] | "
                     f"{ci(r, 'first_token_agreement', '.2f')} | {ci(r, 'identical_answers', '.2f')} | "
                     f"{ci(r, 'f1_change', '+.1f')} | {r['token_layer_fraction']:.2f} | {r['chunk_hit_share']:.0%} | "
                     f"{'pass' if r['passes_gate'] else '—'} |")
    return "\n".join(lines) + "\n" + seam_tables(rows)


def seam_recorder(samples: list[GateSample]) -> SeamRecorder:
    """The recorder of the gate's seams: each sample's ids, passages and gold passages."""
    return SeamRecorder({s.id: SeamPrompt(tuple(s.input_ids.ids), tuple(s.input_ids.chunks),
                                          tuple(s.source.meta["gold_positions"])) for s in samples})


def methods_of(args: argparse.Namespace, store: ChunkStore, seams: SeamRecorder) -> dict[str, Any]:
    """Full prefill, the floor, each policy at each budget (all keeping their K/V for ``seams``)
    and the LazyLLM comparators."""
    methods: dict[str, Any] = {FULL: seams.full(),
                               "blend-floor": seams.blend("blend-floor", budget=0.0, anchor=args.anchor, store=store)}
    for policy in args.policies:
        for budget in args.budgets:
            name = f"blend-{policy}-{round(budget * 100):02d}"
            methods[name] = seams.blend(name, policy=policy, budget=budget, anchor=args.anchor, store=store)
    for item in args.lazyllm:
        name, _, spec = item.partition("=")
        methods[name] = make_method(spec)
    return methods


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--split", default="dev", choices=["dev", "test"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--budgets", nargs="+", type=float, default=[0.05, 0.15, 0.30])
    p.add_argument("--anchor", default="lead", choices=["lead", "zero"])
    p.add_argument("--lazyllm", nargs="*", default=list(LAZYLLM), help="NAME=SPEC comparators (none: --lazyllm)")
    p.add_argument("--store-mb", type=int, default=8192, help="the chunk store's bound (every passage must fit)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's own budget")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)

    set_threads(args.threads)
    keep_freed_memory()
    model, tok = load_model(args.model, dtype=args.dtype)
    dtype = dtype_name(model.dtype)
    task = get_task("multidoc-qa")
    budget = args.max_new_tokens or task.default_max_new_tokens
    store = ChunkStore(args.store_mb << 20)
    samples = gate_samples(tok, task, args)
    seams = seam_recorder(samples)
    methods = methods_of(args, store, seams)
    warmed = warm(model, tok, samples, store, args.seed)
    stem = result_name(args.out, f"blend_gate_{args.model}_{args.length}_{dtype}", resume=args.resume)
    header = {"bench": "blend-gate", "task": "multidoc-qa", "split": args.split, "seed": args.seed, "n": args.n,
              "length": args.length, "max_new_tokens": budget, "model": args.model, "anchor": args.anchor,
              "methods": {FULL: "full prefill", **{k: m.describe() for k, m in methods.items() if k != FULL}},
              "gate": GATE, "warm": warmed, "store_mb": args.store_mb, "warmup": 1,
              **environment(args.threads, model)}
    log = RecordLog(Path(args.out) / f"{stem}.jsonl", header, resume=args.resume, overwrite=False, match=MATCH)

    def on_record(record: Record) -> None:  # between runs: the seams, then the record to the file
        seams.annotate(record)
        log.append(record)

    run_samples(model, tok, Scored(task), samples, methods, length=args.length, max_new_tokens=budget,
                desc=f"blend gate {args.model}", done={(r.sample_id, r.method) for r in log.records},
                on_record=on_record)
    rows = summarize_gate(log.records)
    write_rows(Path(args.out) / f"{stem}.summary.jsonl", log.header, rows)
    text = table(rows, log.header)
    (Path(args.out) / f"{stem}.md").write_text(text)
    print(text)
    print(json.dumps({"warm": warmed, "passes": [r["method"] for r in rows if r["passes_gate"]]}))


if __name__ == "__main__":
    main()
