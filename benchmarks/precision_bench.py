"""The fidelity and speed of a dtype itself: full prefill in ``--dtype`` (default bfloat16) against
full prefill in float32, the same model's weights, the same prompts, in one process.

Both models are loaded as fastprefill loads them (compiled blocks where inductor can) and run
interleaved per prompt with the task's answer budget; the float32 run is the reference
(``full`` in the records), the other is named by its dtype. The summary is the bench's paired
one: first-token agreement, identical answers, the score change with a 95% bootstrap interval,
and the TTFT ratio (float32 over the other dtype, per prompt, median).

    python benchmarks/precision_bench.py --model qwen2.5-coder-0.5b --task multidoc-qa --length 2048 --n 50

Writes ``benchmarks/results/precision_<model>_<task>[_<length>].jsonl`` or ``<--name>.jsonl``
(resumable with ``--resume``), ``.md``, ``.summary.jsonl`` and ``.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastprefill.bench.records import FULL, RecordLog, environment, result_name
from fastprefill.bench.report import write_report
from fastprefill.bench.runner import run_samples
from fastprefill.data.tasks import TASKS, get_task
from fastprefill.host import DTYPES, dtype_name, keep_freed_memory, set_threads
from fastprefill.methods.full import FullPrefill
from fastprefill.models import load as load_model
from reporting import write_paired_rows

RESULTS = Path(__file__).resolve().parent / "results"
MATCH = ("task", "split", "seed", "n", "length", "max_new_tokens", "model", "dtype", "reference_dtype")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--task", default="multidoc-qa", choices=list(TASKS))
    p.add_argument("--length", type=int, default=None, help="prompt tokens (tasks that size their prompts)")
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--split", default="test", choices=["dev", "test"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=[d for d in DTYPES if d != "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's own budget")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--name", default=None, help="result file stem (default precision_<model>_<task>[_<length>])")
    args = p.parse_args(argv)

    set_threads(args.threads)
    keep_freed_memory()
    reference, tok = load_model(args.model, dtype="float32")
    other, _ = load_model(args.model, dtype=args.dtype)
    name = dtype_name(other.dtype)
    task = get_task(args.task)
    budget = args.max_new_tokens or task.default_max_new_tokens
    length = args.length if task.sized else None
    stem = result_name(args.out, f"precision_{args.model}_{args.task}" + (f"_{length}" if length else ""),
                       name=args.name, resume=args.resume)
    header = {"bench": "precision", "task": args.task, "split": args.split, "seed": args.seed, "n": args.n,
              "length": length, "max_new_tokens": budget, "model": args.model, "reference_dtype": "float32",
              "methods": {FULL: "full prefill in float32 (the reference)", name: f"full prefill in {name}"},
              "warmup": 1, **environment(args.threads, other)}
    log = RecordLog(Path(args.out) / f"{stem}.jsonl", header, resume=args.resume, overwrite=False, match=MATCH)
    samples = task.build(tok, length, args.n, split=args.split, seed=args.seed)
    run_samples(reference, tok, task, samples, {name: FullPrefill()}, length=length, max_new_tokens=budget,
                method_models={name: other}, desc=f"{args.model} {args.task} float32 vs {name}",
                done={(r.sample_id, r.method) for r in log.records}, on_record=log.append)
    summaries = write_report(Path(args.out), stem, log.header, log.records, save=False)
    write_paired_rows(Path(args.out) / f"{stem}.summary.jsonl", log.header, summaries)
    print((Path(args.out) / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
