"""Summarize the anchor runners' JSONL files as markdown tables (any Python 3.10+, stdlib only).

``run_all.sh`` runs in rounds: each round runs every system once on the same prompt set, so a
system's runs in round ``r`` (file ``run-<system>-round<r>.jsonl``) sit beside fastprefill's runs
of the same round, minutes apart, not hours. A file named without ``-round<r>`` is round 0 (the
older layout: each system ran once, one after another).

Per cell (model, target length, kind: ``cold`` = nothing cached, ``hit`` = the document comes from
the prefix cache, ``decode`` = one decode step after the hit's first token, at the follow-up's
length: its ``step_s`` stands where the other kinds have their TTFT) and system:

- ``n``: timed runs, over all rounds; ``rounds``: rounds with runs;
- ``median ms``: the median wall-clock TTFT over all runs (``own ms``: the system's own figure);
- ``x fp``: the **median over rounds of the paired ratio**: in each round, each run is divided by
  fastprefill's run of the same prompt, kind and repeat in that round, and the round's ratio is
  the median of those; ``> 1`` = slower than fastprefill;
- ``x fp [min, max]``: the lowest and highest round ratio. With R rounds that interval covers the
  median of the round ratios with probability ``1 - 2^(1-R)`` (94% at 5 rounds) when the rounds are
  exchangeable; ``-`` with one round (no interval: the ratio rests on one sitting);
- ``round spread``: (max - min) / median of the system's own per-round median TTFT: how much the
  machine drifted between rounds (a ratio smaller than this spread is not a measured difference);
- the median prompt tokens a hit took from the cache, and how often the first token equals
  fastprefill's on the same prompt (llama.cpp runs 4-bit weights, so some disagreement there;
  for ``decode``: how often all the generated tokens equal fastprefill's).

The machine is named from the run headers: the CPU, its bfloat16 units (``bf16_units``, read from
``/proc/cpuinfo`` by the runner; ``not recorded`` for older files) and each system's dtype.

    python benchmarks/anchors/summarize.py results/MODEL/run-*.jsonl --out results/MODEL/summary.md
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

REFERENCE = "fastprefill"
ORDER = {"fastprefill": 0, "vllm": 1, "openvino": 2, "llamacpp": 3}
KINDS = {"cold": 0, "hit": 1, "decode": 2}
_ROUND = re.compile(r"-round(\d+)\.jsonl$")
#: /proc/cpuinfo flag -> how a page names the unit
#: runs of one round that began further apart than this are not one sitting, and not paired
SITTING_HOURS = 3
UNITS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "none": "no bf16 units"}


def round_of(path: str) -> int:
    """The round a run file belongs to: ``run-<system>-round<r>.jsonl`` -> r; any other name -> 0."""
    match = _ROUND.search(Path(path).name)
    return int(match.group(1)) if match else 0


def load(paths: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The headers (each with its ``file`` and ``round``) and the timed runs (each with its ``round``)."""
    headers, runs = [], []
    for path in paths:
        rnd = round_of(path)
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                item = json.loads(line)
                if item.get("type") == "header" and "system" in item:  # a prompt set's header has none
                    headers.append({**item, "file": path, "round": rnd})
                elif item.get("type") == "run":
                    runs.append({**item, "round": rnd})
    return headers, runs


def value(run: dict[str, Any]) -> float:
    """The seconds a run is compared by: a decode run's step, any other run's TTFT."""
    return run["step_s"] if run["kind"] == "decode" else run["ttft_s"]


def answer(run: dict[str, Any]) -> Any:
    """What a run's agreement with fastprefill compares: a decode run's tokens, any other's first token."""
    return tuple(run["tokens"]) if run["kind"] == "decode" else run["first_token"]


def median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _start(h: dict[str, Any]) -> datetime | None:
    try:
        return datetime.strptime(h.get("started", ""), "%Y-%m-%dT%H:%M:%S%z")
    except ValueError:
        return None


def other_sittings(headers: list[dict[str, Any]]) -> set[tuple[int, str, str]]:
    """``(round, model, system)`` whose run began more than :data:`SITTING_HOURS` from fastprefill's
    of the same round and model: those runs are not paired (a ratio across sittings measures the
    machine's drift as much as the systems)."""
    ref = {(h["round"], h["model"]): _start(h) for h in headers if h["system"] == REFERENCE}
    out = set()
    for h in headers:
        a, b = _start(h), ref.get((h["round"], h["model"]))
        if a and b and abs((a - b).total_seconds()) > SITTING_HOURS * 3600:
            out.add((h["round"], h["model"], h["system"]))
    return out


def paired_ratios(runs: list[dict[str, Any]], model: str, length: int, kind: str, system: str,
                  unpaired: set[tuple[int, str, str]] = frozenset(),
                  reference: str = REFERENCE) -> dict[int, list[float]]:
    """Per round: ``system``'s TTFT over ``reference``'s (fastprefill's) on the same prompt, kind
    and repeat of that round; none for a round in ``unpaired`` (:func:`other_sittings`; unpaired
    with fastprefill's run, which every run of that system in that round is)."""
    ref = {(r["round"], r["prompt_id"], r["repeat"]): value(r) for r in runs
           if r["system"] == reference and (r["round"], model, reference) not in unpaired and r["model"] == model and r["length"] == length and r["kind"] == kind}
    out: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        if (r["system"] == system and r["model"] == model and r["length"] == length and r["kind"] == kind
                and (r["round"], model, system) not in unpaired):
            base = ref.get((r["round"], r["prompt_id"], r["repeat"]))
            if base:
                out[r["round"]].append(value(r) / base)
    return dict(out)


def cell(runs: list[dict[str, Any]], model: str, length: int, kind: str, system: str,
         unpaired: set[tuple[int, str, str]] = frozenset(), reference: str = REFERENCE) -> dict[str, Any]:
    """The figures of one table row (see the module docstring); ratios ``None`` where nothing pairs.
    ``reference``: the system the ratios divide by (the table's is fastprefill; a page may pair two
    other systems of the same rounds the same way)."""
    mine = [r for r in runs if r["system"] == system and r["model"] == model and r["length"] == length
            and r["kind"] == kind]
    by_round: dict[int, list[float]] = defaultdict(list)
    for r in mine:
        by_round[r["round"]].append(value(r))
    round_medians = [statistics.median(v) for _, v in sorted(by_round.items())]
    ratios = {k: statistics.median(v)
              for k, v in sorted(paired_ratios(runs, model, length, kind, system, unpaired, reference).items())}
    values = list(ratios.values())
    mid = median(round_medians)
    return {
        "n": len(mine), "rounds": len(by_round),
        "median_s": median([value(r) for r in mine]),
        "own_s": median([r.get("own_step_s" if kind == "decode" else "own_ttft_s") for r in mine]),
        "ratio": median(values), "ratio_rounds": values,
        "low": min(values) if len(values) > 1 else None, "high": max(values) if len(values) > 1 else None,
        "spread": (max(round_medians) - min(round_medians)) / mid if len(round_medians) > 1 and mid else None,
        "cached": median([r.get("cached_tokens") for r in mine]) if kind == "hit" else None,
        "prompt_tokens": median([r["prompt_tokens"] for r in mine]),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _units(h: dict[str, Any], headers: list[dict[str, Any]]) -> str:
    """How a header's machine does bfloat16: its ``bf16_units`` where recorded, else what fastprefill's
    ``--dtype auto`` chose on the same CPU (bfloat16 only where the CPU has bfloat16 units)."""
    if h.get("bf16_units"):
        return UNITS.get(h["bf16_units"], h["bf16_units"])
    for fp in headers:
        if (fp["system"] == REFERENCE and fp.get("cpu") == h.get("cpu") and "--dtype" not in fp.get("command", "")
                and fp.get("config", {}).get("model_dtype")):
            chose = fp["config"]["model_dtype"]
            return (f"bf16 units not recorded, fastprefill's dtype auto chose {chose} "
                    f"({'bf16 units present' if chose == 'bfloat16' else 'no bf16 units'})")
    return "bf16 units not recorded"


def machine(headers: list[dict[str, Any]]) -> list[str]:
    """One line per distinct machine the headers name: CPU, bfloat16 units, threads."""
    seen: dict[tuple, list[str]] = {}
    for h in headers:
        key = (h.get("cpu", "?"), _units(h, headers), h.get("threads"))
        seen.setdefault(key, []).append(h["system"])
    return [f"{cpu}, {units}, {threads} threads ({', '.join(sorted(set(systems), key=lambda s: ORDER.get(s, 9)))})"
            for (cpu, units, threads), systems in seen.items()]


def table(headers: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    reference_token: dict[tuple, int] = {}
    for r in runs:
        if r["system"] == REFERENCE:
            reference_token.setdefault((r["model"], r["prompt_id"], r["kind"]), answer(r))
    version = {(h["system"], h["model"]): (h.get("version", "?"), h.get("config", {}).get("model_dtype") or h.get("dtype", ""))
               for h in headers}  # fastprefill's config names the dtype "auto" resolved to
    lines = [
        ("| model | length | kind | system | version | dtype | rounds | n | prompt tok | median ms | own ms "
         "| x fp | x fp [min, max] | round spread | hit cached tok | first token = fp |"),
        "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    keys = sorted({(r["model"], r["length"], r["kind"], r["system"]) for r in runs},
                  key=lambda k: (k[0], k[1], KINDS.get(k[2], 9), k[2], ORDER.get(k[3], 9), k[3]))
    unpaired = other_sittings(headers)
    for model, length, kind, system in keys:
        c = cell(runs, model, length, kind, system, unpaired)
        mine = [r for r in runs if (r["model"], r["length"], r["kind"], r["system"]) == (model, length, kind, system)]
        compared = [r for r in mine if (model, r["prompt_id"], kind) in reference_token]
        same = sum(answer(r) == reference_token[(model, r["prompt_id"], kind)] for r in compared)
        ver, dtype = version.get((system, model), ("?", ""))
        interval = "-" if c["low"] is None else f"[{c['low']:.2f}, {c['high']:.2f}]"
        spread = "-" if c["spread"] is None else f"{100 * c['spread']:.0f}%"
        cached = "-" if c["cached"] is None else f"{c['cached']:.0f}"
        agree = f"{same}/{len(compared)}" if compared else "-"
        lines.append(
            f"| {model} | {length} | {kind} | {system} | {ver} | {dtype} | {c['rounds']} | {c['n']} "
            f"| {c['prompt_tokens']:.0f} | {_ms(c['median_s'])} | {_ms(c['own_s'])} | {_x(c['ratio'])} | {interval} "
            f"| {spread} | {cached} | {agree} |"
        )
    return "\n".join(lines)


def report(headers: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    """The whole summary.md: machine, rounds, the table and the runs' commands."""
    rounds = sorted({r["round"] for r in runs})
    started = sorted(h.get("started", "?") for h in headers)
    if len(rounds) > 1:
        design = (f"{len(rounds)} rounds; each round ran every system once, one after another, on the same prompts "
                  f"(first start {started[0]}, last {started[-1]}).")
    else:
        design = (f"One round: each system ran once, one after another, so every ratio rests on one sitting per "
                  f"system and carries the machine's drift between them (starts: {', '.join(started)}); no interval.")
    if any("serve_round" in h for h in headers):
        design += (" Each system's process stayed up across the rounds (`--serve`): it loaded its model and ran its "
                   "warm-up prompts once, before the first round, not at the start of every round.")
    apart = sorted({f"{system} (round {rnd})" for rnd, _, system in other_sittings(headers)})
    if apart:
        design += (f" Not paired, because they began more than {SITTING_HOURS} h from fastprefill's run of the same "
                   f"round (another sitting): {', '.join(apart)}; their `x fp` is `-`.")
    text = [
        "# TTFT anchors: fastprefill and peer runtimes, same machine, same token ids",
        "",
        "Machine: " + "; ".join(machine(headers)) + ".",
        "",
        design,
        "",
        ("Wall-clock TTFT of a one-token generation call on pre-tokenized ids; `own`: the system's own TTFT metric. "
         "`decode` rows: one decode step after the first token at the follow-up's length (ms per token, the difference "
         "of a 1-token and a (1 + D)-token call on the cached follow-up over D; `own`: the system's own per-token "
         "figure), compared like the TTFTs; their agreement column compares all the tokens. "
         "`x fp`: the median over rounds of each round's median paired ratio to fastprefill (same prompt, kind and "
         "repeat; > 1 = slower than fastprefill), `[min, max]` over rounds; `round spread`: (max - min) / median of the "
         "system's per-round median TTFT."),
        "",
        table(headers, runs),
        "",
        "Runs:",
        "",
        *[f"- {h['system']} {h.get('version')} ({h['model']}, round {h['round']}): `{h.get('command')}` — "
          f"{h.get('started')}, {h.get('cpu')}" for h in sorted(headers, key=lambda h: (h['round'], h.get('started', '')))],
        "",
    ]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="runner outputs (JSONL)")
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    headers, runs = load(args.files)
    if not runs:
        raise SystemExit("no runs in the given files")
    out = report(headers, runs)
    print(out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(out, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
