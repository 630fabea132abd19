"""LazyLLM benchmarks. Each subcommand writes JSON lines into ``--out`` (default
``benchmarks/results/``), under ``--name`` or a default stem that never replaces an existing
result (:func:`fastprefill.bench.records.result_name`).

Subcommands (run on a quiet machine; the commands that made the committed results are in
each result file's header and on the pages of ``docs/results/``):

- ``equivalence``: keep-all LazyLLM vs full prefill on smollm2: max |logit diff|, identical
  greedy tokens, TTFT ratio (keep-all overhead of the layer loop).
- ``curve``: multidoc-qa F1 vs TTFT speedup for the LazyLLM presets, and RandomDrop and
  StaticPruning at each preset's token budget (:func:`equivalent_keep`), full prefill in the
  same process on the same prompts. Summary: paired F1 difference to full with a 95% bootstrap
  CI, realised speedup (median TTFT ratio) vs ideal (1 / token-layer fraction), first-token
  agreement, identical answers and first-token KL against full prefill.
- ``needle``: passkey retrieval at 1k-4k tokens, depths 10-90%, the default preset vs full.
- ``decode``: exactly ``--new-tokens`` (64) new tokens, EOS ignored (``--eos``: at most that
  many, stopping at EOS): total time vs full prefill plus plain decoding, revivals per step;
  each preset under each ``--revivals`` policy.
- ``sweep``: the dev-split schedule sweep that picked the default preset
  (:func:`research.selection.choose_default`).
- ``fidelity-sweep``: the later-cut candidates (:data:`research.selection.FIDELITY_CANDIDATES`)
  on the dev split, chosen by the fidelity rule fixed before the sweep
  (:func:`research.selection.choose_by_fidelity`).
- ``speed``: realised vs ideal speedup on a handful of random-token prompts (no scoring).
- ``ceiling``: a one-cut preset's own selection against two oracles at the same cut and budget
  (the gold passages first; the attention at a deeper probe layer), first token vs full prefill
  on the dev split (:func:`research.ceiling.selection_ceiling`).

The runs, records, summaries and files come from :mod:`fastprefill.bench` (threads fixed,
warm-up excluded, TTFT from the engine's timing window; the model in ``--dtype``, default
``auto``: :func:`fastprefill.host.resolve_dtype`); this script holds the method tables.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastprefill.bench.records import FULL, environment, result_name, save_records
from fastprefill.bench.report import markdown_table
from fastprefill.bench.runner import Unscored, run_benchmark, run_samples
from fastprefill.bench.summary import summarize
from fastprefill.engine import generate
from fastprefill.errors import FastprefillError
from fastprefill.host import DTYPES, keep_freed_memory, resolve_dtype, set_threads
from fastprefill.methods.base import Method
from fastprefill.methods.baselines import matched_baselines
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import LATE_SCHEDULES, PRESETS, LazyLLM
from fastprefill.models.shape import ModelShape
from reporting import needle_by_depth, write_paired_rows, write_rows
from research.ceiling import ceiling_summary, selection_ceiling
from research.selection import (
    FIDELITY_CANDIDATES,
    choose_by_fidelity,
    choose_default,
    describe_choice,
    fidelity_methods,
)
from samples import random_samples

RESULTS = Path(__file__).resolve().parent / "results"

#: Candidate schedules of the first dev sweep (``sweep``), as (relative depth, keep) pairs: the
#: presets it chose among (not the later-cut family, which ``fidelity-sweep`` runs).
SWEEP: dict[str, tuple[tuple[float, float], ...]] = {
    **{k: v for k, v in PRESETS.items() if k not in ("keep-all", "default", "paper", *LATE_SCHEDULES)},
    "mid-two": ((0.33, 0.6), (0.66, 0.35)),
    "early-half": ((0.1, 0.5),),
}


def _load(name: str, dtype: str):
    from fastprefill.models import load as load_model

    return load_model(name, dtype=dtype)


def matched_methods(presets: list[str], num_layers: int, length: int, static_depth: float,
                    baselines: Sequence[str] = ("random", "static")) -> dict[str, Method]:
    """LazyLLM presets plus, at each preset's token budget, the ``baselines`` of
    :func:`~fastprefill.methods.baselines.matched_baselines` (``random``, ``static``, ``gemfilter``)."""
    out: dict[str, Method] = {}
    for preset in presets:
        lazy = LazyLLM(preset=preset)
        p = lazy.preset  # "default" resolves to the schedule's own name
        out[f"lazyllm-{p}"] = lazy
        if not baselines:
            continue
        matched = matched_baselines(lazy, num_layers, length, static_select_layer=max(0, int(static_depth * num_layers)))
        out.update({f"{b}@{p}": matched[b] for b in baselines})
    return out


def revival_methods(presets: Sequence[str], revivals: Sequence[str]) -> dict[str, Method]:
    """Each preset under each revival policy: ``lazyllm-<preset>`` for ``all`` (the paper),
    ``lazyllm-<preset>/<policy>`` otherwise."""
    out: dict[str, Method] = {}
    for preset in presets:
        for policy in revivals:
            lazy = LazyLLM(preset=preset, options={"revival": policy})
            out[f"lazyllm-{lazy.preset}" + ("" if str(lazy.options.revival) == "all" else f"/{lazy.options.revival}")] = lazy
    return out


def cmd_task(args: argparse.Namespace, name: str, methods_fn, split: str, task: str,
             max_new_tokens: int | None = None, stop_at_eos: bool = True,
             choose=None, gate=None) -> None:
    """Run ``task`` through :func:`run_benchmark` (``<name>.{jsonl,md,png}``), then write the
    paired rows (``<name>.summary.jsonl``); ``choose`` (a rule of
    :mod:`research.selection`) picks among the methods, recorded in the header;
    ``gate`` (:func:`fill_gate`) is recorded under ``fill_gate``."""
    name = result_name(args.out, name, name=args.name, resume=args.resume)
    model, tok = _load(args.model, args.dtype)
    methods = methods_fn(ModelShape.from_config(model.config).num_layers)
    records = run_benchmark(
        model, tok, task, methods, args.lengths, args.n, split=split, seed=args.seed, threads=args.threads,
        max_new_tokens=max_new_tokens, out_dir=args.out, name=name, meta={"model": args.model},
        stop_at_eos=stop_at_eos, resume=args.resume,
    )
    summaries = summarize(records)
    header = {"task": task, "split": split, "model": args.model, **environment(args.threads, model),
              "methods": {k: m.describe() for k, m in methods.items()}}
    if task == "needle":
        header["retrieved_by_depth"] = needle_by_depth(records)
        for row in header["retrieved_by_depth"]:
            print(f"{row['length']:>6} depth={row['depth']:.1f} {row['method']:<20} n={row['n']:<3} "
                  f"retrieved={row['retrieved']:.0%}")
    if choose is not None:
        header["selection"] = choose(summaries)
        print(describe_choice(header["selection"]))
    if gate is not None:
        header["fill_gate"] = gate(summaries)
        for row in header["fill_gate"]:
            print(f"{row['budget']} {row['policy']:<11} first token {row['first_token']:.0%} "
                  f"[{row['first_token_ci'][0]:.0%}, {row['first_token_ci'][1]:.0%}] vs none "
                  f"{row['none_first_token']:.0%}; TTFT x{row['ttft_over_none']:.3f} of none: "
                  f"{'PASSES' if row['passes'] else 'fails'}")
    write_paired_rows(Path(args.out) / f"{name}.summary.jsonl", header, summaries)
    print(markdown_table(summaries))


#: fill-gate: one cut at this relative depth under the snap selection, pruned tokens dropped or filled.
FILL_DEPTH = 0.3


def fill_methods(keeps: Sequence[float], policies: Sequence[str], shares: Sequence[float] = (1.0,)) -> dict[str, Method]:
    """One-cut LazyLLM at :data:`FILL_DEPTH` keeping each of ``keeps`` (snap selection, no revival)
    under each fill policy (``none``, ``zero-shot``, ``calibrated:DIR``) and, for an active
    policy, each fill share, named ``lazyllm-k<keep %>/<policy kind>`` (``...-s<share %>`` when
    only a share of the pruned tokens is filled)."""
    from fastprefill.methods.research.fill import Fill

    out: dict[str, Method] = {}
    for keep in keeps:
        for policy in policies:
            fill = Fill.parse(policy)
            for share in shares if fill.active else (1.0,):
                suffix = "" if share == 1 else f"-s{round(100 * share):02d}"
                options = {"revival": "none", "fill": policy} | ({"fill_share": share} if share != 1 else {})
                out[f"lazyllm-k{round(100 * keep):02d}/{fill.kind}{suffix}"] = LazyLLM(
                    depth_schedule=((FILL_DEPTH, keep),), selection="snap",
                    label=f"cut{round(100 * FILL_DEPTH)}k{round(100 * keep):02d}+snap", options=options)
    return out


def fill_gate(summaries: Sequence[Any], confidence: float = 0.95, ttft_slack: float = 0.05) -> list[dict[str, Any]]:
    """The dev gate per (length, budget, policy): passes when the lower end of the policy's
    first-token agreement interval (Wilson) beats ``none``'s point estimate at the same budget and
    its median TTFT is at most ``1 + ttft_slack`` times ``none``'s."""
    from fastprefill.tune import wilson

    by = {(s.length, s.method): s for s in summaries}
    rows = []
    for (length, method), s in sorted(by.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        budget, _, policy = method.partition("/")
        none = by.get((length, f"{budget}/none"))
        if not policy or policy == "none" or none is None or s.first_token_agreement is None:
            continue
        hits = round(s.first_token_agreement * s.n_paired)
        low, high = wilson(hits, s.n_paired, confidence)
        ttft_ratio = s.ttft_median_s / none.ttft_median_s
        passed = low > (none.first_token_agreement or 0.0) and ttft_ratio <= 1 + ttft_slack
        rows.append({"length": length, "budget": budget, "policy": policy, "n": s.n_paired,
                     "first_token": s.first_token_agreement, "first_token_ci": [low, high],
                     "none_first_token": none.first_token_agreement, "ttft_over_none": ttft_ratio,
                     "token_layer_fraction": s.token_layer_fraction,
                     "none_token_layer_fraction": none.token_layer_fraction, "passes": passed})
    return rows


def cmd_equivalence(args: argparse.Namespace) -> None:
    """Keep-all LazyLLM and full prefill on short prompts: first-token logits, greedy tokens, TTFT."""
    set_threads(args.threads)
    model, tok = _load(args.model, args.dtype)
    prompts = ["Explain in one sentence why the sky is blue.",
               "Write a haiku about autumn leaves.",
               "List three prime numbers greater than ten.",
               "What is the boiling point of water at sea level?"][: args.n]
    lazy, full = LazyLLM(preset="keep-all"), FullPrefill()
    ids0 = tok(prompts[0], return_tensors="pt").input_ids
    for m in (full, lazy):  # warm-up, discarded
        generate(model, tok, ids0, m, max_new_tokens=2)
    rows = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        a = generate(model, tok, ids, full, max_new_tokens=args.new_tokens, stop_at_eos=False)
        b = generate(model, tok, ids, lazy, max_new_tokens=args.new_tokens, stop_at_eos=False)
        rows.append({"prompt": p, "tokens": int(ids.shape[1]),
                     "max_abs_logit_diff": float((a.first_logits - b.first_logits).abs().max()),
                     "same_tokens": a.token_ids == b.token_ids, "ttft_full_s": a.timing.ttft_s,
                     "ttft_lazy_s": b.timing.ttft_s, "ttft_ratio_lazy_over_full": b.timing.ttft_s / a.timing.ttft_s})
        print(rows[-1])
    header = {"bench": "lazyllm-equivalence", "model": args.model, **environment(args.threads, model)}
    write_rows(Path(args.out) / f"{result_name(args.out, 'lazyllm_equivalence', name=args.name)}.jsonl", header, rows)


def cmd_speed(args: argparse.Namespace) -> None:
    """TTFT of full vs each preset on random-token prompts of ``length`` (no scoring): the records as
    ``<name>.jsonl`` and, re-derivable from them, the paired summary as ``<name>.summary.jsonl``
    (speedup as the median of per-prompt ratios, beside the ideal ``1 / token-layer fraction``)."""
    set_threads(args.threads)
    model, tok = _load(args.model, args.dtype)
    length = args.lengths[0]
    methods: dict[str, Method] = {FULL: FullPrefill(), **{p: LazyLLM(preset=p) for p in args.presets}}
    samples = random_samples(model.get_input_embeddings().num_embeddings, length, args.n, args.seed)
    records = run_samples(model, tok, Unscored(), samples, methods, length=length, max_new_tokens=1, desc="speed")
    summaries = summarize(records)
    for s in summaries:
        print(f"{s.method}: TTFT {s.ttft_median_s:.3f} s, speedup {s.speedup_paired_median:.2f}x, "
              f"ideal {s.ideal_speedup:.2f}x (token-layer fraction {s.token_layer_fraction:.3f})")
    name = result_name(args.out, f"lazyllm_speed_{args.model}_{length}", name=args.name)
    header = {"bench": "lazyllm-speed", "model": args.model, **environment(args.threads, model),
              "methods": {k: m.describe() for k, m in methods.items()}}
    save_records(Path(args.out) / f"{name}.jsonl", header, records)
    write_paired_rows(Path(args.out) / f"{name}.summary.jsonl", header, summaries)


def cmd_ceiling(args: argparse.Namespace) -> None:
    """Each preset's selection vs the gold and deep-probe oracles on multidoc-qa dev (first token only)."""
    from tqdm import tqdm

    from fastprefill.data.tasks import get_task

    set_threads(args.threads)
    env = environment(args.threads, resolve_dtype(args.dtype))  # "started" is now
    model, tok = _load(args.model, args.dtype)
    task = get_task("multidoc-qa")
    rows = []
    for length in args.lengths:
        samples = task.build(tok, length, args.n, split="dev", seed=args.seed)
        for preset in args.presets:
            lazy = LazyLLM(preset=preset)
            bar = functools.partial(tqdm, desc=f"ceiling {lazy.preset}@{length}")
            got = selection_ceiling(model, tok, task, samples, lazy, args.probe_depth, progress=bar)
            rows += [{"length": length, "preset": lazy.preset, **r.as_dict()} for r in got]
    summary = ceiling_summary(rows)
    for row in summary:
        print(f"{row['length']:>6} {row['preset']:<22} {row['selection']:<7} n={row['n']:<3} "
              f"first token = full {row['first_token_agreement']:.0%}  median KL {row['median_first_token_kl']:.3f}  "
              f"gold kept {row['gold_kept_share_mean']:.0%}  token-layers {row['token_layer_fraction_mean']:.0%}")
    header = {"bench": "lazyllm-ceiling", "task": "multidoc-qa", "split": "dev", "seed": args.seed, "n": args.n,
              "model": args.model, "probe_depth": args.probe_depth, "summary": summary, **env}
    write_rows(Path(args.out) / f"{result_name(args.out, 'lazyllm_ceiling_' + args.model, name=args.name)}.jsonl",
               header, rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["equivalence", "curve", "needle", "decode", "sweep", "fidelity-sweep", "speed",
                                        "ceiling", "fill-gate"])
    ap.add_argument("--model", default=None, help="zoo name (default depends on the command)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--n", type=int, default=None, help="samples per length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=list(DTYPES), help="the model's dtype (default auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--presets", nargs="+", default=None,
                    help="LazyLLM presets, '<schedule>' or '<schedule>+<selection>' (curve/decode/speed: default "
                         "gentle default aggressive; needle: default; ceiling: cut30k20+snap); 'default' is DEFAULT_PRESET")
    ap.add_argument("--revivals", nargs="+", default=["all"],
                    help="decode: the revival policies each preset runs under (all, budget:R, none, catch-up)")
    ap.add_argument("--eos", action="store_true",
                    help="decode: stop at EOS (at most --new-tokens) instead of forcing --new-tokens")
    ap.add_argument("--no-baselines", action="store_true",
                    help="curve: LazyLLM presets against full prefill only (no matched baselines)")
    ap.add_argument("--baselines", nargs="+", default=["random", "static"], choices=["random", "static", "gemfilter"],
                    help="curve: the matched baselines run at each preset's token budget")
    ap.add_argument("--name", default=None,
                    help="result file stem (default lazyllm_<command>_<model>_<lengths>, with -runN added when "
                         "that exists: only a named stem or --resume reuses a file)")
    ap.add_argument("--out", default=str(RESULTS), help="output directory (default benchmarks/results)")
    ap.add_argument("--resume", action="store_true",
                    help="curve/needle/decode/sweep: continue an interrupted run's <name>.jsonl, or extend it to a larger --n")
    ap.add_argument("--schedules", nargs="+", default=sorted(SWEEP), choices=sorted(SWEEP),
                    help="sweep candidates (names in SWEEP)")
    ap.add_argument("--candidates", nargs="+", default=list(FIDELITY_CANDIDATES), choices=list(FIDELITY_CANDIDATES),
                    metavar="CANDIDATE", help="fidelity-sweep candidates (default: all of FIDELITY_CANDIDATES)")
    ap.add_argument("--static-depth", type=float, default=0.25,
                    help="StaticPruning selects at layer floor(depth * L)")
    ap.add_argument("--probe-depth", type=float, default=0.67,
                    help="ceiling: the deep oracle scores at layer floor(depth * L) of the full model")
    ap.add_argument("--answer-tokens", type=int, default=None,
                    help="fidelity-sweep: tokens per answer (default: the task's); 1 screens the first token only")
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.25, 0.10],
                    help=f"fill-gate: keep fractions of the one cut at depth {FILL_DEPTH} (about 50%% and 40%% of "
                         "token-layers computed exactly)")
    ap.add_argument("--fills", nargs="+", default=["none", "zero-shot"],
                    help="fill-gate: fill policies (none, zero-shot, calibrated:DIR with maps from the cut's layer + 1)")
    ap.add_argument("--fill-shares", type=float, nargs="+", default=[1.0],
                    help="fill-gate: shares of the pruned tokens an active policy fills (highest-ranked first)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="tokens generated per run, EOS ignored (default: 16 for equivalence, 64 for decode)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    defaults = {
        "equivalence": ("smollm2-135m", [0], 4),
        "curve": ("qwen2.5-coder-0.5b", [2048], 50),
        "needle": ("qwen2.5-coder-0.5b", [1024, 2048, 3072, 4096], 10),
        "decode": ("qwen2.5-coder-0.5b", [2048], 20),
        "sweep": ("qwen2.5-coder-0.5b", [2048], 30),
        "fidelity-sweep": ("qwen2.5-coder-0.5b", [2048], 40),
        "speed": ("smollm2-135m", [2048], 4),
        "ceiling": ("qwen2.5-coder-0.5b", [2048], 16),
        "fill-gate": ("qwen2.5-coder-0.5b", [2048], 48),
    }[args.command]
    args.presets = args.presets or {"needle": ["default"], "ceiling": ["cut30k20+snap"]}.get(
        args.command, ["gentle", "default", "aggressive"])
    args.model = args.model or defaults[0]
    args.new_tokens = args.new_tokens or (64 if args.command == "decode" else 16)
    args.lengths = args.lengths or defaults[1]
    args.n = args.n or defaults[2]
    tag = f"{args.model}_{'-'.join(map(str, args.lengths))}"
    try:
        if args.command == "equivalence":
            cmd_equivalence(args)
        elif args.command == "speed":
            cmd_speed(args)
        elif args.command == "ceiling":
            cmd_ceiling(args)
        elif args.command == "curve":
            cmd_task(args, f"lazyllm_curve_{tag}",
                     lambda L: matched_methods(args.presets, L, args.lengths[0], args.static_depth,
                                               baselines=() if args.no_baselines else args.baselines),
                     "test", "multidoc-qa")
        elif args.command == "needle":
            cmd_task(args, f"lazyllm_needle_{tag}",
                     lambda L: {f"lazyllm-{m.preset}": m for m in (LazyLLM(preset=p) for p in args.presets)},
                     "test", "needle")
        elif args.command == "decode":
            cmd_task(args, f"lazyllm_decode_{tag}", lambda L: revival_methods(args.presets, args.revivals),
                     "test", "multidoc-qa", max_new_tokens=args.new_tokens, stop_at_eos=args.eos)
        elif args.command == "sweep":
            cmd_task(args, f"lazyllm_sweep_{tag}",
                     lambda L: {f"lazyllm-{k}": LazyLLM(depth_schedule=SWEEP[k], label=k) for k in args.schedules},
                     "dev", "multidoc-qa", choose=choose_default)
        elif args.command == "fill-gate":
            cmd_task(args, f"lazyllm_fill_gate_{tag}", lambda L: fill_methods(args.keeps, args.fills, args.fill_shares), "dev",
                     "multidoc-qa", max_new_tokens=args.answer_tokens,
                     gate=fill_gate)
        elif args.command == "fidelity-sweep":
            cmd_task(args, f"lazyllm_fidelity_sweep_{tag}", lambda L: fidelity_methods(args.candidates),
                     "dev", "multidoc-qa", max_new_tokens=args.answer_tokens, choose=choose_by_fidelity)
    except FastprefillError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
