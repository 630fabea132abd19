"""What prepacked linear weights (``fastprefill.models.packed``) change: the same model loaded
packed and unpacked in one process, timed interleaved on the same random prompts.

For each prompt length ``T``:

- **cold**: full prefill of ``T`` tokens (one forward, ``logits_to_keep=1``);
- **hit**: the last ``--suffix`` tokens over the K/V of the ``T - suffix`` before them (the
  computation of a prefix-cache hit: the cache is cropped back after each run);
- **decode**: one single-token step over the ``T``-token cache.

Each setting runs once as a warm-up, then ``--repeats`` times, packed and unpacked alternating.
Reported: medians, ``unpacked / packed`` per setting, and whether the greedy next token agrees.
With ``--against unfused`` the baseline is the same model packed with its MLPs left unfused
(``pack_linears`` without ``fuse_mlps``, its MLPs compiled as before), so the comparison is what
fusing the SwiGLU into the products adds: ``fused`` against ``unfused`` (a float32 model, which
loads unfused, is fused for it). With ``--against
own-attention`` the baseline is the same model with its attention modules' own forward
(``fuse_attention(model, fused=False)``: transformers' rotary passes, three q/k/v products), so the comparison is
what fastprefill's attention forward adds (``fuse_attention``). With ``--against mkl-wide`` (float32)
the baseline is the same packed model with its products of more than ``--wide-rows`` rows on the
plain weight (``set_wide_rows``: MKL's sgemm), so the comparison is oneDNN's packed products
against MKL's for prompt-sized inputs. These last two give the median of the per-round paired
ratios with their range.

    python benchmarks/packed_bench.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --lengths 2048 4096
    python benchmarks/packed_bench.py --against unfused
    python benchmarks/packed_bench.py --against own-attention --model qwen2.5-coder-0.5b
    python benchmarks/packed_bench.py --model qwen2.5-coder-0.5b --lengths 2048 --dtype float32 --pack
    python benchmarks/packed_bench.py --against mkl-wide --model qwen2.5-coder-0.5b --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fastprefill.bench.records import environment, result_name
from fastprefill.host import DTYPES, keep_freed_memory, set_threads
from fastprefill.models import load as load_model
from fastprefill.models.adapters import fuse_mlps
from fastprefill.models.fused import fuse_attention
from fastprefill.models.packed import linears_packed, pack_linears, set_wide_rows
from reporting import paired_ratios, write_json

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("cold", "hit", "decode")


def _timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _runs(model: Any, ids: torch.Tensor, suffix: int) -> dict[str, tuple[float, int]]:
    """Seconds and greedy next token of each setting on ``model`` for ``ids`` ``(1, T)``."""
    t = ids.shape[1]
    out: dict[str, tuple[float, int]] = {}
    with torch.inference_mode():
        s, res = _timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
        out["cold"] = (s, int(res.logits[0, -1].argmax()))
        cache = res.past_key_values
        nxt = res.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        s, res = _timed(lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True))
        out["decode"] = (s, int(res.logits[0, -1].argmax()))
        cache.crop(-(suffix + 1))  # back to the first t - suffix tokens (transformers crops by a negative count)
        s, res = _timed(lambda: model(input_ids=ids[:, t - suffix:], past_key_values=cache, use_cache=True,
                                      logits_to_keep=1))
        out["hit"] = (s, int(res.logits[0, -1].argmax()))
    return out


def _labels(against: str) -> tuple[str, str]:
    """What the default load and its baseline are called: packed / unpacked, fused / unfused,
    fused attention / own attention, or oneDNN / MKL wide."""
    return {"unpacked": ("packed", "unpacked"), "unfused": ("fused", "unfused"),
            "own-attention": ("fused attention", "own attention"), "mkl-wide": ("oneDNN", "MKL wide")}[against]


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    new, base = _labels(args.against)
    packed, _ = load_model(name, dtype=args.dtype, pack=args.pack or None, progress=False)
    base_pack = (args.pack or None) if args.against in ("own-attention", "mkl-wide") else False  # packed as new
    baseline, _ = load_model(name, dtype=args.dtype, pack=base_pack, progress=False)
    if not linears_packed(packed):
        raise SystemExit(f"{name} in {args.dtype} is not packed on this machine (--pack packs it anyway): "
                         "nothing to compare")
    if args.against == "unfused":
        fuse_mlps(packed)  # a float32 model loads unfused
        pack_linears(baseline)  # packed, MLPs as the model has them (compiled)
    if args.against == "own-attention":
        fuse_attention(baseline, fused=False)  # everything else as loaded
    if args.against == "mkl-wide":
        if packed.dtype != torch.float32:
            raise SystemExit(f"--against mkl-wide compares float32 products; {name} loaded in {packed.dtype}")
        set_wide_rows(baseline, args.wide_rows)
    models = {new: packed, base: baseline}
    rows = []
    for length in args.lengths:
        ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))
        for m in models.values():
            _runs(m, ids, args.suffix)  # warm-up (compiles on the first call)
        times: dict[str, dict[str, list[float]]] = {k: {s: [] for s in SETTINGS} for k in models}
        tokens: dict[str, dict[str, int]] = {}
        for r in range(args.repeats):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for key in order:
                for setting, (seconds, token) in _runs(models[key], ids, args.suffix).items():
                    times[key][setting].append(seconds)
                    tokens.setdefault(key, {})[setting] = token
        med = {k: {s: statistics.median(v) for s, v in d.items()} for k, d in times.items()}
        paired = {s: paired_ratios(times[base][s], times[new][s]) for s in SETTINGS}
        row = {"length": length, "times": times, "medians": med,
               f"{base}_over_{new}": {s: med[base][s] / med[new][s] for s in SETTINGS},
               "paired": {s: p["ratio"] for s, p in paired.items()},
               "paired_range": {s: [p["min"], p["max"]] for s, p in paired.items()},
               "same_token": {s: tokens[new][s] == tokens[base][s] for s in SETTINGS}}
        rows.append(row)
        print(f"{name} {length}: " + ", ".join(
            f"{s} {med[new][s] * 1000:.1f} ms {new} / {med[base][s] * 1000:.1f} {base}" for s in SETTINGS), flush=True)
    extra = {"wide_rows": args.wide_rows} if args.against == "mkl-wide" else {}
    return {"model": name, "against": args.against, "suffix": args.suffix, "repeats": args.repeats, "rows": rows,
            **extra, "environment": environment(args.threads, packed)}


def machine(env: dict[str, Any]) -> str:
    """The first words of a result page: threads, CPU and its bfloat16 units, torch, compiled blocks."""
    return (f"{env['threads']} threads, CPU {env['cpu']} (bfloat16 units: {env['bf16_units']}), torch {env['torch']}, "
            f"blocks compiled: {env['compiled']}")


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    new, base = _labels(result.get("against", "unpacked"))
    title = {"unpacked": "Packed against unpacked linear weights",
             "unfused": "SwiGLU fused into the packed products against packed unfused MLPs",
             "own attention": ("fastprefill's attention forward (one-pass rotary, one q/k/v product) "
                               "against the model's own"),
             "MKL wide": (f"Products of more than {result.get('wide_rows')} rows on oneDNN's packed weights "
                          "against MKL's plain ones")}[base]
    lines = [f"# {title}: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. Medians of {result['repeats']} runs each, {new} and {base} "
              f"alternating; hit: the last {result['suffix']} tokens over the cached rest."), "",
             f"| T | setting | {new} (ms) | {base} (ms) | {base} / {new} | same next token |", "|---|---|---|---|---|---|"]
    paired = all("paired" in r for r in result["rows"])
    if paired:  # the per-round paired ratios beside the ratio of medians
        lines[-2:] = [f"| T | setting | {new} (ms) | {base} (ms) | {base} / {new} | paired [min, max] | same next token |",
                      "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        for s in SETTINGS:
            pair = (f" {r['paired'][s]:.2f} [{r['paired_range'][s][0]:.2f}, {r['paired_range'][s][1]:.2f}] |"
                    if paired else "")
            lines.append(f"| {r['length']} | {s} | {r['medians'][new][s] * 1000:.1f} | "
                         f"{r['medians'][base][s] * 1000:.1f} | {r[f'{base}_over_{new}'][s]:.2f} |{pair} "
                         f"{'yes' if r['same_token'][s] else 'no'} |")
    return "\n".join(lines) + "\n"


def parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The options this benchmark and ``kv_room_bench.py`` share (models, lengths, the hit's suffix,
    repeats, threads, dtype, output directory)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--suffix", type=int, default=32, help="tokens of the hit's uncached suffix")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    return p


def run_all(args: argparse.Namespace, prefix: str, run: Any, render: Any, stem: Any = None) -> None:
    """``run(name, args)`` for each ``--model`` on ``--threads`` threads; each result written as
    ``<prefix>_<model>.json`` (or ``stem(name, result)``) and ``render(result)`` as its ``.md`` (a
    new name if taken), and printed."""
    set_threads(args.threads)
    keep_freed_memory()
    for name in args.model:
        result = run(name, args)
        base = stem(name, result) if stem is not None else f"{prefix}_{name}"
        path = str(Path(args.out) / result_name(args.out, base))
        table = render(result)
        write_json(path + ".json", result)
        Path(path + ".md").write_text(table)
        print(table)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, repeats=5)
    p.add_argument("--against", choices=("unpacked", "unfused", "own-attention", "mkl-wide"), default="unpacked",
                   help="the baseline: the model unpacked, packed with its MLPs unfused, with its attention "
                        "modules' own forward, or (float32) with its products of more than --wide-rows rows on MKL")
    p.add_argument("--wide-rows", type=int, default=128,
                   help="with --against mkl-wide: the baseline's products of more rows than this run on MKL")
    p.add_argument("--pack", action="store_true",
                   help="pack where the default does not (a float32 model); results named <prefix>_<model>_<dtype>")
    args = p.parse_args(argv)
    if min(args.lengths) <= args.suffix or args.suffix < 1 or args.repeats < 1:
        p.error("every length must exceed --suffix >= 1, and --repeats >= 1")
    if args.wide_rows < 0:
        p.error("--wide-rows takes a non-negative number of rows")
    prefix = {"unpacked": "packed", "unfused": "fused", "own-attention": "fused_attention",
              "mkl-wide": "wide_rows"}[args.against]
    dtyped = args.pack or args.dtype != "auto" or args.against == "mkl-wide"
    stem = (lambda name, result: f"{prefix}_{name}_{result['environment']['dtype']}") if dtyped else None
    run_all(args, prefix, run_model, markdown, stem=stem)


if __name__ == "__main__":
    main()
