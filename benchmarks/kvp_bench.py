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

from fastprefill.bench.runner import Record, environment, run_samples, save_jsonl
from fastprefill.data.tasks import get_task
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction import AuxAlone, AuxSpec, KVPrediction, KVPredictor
from fastprefill.methods.kv_prediction.train import TrainConfig, fit_least_squares, kv_relative_errors, train_kvp, training_corpus
from fastprefill.models import zoo
from fastprefill.models.adapters import ModelShape, prefix_kv, rotate_keys

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
                      suffix_len=args.suffix_len, lr=args.lr, l1_weight=args.l1_weight, ridge=args.ridge,
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

    result: dict[str, Any] = {"pair": args.pair, "lsq_tokens": args.lsq_tokens, "heldout_tokens": len(held) * args.seq_len}
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


# ----------------------------------------------------------------------------------- eval
def _agreement_and_errors(base, methods: dict[str, Any], samples) -> dict[str, Any]:
    """First-token agreement with the base and per-layer relative K/V error of each KVP method."""
    out: dict[str, Any] = {}
    full = FullPrefill()
    prompts = [torch.as_tensor(s.input_ids, dtype=torch.long, device=base.device).reshape(1, -1) for s in samples]
    with torch.no_grad():
        ref = [int(full.prefill(base, ids).logits.argmax()) for ids in prompts]
        for name, m in methods.items():
            firsts = [int(m.prefill(base, ids).logits.argmax()) for ids in prompts]
            out[name] = {"first_token_agreement": sum(a == b for a, b in zip(firsts, ref)) / len(ref)}
            if isinstance(m, KVPrediction):
                aux = m.bind(base)
                errs = kv_relative_errors(base, aux, m.predictor, [ids[:, :-1] for ids in prompts])
                out[name]["rel_error_k"], out[name]["rel_error_v"] = errs["k"], errs["v"]
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
        axes[0].scatter(statistics.median(r.ttft_s for r in rs), acc, label=name)
        axes[1].scatter(statistics.median(r.prefill_flops for r in rs), acc, label=name)
    axes[0].set_xlabel("median TTFT (s)")
    axes[1].set_xlabel("TTFT FLOPs")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_eval(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    base, tok = zoo.load(args.base)
    methods: dict[str, Any] = {}
    for ckpt in args.kvp:
        method = KVPrediction.load(ckpt, base_tokenizer=tok)
        method.bind(base)  # checks outside the timed region
        methods[f"kvp:{Path(ckpt).name}"] = method
    for aux in args.aux_alone:
        if aux.startswith("drop:"):
            methods[f"aux-alone:{aux}"] = AuxAlone(AuxSpec.layer_drop(int(aux.split(":")[1])))
        else:
            methods[f"aux-alone:{aux}"] = AuxAlone(zoo.load(aux)[0])
    task = get_task(args.task)
    samples = task.build(tok, args.length, args.n, split=args.split, seed=args.seed)
    records = run_samples(base, tok, task, samples, methods, length=args.length,
                          max_new_tokens=args.max_new_tokens or task.default_max_new_tokens, warmup=args.warmup,
                          desc=f"{args.task}@{args.length}")
    extra = _agreement_and_errors(base, methods, samples[: args.agreement_n])
    summary: dict[str, Any] = {}
    base_ttft = {r.sample_id: r.ttft_s for r in records if r.method == "full"}
    for name in ["full", *methods]:
        rs = [r for r in records if r.method == name]
        summary[name] = {
            "n": len(rs),
            "accuracy": statistics.mean(r.score for r in rs),
            "median_ttft_s": statistics.median(r.ttft_s for r in rs),
            "median_speedup": statistics.median(base_ttft[r.sample_id] / r.ttft_s for r in rs),
            "median_ttft_flops": statistics.median(r.prefill_flops for r in rs),
            **extra.get(name, {}),
        }
    header = {"task": args.task, "split": args.split, "length": args.length, "n": args.n, "base": args.base,
              "methods": {k: m.describe() for k, m in methods.items()}, "summary": summary,
              "command": " ".join(shlex.quote(a) for a in sys.argv), **environment(args.threads)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"kvp_{args.task}_{args.base}_{args.length}"
    save_jsonl(stem.with_suffix(".jsonl"), header, records)
    _plots(records, stem.with_suffix(".png"), f"KV Prediction, {args.task}, base {args.base}")
    print(json.dumps(summary, indent=2))


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
    t.add_argument("--suffix-len", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--l1-weight", type=float, default=0.1)
    t.add_argument("--checkpoint-every", type=int, default=25)
    t.add_argument("--resume", action="store_true")
    sub.choices["rope"].add_argument("--heldout-seqs", type=int, default=8)
    e = sub.add_parser("eval")
    e.add_argument("--base", required=True)
    e.add_argument("--kvp", nargs="*", default=[], help="checkpoint directories")
    e.add_argument("--aux-alone", nargs="*", default=[], help="zoo names or drop:<stride>")
    e.add_argument("--task", default="singledoc-qa")
    e.add_argument("--length", type=int, default=1024)
    e.add_argument("--n", type=int, default=100)
    e.add_argument("--split", default="test")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-new-tokens", type=int, default=None)
    e.add_argument("--warmup", type=int, default=1)
    e.add_argument("--agreement-n", type=int, default=20)
    args = p.parse_args(argv)
    {"train": cmd_train, "rope": cmd_rope, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
