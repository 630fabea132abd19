"""Which operation's result for a row depends on the other rows computed with it: a deterministic
check on random inputs, per dtype, without a model.

A decode step in a batch of ``B`` streams multiplies ``B`` rows where a lone decode multiplies
one; a prefix-cache hit computes its few suffix rows where a whole prefill computes them among
``T``. A row's result stays the same only if every operation computes it the same whatever rows
come with it. Checked here, each as the largest absolute difference of the rows compared (and
whether they are equal bit for bit):

- ``linear``: a product ``(M, D_in) x (D_in, D_out)`` at the model's shapes (``--shapes``), in
  its packed form (``PackedLinear``, oneDNN, as fastprefill loads a bfloat16 model) and its plain
  form (``torch.nn.functional.linear``); each ``M`` of ``--rows`` against the same rows computed
  inside the ``--tokens``-row product, and one row alone against that row inside a 4-row product;
- ``attention``: the C++ kernel (:mod:`fastprefill.kernels`): a suffix of ``s`` query rows over
  all ``--tokens`` keys (a hit's suffix; ``s = 1``: a decode step) against the same rows of the
  whole causal prefill, and the whole prefill with other ``row_target`` and ``key_block`` values
  against the defaults.

    python benchmarks/row_invariance.py --dtypes bfloat16,float32

Writes ``benchmarks/results/row_invariance.jsonl`` (a header, one row per check) and ``.md``;
``benchmarks/verify.py`` re-makes the table from the rows (:func:`markdown`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fastprefill.bench.records import environment, read_rows, result_name
from fastprefill.host import DTYPES, dtype_name, set_threads
from fastprefill.kernels import attention_kernel
from fastprefill.models.packed import pack_linears, packable
from fastprefill.models.row_floor import chunked, row_floor_for, set_row_floor

RESULTS = Path(__file__).resolve().parent / "results"
#: Qwen2.5-Coder-0.5B's products: q (and o), k/v, the MLP's gate/up, down; and its attention heads
SHAPES = "896x896,896x128,896x4864,4864x896"
HEADS = (14, 2, 64)  # H_q, H_kv, d
#: one decode step's packed products of Qwen2.5-Coder-0.5B: IN x OUT x per step (24 layers: the
#: merged q/k/v, o, gate and up, down; the LM head once)
STEP = "896x1152x24,896x896x24,896x4864x48,4864x896x24,896x151936x1"


def _row(dtype: str, op: str, form: str, case: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    diff = float((a.float() - b.float()).abs().max())
    return {"dtype": dtype, "op": op, "form": form, "case": case, "max_abs_diff": diff,
            "bitwise_equal": bool(torch.equal(a, b))}


def linear_checks(dtype: torch.dtype, shapes: Sequence[tuple[int, int]], tokens: int,
                  rows: Sequence[int], seed: int, compared: int = 48) -> list[dict[str, Any]]:
    """Each shape's product: the first ``compared`` rows computed ``M`` rows at a time against the
    same rows inside one ``tokens``-row product; packed (where oneDNN packs this dtype) and plain.
    (Many rows: two kernels' float32 sums in another order mostly round to one bfloat16.)"""
    name = dtype_name(dtype)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for d_in, d_out in shapes:
        layer = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=d_out == 128)).to(dtype)
        with torch.no_grad():
            layer[0].weight.copy_(torch.randn(d_out, d_in, generator=gen) * d_in ** -0.5)
        x = torch.randn(tokens, d_in, generator=gen).to(dtype)
        forms = {"plain": lambda t, w=layer[0]: torch.nn.functional.linear(t, w.weight, w.bias)}
        if packable("cpu", dtype):
            packed = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=d_out == 128)).to(dtype)
            packed.load_state_dict(layer.state_dict())
            pack_linears(packed)
            forms["packed"] = packed[0]
        with torch.inference_mode():
            for form, f in forms.items():
                whole = f(x)[:compared]
                for m in rows:
                    out.append(_row(name, "linear", form, f"{d_in}x{d_out}: {m} at a time vs inside {tokens}",
                                    chunked(f, x[:compared], m), whole))
    return out


def attention_checks(dtype: torch.dtype, tokens: int, suffixes: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """The kernel's suffix rows (a hit's, a decode step's) against the whole prefill's, and the
    whole prefill under other row blockings and key blocks against the defaults."""
    name = dtype_name(dtype)
    kernel = attention_kernel(dtype)
    if kernel is None:
        return []
    hq, hkv, d = HEADS
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, tokens, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    whole = kernel(q, k, v, scale)  # (1, T, H_q, d)
    out = [_row(name, "attention", "kernel", f"last {s} rows over {tokens} keys vs the whole prefill's",
                kernel(q[:, :, tokens - s:], k, v, scale), whole[:, tokens - s:]) for s in suffixes]
    for row_target in (1, 64, 1024):
        out.append(_row(name, "attention", "kernel", f"whole prefill, row_target={row_target} vs 384",
                        kernel(q, k, v, scale, row_target=row_target), whole))
    out.append(_row(name, "attention", "kernel", "whole prefill, key_block=128 vs 256",
                    kernel(q, k, v, scale, key_block=128), whole))
    return out


def cost_rows(dtype: torch.dtype, step: Sequence[tuple[int, int, int]], floor: int | None, reps: int,
              seed: int) -> list[dict[str, Any]]:
    """Each product of a decode step timed at one row and at its row floor (``floor``, or ``None``:
    the one :func:`~fastprefill.models.row_floor.row_floor_for` finds for its shape, as
    ``set_row_floor(model, "auto")`` sets it; one row padded with zero rows, as the floor runs
    it), alternating, ``reps`` times: the medians in milliseconds."""
    name = dtype_name(dtype)
    gen = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for d_in, d_out, count in step:
            layer = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False)).to(dtype)
            pack_linears(layer)
            x = torch.randn(1, d_in, generator=gen).to(dtype)
            rows_at = floor if floor is not None else row_floor_for([(d_in, d_out)], dtype)
            if rows_at is None:
                raise SystemExit(f"error: no row floor makes the {d_in}x{d_out} {dtype} product row-invariant here")
            times: dict[int, list[float]] = {1: [], rows_at: []}
            for _ in range(reps + 1):  # the first round warms up
                for rows, took in times.items():
                    layer[0].row_floor = rows
                    start = time.perf_counter()
                    layer[0](x)
                    took.append(time.perf_counter() - start)
            out.append({"dtype": name, "op": "cost", "shape": f"{d_in}x{d_out}", "per_step": count, "floor": rows_at,
                        "ms_one_row": 1e3 * statistics.median(times[1][1:]),
                        "ms_floor": 1e3 * statistics.median(times[rows_at][1:])})
    return out


#: random prompts whose hits over 16-token blocks leave 1, 2, 9 and 15 suffix rows
MODEL_LENGTHS = (161, 162, 169, 175)


def model_checks(spec: str, dtype: str, seed: int) -> list[dict[str, Any]]:
    """The ``model`` rows (see the module docstring) of ``spec`` in ``dtype``, floor off and auto."""
    from fastprefill.engine import Generation, generate
    from fastprefill.methods.full import FullPrefill
    from fastprefill.methods.layer_steps import run_layers
    from fastprefill.models import load as load_model
    from fastprefill.models.adapters import DecoderAdapter
    from fastprefill.prefix_cache import PrefixCache

    model, _ = load_model(spec, dtype=dtype, pack=True)
    adapter = DecoderAdapter(model)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, model.config.vocab_size, (1, n), generator=gen) for n in MODEL_LENGTHS]

    def branches() -> list[Any]:
        gens = [Generation(model, None, ids, FullPrefill(), 4, stop_at_eos=False) for ids in prompts]
        for g in gens:
            g.prefill(None)
            g.first_events()
        return [g.live[0] for g in gens]

    def step(rows: list[Any]) -> torch.Tensor:
        with torch.inference_mode():
            return run_layers(adapter, [b.decoder.layer_steps(b.last_token) for b in rows]).float()

    out = []
    for floor in (1, "auto"):
        label = f"row floor {set_row_floor(model, floor)}" + (" (auto)" if floor == "auto" else "")
        alone = torch.cat([step([b]) for b in branches()])
        out.append(_row(dtype, "model", label, f"{spec}: a decode step alone vs in a batch of {len(prompts)}",
                        alone, step(branches())))
        for ids in prompts:
            cache = PrefixCache(max_bytes=1 << 30, block_tokens=16)
            cold = generate(model, None, ids, FullPrefill(), 1, stop_at_eos=False, prefix_cache=cache)
            hit = generate(model, None, ids, FullPrefill(), 1, stop_at_eos=False, prefix_cache=cache)
            suffix = ids.shape[1] - hit.timing.cached_tokens
            out.append(_row(dtype, "model", label, f"{spec}: first token, a hit's {suffix}-row suffix vs cold",
                            hit.first_logits, cold.first_logits))
    return out


def markdown(header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """One table row per check; then the row floor's cost, one row per product and a step's sum."""
    costs = [r for r in rows if r["op"] == "cost"]
    rows = [r for r in rows if r["op"] != "cost"]
    lines = [(f"Row invariance on random inputs ({header['tokens']} rows; threads {header['threads']}, "
             f"{header['cpu']}): a row computed among other rows against the same row computed otherwise."),
             "", "| dtype | op | form | case | bit for bit | max abs diff |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['op']} | {r['form']} | {r['case']} | {'yes' if r['bitwise_equal'] else 'no'} | "
              f"{r['max_abs_diff']:.3g} |" for r in rows]
    if costs:
        lines += ["", (f"A lone decode step's packed products at one row and padded to their row floor "
                  f"(medians of {header['reps']} interleaved calls):"), "",
                  "| dtype | product | per step | floor | ms at 1 row | ms at the floor | ratio |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['shape']} | {r['per_step']} | {r['floor']} | {r['ms_one_row']:.3f} | "
                  f"{r['ms_floor']:.3f} | {r['ms_floor'] / r['ms_one_row']:.2f}x |" for r in costs]
        for dtype in dict.fromkeys(r["dtype"] for r in costs):
            one = sum(r["per_step"] * r["ms_one_row"] for r in costs if r["dtype"] == dtype)
            floored = sum(r["per_step"] * r["ms_floor"] for r in costs if r["dtype"] == dtype)
            lines.append(f"| {dtype} | a decode step's products | 1 | - | {one:.2f} | {floored:.2f} | "
                         f"{floored / one:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--shapes", default=SHAPES, help="products as IN x OUT, comma-separated")
    p.add_argument("--tokens", type=int, default=768, help="rows of the whole product / prefill")
    p.add_argument("--rows", default="1,2,3,4,8,16", help="row counts (divisors of 48) compared with the whole product's")
    p.add_argument("--suffixes", default="1,4,15", help="suffix rows compared with the whole prefill's")
    p.add_argument("--step", default=STEP, help="a decode step's products as IN x OUT x COUNT, comma-separated")
    p.add_argument("--floor", default="auto",
                   help="the row floor whose cost is timed: an integer >= 2, or 'auto' (each product's own)")
    p.add_argument("--reps", type=int, default=30, help="timed calls per product and row count (0: no timing)")
    p.add_argument("--model", default=None, help="also check this model end to end (a zoo name; loaded packed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default=None, help="result file stem (default row_invariance)")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"error: unknown dtype {bad[0]!r}; choose from {', '.join(DTYPES)}")
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
        step = [tuple(int(x) for x in s.lower().split("x")) for s in args.step.split(",")]
        rows = [int(r) for r in args.rows.split(",")]
        suffixes = [int(s) for s in args.suffixes.split(",")]
    except ValueError:
        raise SystemExit("error: --shapes is IN x OUT pairs, --rows and --suffixes integers, comma-separated") from None
    if (any(len(s) != 2 or min(s) < 1 for s in shapes) or any(len(s) != 3 or min(s) < 1 for s in step)
            or not (args.floor == "auto" or (args.floor.isdigit() and int(args.floor) >= 2)) or args.reps < 0 or args.tokens < 48 or any(48 % r for r in rows if r > 0)
            or not all(1 <= r <= args.tokens for r in [*rows, *suffixes])):
        raise SystemExit(f"error: shapes of two positive sizes, --step of three, --floor >= 2, --reps >= 0, "
                         f"--tokens >= 48, --rows divisors of 48, --suffixes in [1, --tokens={args.tokens}]")

    set_threads(args.threads)
    results: list[dict[str, Any]] = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        results += linear_checks(dt, shapes, args.tokens, rows, args.seed)  # type: ignore[arg-type]
        results += attention_checks(dt, args.tokens, suffixes, args.seed)
        if args.model is not None and packable("cpu", dt):
            results += model_checks(args.model, dtype, args.seed)
        if packable("cpu", dt) and args.reps:
            floor = None if args.floor == "auto" else int(args.floor)
            results += cost_rows(dt, step, floor, args.reps, args.seed)  # type: ignore[arg-type]
    header = {"bench": "row_invariance", "dtypes": dtypes, "shapes": args.shapes, "tokens": args.tokens,
              "step": args.step, "reps": args.reps, "model": args.model,
              "seed": args.seed, **environment(args.threads, getattr(torch, dtypes[0]))}
    header.pop("dtype", None)  # each row names its own
    stem = result_name(args.out, "row_invariance", name=args.name)
    path = Path(args.out) / f"{stem}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in [{"header": header}, *results]))
    header, results = read_rows(path)
    path.with_suffix(".md").write_text(markdown(header, results))
    print(markdown(header, results))


if __name__ == "__main__":
    main()
