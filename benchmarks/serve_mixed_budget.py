"""Where a long prompt's extra time goes under the mixed load: a budget read off a
``serve_load_mixed.py`` record, no new run.

For each long prompt of each ``interleaved`` server in the record, over the window from its
arrival to its first token (the client's clock):

- **short prefills**: the short requests (and follow-ups) that arrived in the window, and the
  sum of their prefills as the same requests took alone (their server-side TTFTs in the
  record's sequential ``fifo`` answers);
- **decode steps**: the time in the window during which at least one short stream was between
  its first and last token; with a step due every ``decode interval`` seconds (the ``decode=``
  of the server's label, else the servers' default the record's header gives, else 0.5 s: the
  default of every run made before headers recorded it), that many steps, each costing one decode step of a lone
  stream (the median per-token time of the sequential ``fifo`` answers in the same record).

Arrival times are the plan's (``serve_load_mixed._plan``: short ``i`` at ``i / rate``, long ``j``
at ``span * (j + 0.5) / long``), so the budget holds for records of that script only. The
growth the budget leaves unexplained is what it does not model (pauses, batching, the machine).

    python benchmarks/serve_mixed_budget.py benchmarks/results/serve_mixed_qwen2.5-coder-0.5b_quiet.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from fastprefill.bench.records import read_rows


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def budget(head: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per long prompt of each ``interleaved`` server of a record (its header and rows)."""
    default_interval = head.get("decode_interval_s", 0.5)
    span = head["n"] / head["rate"]
    sequential = [r for r in rows if r.get("phase") == "sequential" and r["kind"] != "long" and r["completion_tokens"] > 1]
    step = statistics.median((r["total_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in sequential)
    alone_prefill = {(r["kind"], r["i"]): r["server_ttft_s"] for r in rows if r.get("phase") == "sequential"}
    out = []
    for label in dict.fromkeys(r["scheduler"] for r in rows if r["scheduler"].startswith("interleaved")):
        interval = next((float(p[7:]) for p in label.split(":") if p.startswith("decode=")), default_interval)
        mixed = [r | {"at": span * (r["i"] + 0.5) / head["long"] if r["kind"] == "long" else r["i"] / head["rate"]}
                 for r in rows if r["scheduler"] == label and r.get("phase") == "mixed"]
        alone = statistics.median(r["ttft_s"] for r in rows if r["scheduler"] == label and r.get("phase") == "long_alone")
        others = [r for r in mixed if r["kind"] != "long"]
        for long in (r for r in mixed if r["kind"] == "long"):
            start, end = long["at"], long["at"] + long["ttft_s"]
            arrived = [r for r in others if start <= r["at"] < end]
            decoding = _covered([(max(start, r["at"] + r["ttft_s"]), min(end, r["at"] + r["total_s"])) for r in others
                                 if min(end, r["at"] + r["total_s"]) > max(start, r["at"] + r["ttft_s"])])
            out.append({"server": label, "long": long["i"], "ttft_s": long["ttft_s"], "alone_s": alone,
                        "extra_s": long["ttft_s"] - alone, "shorts": len(arrived),
                        "short_prefill_s": sum(alone_prefill[r["kind"], r["i"]] for r in arrived), "decoding_s": decoding,
                        "steps": decoding / interval, "step_s": step, "decode_s": decoding / interval * step})
    return out


def markdown(path: Path, head: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Budget of the long prompts' extra time: `{path.name}`", "",
             (f"The record: {head['model']}, {head['threads']} threads, {head['dtype']} on {head['cpu']} "
             f"(bfloat16 units: {head.get('bf16_units')}), torch {head['torch']}."), "",
             ("Per long prompt: its TTFT under the load and alone (median of the alone runs), the short requests "
             "that arrived before its first token and their prefills summed (each as it took alone), the time some short stream "
             "was decoding, and the decode steps that time implies (one per decode interval, each a lone stream's "
             "step from the sequential answers). See the script's docstring."), "",
             f"Command: `python benchmarks/serve_mixed_budget.py benchmarks/results/{path.name}`", "",
             ("| server | long | TTFT (s) | alone (s) | extra (s) | shorts arrived | their prefills (s) | "
             "streams decoding (s) | steps | decode (s) | prefills + decode (s) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['long']} | {r['ttft_s']:.2f} | {r['alone_s']:.2f} | {r['extra_s']:.2f} | "
                     f"{r['shorts']} | {r['short_prefill_s']:.2f} | {r['decoding_s']:.2f} | {r['steps']:.0f} | "
                     f"{r['decode_s']:.2f} | {r['short_prefill_s'] + r['decode_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", type=Path, help="serve_load_mixed.py JSONL records")
    args = p.parse_args(argv)
    for path in args.records:
        head, rows = read_rows(path)
        text = markdown(path, head, budget(head, rows))
        out = path.with_name(f"{path.stem}_budget.md")
        out.write_text(text)
        print(text)


if __name__ == "__main__":
    main()
