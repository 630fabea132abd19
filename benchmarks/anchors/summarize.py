"""Summarize the anchor runners' JSONL files as one markdown table (any Python 3.10+, stdlib only).

Per model x target length x system: the median wall-clock TTFT of the cold runs and of the
prefix-cache hits (and the system's own TTFT figure beside it), the number of runs, the median
prompt tokens taken from the cache on a hit, each median as a multiple of fastprefill's
(``x fp`` > 1: slower than fastprefill), and how often the first token equals fastprefill's on the
same prompt (a check that every system ran the same model on the same ids; llama.cpp runs
4-bit weights, so some disagreement is expected there).

    python benchmarks/anchors/summarize.py results/*.jsonl --out anchors.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REFERENCE = "fastprefill"
ORDER = {"fastprefill": 0, "vllm": 1, "openvino": 2, "llamacpp": 3}


def load(paths: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    headers, runs = [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                item = json.loads(line)
                if item.get("type") == "header" and "system" in item:  # a prompt set's header has none
                    headers.append({**item, "file": path})
                elif item.get("type") == "run":
                    runs.append(item)
    return headers, runs


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _ratio(v: float | None, ref: float | None) -> str:
    return "-" if v is None or not ref else f"{v / ref:.2f}"


def table(headers: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["model"], r["length"], r["system"], r["kind"])].append(r)
    reference_token: dict[tuple, int] = {}
    for r in runs:
        if r["system"] == REFERENCE:
            reference_token.setdefault((r["model"], r["prompt_id"], r["kind"]), r["first_token"])
    version = {(h["system"], h["model"]): (h.get("version", "?"), h.get("config", {}).get("model_dtype") or h.get("dtype", ""))
               for h in headers}  # fastprefill's config names the dtype "auto" resolved to

    lines = [
        ("| model | length | system | version | dtype | n | prompt tok | cold ms | cold own ms | hit ms | hit own ms "
         "| hit cached tok | cold x fp | hit x fp | first token = fp |"),
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({k[:3] for k in groups}, key=lambda k: (k[0], k[1], ORDER.get(k[2], 9), k[2]))
    for model, length, system in keys:
        cold, hit = groups.get((model, length, system, "cold"), []), groups.get((model, length, system, "hit"), [])
        ref_cold = _median([r["ttft_s"] for r in groups.get((model, length, REFERENCE, "cold"), [])])
        ref_hit = _median([r["ttft_s"] for r in groups.get((model, length, REFERENCE, "hit"), [])])
        c, h = _median([r["ttft_s"] for r in cold]), _median([r["ttft_s"] for r in hit])
        both = cold + hit
        compared = [r for r in both if (r["model"], r["prompt_id"], r["kind"]) in reference_token]
        same = sum(r["first_token"] == reference_token[(r["model"], r["prompt_id"], r["kind"])] for r in compared)
        cached = _median([r["cached_tokens"] for r in hit])
        ver, dtype = version.get((system, model), ("?", ""))
        lines.append(
            f"| {model} | {length} | {system} | {ver} | {dtype} | {len(cold)}/{len(hit)} "
            f"| {_median([r['prompt_tokens'] for r in cold]) or '-':.0f} "
            f"| {_ms(c)} | {_ms(_median([r['own_ttft_s'] for r in cold]))} "
            f"| {_ms(h)} | {_ms(_median([r['own_ttft_s'] for r in hit]))} "
            f"| {'-' if cached is None else f'{cached:.0f}'} | {_ratio(c, ref_cold)} | {_ratio(h, ref_hit)} "
            f"| {f'{same}/{len(compared)}' if compared else '-'} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="runner outputs (JSONL)")
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args()
    headers, runs = load(args.files)
    if not runs:
        raise SystemExit("no runs in the given files")
    threads = sorted({h.get("threads") for h in headers})
    text = [
        "# TTFT anchors: fastprefill and peer runtimes, same machine, same token ids",
        "",
        (f"Medians over runs (n = cold/hit runs). Wall-clock TTFT of a one-token generation call on pre-tokenized "
        f"ids; `own` is the system's own TTFT metric. `x fp`: the median over fastprefill's (> 1 = slower). "
        f"Threads: {', '.join(map(str, threads))}."),
        "",
        table(headers, runs),
        "",
        "Runs:",
        "",
        *[f"- {h['system']} {h.get('version')} ({h['model']}): `{h.get('command')}` — {h.get('started')}, "
          f"{h.get('cpu')}" for h in headers],
        "",
    ]
    out = "\n".join(text)
    print(out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(out, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
