"""A prefix-cache hit with its storage reused (:data:`fastprefill.cache.dynamic.HIT_STORAGE`, the
library's default) against a new tensor for every hit (``PrefixCache.hit_storage = None``), in one
process, timed interleaved.

Each round and mode: a new :class:`fastprefill.PrefixCache`, a cold prompt (a random ``T``-token
document and a 16-token question, untimed: it stores the document and leaves the heap as a request
leaves it), then the follow-up (the same document, another 18-token question), timed:
``fastprefill.engine.generate(..., max_new_tokens=1, prefix_cache=cache)``. Per hit the wall time, the
prefix lookup's seconds (which copy the blocks into the hit's storage) and the page faults of the
lookup and of the whole call (``getrusage`` minor faults). Per cell the medians and the median of the per-round paired ratios
``fresh / pool`` with their range; the first token of both modes is compared.

    python benchmarks/hit_storage.py --model qwen2.5-coder-0.5b qwen2.5-coder-1.5b --lengths 2048 4096
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import torch

from fastprefill import PrefixCache
from fastprefill.bench.records import environment
from fastprefill.cache.dynamic import HIT_STORAGE
from fastprefill.engine import generate
from fastprefill.host import DTYPES
from fastprefill.models import load as load_model
from packed_bench import RESULTS, machine, run_all

MODES = ("pool", "fresh")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _hit(model: Any, tok: Any, first: torch.Tensor, followup: torch.Tensor, mode: str) -> dict[str, Any]:
    """One round of one mode: a cold prompt stored, then the follow-up timed (and the page faults
    of its prefix lookup counted apart)."""
    cache = PrefixCache(4 << 30, block_tokens=16)
    cache.hit_storage = HIT_STORAGE if mode == "pool" else None
    generate(model, tok, first, None, max_new_tokens=1, prefix_cache=cache)
    lookup, counted = cache.lookup, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        f0 = _faults()
        out = lookup(*args, **kwargs)
        counted.append(_faults() - f0)
        return out

    cache.lookup = counting  # type: ignore[method-assign]
    f0, t0 = _faults(), time.perf_counter()
    res = generate(model, tok, followup, None, max_new_tokens=1, prefix_cache=cache)
    seconds, faults = time.perf_counter() - t0, _faults() - f0
    return {"seconds": seconds, "lookup_s": res.timing.prefix_lookup_s, "faults": faults,
            "lookup_faults": sum(counted), "cached_tokens": res.timing.cached_tokens, "token": int(res.token_ids[0])}


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, tok = load_model(name, dtype=args.dtype, progress=False)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        doc = torch.randint(100, 20000, (1, length), generator=gen)
        first = torch.cat([doc, torch.randint(100, 20000, (1, 16), generator=gen)], dim=1)
        followup = torch.cat([doc, torch.randint(100, 20000, (1, 18), generator=gen)], dim=1)
        for mode in MODES:  # warm-up: kernels, allocators and the pool at this length
            _hit(model, tok, first, followup, mode)
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                rows.append({"length": length, "round": r, "mode": mode, **_hit(model, tok, first, followup, mode)})
        print(f"{name} {length}: {_cell(rows, length)}", flush=True)
    return {"bench": "hit-storage", "model": name, "rounds": args.rounds, "keep": HIT_STORAGE.keep, "rows": rows,
            "environment": environment(args.threads, model)}


def _cell(rows: list[dict[str, Any]], length: int) -> dict[str, Any]:
    """Per mode the medians (hit ms, lookup ms, faults); the paired ratio ``fresh / pool`` of the hit."""
    pick = sorted((r for r in rows if r["length"] == length), key=lambda r: r["round"])
    by = {m: [r for r in pick if r["mode"] == m] for m in MODES}
    ratios = [f["seconds"] / p["seconds"] for p, f in zip(by["pool"], by["fresh"], strict=True)]
    out: dict[str, Any] = {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios),
                           "same": all(r["token"] == pick[0]["token"] for r in pick),
                           "cached": pick[0]["cached_tokens"]}
    for m, rs in by.items():
        out[f"{m}_ms"] = 1e3 * statistics.median(r["seconds"] for r in rs)
        out[f"{m}_lookup_ms"] = 1e3 * statistics.median(r["lookup_s"] for r in rs)
        out[f"{m}_lookup_max_ms"] = 1e3 * max(r["lookup_s"] for r in rs)
        out[f"{m}_faults"] = statistics.median(r["faults"] for r in rs)
        out[f"{m}_lookup_faults"] = statistics.median(r["lookup_faults"] for r in rs)
    return out


def markdown(result: dict[str, Any]) -> str:
    env, rows = result["environment"], result["rows"]
    lines = [f"# A prefix-cache hit's storage, reused or new: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}. {result['rounds']} rounds, the modes alternating; each hit follows a cold prompt "
              f"over the same document in a new prefix cache. `pool`: the hit's storage comes from the library's pool "
              f"(keeps {result['keep']}); `fresh`: a new tensor per hit (`PrefixCache.hit_storage = None`). Faults: "
              f"minor page faults, of the prefix lookup and of the whole hit (medians)."), "",
             ("| T | cached | pool ms | fresh ms | fresh / pool (paired median) | range | rounds | pool lookup ms | "
              "fresh lookup ms | pool lookup max ms | fresh lookup max ms | pool lookup faults | fresh lookup faults | "
              "pool faults | fresh faults | same token |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for length in sorted({r["length"] for r in rows}):
        c = _cell(rows, length)
        lines.append(f"| {length} | {c['cached']} | {c['pool_ms']:.1f} | {c['fresh_ms']:.1f} | {c['ratio']:.2f} | "
                     f"[{c['min']:.2f}, {c['max']:.2f}] | {c['n']} | {c['pool_lookup_ms']:.1f} | "
                     f"{c['fresh_lookup_ms']:.1f} | {c['pool_lookup_max_ms']:.1f} | {c['fresh_lookup_max_ms']:.1f} | "
                     f"{c['pool_lookup_faults']:.0f} | {c['fresh_lookup_faults']:.0f} | {c['pool_faults']:.0f} | {c['fresh_faults']:.0f} | {'yes' if c['same'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.rounds, *args.lengths) < 1:
        p.error("--rounds and every length must be >= 1")
    run_all(args, "hit_storage", run_model, markdown)


if __name__ == "__main__":
    main()
