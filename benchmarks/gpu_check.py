"""The device check: exactness on the device, then a TTFT table on 7B-shaped random models.

One command, nothing outside the working tree (no weights, no network)::

    python benchmarks/gpu_check.py                      # CUDA: both parts, bfloat16 table
    python benchmarks/gpu_check.py --device cpu --tiny  # the same code on tiny configs, seconds

**Exactness** (``--dtypes``, default bfloat16 and float32) on two small random models (Llama and
Qwen2 conventions, GQA, head size 64) on the device, each check two paths of the same model:

- ``prefix-hit``: a prompt whose first blocks are in the prefix cache against the same prompt
  prefilled whole (first-token logits; greedy tokens through the engine);
- ``chunked``: the prompt prefilled in chunks (the server's ``--prefill-chunk`` path) against whole;
- ``paused``: a prefill paused at every layer, another request's prefill run in each pause
  (:class:`~fastprefill.serve.pauses.LayerPauses`), against the same prefill unpaused;
- ``decode-batch``: answers of prompts of different lengths decoded in one padded
  :class:`~fastprefill.batch.DecodeBatch` against each decoded alone;
- ``persisted``: the prefix cache saved and loaded again: the loaded blocks' hit against the
  hit before saving (bit for bit) and against full prefill;
- ``layer-loop``: LazyLLM at ``keep-all`` (the layer loop every pruning method drives) against
  the model's own forward.

A check passes when the first-token logits agree within the dtype's tolerance
(:data:`RTOL`, relative to the largest reference logit; ``bitwise`` checks must be equal) and the
greedy tokens are equal, or part only where the reference's top two were closer than that
tolerance (a near-tie that any rounding may flip: random weights make near-uniform logits).

**TTFT** on models built with ``AutoModelForCausalLM.from_config`` from the configs in
:data:`SHAPES` (Llama-2-7B's and Qwen2.5-7B's, random weights: the time does not depend on
their values), in ``--table-dtype`` (bfloat16), at ``--lengths`` tokens: full prefill, LazyLLM at
the paper's rule (``preset=default``) and at two of the library's presets, static pruning, a
prefix-cache hit (all but the last ``--hit-tail`` tokens cached, each timed run a fresh tail)
and kvp-prefix with zero-shot maps (no calibrated checkpoint travels; its maps have a
checkpoint's shapes, so its time and FLOPs are a calibrated one's). Each cell: one warm-up run
(excluded), then ``--repeats`` runs through :func:`fastprefill.engine.generate` (one new token),
whose TTFT is the engine's synchronised clock; the median, the speedup over full prefill's
median, the share of prompt token-layers computed and the method's FLOPs estimate
(:class:`~fastprefill.methods.base.ComputeStats`). ``max_position_embeddings`` is raised to fit
the longest length (rotary positions are computed, not tabled: the time is the same).

Results: ``<out>/gpu_check_<device>[_tiny].json`` (header: :func:`fastprefill.bench.records.environment`
with the GPU, driver, torch, CUDA and transformers versions; the exactness rows; the TTFT rows)
and the same as markdown tables in ``.md``. Exit status 1 when an exactness check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from fastprefill.batch import DecodeBatch
from fastprefill.bench.records import environment
from fastprefill.engine import Generation, generate
from fastprefill.host import DTYPES
from fastprefill.methods.base import Method
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.registry import make_method
from fastprefill.prefix_cache import PrefixCache
from fastprefill.sampling import SamplingParams
from reporting import write_json

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config}

#: The 7B shapes of the TTFT table (the fields of their public ``config.json``; no weights).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-2-7b": ("llama", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }),
    "qwen2.5-7b": ("qwen2", {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151643,
    }),
}
_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
         "tie_word_embeddings": True}
#: ``--tiny``: the same table on two 8-layer models of the tiny test size.
TINY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {"llama-tiny": ("llama", _TINY), "qwen2-tiny": ("qwen2", _TINY)}
#: The exactness checks' models: small, but with a 64-wide head (the GPU kernels' common case).
_EXACT = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
          "tie_word_embeddings": False}
EXACT_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {"llama-small": ("llama", _EXACT), "qwen2-small": ("qwen2", _EXACT)}
#: Tolerance of a check, relative to the reference's largest absolute first-token logit.
RTOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
NEW_TOKENS = 8


def build(shape: tuple[str, dict[str, Any]], device: str, dtype: torch.dtype, max_positions: int = 0,
          seed: int = 0) -> PreTrainedModel:
    """A random model of ``shape`` ``(family, config fields)``, initialised on ``device`` itself."""
    family, fields = shape
    fields = {**fields, "max_position_embeddings": max(fields["max_position_embeddings"], max_positions)}
    config = CONFIGS[family](**fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    """``(1, n)`` ids, seeded (on the CPU; the engine moves them to the model's device)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=gen)


# --------------------------------------------------------------------------- exactness
def _greedy(model: PreTrainedModel, ids: torch.Tensor, **kw: Any) -> tuple[list[int], list[float], torch.Tensor, int]:
    """Greedy tokens through the engine, the top-two margin of each step's logits, the first
    logits ``(V,)`` and the prompt tokens that came from a prefix cache."""
    res = generate(model, None, ids, FullPrefill(), NEW_TOKENS, stop_at_eos=False,
                   sampling=SamplingParams(logprobs=2), **kw)
    logprobs = res.answers[0].logprobs or []
    margins = [e.top[0][1] - e.top[1][1] for e in logprobs]
    assert res.first_logits is not None
    return res.token_ids, margins, res.first_logits, res.timing.cached_tokens


def _compare(name: str, ref_logits: torch.Tensor, got_logits: torch.Tensor | None, dtype: str,
             ref_tokens: Sequence[int] = (), margins: Sequence[float] = (), got_tokens: Sequence[int] = (),
             bitwise: bool = False, **extra: Any) -> dict[str, Any]:
    """One check's row: the logits' largest difference against the tolerance (``got_logits=None``:
    the tokens only), and the tokens."""
    scale = float(ref_logits.abs().max()) or 1.0
    diff = 0.0 if got_logits is None else float((got_logits.float() - ref_logits.float()).abs().max())
    tol = RTOL[dtype] * scale
    split = next((i for i, (a, b) in enumerate(zip(ref_tokens, got_tokens, strict=True)) if a != b), None)
    near_tie = split is not None and split < len(margins) and margins[split] <= tol
    logits_ok = diff == 0.0 if bitwise else diff <= tol
    return {"check": name, "dtype": dtype, "passed": bool(logits_ok and (split is None or near_tie)),
            "max_abs_logit_diff": None if got_logits is None else diff, "tolerance": 0.0 if bitwise else tol, "bitwise_equal": diff == 0.0,
            "tokens_equal": split is None, "first_token_split": split,
            "split_margin": None if split is None else margins[split] if split < len(margins) else None, **extra}


def check_prefix_hit(model: PreTrainedModel, ids: torch.Tensor, dtype: str) -> dict[str, Any]:
    cache = PrefixCache(1 << 30, block_tokens=16)
    generate(model, None, ids[:, : ids.shape[1] * 3 // 4], max_new_tokens=1, prefix_cache=cache)
    ref_tokens, margins, ref, _ = _greedy(model, ids)
    tokens, _, got, hit = _greedy(model, ids, prefix_cache=cache)
    row = _compare("prefix-hit", ref, got, dtype, ref_tokens, margins, tokens, cached_tokens=hit)
    row["passed"] = row["passed"] and hit > 0
    return row


def check_chunked(model: PreTrainedModel, ids: torch.Tensor, dtype: str) -> dict[str, Any]:
    chunk = max(1, ids.shape[1] // 3)
    ref_tokens, margins, ref, _ = _greedy(model, ids)
    gen = Generation(model, None, ids.to(model.device), FullPrefill(), NEW_TOKENS, stop_at_eos=False)
    list(gen.run(chunk))
    assert gen.first_logits is not None
    return _compare("chunked", ref, gen.first_logits, dtype, ref_tokens, margins, gen.choices[0].ids,
                    chunk=chunk, chunks=math.ceil(ids.shape[1] / chunk))


def check_paused(model: PreTrainedModel, ids: torch.Tensor, dtype: str) -> dict[str, Any]:
    from fastprefill.serve.pauses import LayerPauses  # imports the server's package (fastapi)

    ids = ids.to(model.device)
    alone = Generation(model, None, ids, FullPrefill(), 1, stop_at_eos=False)
    alone.prefill()
    other = prompt(40, model.config.vocab_size, 99)
    paused = Generation(model, None, ids, FullPrefill(), 1, stop_at_eos=False)
    pauses = LayerPauses(model, threading.Condition())
    between: list[list[int]] = []
    try:
        pauses.run(paused.prefill, lambda: True,
                   lambda: between.append(generate(model, None, other, FullPrefill(), 2, stop_at_eos=False).token_ids))
    finally:
        pauses.remove()
    assert alone.first_logits is not None and paused.first_logits is not None
    return _compare("paused", alone.first_logits, paused.first_logits, dtype, bitwise=True, pauses=len(between))


def check_decode_batch(model: PreTrainedModel, prompts: Sequence[torch.Tensor], dtype: str) -> dict[str, Any]:
    alone = [_greedy(model, ids) for ids in prompts]
    gens = [Generation(model, None, ids.to(model.device), FullPrefill(), NEW_TOKENS, stop_at_eos=False)
            for ids in prompts]
    for gen in gens:
        gen.prefill(None)
        gen.first_events()
    batch, widest = DecodeBatch(model, max_batch=len(gens)), 0
    while live := [g for g in gens if not g.finished]:
        batch.step(live)
        widest = max(widest, len(batch.members))
    rows = [_compare("decode-batch", a[2], None, dtype, a[0], a[1], g.choices[0].ids)
            for a, g in zip(alone, gens, strict=True)]
    worst = max(rows, key=lambda r: (not r["passed"], not r["tokens_equal"]))
    return {**worst, "passed": all(r["passed"] for r in rows), "rows": widest, "streams": len(gens)}


def check_persisted(model: PreTrainedModel, ids: torch.Tensor, dtype: str) -> dict[str, Any]:
    cache = PrefixCache(1 << 30, block_tokens=16)
    generate(model, None, ids, max_new_tokens=1, prefix_cache=cache)
    with torch.inference_mode():
        full = FullPrefill().prefill(model, ids.to(model.device)).logits
        before = FullPrefill().prefill(model, ids.to(model.device), cache.lookup(model, ids).cache).logits
    with tempfile.TemporaryDirectory() as tmp:
        cache.save(tmp)
        again = PrefixCache(1 << 30, block_tokens=16)
        loaded = again.load(tmp, model)
    with torch.inference_mode():
        hit = again.lookup(model, ids)
        after = FullPrefill().prefill(model, ids.to(model.device), hit.cache).logits
    row = _compare("persisted", before, after, dtype, bitwise=True, loaded_tokens=loaded)
    against_full = _compare("persisted", full, after, dtype)
    row["max_abs_logit_diff_vs_full"] = against_full["max_abs_logit_diff"]
    row["passed"] = row["passed"] and against_full["passed"] and loaded >= hit.tokens > 0
    return row


def check_layer_loop(model: PreTrainedModel, ids: torch.Tensor, dtype: str) -> dict[str, Any]:
    with torch.inference_mode():
        ref = FullPrefill().prefill(model, ids.to(model.device)).logits
        got = LazyLLM(preset="keep-all").prefill(model, ids.to(model.device)).logits
    return _compare("layer-loop", ref, got, dtype, bitwise=True)


def exactness(device: str, dtypes: Sequence[str], progress: Callable[[str], None], tokens: int = 300,
              ) -> list[dict[str, Any]]:
    """Every check on both small models in every dtype, on ``tokens``-token prompts: one row each."""
    rows = []
    for dtype in dtypes:
        for name, shape in EXACT_SHAPES.items():
            model = build(shape, device, DTYPES[dtype])  # type: ignore[arg-type]
            vocab = model.config.vocab_size
            ids = prompt(tokens, vocab, 1)
            batch = [prompt(n, vocab, 10 + n) for n in (tokens // 8, tokens // 2, tokens)]
            for check, data in ((check_prefix_hit, ids), (check_chunked, ids), (check_paused, ids),
                                (check_decode_batch, batch), (check_persisted, ids), (check_layer_loop, ids)):
                try:
                    row = check(model, data, dtype)
                except ImportError as exc:  # only the paused check imports the server's package
                    row = {"check": "paused", "dtype": dtype, "passed": None, "skipped": f"{exc}"}
                rows.append({"model": name, **row})
                progress(f"{name} {dtype} {row['check']}: {'ok' if row['passed'] else row}")
            del model
            _free(device)
    return rows


# --------------------------------------------------------------------------- TTFT table
def table_methods(num_layers: int) -> list[tuple[str, str]]:
    """``(label, spec)`` of every row of the table; ``hit`` is full prefill over a cached prefix."""
    return [
        ("full prefill", "full"),
        ("LazyLLM, the paper's rule", "lazyllm:preset=default"),
        ("LazyLLM, preset cut30k20+snap", "lazyllm:preset=cut30k20+snap"),
        ("LazyLLM, preset late-quarter", "lazyllm:preset=late-quarter"),
        ("static pruning, keep 0.5", f"static:keep=0.5,select_layer={max(1, num_layers // 4)}"),
        ("prefix-cache hit", "hit"),
        ("kvp-prefix, zero-shot maps", f"kvp-prefix:layer={num_layers // 2}"),
    ]


def _time(model: PreTrainedModel, ids_for: Callable[[int], torch.Tensor], method: Method, runs: int,
          cache: PrefixCache | None) -> tuple[list[float], Any, int, float]:
    """``runs + 1`` generations of one token (the first excluded): their TTFTs, the last timing's
    stats, its cached tokens, and the peak device memory (GiB)."""
    times, timing = [], None
    if torch.cuda.is_available() and model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    for run in range(runs + 1):
        res = generate(model, None, ids_for(run), method, 1, stop_at_eos=False, prefix_cache=cache)
        timing = res.timing
        if run:
            times.append(timing.ttft_s)
    peak = torch.cuda.max_memory_allocated(model.device) / 2**30 if model.device.type == "cuda" else 0.0
    return times, timing, timing.cached_tokens, peak


@dataclass
class TablePlan:
    """How the TTFT table runs: timed runs per cell, the hit's uncached tail, the clock reading
    (``time.perf_counter``) after which the cells left are skipped, and the progress line."""

    repeats: int
    hit_tail: int
    deadline: float
    progress: Callable[[str], None]


def ttft_rows(model_name: str, model: PreTrainedModel, length: int, plan: TablePlan) -> list[dict[str, Any]]:
    """Every method's row at one prompt length."""
    vocab, layers = model.config.vocab_size, model.config.num_hidden_layers
    base = prompt(length, vocab, length)
    tail = min(plan.hit_tail, length - 1)
    rows: list[dict[str, Any]] = []
    for label, spec in table_methods(layers):
        hit = spec == "hit"

        def ids_for(run: int, hit: bool = hit) -> torch.Tensor:
            """The prompt of run ``run``: for the hit, the cached part and a fresh tail each run."""
            return torch.cat([base[:, : length - tail], prompt(tail, vocab, 1000 + run)], 1) if hit else base

        row: dict[str, Any] = {"model": model_name, "tokens": length, "method": label, "spec": "full" if hit else spec}
        cache = PrefixCache(1 << 40, block_tokens=16) if hit else None
        try:
            if time.perf_counter() > plan.deadline:
                raise TimeoutError("skipped: past --budget-s")
            if cache is not None:  # the cached part, stored once (untimed)
                generate(model, None, base[:, : length - tail], max_new_tokens=1, prefix_cache=cache)
            times, timing, cached, peak = _time(model, ids_for, FullPrefill() if hit else make_method(spec),
                                                plan.repeats, cache)
            stats = timing.stats
            row.update(ttft_median_s=statistics.median(times), ttft_s=times, cached_tokens=cached,
                       token_layer_fraction=stats.token_layers / stats.total_token_layers, flops=stats.flops,
                       peak_memory_gib=round(peak, 2), describe=timing.method)
        except torch.OutOfMemoryError as exc:
            row.update(error=f"out of memory: {str(exc).splitlines()[0]}")
        except TimeoutError as exc:
            row.update(error=str(exc))
        del cache
        _free(str(model.device))
        rows.append(row)
        plan.progress(f"{model_name} {length} {label}: {row.get('ttft_median_s', row.get('error'))}")
    full = next((r for r in rows if r["method"] == "full prefill" and "ttft_median_s" in r), None)
    for r in rows:
        if full is not None and "ttft_median_s" in r:
            r["speedup_vs_full"] = full["ttft_median_s"] / r["ttft_median_s"]
            r["flops_vs_full"] = r["flops"] / full["flops"]
    return rows


def ttft_table(device: str, shapes: dict[str, tuple[str, dict[str, Any]]], lengths: Sequence[int], dtype: str,
               plan: TablePlan, done: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every model's rows (each model built once, for all its lengths); ``done(rows so far)``
    after each model, so a run cut short keeps what it measured."""
    rows: list[dict[str, Any]] = []
    for name, shape in shapes.items():
        started = time.perf_counter()
        model = build(shape, device, DTYPES[dtype], max_positions=max(lengths) + 64)  # type: ignore[arg-type]
        plan.progress(f"{name}: built on {device} in {time.perf_counter() - started:.0f} s")
        for length in lengths:
            rows += ttft_rows(name, model, length, plan)
        del model
        _free(device)
        done(rows)
    return rows


def _free(device: str) -> None:
    """Return a finished cell's memory to the device (its caches and K/V are garbage now)."""
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- output
def device_slug(device: str) -> str:
    """``cpu``, or the GPU's name in lower case with dashes (``nvidia-h100-80gb-hbm3``)."""
    if not device.startswith("cuda"):
        return torch.device(device).type
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(torch.device(device)).lower()).strip("-")


def markdown(document: dict[str, Any]) -> str:
    """The header, the exactness rows and the TTFT table as markdown."""
    h = document["header"]
    acc = h.get("accelerator") or {}
    lines = ["# Device check", "",
             (f"device: {acc.get('gpu', h['device'])}; driver {acc.get('driver', '-')}; torch {h['torch']}; "
             f"CUDA {acc.get('cuda', '-')}; transformers {h['transformers']}; python {h['python']}; "
             f"table dtype {h['table_dtype']}; command `{h['command']}`"), "",
             "## Exactness", "", "| model | dtype | check | passed | max abs logit diff | tolerance | tokens equal |",
             "|---|---|---|---|---|---|---|"]
    for r in document["exactness"]:
        if r.get("skipped"):
            lines.append(f"| {r['model']} | {r['dtype']} | {r['check']} | skipped: {r['skipped']} | | | |")
            continue
        tokens = "yes" if r["tokens_equal"] else f"split at {r['first_token_split']} (margin {r['split_margin']})"
        diff = "tokens only" if r["max_abs_logit_diff"] is None else f"{r['max_abs_logit_diff']:.3g}"
        tol = "bitwise" if not r["tolerance"] else f"{r['tolerance']:.3g}"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['check']} | {'yes' if r['passed'] else 'NO'} | "
                     f"{diff} | {tol} | {tokens} |")
    lines += ["", f"## TTFT ({h['table_dtype']}, median of {h['repeats']} after one warm-up)", "",
              ("| model | tokens | method | median TTFT (s) | speedup vs full | token-layers computed | "
              "FLOPs (T) | FLOPs vs full | peak memory (GiB) |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in document["ttft"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['method']} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['tokens']} | {r['method']} | {r['ttft_median_s']:.4f} | "
                     f"{r['speedup_vs_full']:.2f}x | {r['token_layer_fraction']:.1%} | {r['flops'] / 1e12:.3g} | "
                     f"{r['flops_vs_full']:.2f} | {r['peak_memory_gib']} |")
    lines += ["", ("For comparison: LazyLLM reports a 2.34x TTFT speedup on Llama 2 7B (multi-document QA, "
              "an A100, its own weights); the rows above time random weights, so their speedups hold for the "
              "work done, not for answers' fidelity, which is measured on the CPU with real weights.")]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny 8-layer configs and short lengths (CI, CPU)")
    p.add_argument("--lengths", type=int, nargs="+", help="prompt lengths of the table (default 2048 8192 32768; "
                   "--tiny: 64 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell after one warm-up (default 3)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(RTOL),
                   help="dtypes of the exactness checks")
    p.add_argument("--table-dtype", default="bfloat16", choices=sorted(RTOL))
    p.add_argument("--models", nargs="+", help=f"models of the table (default all of {sorted(SHAPES)})")
    p.add_argument("--hit-tail", type=int, help="uncached tokens of a prefix-cache hit (default 256; --tiny: 16)")
    p.add_argument("--skip-table", action="store_true", help="the exactness checks only")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="cells of the table not started by this many seconds after the start are skipped and "
                        "recorded as such (default 420)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device (use --device cpu --tiny)")
    if not args.device.startswith(("cuda", "cpu")):
        p.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    unknown = set(args.models or ()) - set(shapes)
    if unknown:
        p.error(f"--models: unknown {sorted(unknown)}; choose from {sorted(shapes)}")
    args.shapes = {name: shapes[name] for name in (args.models or shapes)}
    args.lengths = args.lengths or ([64, 128] if args.tiny else [2048, 8192, 32768])
    args.hit_tail = args.hit_tail or (16 if args.tiny else 256)
    args.exact_tokens = 96 if args.tiny else 300
    if args.repeats < 1 or min(args.lengths) < 2 or args.hit_tail < 1 or args.budget_s < 0:
        p.error("--repeats and --hit-tail must be >= 1, every length >= 2 and --budget-s >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    dtype = DTYPES[args.table_dtype]
    assert dtype is not None
    header = {**environment(torch.get_num_threads(), dtype, device=args.device), "bench": "gpu-check", "tiny": args.tiny,
              "table_dtype": args.table_dtype, "exactness_dtypes": list(args.dtypes), "lengths": list(args.lengths),
              "repeats": args.repeats, "hit_tail": args.hit_tail, "budget_s": args.budget_s,
              "models": {k: v[1] for k, v in args.shapes.items()},
              "max_position_embeddings": f"raised to {max(args.lengths) + 64} where smaller (rotary computed, not tabled)"}
    stem = args.out / f"gpu_check_{device_slug(args.device)}{'_tiny' if args.tiny else ''}"

    def write(exact: list[dict[str, Any]], table: list[dict[str, Any]]) -> None:
        header["wall_s"] = round(time.perf_counter() - started, 1)
        document = {"header": header, "exactness": exact, "ttft": table}
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(stem.with_suffix(".json"), json.loads(json.dumps(document, default=str)))
        stem.with_suffix(".md").write_text(markdown(document))

    rows = exactness(args.device, args.dtypes, progress, args.exact_tokens)
    write(rows, [])
    if not args.skip_table:
        plan = TablePlan(args.repeats, args.hit_tail, started + args.budget_s, progress)
        write(rows, ttft_table(args.device, args.shapes, args.lengths, args.table_dtype, plan,
                               lambda table: write(rows, table)))
    failed = [r for r in rows if r["passed"] is False]
    progress(f"wrote {stem}.json and .md; {len(rows) - len(failed)} of {len(rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
