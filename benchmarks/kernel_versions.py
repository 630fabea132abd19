"""Two versions of one C++ kernel in one process: the source at a git revision (``--base``)
against this checkout's build, timed interleaved on the same inputs.

``--kernel attention`` (``src/fastprefill/kernels/attention.cpp``) or ``--kernel rows``
(``rows.cpp``, the few-row products) as it was at ``--base`` is compiled under another module
name with the flags of this CPU's variant (:func:`fastprefill.kernels.compile_source`, a
temporary directory), beside the checkout's own build (:func:`fastprefill.kernels.attention_kernel`
or :func:`fastprefill.kernels.row_products`). First both run every measured shape (attention:
plain and with a random mask; rows: one layer's gate and up weights on 1 to ``--suffix`` rows),
and the record says whether they give the same bits. Then, for each model and prompt length
``T``, in ``--rounds`` rounds, the two versions alternating in order:

- **the kernel alone** on the model's layer shape, the median of ``--calls`` calls: attention of
  a ``--suffix``-row hit over ``T`` keys and of a decode step (one row over ``T`` keys); or the
  products of one layer's gate and up weights on ``--suffix`` rows and on one row;
- **the model**, the kernel switched between the versions: the hit (the last ``--suffix`` tokens
  of a random ``T``-token prompt over the cached rest, the cache cropped back after each run) and
  a decode step over that cache (the median of ``--steps`` steps), as the engine decodes (a cache
  with room, appended in place; the kernel on every layer).

Per setting: each version's median, and the median of the per-round paired ratios ``base / new``
with their range. The cold prefill is not timed: at these lengths both versions spend the same.

    python benchmarks/kernel_versions.py --base HEAD --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --lengths 2048 4096
    python benchmarks/kernel_versions.py --kernel rows --base HEAD --model qwen2.5-coder-0.5b --lengths 2048 4096

Results: ``kernel_versions_<model>`` (attention) or ``kernel_versions_rows_<model>``, ``.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import fastprefill.models.attention as attention_module
import fastprefill.models.packed as packed_module
from fastprefill.bench.records import environment
from fastprefill.cache import make_roomy
from fastprefill.host import DTYPES
from fastprefill.kernels import attention_kernel, compile_source, kernel_status, row_products, rows_status
from fastprefill.models import load as load_model
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.shape import ModelShape
from packed_bench import RESULTS, machine, run_all
from reporting import paired_ratios

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("attention", "rows")
VERSIONS = ("base", "new")
#: The settings timed, by kernel: the kernel alone (two), then the model's hit and decode step.
SETTINGS = {"attention": ("attention hit", "attention decode", "hit", "decode step"),
            "rows": ("products hit", "products decode", "hit", "decode step")}


def build_base(rev: str, dtype: torch.dtype, kernel: str = "attention") -> tuple[Any, str]:
    """The ``kernel``'s source at git revision ``rev`` compiled for this CPU's variant and imported:
    ``(module, full commit hash)``."""
    status = (kernel_status if kernel == "attention" else rows_status)(dtype)
    if not status.available:
        raise SystemExit(f"the checkout's {kernel} kernel does not run {dtype} here: {status.reason}")
    try:
        sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.strip()
        source = subprocess.run(["git", "show", f"{sha}:src/fastprefill/kernels/{kernel}.cpp"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"--base {rev}: {exc.stderr.strip() or exc}") from exc
    out = Path(tempfile.mkdtemp(prefix="fastprefill-kernel-base-"))
    path = out / f"{kernel}.cpp"
    path.write_text(source)
    return compile_source(path, f"fastprefill_{kernel}_base_{sha[:12]}", out, status.variant), sha


def _shapes(shape: Any, length: int, suffix: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``{setting: (q shape, k shape)}`` of the attention-alone settings at prompt length ``length``."""
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    return {"attention hit": ((1, hq, suffix, d), (1, hkv, length, d)),
            "attention decode": ((1, hq, 1, d), (1, hkv, length, d))}


def same_row_bits(kernels: dict[str, Any], weights: list[torch.Tensor], rows: int) -> bool:
    """Whether the versions' products of ``weights`` give the same bits on random inputs of 1 to ``rows`` rows."""
    gen = torch.Generator().manual_seed(0)
    for r in range(1, rows + 1):
        x = torch.randn(r, weights[0].shape[1], generator=gen).to(weights[0].dtype)
        outs = [kernels[ver].products(x, weights, [None] * len(weights)) for ver in VERSIONS]
        if not torch.equal(outs[0], outs[1]):
            return False
    return True


def same_bits(kernels: dict[str, Callable], shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
              dtype: torch.dtype) -> bool:
    """Whether the versions give the same bits on random inputs of every shape, with and without a mask."""
    gen = torch.Generator().manual_seed(0)
    for qs, ks in shapes:
        q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in (qs, ks, ks))
        mask = torch.rand((1, 1, qs[2], ks[2]), generator=gen) > 0.3
        for kw in ({}, {"mask": mask}):
            outs = [kernels[ver](q, k, v, qs[-1] ** -0.5, **kw) for ver in VERSIONS]
            if not torch.equal(outs[0], outs[1]):
                return False
    return True


def _call(kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], Any]:
    return lambda: kernel(q, k, v, q.shape[-1] ** -0.5)


def _median_call(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def kernel_version(kernel: Any, kind: str = "attention") -> Iterator[None]:
    """Inside, the attention function calls ``kernel`` for every kernel call (``kind`` attention), or
    the packed layers take their few-row products from the module ``kernel`` (rows); the versions
    share the checkout's Python."""
    module, name = (attention_module, "attention_kernel") if kind == "attention" else (packed_module, "row_products")
    previous = getattr(module, name)
    setattr(module, name, lambda dtype: kernel)
    try:
        yield
    finally:
        setattr(module, name, previous)


def _row_weights(model: Any) -> list[torch.Tensor]:
    """The weights the few-row kernel is timed and checked on alone: layer 0's gate and up ``(I, D)``."""
    mlp = model.model.layers[0].mlp
    return [mlp.gate_proj.weight, mlp.up_proj.weight]


def _same_bits(kind: str, kernels: dict[str, Any], model: Any, args: argparse.Namespace) -> bool:
    """Whether the two versions give the same bits: attention on every measured shape (plain and
    masked), or the row products on 1 to ``--suffix`` rows."""
    if kind == "rows":
        return same_row_bits(kernels, _row_weights(model), args.suffix)
    shape = ModelShape.from_config(model.config)
    return same_bits(kernels, [c for t in args.lengths for c in _shapes(shape, t, args.suffix).values()], model.dtype)


def _alone(kind: str, kernels: dict[str, Any], model: Any, length: int, suffix: int,
           gen: torch.Generator) -> dict[str, dict[str, Callable[[], Any]]]:
    """``{setting: {version: call}}`` of the kernel-alone settings at prompt length ``length``."""
    if kind == "rows":
        weights = _row_weights(model)
        xs = {f"products {s}": torch.randn(r, weights[0].shape[1], generator=gen).to(model.dtype)
              for s, r in (("hit", suffix), ("decode", 1))}
        return {s: {ver: (lambda k=kernels[ver], x=x: k.products(x, weights, [None, None])) for ver in VERSIONS}
                for s, x in xs.items()}
    cases = _shapes(ModelShape.from_config(model.config), length, suffix)
    inputs = {s: [torch.randn(x, generator=gen).to(model.dtype) for x in (qs, ks, ks)] for s, (qs, ks) in cases.items()}
    return {s: {ver: _call(kernels[ver], *qkv) for ver in VERSIONS} for s, qkv in inputs.items()}


def _kernels(kind: str, model: Any, rev: str) -> tuple[dict[str, Any], str]:
    """Both versions of ``kind`` for ``model``'s dtype (attention: the callables; rows: the modules), and the base's sha."""
    if kind == "attention" and attention_module.attention_backend(model)[0] != "kernel":
        raise SystemExit(f"its attention does not run on the C++ kernel here ({model.dtype}); nothing to compare")
    if kind == "rows" and not packed_module.few_rows_used(model)[0]:
        raise SystemExit(f"its products do not run on the few-row kernel here ({model.dtype}); nothing to compare")
    base, sha = build_base(rev, model.dtype, kind)
    if kind == "attention":
        return {"base": base.causal_attention, "new": attention_kernel(model.dtype)}, sha
    return {"base": base, "new": row_products(model.dtype)}, sha


def _model_round(model: Any, cache: Any, ids: torch.Tensor, suffix: int, steps: int) -> dict[str, float]:
    """The hit (the last ``suffix`` of ``ids`` (1, T) over the cache cropped to ``T - suffix``) and the
    median of ``steps`` decode steps after it; the cache is left holding ``T + steps`` positions."""
    t = ids.shape[1]
    scope = DecoderAdapter(model).attention_scope
    cache.crop(-(cache.get_seq_length() - (t - suffix)))  # back to the first t - suffix (a negative count)
    with scope():
        t0 = time.perf_counter()
        out = model(input_ids=ids[:, t - suffix:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        hit = time.perf_counter() - t0
        token = out.logits[:, -1:].argmax(-1)  # (1, 1)
        times = []
        for i in range(steps):
            position = torch.tensor([[t + i]])
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, position_ids=position, use_cache=True,
                        logits_to_keep=1)
            times.append(time.perf_counter() - t0)
            token = out.logits[:, -1:].argmax(-1)
    return {"hit": hit, "decode step": statistics.median(times)}


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    try:
        kernels, sha = _kernels(args.kernel, model, args.base)
    except SystemExit as exc:
        raise SystemExit(f"{name}: {exc}") from None
    settings = SETTINGS[args.kernel]
    rows = []
    with torch.inference_mode():
        for length in args.lengths:
            gen = torch.Generator().manual_seed(length)
            alone = _alone(args.kernel, kernels, model, length, args.suffix, gen)
            ids = torch.randint(100, 20000, (1, length), generator=gen)
            with DecoderAdapter(model).attention_scope():
                cache = make_roomy(model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values)
            for ver in VERSIONS:  # warm-up
                with kernel_version(kernels[ver], args.kernel):
                    _model_round(model, cache, ids, args.suffix, 1)
            for r in range(args.rounds):
                for ver in VERSIONS if r % 2 == 0 else VERSIONS[::-1]:
                    row = {"length": length, "round": r, "version": ver}
                    for setting, calls in alone.items():
                        row[setting] = _median_call(calls[ver], args.calls)
                    with kernel_version(kernels[ver], args.kernel):
                        row.update(_model_round(model, cache, ids, args.suffix, args.steps))
                    rows.append(row)
            print(f"{name} {length}: " + ", ".join(f"{s} {_cell(rows, length, s)}" for s in settings), flush=True)
        bits = _same_bits(args.kernel, kernels, model, args)
    return {"bench": "kernel-versions", "kernel": args.kernel, "model": name, "base": sha, "base_rev": args.base,
            "suffix": args.suffix, "rounds": args.rounds, "calls": args.calls, "steps": args.steps,
            "same_bits": bits, "rows": rows, "environment": environment(args.threads, model)}


def _series(rows: list[dict[str, Any]], length: int, setting: str) -> dict[str, list[float]]:
    """Each version's seconds of ``setting`` at ``length``, by round."""
    out: dict[str, list[float]] = {ver: [] for ver in VERSIONS}
    for row in sorted(rows, key=lambda r: r["round"]):
        if row["length"] == length:
            out[row["version"]].append(row[setting])
    return out


def summarize(rows: list[dict[str, Any]], length: int, setting: str) -> dict[str, Any]:
    """Medians (ms) of both versions and the paired ratio ``base / new`` (median, min, max) over rounds."""
    s = _series(rows, length, setting)
    return {"base_ms": statistics.median(s["base"]) * 1e3, "new_ms": statistics.median(s["new"]) * 1e3,
            **paired_ratios(s["base"], s["new"])}


def _cell(rows: list[dict[str, Any]], length: int, setting: str) -> str:
    c = summarize(rows, length, setting)
    return f"{c['base_ms']:.2f} -> {c['new_ms']:.2f} ms"


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    kind = result.get("kernel", "attention")
    title = "Attention kernel" if kind == "attention" else "Few-row products kernel"
    alone = ("attention alone" if kind == "attention"
             else f"products alone (one layer's gate and up weights, {result['suffix']} rows or one)")
    lines = [f"# {title}: {result['base'][:12]} (base) against this checkout (new), {result['model']}",
             "",
             (f"{machine(env)}, dtype {env['dtype']}. {result['rounds']} rounds, the versions alternating; "
              f"{alone}: median of {result['calls']} calls; decode step: median of {result['steps']} steps; "
              f"hit: {result['suffix']} tokens over the rest. Same bits on every measured shape: "
              f"{'yes' if result['same_bits'] else 'no'}."),
             "",
             "| T | setting | base ms | new ms | base / new (paired median) | range | rounds |",
             "|---|---|---|---|---|---|---|"]
    for length in sorted({r["length"] for r in result["rows"]}):
        for setting in SETTINGS[kind]:
            c = summarize(result["rows"], length, setting)
            lines.append(f"| {length} | {setting} | {c['base_ms']:.2f} | {c['new_ms']:.2f} | {c['ratio']:.2f} | "
                         f"[{c['min']:.2f}, {c['max']:.2f}] | {c['n']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--suffix", type=int, default=16, help="tokens of the hit's uncached suffix")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--kernel", choices=KERNELS, default="attention", help="which kernel's two versions")
    p.add_argument("--base", default="HEAD", help="the git revision whose kernel source is the baseline (default HEAD)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls per attention-alone timing")
    p.add_argument("--steps", type=int, default=8, help="decode steps per model timing")
    args = p.parse_args(argv)
    if min(args.lengths) <= args.suffix or args.suffix < 1 or min(args.rounds, args.calls, args.steps) < 1:
        p.error("every length must exceed --suffix >= 1; --rounds, --calls and --steps >= 1")
    run_all(args, "kernel_versions" if args.kernel == "attention" else "kernel_versions_rows", run_model, markdown)


if __name__ == "__main__":
    main()
