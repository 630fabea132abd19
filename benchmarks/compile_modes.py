"""What compiling the whole model would buy over fastprefill's compiled blocks, and what it costs.

fastprefill compiles each decoder layer's norms (and, unpacked, its MLP) and multiplies with
prepacked oneDNN weights, so that full prefill, a prefix-cache hit, the server's pauses between
layers and every layer-by-layer method run the same modules (docs/decisions.md). This script
measures the alternative those constraints rule out, in one process, on the same prompts:

- ``blocks``: the model as :func:`fastprefill.models.load` gives it (the default);
- ``model``: the decoder stack (``model.model``) compiled whole with ``torch.compile``
  (inductor, dynamic sequence length), plain weights;
- ``model-frozen``: the same with inductor's freezing (``torch._inductor.config.freezing``:
  weights folded in as constants, prepacked for oneDNN, post-ops fused by inductor).

One whole-model mode per process (dynamo keeps compiled code per function, so a second
compiled model in the same process would run the first one's graph; ``--modes`` refuses two).
For each: the seconds from the compile to the end of the first call (``compile_s``: paid in
every new process, as measured by running the script twice), then full-prefill forwards at each
length (``model(input_ids, use_cache=True, logits_to_keep=1)``, the same call for all modes),
interleaved, warm-up excluded, medians; the ratio to ``blocks`` is the median of per-round
ratios. ``max_logit_diff`` and ``same_argmax`` compare the last position's logits with
``blocks``'s.

    python benchmarks/compile_modes.py --model qwen2.5-coder-0.5b --modes blocks model
    python benchmarks/compile_modes.py --model qwen2.5-coder-0.5b --modes blocks model-frozen
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.host import dtype_name
from fastprefill.models import load as load_model
from packed_bench import run_all

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("blocks", "model", "model-frozen")


def _forward(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits of a full prefill, ``(1, 1, V)``."""
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))


def load_mode(name: str, mode: str, first: torch.Tensor) -> tuple[Any, float]:
    """The model in ``mode`` and the seconds from its compile to the end of its first call."""
    import torch._inductor.config as inductor

    if mode == "blocks":
        model, _ = load_model(name, dtype="bfloat16", progress=False)
        start = time.perf_counter()
        _forward(model, first)
        return model, time.perf_counter() - start
    model, _ = load_model(name, dtype="bfloat16", progress=False, compile=False, pack=False)
    frozen = inductor.freezing
    inductor.freezing = mode == "model-frozen"
    try:
        start = time.perf_counter()
        model.model.compile(dynamic=True)
        _forward(model, first)  # the compile happens here
        return model, time.perf_counter() - start
    finally:
        inductor.freezing = frozen


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    first = _prompt(args.lengths[0])
    models, compile_s = {}, {}
    for mode in args.modes:
        models[mode], compile_s[mode] = load_mode(name, mode, first)
        print(f"{name} {mode}: compile and first call {compile_s[mode]:.1f} s", flush=True)
    rows = []
    for length in args.lengths:
        ids = _prompt(length)
        ref = _forward(models[args.modes[0]], ids).float()
        row: dict[str, Any] = {"length": length, "runs": {m: [] for m in models}, "agreement": {}}
        for mode, model in models.items():
            got = _forward(model, ids).float()  # also the warm-up at this length
            row["agreement"][mode] = {"max_logit_diff": (got - ref).abs().max().item(),
                                      "same_argmax": bool(got.argmax() == ref.argmax())}
        for _ in range(args.repeats):
            for mode, model in models.items():
                start = time.perf_counter()
                _forward(model, ids)
                row["runs"][mode].append(time.perf_counter() - start)
        base = row["runs"][args.modes[0]]
        row["medians"] = {m: statistics.median(v) for m, v in row["runs"].items()}
        row["speedup"] = {m: statistics.median([b / a for a, b in zip(v, base, strict=True)])
                          for m, v in row["runs"].items()}
        rows.append(row)
        print(f"{name} {length}: " + ", ".join(f"{m} {row['medians'][m]:.3f} s ({row['speedup'][m]:.2f}x)"
                                               for m in models), flush=True)
    model = models[args.modes[0]]
    return {"model": name, "dtype": dtype_name(model.dtype), "modes": list(args.modes), "compile_s": compile_s,
            "repeats": args.repeats, "rows": rows, "environment": environment(args.threads, model)}


def markdown(result: dict[str, Any]) -> str:
    modes = result["modes"]
    env = result["environment"]
    lines = [f"# Compiled blocks against a compiled model: {result['model']}, {result['dtype']}", "",
             (f"{env['threads']} threads, CPU {env['cpu']} (bfloat16 units: {env['bf16_units']}), torch {env['torch']}. "
             f"Full-prefill forwards, {result['repeats']} interleaved rounds per length after a warm-up, medians; "
             f"speedup = median over rounds of {modes[0]} / mode. Compile: seconds from the compile to the end of "
             f"the first call ({result['rows'][0]['length']} tokens), in a fresh process."), "",
             "| mode | compile (s) | " + " | ".join(f"{r['length']} tokens: s (speedup)" for r in result["rows"])
             + " | max logit diff, same argmax |",
             "|---|---|" + "---|" * len(result["rows"]) + "---|"]
    for mode in modes:
        cells = [f"{r['medians'][mode]:.3f} ({r['speedup'][mode]:.2f}x)" for r in result["rows"]]
        agree = "; ".join(f"{r['agreement'][mode]['max_logit_diff']:.3f}, {r['agreement'][mode]['same_argmax']}"
                          for r in result["rows"])
        lines.append(f"| {mode} | {result['compile_s'][mode]:.1f} | " + " | ".join(cells) + f" | {agree} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if sum(mode != "blocks" for mode in args.modes) > 1:
        p.error("one whole-model mode per process (a second would run the first one's compiled graph)")
    run_all(args, "compile_modes", run_model, markdown,
            stem=lambda name, result: "_".join(["compile_modes", name, result["dtype"], *args.modes]))


if __name__ == "__main__":
    main()
