"""What keeping freed memory (``fastprefill.host.keep_freed_memory``) does to a prefill.

Each setting runs in a fresh process (the allocator's settings are per process), ``--rounds``
times in alternating order: load the model, one untimed warm-up prefill, then ``--repeats``
timed full prefills of the same ``--length`` random-token prompt. Per prefill: TTFT (the
engine's clock), minor page faults and system CPU seconds (``getrusage``).

    python benchmarks/allocator_bench.py --model qwen2.5-coder-0.5b --length 2048

Writes ``benchmarks/results/allocator_<model>_<length>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastprefill.bench.records import environment, result_name
from fastprefill.host import resolve_dtype
from reporting import write_json

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("default", "keep_freed_memory")

_CHILD = """
import json, resource, sys, torch
from fastprefill.host import keep_freed_memory, set_threads
setting, model_name, length, repeats, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
kept = keep_freed_memory() if setting == "keep_freed_memory" else False
set_threads(threads)
from fastprefill.engine import generate
from fastprefill.models import load
model, tok = load(model_name, progress=False)
ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))
generate(model, tok, ids, max_new_tokens=1)
runs = []
for _ in range(repeats):
    before = resource.getrusage(resource.RUSAGE_SELF)
    res = generate(model, tok, ids, max_new_tokens=1)
    after = resource.getrusage(resource.RUSAGE_SELF)
    runs.append({"ttft_s": res.timing.ttft_s, "minor_faults": after.ru_minflt - before.ru_minflt,
                 "system_s": after.ru_stime - before.ru_stime})
print(json.dumps({"setting": setting, "kept": kept, "dtype": str(model.dtype), "runs": runs}))
"""


def run_child(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, setting, args.model, str(args.length), str(args.repeats),
                          str(args.threads)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
            runs[setting] += run_child(setting, args)["runs"]
    rows = [{"setting": s, "n": len(rs), "ttft_median_s": statistics.median(x["ttft_s"] for x in rs),
             "minor_faults_median": statistics.median(x["minor_faults"] for x in rs),
             "system_s_median": statistics.median(x["system_s"] for x in rs)} for s, rs in runs.items()]
    header = {"bench": "allocator", "model": args.model, "length": args.length, "repeats": args.repeats,
              "rounds": args.rounds, **environment(args.threads, resolve_dtype("auto"))}
    stem = str(Path(args.out) / result_name(args.out, f"allocator_{args.model}_{args.length}"))
    write_json(stem + ".json", {"header": header, "rows": rows, "runs": runs})
    lines = [f"# Keeping freed memory: {args.model}, {args.length} tokens, {header['dtype']}", "",
             "| setting | n | median TTFT (s) | median minor page faults per prefill | median system CPU (s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['n']} | {r['ttft_median_s']:.3f} | {r['minor_faults_median']:.0f} | "
              f"{r['system_s_median']:.3f} |" for r in rows]
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
