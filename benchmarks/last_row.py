"""What the last layer on the last row only saves (``fastprefill.models.fused.last_row_only``):
full prefill with it on (the default) and off (``set_last_row_only(model, False)``: every row
through every layer), one model in one process, timed interleaved on the same random prompts.

For each prompt length ``T``, ``--rounds`` rounds, the two modes alternating in order:

- **cold**: ``FullPrefill().prefill`` of ``T`` tokens (what the engine times as a cold TTFT,
  without the sampling of the token);
- **hit**: the last ``--suffix`` tokens over a copy of the cached first ``T - suffix`` (the
  copy made before the clock starts);
- **last layer**: the model's last decoder layer alone on ``T`` random rows over an empty cache
  (``DecoderAdapter.layer`` inside ``last_row_only``, the switch on or off): the time the switch
  can save, measured
  apart from the whole prefill's run-to-run drift.

Per setting: each mode's median, the median of the per-round paired ratios ``off / on`` with
their range, whether the greedy next token agrees, and the largest logit difference.

    python benchmarks/last_row.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --lengths 2048 4096
    python benchmarks/last_row.py --settings "last layer" --rounds 9 --name layer

Results: ``last_row_<model>_<dtype>``, ``.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache

from fastprefill.bench.records import environment
from fastprefill.methods.full import FullPrefill
from fastprefill.models import load as load_model
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.fused import last_row_only, set_last_row_only
from packed_bench import machine, parser, run_all
from reporting import paired_ratios

MODES = ("on", "off")
SETTINGS = ("cold", "hit", "last layer")


def _timed(model: Any, ids: torch.Tensor, prefix: Any, mode: str) -> tuple[float, torch.Tensor]:
    """Seconds and ``(V,)`` logits of one full prefill of ``ids`` (over a copy of ``prefix``, if
    any), or with ``prefix`` ``"layer"`` of the last decoder layer alone on ``ids``' length in
    random rows (its last row's output for logits)."""
    set_last_row_only(model, mode == "on")
    if isinstance(prefix, str):
        ad = DecoderAdapter(model)
        hidden = torch.randn(1, ids.shape[1], model.config.hidden_size, dtype=model.dtype,
                             generator=torch.Generator().manual_seed(1))
        positions = torch.arange(ids.shape[1])[None]
        rotary, cache = ad.rotary(hidden, positions), DynamicCache(config=model.config)
        with ad.attention_scope(), last_row_only(model, cache):  # applies only while the switch is on
            t0 = time.perf_counter()
            out = ad.layer(ad.num_layers - 1, hidden, positions, cache, rotary=rotary)
            return time.perf_counter() - t0, out[0, -1].float()
    cache = copy.deepcopy(prefix) if prefix is not None else None
    t0 = time.perf_counter()
    out = FullPrefill().prefill(model, ids, cache)
    return time.perf_counter() - t0, out.logits


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    rows = []
    for length in args.lengths:
        ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.inference_mode():
            prefix = FullPrefill().prefill(model, ids[:, :length - args.suffix]).cache
            inputs = {"cold": (ids, None), "hit": (ids, prefix), "last layer": (ids, "layer")}
            settings = args.settings
            times = {s: {m: [] for m in MODES} for s in settings}
            logits: dict[str, dict[str, torch.Tensor]] = {s: {} for s in settings}
            for m in MODES:  # warm-up (compiles on the first call)
                for s in settings:
                    _timed(model, *inputs[s], m)
            for r in range(args.rounds):
                for m in (MODES if r % 2 == 0 else MODES[::-1]):
                    for s in settings:
                        seconds, logits[s][m] = _timed(model, *inputs[s], m)
                        times[s][m].append(seconds)
        set_last_row_only(model, True)
        paired = {s: paired_ratios(times[s]["off"], times[s]["on"]) for s in settings}
        rows.append({"length": length, "times": times,
                     "medians": {s: {m: statistics.median(t) for m, t in d.items()} for s, d in times.items()},
                     "paired": {s: [p["ratio"], p["min"], p["max"]] for s, p in paired.items()},
                     "same_token": {s: int(logits[s]["on"].argmax()) == int(logits[s]["off"].argmax()) for s in settings},
                     "max_logit_diff": {s: float((logits[s]["on"] - logits[s]["off"]).abs().max()) for s in settings}})
        print(f"{name} {length}: " + ", ".join(
            f"{s} {statistics.median(times[s]['on']):.3f} s on / {statistics.median(times[s]['off']):.3f} off"
            for s in settings), flush=True)
    return {"model": name, "suffix": args.suffix, "rounds": args.rounds, "rows": rows,
            "environment": environment(args.threads, model)}


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# The last layer on the last row only: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. One process, full prefill with the switch on and off alternating, "
              f"{result['rounds']} rounds; hit: the last {result['suffix']} tokens over the cached rest. "
              "Paired: the per-round ratio of off's time over on's, median [min, max]. For the last layer "
              "alone the last two columns compare its last row's output, not logits."), "",
             ("| T | setting | on (s) | off (s) | off / on (paired median) | range | rounds | same next token "
             "| max logit diff |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for s in row["times"]:
            ratio, lo, hi = row["paired"][s]
            lines.append(f"| {row['length']} | {s} | {row['medians'][s]['on']:.3f} | {row['medians'][s]['off']:.3f} "
                         f"| {ratio:.3f} | [{lo:.3f}, {hi:.3f}] | {len(row['times'][s]['on'])} "
                         f"| {'yes' if row['same_token'][s] else 'no'} | {row['max_logit_diff'][s]:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, repeats=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS[:2]),
                   help="what to time (default: cold and hit)")
    p.add_argument("--name", default="", help="a tag appended to the results' names")
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.lengths) <= args.suffix or args.suffix < 1:
        p.error("--rounds takes at least 1, and every length must exceed --suffix >= 1")
    run_all(args, "last_row", run_model, markdown,
            stem=lambda name, result: f"last_row_{name}_{result['environment']['dtype']}"
                                      + (f"_{args.name}" if args.name else ""))


if __name__ == "__main__":
    main()
