"""LazyLLM benchmarks (issue 3). Each subcommand writes JSON lines into ``benchmarks/results/``.

Subcommands (run on a quiet machine; the commands that made the committed results are in
``benchmarks/README`` / the report):

- ``equivalence``: keep-all LazyLLM vs full prefill on smollm2: max |logit diff|, identical
  greedy tokens, TTFT ratio (keep-all overhead of the layer loop).
- ``curve``: multidoc-qa F1 vs TTFT speedup for the LazyLLM presets, and RandomDrop and
  StaticPruning at each preset's token budget (:func:`equivalent_keep`), full prefill in the
  same process on the same prompts. Summary: paired F1 difference to full with a 95% bootstrap
  CI, realised speedup (median TTFT ratio) vs ideal (1 / token-layer fraction).
- ``needle``: passkey retrieval at 1k-4k tokens, depths 10-90%, the default preset vs full.
- ``decode``: exactly ``--new-tokens`` (64) new tokens, EOS ignored: total time vs full prefill
  plus plain decoding, revivals per step.
- ``sweep``: the dev-split schedule sweep that picks the default preset.
- ``speed``: realised vs ideal speedup on a handful of prompts (no scoring).

Every run fixes ``torch.set_num_threads`` and excludes warm-up (via
:func:`fastprefill.bench.runner.run_benchmark`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fastprefill.bench.report import summarize
from fastprefill.bench.runner import FULL, Record, environment, run_benchmark
from fastprefill.engine import generate
from fastprefill.methods.base import Method
from fastprefill.methods.baselines import RandomDrop, StaticPruning, equivalent_keep
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import DEFAULT_PRESET, PRESETS, LazyLLM
from fastprefill.models.shape import ModelShape

RESULTS = Path(__file__).resolve().parent / "results"

#: Candidate schedules of the dev sweep, as (relative depth, keep) pairs.
SWEEP: dict[str, tuple[tuple[float, float], ...]] = {
    **{k: v for k, v in PRESETS.items() if k not in ("keep-all", "default")},
    "mid-two": ((0.33, 0.6), (0.66, 0.35)),
    "early-half": ((0.1, 0.5),),
}


def _load(name: str):
    from fastprefill.models import zoo

    return zoo.load(name)


def summarize_paired(records: list[Record]) -> list[dict[str, Any]]:
    """Per (length, method): :func:`fastprefill.bench.report.summarize` (paired score difference
    to full with its 95% CI, paired speedup, token-layers) plus what LazyLLM's reports add: the
    share of answers identical to full prefill's, full-generation times and revivals per step."""
    by: dict[tuple[Any, str], dict[str, Record]] = defaultdict(dict)
    for r in records:
        by[(r.length, r.sample_id)][r.method] = r
    rows = []
    for s in summarize(records):
        ps = [v for (ln, _), v in by.items() if ln == s.length and FULL in v and s.method in v]
        if s.method == FULL or not ps:
            continue
        m = s.method
        rows.append({
            "length": s.length, "method": m, "n": s.n,
            "score": s.score_mean, "score_full": statistics.mean(p[FULL].score for p in ps),
            "score_diff": s.score_diff_vs_full, "score_diff_ci95": s.score_diff_ci95,
            "same_output_as_full": statistics.mean(p[m].output.strip() == p[FULL].output.strip() for p in ps),
            "ttft_s_median": s.ttft_median_s,
            "ttft_full_s_median": statistics.median(p[FULL].ttft_s for p in ps),
            "speedup_median": s.speedup_paired_median,
            "total_s_median": statistics.median(p[m].total_s for p in ps),
            "total_full_s_median": statistics.median(p[FULL].total_s for p in ps),
            "new_tokens_mean": statistics.mean(p[m].new_tokens for p in ps),
            "token_layer_fraction": s.token_layer_fraction, "ideal_speedup": s.ideal_speedup,
            "revived_per_step_mean": statistics.mean(
                statistics.mean(p[m].extra.get("revived_per_step") or [0]) for p in ps),
        })
    return rows


#: Largest mean F1 loss (0-1 scale) on dev that still counts as "matched accuracy" in the sweep.
SWEEP_TOLERANCE = 0.01


def choose_default(rows: list[dict[str, Any]], tolerance: float = SWEEP_TOLERANCE) -> dict[str, Any]:
    """The sweep's rule: the schedule computing the fewest token-layers whose mean dev F1 loss
    against full prefill is at most ``tolerance``; if none qualifies, the one losing the least F1
    (ties: fewer token-layers). Returns ``{"chosen", "rule", "qualifying"}``."""
    if not rows:
        raise ValueError("no sweep rows to choose from")
    ok = [r for r in rows if r["score_diff"] >= -tolerance]
    if ok:
        best = min(ok, key=lambda r: r["token_layer_fraction"])
        rule = f"fewest token-layers with mean dev F1 loss <= {100 * tolerance:.0f} point(s)"
    else:
        best = max(rows, key=lambda r: (r["score_diff"], -r["token_layer_fraction"]))
        rule = f"no schedule within {100 * tolerance:.0f} point(s): the smallest mean dev F1 loss"
    return {"chosen": best["method"], "rule": rule, "qualifying": [r["method"] for r in ok]}


def needle_by_depth(records: list[Record]) -> list[dict[str, Any]]:
    """Retrieval rate per (length, depth, method), the depth read back from each sample id."""
    from fastprefill.data.tasks import NeedleTask

    task = NeedleTask()
    hits: dict[tuple[Any, float, str], list[float]] = defaultdict(list)
    for r in records:
        hits[(r.length, task.depth_of(r.sample_id), r.method)].append(r.score)
    return [{"length": ln, "depth": d, "method": m, "n": len(v), "retrieved": statistics.mean(v)}
            for (ln, d, m), v in sorted(hits.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))]


def _write_summary(name: str, header: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.summary.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        print(f"{row['length']!s:>6} {row['method']:<28} n={row['n']:<3} score={row['score']:.3f} "
              f"diff={row['score_diff']:+.3f} CI95=({row['score_diff_ci95'][0]:+.3f},{row['score_diff_ci95'][1]:+.3f}) "
              f"speedup={row['speedup_median']:.2f}x ideal={row['ideal_speedup']:.2f}x "
              f"same-as-full={row['same_output_as_full']:.0%}")
    return path


def matched_methods(presets: list[str], num_layers: int, length: int, static_depth: float,
                    baselines: bool = True) -> dict[str, Method]:
    """LazyLLM presets plus (unless ``baselines=False``) RandomDrop and StaticPruning at each preset's token budget."""
    select_layer = max(0, int(static_depth * num_layers))
    out: dict[str, Method] = {}
    for preset in presets:
        lazy = LazyLLM.preset(preset)
        p = lazy.preset_name  # "default" resolves to the schedule's own name
        out[f"lazyllm-{p}"] = lazy
        if not baselines:
            continue
        sched = lazy.resolved(num_layers)
        out[f"random@{p}"] = RandomDrop(keep=equivalent_keep(sched, num_layers, length), seed=0)
        out[f"static@{p}"] = StaticPruning(
            keep=equivalent_keep(sched, num_layers, length, select_layer=select_layer), select_layer=select_layer)
    return out


def cmd_task(args: argparse.Namespace, name: str, methods_fn, split: str, task: str,
             max_new_tokens: int | None = None, stop_at_eos: bool = True,
             select_default: bool = False) -> None:
    name = args.name or name
    model, tok = _load(args.model)
    shape = ModelShape.from_config(model.config)
    methods = methods_fn(shape.num_layers)
    records = run_benchmark(
        model, tok, task, methods, args.lengths, args.n, split=split, seed=args.seed, threads=args.threads,
        max_new_tokens=max_new_tokens, out_dir=RESULTS, name=name, meta={"model": args.model},
        stop_at_eos=stop_at_eos,
    )
    header = {"task": task, "split": split, "model": args.model, **environment(args.threads),
              "methods": {k: m.describe() for k, m in methods.items()}}
    rows = summarize_paired(records)
    if task == "needle":
        header["retrieved_by_depth"] = needle_by_depth(records)
        for row in header["retrieved_by_depth"]:
            print(f"{row['length']:>6} depth={row['depth']:.1f} {row['method']:<20} n={row['n']:<3} "
                  f"retrieved={row['retrieved']:.0%}")
    if select_default:
        header["selection"] = choose_default(rows)
        print(f"sweep choice: {header['selection']}")
    _write_summary(name, header, rows)


def cmd_equivalence(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model, tok = _load(args.model)
    prompts = ["Explain in one sentence why the sky is blue.",
               "Write a haiku about autumn leaves.",
               "List three prime numbers greater than ten.",
               "What is the boiling point of water at sea level?"][: args.n]
    lazy, full = LazyLLM.preset("keep-all"), FullPrefill()
    ids0 = tok(prompts[0], return_tensors="pt").input_ids
    for m in (full, lazy):  # warm-up, discarded
        generate(model, tok, ids0, m, max_new_tokens=2)
    rows = []
    for p in tqdm(prompts, desc="equivalence"):
        ids = tok(p, return_tensors="pt").input_ids
        with torch.inference_mode():
            diff = float((full.prefill(model, ids).logits - lazy.prefill(model, ids).logits).abs().max())
        a = generate(model, tok, ids, full, max_new_tokens=args.new_tokens, stop_at_eos=False)
        b = generate(model, tok, ids, lazy, max_new_tokens=args.new_tokens, stop_at_eos=False)
        rows.append({"prompt": p, "tokens": int(ids.shape[1]), "max_abs_logit_diff": diff,
                     "same_tokens": a.token_ids == b.token_ids, "ttft_full_s": a.timing.ttft_s,
                     "ttft_lazy_s": b.timing.ttft_s, "ttft_ratio_lazy_over_full": b.timing.ttft_s / a.timing.ttft_s})
        print(rows[-1])
    header = {"bench": "lazyllm-equivalence", "model": args.model, **environment(args.threads)}
    _write_summary_raw("lazyllm_equivalence", header, rows)


def _write_summary_raw(name: str, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / f"{name}.jsonl").open("w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in rows)


def cmd_speed(args: argparse.Namespace) -> None:
    """TTFT of full vs each preset on random-token prompts of ``length`` (no scoring)."""
    torch.set_num_threads(args.threads)
    model, _ = _load(args.model)
    length = args.lengths[0]
    methods: dict[str, Method] = {"full": FullPrefill(), **{p: LazyLLM.preset(p) for p in args.presets}}
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.get_input_embeddings().num_embeddings
    prompts = [torch.randint(100, vocab, (1, length), generator=gen) for _ in range(args.n + 1)]
    times: dict[str, list[float]] = defaultdict(list)
    fracs: dict[str, float] = {}
    for i, ids in enumerate(tqdm(prompts, desc="speed")):
        for name, m in methods.items():
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = m.prefill(model, ids)
                int(out.logits.argmax())
                dt = time.perf_counter() - t0
            fracs[name] = out.stats.fraction
            if i > 0:  # prompt 0 is the warm-up
                times[name].append(dt)
    rows = []
    for name in methods:
        med = statistics.median(times[name])
        rows.append({"method": name, "length": length, "n": args.n, "ttft_s_median": med,
                     "speedup": statistics.median(times["full"]) / med, "token_layer_fraction": fracs[name],
                     "ideal_speedup": 1 / fracs[name]})
        print(rows[-1])
    _write_summary_raw(f"lazyllm_speed_{args.model}_{length}",
                       {"bench": "lazyllm-speed", "model": args.model, **environment(args.threads)}, rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["equivalence", "curve", "needle", "decode", "sweep", "speed"])
    ap.add_argument("--model", default=None, help="zoo name (default depends on the command)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--n", type=int, default=None, help="samples per length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--presets", nargs="+", default=["gentle", "default", "aggressive"],
                    help="LazyLLM presets (curve/decode); 'default' is DEFAULT_PRESET")
    ap.add_argument("--no-baselines", action="store_true",
                    help="curve: LazyLLM presets against full prefill only (no matched random/static)")
    ap.add_argument("--name", default=None,
                    help="result file stem (default lazyllm_<command>_<model>_<lengths>)")
    ap.add_argument("--schedules", nargs="+", default=sorted(SWEEP), choices=sorted(SWEEP),
                    help="sweep candidates (names in SWEEP)")
    ap.add_argument("--static-depth", type=float, default=0.25,
                    help="StaticPruning selects at layer floor(depth * L)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="tokens generated per run, EOS ignored (default: 16 for equivalence, 64 for decode)")
    args = ap.parse_args(argv)
    defaults = {
        "equivalence": ("smollm2-135m", [0], 4),
        "curve": ("qwen2.5-coder-0.5b", [2048], 50),
        "needle": ("qwen2.5-coder-0.5b", [1024, 2048, 3072, 4096], 10),
        "decode": ("qwen2.5-coder-0.5b", [2048], 20),
        "sweep": ("qwen2.5-coder-0.5b", [2048], 30),
        "speed": ("smollm2-135m", [2048], 4),
    }[args.command]
    args.model = args.model or defaults[0]
    args.new_tokens = args.new_tokens or (64 if args.command == "decode" else 16)
    args.lengths = args.lengths or defaults[1]
    args.n = args.n or defaults[2]
    tag = f"{args.model}_{'-'.join(map(str, args.lengths))}"
    if args.command == "equivalence":
        cmd_equivalence(args)
    elif args.command == "speed":
        cmd_speed(args)
    elif args.command == "curve":
        cmd_task(args, f"lazyllm_curve_{tag}",
                 lambda L: matched_methods(args.presets, L, args.lengths[0], args.static_depth,
                                           baselines=not args.no_baselines),
                 "test", "multidoc-qa")
    elif args.command == "needle":
        cmd_task(args, f"lazyllm_needle_{tag}", lambda L: {f"lazyllm-{DEFAULT_PRESET}": LazyLLM.preset("default")},
                 "test", "needle")
    elif args.command == "decode":
        cmd_task(args, f"lazyllm_decode_{tag}",
                 lambda L: {f"lazyllm-{m.preset_name}": m for m in map(LazyLLM.preset, args.presets)},
                 "test", "multidoc-qa", max_new_tokens=args.new_tokens, stop_at_eos=False)
    elif args.command == "sweep":
        cmd_task(args, f"lazyllm_sweep_{tag}",
                 lambda L: {f"lazyllm-{k}": LazyLLM(depth_schedule=SWEEP[k], preset_name=k) for k in args.schedules},
                 "dev", "multidoc-qa", select_default=True)


if __name__ == "__main__":
    main()
