"""KV Prediction benchmarks. Results go to ``--out`` (default ``benchmarks/results/``), under
``--name`` or a default stem that never replaces an existing result
(:func:`fastprefill.bench.records.result_name`); checkpoints to ``benchmarks/checkpoints/``. Run the timing subcommands on a quiet machine.

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
  accuracy; plus first-token agreement, identical answers and first-token KL against each
  method's reference and per-layer relative K/V error on the same prompts; plots accuracy vs
  TTFT and accuracy vs TTFT FLOPs.
- ``plot``: score against TTFT FLOPs (relative to the base's full prefill) from several ``eval``
  summaries of the same prompts (:func:`fastprefill.bench.report.merge_eval_summaries`).
- ``layers``: redraw the per-layer K/V error plot from a committed ``.summary.json``.
- ``prefix``: calibrate kvp-prefix maps (:func:`calibrate_prefix`, least squares) for ``--model``
  at ``--layer``; the checkpoint's ``config.json`` holds the held-out errors (relative, R²) of the
  zero-shot and the fitted maps.
- ``distill``: KL distillation of a least-squares kvp-prefix checkpoint
  (:func:`~fastprefill.methods.kv_prediction.prefix.distill.distill_prefix`) on dev task prompts
  other than the l-sweep's and the calibration's; writes ``kvp_distill_<checkpoint>.json``.
- ``l-sweep``: kvp-prefix at several ``l`` beside full prefill on dev prompts
  (:func:`research.kvp.l_sweep`): first-token agreement, median first-token KL and TTFT
  FLOPs fraction per ``l``, zero-shot or from ``--predictor L=DIR`` checkpoints.
- ``gate``: the dev gate of a KV predictor (:func:`research.kvp.dev_gate`): mean held-out
  V error <= 0.5 and median first-token KL <= 1.0 on 16 dev prompts; writes pass/fail with the numbers.

``eval`` specs: ``full``, ``kvp:<dir>``, ``drop:<stride>`` or any registry spec
(``kvp-prefix:predictor=<dir>``, ``kvp-prefix:layer=<l>``, ``lazyllm:preset=<name>``).

Every model (a base and its aux alike) is loaded in ``--dtype``: by default ``auto``
(:func:`fastprefill.host.resolve_dtype`) for ``ablate``, ``eval``, ``l-sweep`` and ``gate``, and
``float32`` for the subcommands that fit maps (``train``, ``rope``, ``prefix``, ``distill``, as
``fastprefill train-kvp`` does).

Records, summaries, tables and plots come from :mod:`fastprefill.bench`; this script holds the
model pairs and method specs.
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

from fastprefill.bench.records import FULL, RecordLog, environment, result_name
from fastprefill.bench.runner import run_samples
from fastprefill.bench.summary import summarize
from fastprefill.data.tasks import get_task
from fastprefill.errors import FastprefillError
from fastprefill.host import DTYPES, keep_freed_memory, set_threads
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction import AuxAlone, AuxSpec, KVPrediction, KVPredictor
from fastprefill.methods.kv_prediction.auxiliary.fit import fit_least_squares, kv_relative_errors
from fastprefill.methods.kv_prediction.auxiliary.models import check_tokenizers
from fastprefill.methods.kv_prediction.auxiliary.train import TrainConfig, train_kvp
from fastprefill.methods.kv_prediction.corpus import training_corpus
from fastprefill.methods.kv_prediction.prefix import KVPrefix, PrefixCalibration, calibrate_prefix
from fastprefill.methods.kv_prediction.prefix.distill import PrefixDistillation, distill_on_dev
from fastprefill.methods.kv_prediction.prefix.distill_prompts import (
    DEFAULT_HELDOUT,
    DEFAULT_TRAIN,
    DISTILL_SEED,
)
from fastprefill.methods.registry import make_method
from fastprefill.models import load as load_model
from fastprefill.models.kv import prefix_kv, rotate_keys
from fastprefill.models.shape import ModelShape
from reporting import (
    error_summary,
    merge_eval_summaries,
    method_entry,
    plot_layer_errors,
    plot_score_vs_cost,
    plot_score_vs_flops,
    redraw_layer_plot,
    reference_table,
    references_by_model,
    write_json,
    write_rows,
)
from research.ablation import ablation_table, ablation_variants, run_ablation
from research.kvp import dev_gate, exclude_calibration, l_sweep, lsweep_table

PAIRS: dict[str, dict[str, Any]] = {
    "c": {"base": "qwen2.5-coder-1.5b", "aux": "qwen2.5-coder-0.5b"},
    "lp": {"base": "qwen2.5-coder-0.5b", "aux": None},
    "smoke": {"base": "smollm2-135m", "aux": None},
}
RESULTS = Path(__file__).resolve().parent / "results"
#: Subcommands that fit maps: their models load in float32 unless ``--dtype`` says otherwise.
FIT_COMMANDS = ("train", "rope", "prefix", "distill")
#: Subcommands that load no model.
NO_MODEL_COMMANDS = ("layers", "plot")


def _load_pair(pair: str, stride: int, dtype: str):
    spec = PAIRS[pair]
    base, tok = load_model(spec["base"], dtype=dtype)
    if spec["aux"]:
        aux, aux_tok = load_model(spec["aux"], dtype=dtype)
        return base, tok, aux, aux_tok, AuxSpec.model(spec["aux"])
    return base, tok, AuxSpec.layer_drop(stride).build(base), None, AuxSpec.layer_drop(stride)


def _load_predictor(path: str, cfg: dict[str, Any], tok: Any, dtype: str) -> KVPrediction:
    """The KV Prediction checkpoint at ``path`` (``cfg``: its config), a separate aux model
    (KVP-C) loaded in ``dtype`` like the base."""
    aux_name = cfg["aux"].get("name")  # None for a layer-drop aux (built from the base)
    aux, aux_tok = load_model(aux_name, dtype=dtype) if aux_name else (None, None)
    return KVPrediction.load(path, aux=aux, aux_tokenizer=aux_tok, base_tokenizer=tok)


# ----------------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    spec = PAIRS[args.pair]
    base, tok, aux, aux_tok, aux_spec = _load_pair(args.pair, args.stride, args.dtype)
    cfg = TrainConfig(lsq_tokens=args.lsq_tokens, steps=args.steps, seq_len=args.seq_len,
                      lr=args.lr, l1_weight=args.l1_weight, ridge=args.ridge,
                      checkpoint_every=args.checkpoint_every, source=args.source, task_share=args.task_share)
    t0 = time.perf_counter()
    method = train_kvp(base, aux if aux_spec.kind == "model" else aux_spec, args.out, tokenizer=tok,
                       aux_tokenizer=aux_tok, base_name=spec["base"], aux_name=spec["aux"], config=cfg,
                       resume=args.resume)
    seconds = time.perf_counter() - t0
    held = training_corpus(tok, args.seq_len * 4, args.seq_len, seed=12345)  # other seed: other text
    aux_model = aux if aux_spec.kind == "model" else aux_spec.build(base)
    errors = kv_relative_errors(base, aux_model, method.predictor, held)
    phases = json.loads(Path(args.out, "config.json").read_text()).get("heldout_errors", {})
    meta = {"command": " ".join(shlex.quote(a) for a in sys.argv), "wall_seconds_this_run": seconds,
            "train_config": vars(cfg), "predictor_parameters": sum(p.numel() for p in method.predictor.parameters()),
            "heldout_rel_error": errors, "heldout_by_phase": phases, **environment(args.threads, base)}
    write_json(Path(args.out, "train_meta.json"), meta)
    write_json(Path(args.results, f"kvp_train_{Path(args.out).name}.json"), meta)  # the figures' result file
    print(json.dumps({"wall_seconds": seconds, "final": error_summary(errors),
                      **{phase: error_summary(errs) for phase, errs in phases.items()}}, indent=2))


# ----------------------------------------------------------------------------------- rope ablation
def cmd_rope(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    base, tok, aux, _, _ = _load_pair(args.pair, args.stride, args.dtype)
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
                              **environment(args.threads, base)}
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
    out = write_json(Path(args.out) / f"{result_name(args.out, f'kvp_rope_{args.pair}')}.json", result)
    print(json.dumps(result["mean"], indent=2), "->", out)


# ----------------------------------------------------------------------------------- ablate
def cmd_ablate(args: argparse.Namespace) -> None:
    """First-token agreement and KL of the base reading partly predicted caches (dev prompts)."""
    set_threads(args.threads)
    cfg = json.loads(Path(args.predictor, "config.json").read_text())
    base, tok = load_model(cfg["base"]["name"], dtype=args.dtype)
    method = _load_predictor(args.predictor, cfg, tok, args.dtype)
    aux = method.bind(base)
    task = get_task(args.task)
    samples = task.build(tok, args.length if task.sized else None, args.n, split=args.split, seed=args.seed)
    prompts = [torch.as_tensor(s.input_ids, dtype=torch.long).reshape(1, -1) for s in samples]
    predictor = method.predictor
    rows = run_ablation(base, lambda ids: predictor(predictor.features(aux, ids)[0], dtype=base.dtype), prompts,
                        ablation_variants(args.sink))
    errors = kv_relative_errors(base, aux, predictor, [ids[:, :-1] for ids in prompts])
    header = {"bench": "kvp-ablation", "predictor": args.predictor, "base": cfg["base"]["name"],
              "aux": cfg["aux"].get("name") or cfg["aux"]["spec"], "task": args.task, "split": args.split,
              "length": args.length, "n": len(samples), "sink": args.sink,
              "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
              **environment(args.threads, base)}
    stem = str(Path(args.out) / result_name(args.out, f"kvp_ablation_{Path(args.predictor).name}", name=args.name))
    write_json(stem + ".json", {"header": header, "rows": rows, "kv_errors": {**errors, **error_summary(errors)},
                                "heldout_by_phase": cfg.get("heldout_errors", {})})
    md = Path(stem + ".md")
    md.write_text(ablation_table(header, rows, f"KV Prediction ablation: {Path(args.predictor).name}")
                  + _error_table(errors, cfg.get("heldout_errors", {})))
    print(md.read_text())


def _error_table(errors: dict[str, list[float]], phases: dict[str, dict[str, list[float]]]) -> str:
    """Markdown: per-layer relative error and centred R² of K and V on the prompts, then the means
    on held-out text after least squares and after the gradient phase (from the checkpoint)."""
    lines = ["", "Per-layer error of the predicted cache on these prompts (relative error, centred R²):", "",
             "| layer | rel. error K | R² K | rel. error V | R² V |", "|---|---|---|---|---|"]
    lines += [f"| {l} | {errors['k'][l]:.3f} | {errors['r2_k'][l]:.3f} | {errors['v'][l]:.3f} | {errors['r2_v'][l]:.3f} |"
              for l in range(len(errors["k"]))]
    if phases:
        lines += ["", "Held-out text, means over layers:", "",
                  "| after | rel. error K | R² K | rel. error V | R² V |", "|---|---|---|---|---|"]
        for phase, errs in phases.items():
            m = error_summary(errs)
            lines.append(f"| {phase.replace('_', ' ')} | {m['mean_k']:.3f} | {m.get('mean_r2_k', float('nan')):.3f} | "
                         f"{m['mean_v']:.3f} | {m.get('mean_r2_v', float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- kvp-prefix
def cmd_prefix(args: argparse.Namespace) -> None:
    """Calibrate kvp-prefix maps at ``--layer`` (resumable)."""
    set_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    cfg = PrefixCalibration(layer=args.layer, lsq_tokens=args.lsq_tokens, seq_len=args.seq_len, ridge=args.ridge,
                            rank=args.rank, max_mb=args.max_mb, task_share=args.task_share)
    t0 = time.perf_counter()
    calibrate_prefix(model, args.out, cfg, tokenizer=tok, model_name=args.model, resume=args.resume)
    config = json.loads(Path(args.out, "config.json").read_text())
    report = {phase: error_summary({k: v for k, v in errs.items() if k != "layers"})
              for phase, errs in config.get("heldout_errors", {}).items() if isinstance(errs, dict)}
    meta = {"command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
            "wall_seconds_this_run": time.perf_counter() - t0, "heldout_means": report,
            **environment(args.threads, model)}
    write_json(Path(args.out, "calibrate_meta.json"), meta)
    write_json(Path(args.results, f"kvp_calibrate_{Path(args.out).name}.json"), meta)  # the figures' result file
    print(json.dumps({"wall_seconds": time.perf_counter() - t0, "storage": config["maps"]["storage"], **report},
                     indent=2))


def cmd_distill(args: argparse.Namespace) -> None:
    """KL distillation of a least-squares kvp-prefix checkpoint on dev task prompts (resumable).

    Training and held-out prompts are dev prompts built with ``--seed`` (default 2000), never
    the seed-0 dev prompts that ``l-sweep`` scores (``--sweep-n`` of each task) nor the
    calibration's own task prompts."""
    set_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    cfg = PrefixDistillation(steps=args.steps, batch=args.batch, lr=args.lr, tail=args.tail, seed=args.seed,
                             eval_every=args.eval_every, end_share=args.end_share)
    t0 = time.perf_counter()
    _, info = distill_on_dev(model, tok, args.predictor, args.out, cfg, train=args.train or DEFAULT_TRAIN,
                             heldout=args.heldout or DEFAULT_HELDOUT, length=args.length, keep_out_n=args.sweep_n,
                             seed=args.seed, resume=args.resume)
    config = json.loads(Path(args.out, "config.json").read_text())
    meta = {"command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
            "wall_seconds_this_run": time.perf_counter() - t0, **info,
            "distillation": config["distillation"], **environment(args.threads, model)}
    write_json(Path(args.out, "distill_meta.json"), meta)
    write_json(Path(args.results, f"kvp_distill_{Path(args.out).name}.json"), meta)
    print(json.dumps(config["distillation"]["curve"], indent=1))


def _dev_prompts(tok, args: argparse.Namespace, meta: dict[str, Any] | None = None) -> tuple[list[Any], list[torch.Tensor]]:
    task = get_task(args.task)
    samples = task.build(tok, args.length if task.sized else None, args.n, split="dev", seed=args.seed)
    samples = exclude_calibration(samples, meta or {})
    return samples, [torch.as_tensor(s.input_ids, dtype=torch.long).reshape(1, -1) for s in samples]


def cmd_lsweep(args: argparse.Namespace) -> None:
    """kvp-prefix per l beside full prefill on dev prompts; rows via the bench records module."""
    set_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    predictors = [item.split("=", 1) for item in args.predictor]  # [(l, dir)], one l may have several
    metas = [json.loads(Path(d, "config.json").read_text()) for _, d in predictors]
    used = {"task_ids": [i for m in metas for i in m.get("task_ids", [])]}
    samples, prompts = _dev_prompts(tok, args, used)

    extra = [(int(l), KVPrefix(layer=int(l), predictor=d, tail=w)) for l, d in predictors for w in args.tails]
    rows = l_sweep(model, prompts, args.layers, extra=extra)
    header = {"bench": "kvp-prefix-l-sweep", "model": args.model, "task": args.task, "split": "dev",
              "length": args.length, "n": len(samples), "seed": args.seed, "layers": args.layers,
              "predictors": predictors, "tails": args.tails, "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
              **environment(args.threads, model)}
    stem = str(Path(args.out) / result_name(args.out, f"kvp_lsweep_{args.model}_{args.task}_{args.length}",
                                            name=args.name))  # names hold dots: no with_suffix
    write_rows(stem + ".jsonl", header, rows)
    Path(stem + ".md").write_text(lsweep_table(header, rows))
    print(Path(stem + ".md").read_text())


def cmd_gate(args: argparse.Namespace) -> None:
    """The dev gate of a KV predictor (mean held-out V error, median first-token KL)."""
    set_threads(args.threads)
    cfg = json.loads(Path(args.predictor, "config.json").read_text())
    base, tok = load_model(cfg["base"]["name"], dtype=args.dtype)
    method = _load_predictor(args.predictor, cfg, tok, args.dtype)
    samples, prompts = _dev_prompts(tok, args, cfg)
    held = training_corpus(tok, args.seq_len * args.heldout_seqs, args.seq_len, seed=12345, task_share=0.0)
    result = dev_gate(base, method, prompts, held)
    header = {"bench": "kvp-gate", "predictor": args.predictor, "base": cfg["base"]["name"],
              "source": cfg.get("source", "kv"), "task": args.task, "split": "dev", "length": args.length,
              "n": len(samples), "heldout_tokens": args.seq_len * args.heldout_seqs,
              "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
              **environment(args.threads, base)}
    stem = str(Path(args.out) / result_name(args.out, f"kvp_gate_{Path(args.predictor).name}", name=args.name))
    write_json(stem + ".json", {"header": header, "gate": result.to_json()})
    Path(stem + ".md").write_text(f"# KV Prediction dev gate: {Path(args.predictor).name}\n\n"
                                  f"Command: `{header['command']}`\n\n{result.describe()}\n")
    print(result.describe())


# ----------------------------------------------------------------------------------- eval
FULL_SPEC = "full"


def _parse_method(text: str) -> tuple[str, str, str]:
    """``NAME=MODEL:SPEC`` -> (name, zoo model, spec); SPEC is ``full``, ``kvp:<dir>``, ``drop:<stride>``
    or a registry spec (``kvp-prefix:predictor=<dir>``, ``lazyllm:preset=<name>``, ...)."""
    name, eq, rest = text.partition("=")
    model, colon, spec = rest.partition(":")
    if not (eq and colon and name and model and spec):
        raise SystemExit(f"--method {text!r}: expected NAME=MODEL:full, NAME=MODEL:kvp:<checkpoint dir>, "
                         "NAME=MODEL:drop:<stride> or NAME=MODEL:<registry spec>")
    return name, model, spec


#: Header keys a resumed eval must share with the new run.
EVAL_MATCH = ("task", "split", "length", "n", "seed", "max_new_tokens", "methods", "dtype")


def cmd_eval(args: argparse.Namespace) -> None:
    """Every method on the same prompts in one process; records appended as they come (resumable)."""
    set_threads(args.threads)
    parsed = [_parse_method(m) for m in args.method]
    specs = {FULL: (args.model, FULL_SPEC), **{n: (m, s) for n, m, s in parsed}}
    if len(specs) != len(parsed) + 1:
        raise SystemExit("--method names must be unique and not 'full'")
    models: dict[str, Any] = {}
    toks: dict[str, Any] = {}
    for model_name in dict.fromkeys(m for m, _ in specs.values()):
        models[model_name], toks[model_name] = load_model(model_name, dtype=args.dtype)
    tok = toks[args.model]
    for other in toks.values():
        check_tokenizers(tok, other)  # one prompt encoding serves every model
    methods: dict[str, Any] = {}
    for name, (model_name, spec) in specs.items():
        if spec == FULL_SPEC:
            methods[name] = FullPrefill()
        elif spec.startswith("drop:"):
            methods[name] = AuxAlone(AuxSpec.layer_drop(int(spec.split(":")[1])))
        elif not spec.startswith("kvp:"):
            methods[name] = make_method(spec)
            if isinstance(methods[name], KVPrefix):
                methods[name].bind(models[model_name])  # checks and maps outside the timed region
        else:
            ckpt = spec.split(":", 1)[1]
            cfg = json.loads(Path(ckpt, "config.json").read_text())
            aux_name = cfg["aux"].get("name")  # None for a layer-drop aux (built from the base)
            if aux_name and aux_name not in models:  # the aux in the base's dtype
                models[aux_name], toks[aux_name] = load_model(aux_name, dtype=args.dtype)
            method = KVPrediction.load(ckpt, aux=models.get(aux_name),
                                       aux_tokenizer=toks.get(aux_name), base_tokenizer=toks[model_name])
            method.bind(models[model_name])  # checks outside the timed region
            methods[name] = method
    refs = references_by_model({n: m for n, (m, _) in specs.items()},
                               {n for n, (_, s) in specs.items() if s == FULL_SPEC})
    task = get_task(args.task)
    length = args.length if task.sized else None
    samples = task.build(tok, length, args.n, split=args.split, seed=args.seed)
    budget = args.max_new_tokens or task.default_max_new_tokens
    header = {"task": args.task, "split": args.split, "length": length, "n": args.n, "seed": args.seed,
              "max_new_tokens": budget, "warmup": args.warmup, "reference_model": args.model,
              "methods": {n: list(v) for n, v in specs.items()},
              "method_describe": {n: m.describe() for n, m in methods.items()}, "references": refs,
              "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
              **environment(args.threads, models[args.model])}
    stem = str(Path(args.out) / result_name(args.out, f"kvp_{args.task}" + (f"_{length}" if length else ""),
                                            name=args.name, resume=args.resume))
    log = RecordLog(stem + ".jsonl", header, resume=args.resume, overwrite=False, match=EVAL_MATCH)
    records = list(log.records) + run_samples(
        models[args.model], tok, task, samples, methods, length=length, max_new_tokens=budget,
        warmup=args.warmup, desc=f"{args.task}", method_models={n: models[m] for n, (m, _) in specs.items()},
        done=log.done(length), on_record=log.append, reference=refs)
    order = list(specs)
    by_ref = summarize(records, reference=refs, order=order)
    vs_full = {s.method: s for s in summarize(records, reference=FULL, order=order)}
    summary = {s.method: method_entry(s, vs_full[s.method]) for s in by_ref}
    # per-layer relative error of the predicted K / V on the first prompts (their prompt[:-1])
    for name, method in methods.items():
        if isinstance(method, KVPrediction) and name in summary:
            base = models[specs[name][0]]
            ids = [torch.as_tensor(s.input_ids, dtype=torch.long).reshape(1, -1)[:, :-1] for s in samples[: args.errors_n]]
            errs = kv_relative_errors(base, method.bind(base), method.predictor, ids)
            summary[name]["rel_error_k"], summary[name]["rel_error_v"] = errs["k"], errs["v"]
            summary[name]["rel_error_prompts"] = len(ids)
    header = {**header, "command": log.header["command"], "summary": summary, "n_done": {n: s["n"] for n, s in summary.items()}}
    write_json(stem + ".summary.json", header)
    Path(stem + ".md").write_text(reference_table(header, summary, "KV Prediction"))
    plot_score_vs_cost(by_ref, Path(stem + ".png"), f"KV Prediction, {args.task} ({args.split}), n={args.n}")
    plot_layer_errors(header, stem)
    print(Path(stem + ".md").read_text())


def cmd_layers(args: argparse.Namespace) -> None:
    """Redraw the per-layer K/V error plot from a committed ``.summary.json`` (no model needed)."""
    print(redraw_layer_plot(args.summary))


def cmd_plot(args: argparse.Namespace) -> None:
    """Score against TTFT FLOPs from several evals of the same prompts (no model needed)."""
    rows = merge_eval_summaries(args.summaries)
    out = Path(args.out)
    plot_score_vs_flops(rows, out, args.title or f"score vs TTFT FLOPs ({', '.join(Path(f).name for f in args.summaries)})")
    write_json(out.with_suffix(".json"), {"command": "python " + shlex.join(sys.argv), "summaries": args.summaries,
                                          "rows": rows})
    print(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="the models' dtype, a base and its aux alike (default: auto; float32 for "
                        f"{', '.join(FIT_COMMANDS)}, which fit maps)")
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
    t.add_argument("--source", choices=["kv", "hidden", "hidden2"], default="kv",
                   help="what the maps read: the aux KV (paper), its normalised attention input, or two layers'")
    t.add_argument("--task-share", type=float, default=0.25, help="dev task prompts in the training text")
    pf = sub.add_parser("prefix", help="calibrate kvp-prefix maps (least squares, resumable)")
    pf.add_argument("--model", required=True)
    pf.add_argument("--layer", type=int, required=True)
    pf.add_argument("--out", required=True, help="checkpoint directory")
    pf.add_argument("--lsq-tokens", type=int, default=32_768)
    pf.add_argument("--seq-len", type=int, default=512)
    pf.add_argument("--ridge", type=float, default=1e-3)
    pf.add_argument("--rank", type=int, default=None)
    pf.add_argument("--max-mb", type=float, default=20.0)
    pf.add_argument("--task-share", type=float, default=0.25)
    pf.add_argument("--resume", action="store_true")
    ds = sub.add_parser("distill", help="KL distillation of a least-squares kvp-prefix checkpoint (resumable)")
    ds.add_argument("--model", required=True)
    ds.add_argument("--predictor", required=True, help="the least-squares checkpoint")
    ds.add_argument("--out", required=True, help="the distilled checkpoint directory")
    ds.add_argument("--train", action="append", default=None, metavar="TASK:N",
                    help=f"dev prompts to train on (default {' '.join(DEFAULT_TRAIN)})")
    ds.add_argument("--heldout", action="append", default=None, metavar="TASK:N",
                    help=f"dev prompts to select on (default {' '.join(DEFAULT_HELDOUT)})")
    ds.add_argument("--length", type=int, default=1024, help="prompt tokens (sized tasks)")
    ds.add_argument("--sweep-n", type=int, default=16, help="seed-0 dev prompts per task kept out (the l-sweep's)")
    ds.add_argument("--steps", type=int, default=120)
    ds.add_argument("--batch", type=int, default=2)
    ds.add_argument("--lr", type=float, default=1e-4)
    ds.add_argument("--tail", type=int, default=32)
    ds.add_argument("--end-share", type=float, default=0.5)
    ds.add_argument("--eval-every", type=int, default=25)
    ds.add_argument("--seed", type=int, default=DISTILL_SEED)
    ds.add_argument("--resume", action="store_true")
    sw = sub.add_parser("l-sweep", help="kvp-prefix per l beside full prefill on dev prompts")
    sw.add_argument("--model", required=True)
    sw.add_argument("--layers", type=int, nargs="*", default=[], help="depths with zero-shot maps")
    sw.add_argument("--predictor", action="append", default=[], metavar="L=DIR",
                    help="a calibrated checkpoint at l: a row of its own after the zero-shot rows")
    sw.add_argument("--tails", type=int, nargs="+", default=[1],
                    help="for each --predictor, a row per tail W (the last W prompt tokens run every layer)")
    g = sub.add_parser("gate", help="dev gate of a KV predictor: held-out V error and first-token KL")
    g.add_argument("--predictor", required=True)
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--heldout-seqs", type=int, default=8)
    for s_ in (sw, g):
        s_.add_argument("--task", default="singledoc-qa")
        s_.add_argument("--length", type=int, default=1024)
        s_.add_argument("--n", type=int, default=16)
        s_.add_argument("--seed", type=int, default=0)
        s_.add_argument("--name", default=None, help="result file stem")
    pl = sub.add_parser("plot", help="score vs TTFT FLOPs from several eval summaries of the same prompts")
    pl.add_argument("summaries", nargs="+", help=".summary.json files, newest first (a method in two is taken "
                    "from the first)")
    pl.add_argument("--out", required=True, help="the .png to write (a .json of the points beside it)")
    pl.add_argument("--title", default=None)
    lp = sub.add_parser("layers", help="redraw the per-layer K/V error plot from an eval's .summary.json")
    lp.add_argument("summary", help="benchmarks/results/kvp_<task>[_<length>].summary.json")
    for name in ("train", "prefix", "distill"):
        sub.choices[name].add_argument("--results", default=str(RESULTS),
                                       help="where the run's meta (command, wall time, held-out errors) is also "
                                            "written as a result file (default benchmarks/results)")
    for name in ("rope", "ablate", "eval", "l-sweep", "gate"):
        sub.choices[name].add_argument("--out", default=str(RESULTS), help="results directory (default benchmarks/results)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.cmd in FIT_COMMANDS else "auto")
    if args.cmd not in NO_MODEL_COMMANDS:
        keep_freed_memory()
    try:
        {"train": cmd_train, "rope": cmd_rope, "ablate": cmd_ablate, "eval": cmd_eval,
         "layers": cmd_layers, "plot": cmd_plot, "prefix": cmd_prefix, "l-sweep": cmd_lsweep, "gate": cmd_gate,
         "distill": cmd_distill}[args.cmd](args)
    except FastprefillError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
