"""KV Prediction benchmarks (issue 5). Results go to ``benchmarks/results/``; checkpoints to
``benchmarks/checkpoints/``. Run the timing subcommands on a quiet machine.

Pairs (``--pair``):

- ``c``:  KVP-C,  base ``qwen2.5-coder-1.5b``, aux ``qwen2.5-coder-0.5b`` (same tokenizer);
- ``lp``: KVP-LP, base ``qwen2.5-coder-0.5b``, aux = the base with every 2nd layer (``--stride``);
- ``smoke``: KVP-LP on ``smollm2-135m`` (stride 2), for quick checks of the scripts.

Subcommands:

- ``train``: :func:`train_kvp` (least squares then gradient steps); writes the checkpoint, the
  loss curve and ``train_meta.json`` (command, wall time).
- ``rope``: evidence for the rotary choice: least-squares maps fitted on pre-rotation keys vs on
  rotated keys (same training text), per-layer relative error of K on held-out text.
- ``ablate``: which part of a predicted cache breaks the base: on dev prompts, the base's first
  token when it reads the true KV with one part (K or V, the first positions, the lower or upper
  half of the layers) swapped for the prediction, against its own full prefill.
- ``eval``: base alone, aux alone and KV Prediction on a task (same process, same prompts,
  :func:`fastprefill.bench.runner.run_samples`): TTFT, speedup over the base, TTFT FLOPs,
  accuracy; plus first-token agreement with the base and per-layer relative K/V error on the
  same prompts; plots accuracy vs TTFT and accuracy vs TTFT FLOPs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fastprefill.bench.runner import Record, environment, load_jsonl, run_samples
from fastprefill.data.tasks import get_task
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction import AuxAlone, AuxSpec, KVPrediction, KVPredictor
from fastprefill.methods.kv_prediction.aux import check_tokenizers
from fastprefill.methods.kv_prediction.train import (
    TrainConfig,
    fit_least_squares,
    kv_relative_errors,
    train_kvp,
    training_corpus,
)
from fastprefill.models import zoo
from fastprefill.models.kv import cache_from_kv, prefix_kv, rotate_keys
from fastprefill.models.shape import ModelShape

PAIRS: dict[str, dict[str, Any]] = {
    "c": {"base": "qwen2.5-coder-1.5b", "aux": "qwen2.5-coder-0.5b"},
    "lp": {"base": "qwen2.5-coder-0.5b", "aux": None},
    "smoke": {"base": "smollm2-135m", "aux": None},
}
RESULTS = Path(__file__).parent / "results"


def _load_pair(pair: str, stride: int):
    spec = PAIRS[pair]
    base, tok = zoo.load(spec["base"])
    if spec["aux"]:
        aux, aux_tok = zoo.load(spec["aux"])
        return base, tok, aux, aux_tok, AuxSpec.model(spec["aux"])
    return base, tok, AuxSpec.layer_drop(stride).build(base), None, AuxSpec.layer_drop(stride)


# ----------------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    spec = PAIRS[args.pair]
    base, tok, aux, aux_tok, aux_spec = _load_pair(args.pair, args.stride)
    cfg = TrainConfig(lsq_tokens=args.lsq_tokens, steps=args.steps, seq_len=args.seq_len,
                      lr=args.lr, l1_weight=args.l1_weight, ridge=args.ridge,
                      checkpoint_every=args.checkpoint_every)
    t0 = time.perf_counter()
    method = train_kvp(base, aux if aux_spec.kind == "model" else aux_spec, args.out, tokenizer=tok,
                       aux_tokenizer=aux_tok, base_name=spec["base"], aux_name=spec["aux"], config=cfg,
                       resume=args.resume)
    seconds = time.perf_counter() - t0
    held = training_corpus(tok, args.seq_len * 4, args.seq_len, seed=12345)  # other seed: other text
    aux_model = aux if aux_spec.kind == "model" else aux_spec.build(base)
    errors = kv_relative_errors(base, aux_model, method.predictor, held)
    meta = {"command": " ".join(shlex.quote(a) for a in sys.argv), "wall_seconds_this_run": seconds,
            "train_config": vars(cfg), "predictor_parameters": method.predictor.num_parameters(),
            "heldout_rel_error": errors, **environment(args.threads)}
    Path(args.out, "train_meta.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps({"wall_seconds": seconds, "mean_rel_err_k": statistics.mean(errors["k"]),
                      "mean_rel_err_v": statistics.mean(errors["v"])}, indent=2))


# ----------------------------------------------------------------------------------- rope ablation
def cmd_rope(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    base, tok, aux, _, _ = _load_pair(args.pair, args.stride)
    train = training_corpus(tok, args.lsq_tokens, args.seq_len, seed=0)
    held = training_corpus(tok, args.seq_len * args.heldout_seqs, args.seq_len, seed=12345)

    def rotated(model, ids):
        kv, _ = prefix_kv(model, ids)
        cos, sin = model.model.rotary_emb(kv[0][1], position_ids=torch.arange(ids.shape[1])[None])
        return [(rotate_keys(k, cos, sin), v) for k, v in kv]

    def pre(model, ids):
        return prefix_kv(model, ids)[0]

    result: dict[str, Any] = {"pair": args.pair, "lsq_tokens": args.lsq_tokens, "heldout_tokens": len(held) * args.seq_len,
                              "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
                              **environment(args.threads)}
    with torch.no_grad():
        for name, get in (("pre_rotation", pre), ("rotated", rotated)):
            pred = KVPredictor(ModelShape.from_config(aux.config), ModelShape.from_config(base.config))
            fit_least_squares(pred, ((get(aux, ids), get(base, ids)) for ids in tqdm(train, desc=f"fit {name}")),
                              ridge=args.ridge)
            num = [0.0] * len(pred.layer_map)
            den = [0.0] * len(pred.layer_map)
            for ids in held:
                x, y = get(aux, ids), get(base, ids)
                for l, (k_hat, _) in enumerate(pred(x)):
                    num[l] += float((k_hat - y[l][0]).pow(2).sum())
                    den[l] += float(y[l][0].pow(2).sum())
            # errors of rotated keys are comparable: RoPE is orthogonal, so ||K|| is the same
            result[name] = [(a / b) ** 0.5 for a, b in zip(num, den)]
    result["mean"] = {k: statistics.mean(result[k]) for k in ("pre_rotation", "rotated")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"kvp_rope_{args.pair}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["mean"], indent=2), "->", out)


# ----------------------------------------------------------------------------------- ablate
KVList = list[tuple[torch.Tensor, torch.Tensor]]


def ablation_variants(sink: int) -> dict[str, Any]:
    """Caches to test, each built from the predicted and the true per-layer ``(K, V)`` lists
    (``(1, H, N, d)``, keys before rotation): the true KV with one part replaced by the prediction."""

    def first_exact(p: KVList, t: KVList) -> KVList:
        return [(torch.cat([tk[:, :, :sink], pk[:, :, sink:]], 2), torch.cat([tv[:, :, :sink], pv[:, :, sink:]], 2))
                for (pk, pv), (tk, tv) in zip(p, t)]

    def layers(lo: float, hi: float):
        def pick(p: KVList, t: KVList) -> KVList:
            n = len(t)
            return [p[l] if int(lo * n) <= l < int(hi * n) else t[l] for l in range(n)]
        return pick

    return {
        "true KV (sanity)": lambda p, t: t,
        "predicted K and V": lambda p, t: p,
        "predicted V only": lambda p, t: [(tk, pv) for (_, pv), (tk, _) in zip(p, t)],
        "predicted K only": lambda p, t: [(pk, tv) for (pk, _), (_, tv) in zip(p, t)],
        f"predicted, first {sink} positions exact": first_exact,
        "predicted in the lower half of layers only": layers(0.0, 0.5),
        "predicted in the upper half of layers only": layers(0.5, 1.0),
    }


def cmd_ablate(args: argparse.Namespace) -> None:
    """First-token agreement and KL of the base reading partly predicted caches (dev prompts)."""
    torch.set_num_threads(args.threads)
    cfg = json.loads(Path(args.predictor, "config.json").read_text())
    base, tok = zoo.load(cfg["base"]["name"])
    method = KVPrediction.load(args.predictor, base_tokenizer=tok)
    aux = method.bind(base)
    task = get_task(args.task)
    samples = task.build(tok, args.length if task.sized else None, args.n, split=args.split, seed=args.seed)
    variants = ablation_variants(args.sink)
    agree: dict[str, list[float]] = {v: [] for v in variants}
    kl: dict[str, list[float]] = {v: [] for v in variants}
    with torch.no_grad():
        for s in tqdm(samples, desc="ablate"):
            ids = torch.as_tensor(s.input_ids, dtype=torch.long).reshape(1, -1)
            ref = base(input_ids=ids, logits_to_keep=1).logits[0, -1].float().log_softmax(-1)  # (V,)
            true, _ = prefix_kv(base, ids[:, :-1])
            pred = method.predictor(prefix_kv(aux, ids[:, :-1])[0], dtype=base.dtype)
            for name, build in variants.items():
                cache = cache_from_kv(base, build(pred, true))
                out = base(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)
                logp = out.logits[0, -1].float().log_softmax(-1)
                agree[name].append(float(logp.argmax() == ref.argmax()))
                kl[name].append(float((ref.exp() * (ref - logp)).sum()))
    rows = [{"variant": v, "first_token_agreement": statistics.mean(agree[v]),
             "median_kl_nats": statistics.median(kl[v]), "mean_kl_nats": statistics.mean(kl[v])} for v in variants]
    header = {"bench": "kvp-ablation", "predictor": args.predictor, "base": cfg["base"]["name"],
              "aux": cfg["aux"].get("name") or cfg["aux"]["spec"], "task": args.task, "split": args.split,
              "length": args.length, "n": len(samples), "sink": args.sink,
              "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]), **environment(args.threads)}
    stem = str(RESULTS / (args.name or f"kvp_ablation_{Path(args.predictor).name}"))  # names hold dots
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(stem + ".json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    lines = [f"# KV Prediction ablation: {Path(args.predictor).name}, {args.task} ({args.split}), n={len(samples)}", "",
             f"Command: `{header['command']}`", "",
             ("The base reads its own (true) KV for the prompt with one part replaced by the prediction, then runs "
              "the last prompt token. Reference: the base's full prefill."), "",
             "| cache the base reads | first-token agreement | median KL (nats) | mean KL (nats) |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {100 * r['first_token_agreement']:.0f}% | {r['median_kl_nats']:.3f} | "
              f"{r['mean_kl_nats']:.3f} |" for r in rows]
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    print(Path(stem + ".md").read_text())


# ----------------------------------------------------------------------------------- eval
FULL_SPEC = "full"


def _parse_method(text: str) -> tuple[str, str, str]:
    """``NAME=MODEL:SPEC`` -> (name, zoo model, spec); SPEC is ``full``, ``kvp:<dir>`` or ``drop:<stride>``."""
    name, eq, rest = text.partition("=")
    model, colon, spec = rest.partition(":")
    if not (eq and colon and name and model) or not (spec == FULL_SPEC or spec.startswith(("kvp:", "drop:"))):
        raise SystemExit(f"--method {text!r}: expected NAME=MODEL:full, NAME=MODEL:kvp:<checkpoint dir> "
                         "or NAME=MODEL:drop:<stride>")
    return name, model, spec


def _references(specs: dict[str, tuple[str, str]], main_model: str) -> dict[str, str]:
    """Each method's reference for speedup and first-token agreement: full prefill of the model
    it runs on (KVP-C, KVP-LP, the layer-drop aux alone), or the main model's full prefill (a
    smaller family member run alone: the KVP-C aux alone)."""
    full_on = {model: name for name, (model, spec) in specs.items() if spec == FULL_SPEC}
    return {name: (full_on[model] if spec != FULL_SPEC else ("full" if model != main_model else name))
            for name, (model, spec) in specs.items()}


def _summary(records: list[Record], refs: dict[str, str], names: list[str]) -> dict[str, Any]:
    by = {(r.method, r.sample_id): r for r in records}
    out: dict[str, Any] = {}
    for name in names:
        rs = [r for r in records if r.method == name]
        if not rs:
            continue
        ref = refs[name]
        paired = [(r, by[(ref, r.sample_id)]) for r in rs if (ref, r.sample_id) in by]
        main = [(r, by[("full", r.sample_id)]) for r in rs if ("full", r.sample_id) in by]
        metric_names = sorted(rs[0].metrics)
        out[name] = {
            "n": len(rs),
            "reference": ref,
            "accuracy": statistics.mean(r.score for r in rs),
            **{f"mean_{m}": statistics.mean(r.metrics[m] for r in rs) for m in metric_names if m != "score"},
            "median_ttft_s": statistics.median(r.ttft_s for r in rs),
            "median_speedup_vs_reference": statistics.median(b.ttft_s / r.ttft_s for r, b in paired),
            "median_speedup_vs_full": statistics.median(b.ttft_s / r.ttft_s for r, b in main),
            "median_ttft_flops": statistics.median(r.prefill_flops for r in rs),
            "first_token_agreement_with_reference": statistics.mean(
                float(r.extra["first_token"] == b.extra["first_token"]) for r, b in paired),
            "median_new_tokens": statistics.median(r.new_tokens for r in rs),
        }
    return out


def _plots(records: list[Record], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by: dict[str, list[Record]] = {}
    for r in records:
        by.setdefault(r.method, []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, rs in by.items():
        acc = statistics.mean(r.score for r in rs)
        axes[0].scatter(statistics.median(r.ttft_s for r in rs), 100 * acc, label=name)
        axes[1].scatter(statistics.median(r.prefill_flops for r in rs), 100 * acc, label=name)
    axes[0].set_xlabel("median TTFT (s)")
    axes[1].set_xlabel("TTFT FLOPs")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("accuracy (%)")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layer_plot(header: dict[str, Any], stem: str) -> Path | None:
    """Draw ``<stem>_layers.png``: per-layer relative error of the predicted K and V (x: base layer)
    for every KVP method of an eval ``header`` (its ``summary``, ``task`` and ``split``).

    Returns the path, or None, drawing nothing, when no method carries ``rel_error_k``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvp = {n: s for n, s in header["summary"].items() if s.get("rel_error_k")}
    if not kvp:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for name, s in kvp.items():
        for ax, part in zip(axes, ("k", "v"), strict=True):
            errs = s[f"rel_error_{part}"]
            ax.plot(range(len(errs)), errs, marker=".", label=f"{name} ({s['rel_error_prompts']} prompts)")
    for ax, part in zip(axes, ("K", "V"), strict=True):
        ax.set_xlabel("base layer")
        ax.set_title(f"predicted {part}: ||pred - true|| / ||true||")
        ax.axhline(1.0, color="grey", lw=0.6, ls=":")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("relative error")
    fig.suptitle(f"KV Prediction per-layer error, {header['task']} ({header['split']})")
    fig.tight_layout()
    path = Path(stem + "_layers.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_layers(args: argparse.Namespace) -> None:
    """Redraw the per-layer K/V error plot from a committed ``.summary.json`` (no model needed)."""
    src = Path(args.summary)
    if not src.name.endswith(".summary.json"):
        raise SystemExit(f"{src}: expected an eval summary file ending in .summary.json")
    out = _layer_plot(json.loads(src.read_text()), str(src)[: -len(".summary.json")])
    if out is None:
        raise SystemExit(f"{src}: no method has per-layer errors (rel_error_k)")
    print(out)


def _markdown(header: dict[str, Any], summary: dict[str, Any]) -> str:
    lines = [f"# KV Prediction: {header['task']} ({header['split']} split), n={header['n']}", "",
             f"Command: `{header['command']}`", "",
             f"Threads: {header.get('threads')}; warm-up {header['warmup']} per method, discarded; "
             "speedups are medians of paired per-prompt TTFT ratios.", "",
             "| method | runs on | n | accuracy | median TTFT (s) | speedup vs reference (reference) | "
             "speedup vs full | TTFT GFLOPs | first-token agreement | mean rel. err K / V |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        model, _spec = header["methods"][name]
        err = s.get("rel_error_k")
        errs = f"{statistics.mean(err):.3f} / {statistics.mean(s['rel_error_v']):.3f}" if err else "-"
        lines.append(f"| {name} | {model} | {s['n']} | {100 * s['accuracy']:.1f} | {s['median_ttft_s']:.2f} | "
                     f"{s['median_speedup_vs_reference']:.2f}x ({s['reference']}) | {s['median_speedup_vs_full']:.2f}x | "
                     f"{s['median_ttft_flops'] / 1e9:.0f} | {100 * s['first_token_agreement_with_reference']:.0f}% | {errs} |")
    return "\n".join(lines) + "\n"


def cmd_eval(args: argparse.Namespace) -> None:
    """Every method on the same prompts in one process; records appended as they come (resumable)."""
    torch.set_num_threads(args.threads)
    parsed = [_parse_method(m) for m in args.method]
    specs = {"full": (args.model, FULL_SPEC), **{n: (m, s) for n, m, s in parsed}}
    if len(specs) != len(parsed) + 1:
        raise SystemExit("--method names must be unique and not 'full'")
    models: dict[str, Any] = {}
    toks: dict[str, Any] = {}
    for model_name in dict.fromkeys(m for m, _ in specs.values()):
        models[model_name], toks[model_name] = zoo.load(model_name)
    tok = toks[args.model]
    for model_name, other in toks.items():
        check_tokenizers(tok, other)  # one prompt encoding serves every model
    methods: dict[str, Any] = {}
    for name, (model_name, spec) in specs.items():
        if spec == FULL_SPEC:
            methods[name] = FullPrefill()
        elif spec.startswith("drop:"):
            methods[name] = AuxAlone(AuxSpec.layer_drop(int(spec.split(":")[1])))
        else:
            ckpt = spec.split(":", 1)[1]
            cfg = json.loads(Path(ckpt, "config.json").read_text())
            aux_name = cfg["aux"].get("name")  # None for a layer-drop aux (built from the base)
            method = KVPrediction.load(ckpt, aux=models.get(aux_name),
                                       aux_tokenizer=toks.get(aux_name), base_tokenizer=toks[model_name])
            method.bind(models[model_name])  # checks outside the timed region
            methods[name] = method
    refs = _references(specs, args.model)
    task = get_task(args.task)
    length = args.length if task.sized else None
    samples = task.build(tok, length, args.n, split=args.split, seed=args.seed)
    budget = args.max_new_tokens or task.default_max_new_tokens
    header = {"task": args.task, "split": args.split, "length": length, "n": args.n, "seed": args.seed,
              "max_new_tokens": budget, "warmup": args.warmup, "reference_model": args.model,
              "methods": {n: list(v) for n, v in specs.items()},
              "method_describe": {n: m.describe() for n, m in methods.items()}, "references": refs,
              "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]), **environment(args.threads)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / (args.name or f"kvp_{args.task}" + (f"_{length}" if length else ""))
    log = stem.with_suffix(".jsonl")
    done: list[Record] = []
    if log.exists() and args.resume:
        old, done = load_jsonl(log)
        for key in ("task", "split", "length", "n", "seed", "max_new_tokens", "methods"):
            if old.get(key) != header[key]:
                raise SystemExit(f"--resume: {log} was made with {key}={old.get(key)!r}, not {header[key]!r}")
        header["command"] = old["command"]
    elif log.exists():
        raise SystemExit(f"{log} exists: pass --resume to continue it, or --name for another file")
    else:
        log.write_text(json.dumps({"header": header}) + "\n")

    def append(record: Record) -> None:
        with log.open("a") as f:
            f.write(json.dumps(record.__dict__) + "\n")

    records = done + run_samples(
        models[args.model], tok, task, samples, methods, length=length, max_new_tokens=budget,
        warmup=args.warmup, desc=f"{args.task}", method_models={n: models[m] for n, (m, _) in specs.items()},
        done=[(r.sample_id, r.method) for r in done], on_record=append)
    summary = _summary(records, refs, list(specs))
    # per-layer relative error of the predicted K / V on the first prompts (their prompt[:-1])
    for name, method in methods.items():
        if isinstance(method, KVPrediction) and name in summary:
            base = models[specs[name][0]]
            ids = [torch.as_tensor(s.input_ids, dtype=torch.long).reshape(1, -1)[:, :-1] for s in samples[: args.errors_n]]
            errs = kv_relative_errors(base, method.bind(base), method.predictor, ids)
            summary[name]["rel_error_k"], summary[name]["rel_error_v"] = errs["k"], errs["v"]
            summary[name]["rel_error_prompts"] = len(ids)
    header["summary"] = summary
    header["n_done"] = {n: s["n"] for n, s in summary.items()}
    stem.with_suffix(".summary.json").write_text(json.dumps(header, indent=2))
    stem.with_suffix(".md").write_text(_markdown(header, summary))
    _plots(records, stem.with_suffix(".png"), f"KV Prediction, {args.task} ({args.split}), n={args.n}")
    _layer_plot(header, str(stem))
    print(stem.with_suffix(".md").read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("train", "rope"):
        s = sub.add_parser(name)
        s.add_argument("--pair", choices=sorted(PAIRS), required=True)
        s.add_argument("--stride", type=int, default=2)
        s.add_argument("--lsq-tokens", type=int, default=60_000)
        s.add_argument("--seq-len", type=int, default=512)
        s.add_argument("--ridge", type=float, default=1e-4)
    t = sub.choices["train"]
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--l1-weight", type=float, default=0.1)
    t.add_argument("--checkpoint-every", type=int, default=25)
    t.add_argument("--resume", action="store_true")
    sub.choices["rope"].add_argument("--heldout-seqs", type=int, default=8)
    a = sub.add_parser("ablate", help="which part of the predicted cache breaks the base (dev prompts)")
    a.add_argument("--predictor", required=True, help="checkpoint directory")
    a.add_argument("--task", default="singledoc-qa")
    a.add_argument("--length", type=int, default=1024)
    a.add_argument("--n", type=int, default=16)
    a.add_argument("--split", default="dev")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--sink", type=int, default=4, help="leading positions given their true KV in one variant")
    a.add_argument("--name", default=None, help="result file stem (default kvp_ablation_<checkpoint>)")
    e = sub.add_parser("eval", help="every method on the same prompts (resumable)")
    e.add_argument("--model", required=True, help="the reference model (its full prefill is 'full')")
    e.add_argument("--method", action="append", default=[], metavar="NAME=MODEL:SPEC",
                   help="SPEC: full | kvp:<checkpoint dir> | drop:<stride> (the layer-drop aux alone)")
    e.add_argument("--task", default="singledoc-qa")
    e.add_argument("--length", type=int, default=1024, help="prompt tokens (sized tasks only)")
    e.add_argument("--n", type=int, default=100)
    e.add_argument("--split", default="test")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-new-tokens", type=int, default=None)
    e.add_argument("--warmup", type=int, default=1)
    e.add_argument("--errors-n", type=int, default=8, help="prompts for the per-layer K/V error")
    e.add_argument("--name", default=None, help="result file stem (default kvp_<task>[_<length>])")
    e.add_argument("--resume", action="store_true", help="continue an interrupted run")
    lp = sub.add_parser("layers", help="redraw the per-layer K/V error plot from an eval's .summary.json")
    lp.add_argument("summary", help="benchmarks/results/kvp_<task>[_<length>].summary.json")
    args = p.parse_args(argv)
    {"train": cmd_train, "rope": cmd_rope, "ablate": cmd_ablate, "eval": cmd_eval,
     "layers": cmd_layers}[args.cmd](args)


if __name__ == "__main__":
    main()
