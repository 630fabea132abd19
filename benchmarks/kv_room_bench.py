"""What K/V storage with room (``fastprefill.cache.RoomyLayer``) changes on a prefix-cache hit
and on decoding: one model, one process, the two ways alternated on the same prompts.

For each cached length ``P`` a random prompt of ``P + --suffix`` tokens has its first ``P``
tokens in a :class:`~fastprefill.prefix_cache.PrefixCache`; then, timed:

- **hit**: the lookup (the cached blocks copied out), the suffix's forward over them and the
  first token (a hit's TTFT);
- **decode**: the mean of ``--steps`` single-token steps after it.

``room``: the lookup's cache as the library builds it (the blocks copied once into storage with
room; the suffix and each step written in place). ``concat``: the same lookup, then its layers
handed to transformers' own ``DynamicLayer`` (as before storage with room), so the suffix and every
step concatenate onto the whole cache. Reported: medians, ``concat / room`` and whether the tokens agree.

    python benchmarks/kv_room_bench.py --model qwen2.5-coder-1.5b qwen2.5-coder-0.5b --lengths 2048 4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.cache import layer_kv, wrap_dynamic_cache
from fastprefill.models import load as load_model
from fastprefill.models.attention import MASK_MEMO_KWARG, fastprefill_attention
from fastprefill.prefix_cache import PrefixCache
from packed_bench import machine, parser, run_all

WAYS = ("room", "concat")


def _run(model: Any, pc: PrefixCache, ids: torch.Tensor, way: str, steps: int) -> tuple[float, float, list[int]]:
    """Seconds of the hit, seconds per decode step, and the greedy tokens, for one way."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        hit = pc.lookup(model, ids)
        cache = hit.cache
        if way == "concat":
            cache = wrap_dynamic_cache(model.config, [layer_kv(cache, i) for i in range(len(cache.layers))])
        with fastprefill_attention(model):
            out = model(input_ids=ids[:, hit.tokens:], past_key_values=cache, use_cache=True, logits_to_keep=1,
                        **{MASK_MEMO_KWARG: {}})
        tokens = [int(out.logits[0, -1].argmax())]
        t1 = time.perf_counter()
        for pos in range(ids.shape[1], ids.shape[1] + steps):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos]]), use_cache=True, logits_to_keep=1)
            tokens.append(int(out.logits[0, -1].argmax()))
        t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / max(steps, 1), tokens


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    rows = []
    for length in args.lengths:
        ids = torch.randint(100, 20000, (1, length + args.suffix), generator=torch.Generator().manual_seed(length))
        pc = PrefixCache(max_bytes=1 << 34)
        with torch.inference_mode():
            pc.store(model, ids[0, :length].tolist(), model(input_ids=ids[:, :length], use_cache=True).past_key_values,
                     length)
        for way in WAYS:
            _run(model, pc, ids, way, args.steps)  # warm-up
        hit: dict[str, list[float]] = {w: [] for w in WAYS}
        step: dict[str, list[float]] = {w: [] for w in WAYS}
        tokens: dict[str, list[int]] = {}
        for r in range(args.repeats):
            for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                h, s, tokens[way] = _run(model, pc, ids, way, args.steps)
                hit[way].append(h)
                step[way].append(s)
        med = {w: {"hit": statistics.median(hit[w]), "decode": statistics.median(step[w])} for w in WAYS}
        rows.append({"cached": length, "hit_s": hit, "decode_s_per_step": step, "medians": med,
                     "concat_over_room": {k: med["concat"][k] / med["room"][k] for k in ("hit", "decode")},
                     "same_tokens": tokens["room"] == tokens["concat"]})
        print(f"{name} P={length}: hit {med['room']['hit'] * 1000:.1f} ms room / {med['concat']['hit'] * 1000:.1f} "
              f"concat; decode {med['room']['decode'] * 1000:.1f} / {med['concat']['decode'] * 1000:.1f} ms per step",
              flush=True)
    return {"model": name, "suffix": args.suffix, "steps": args.steps, "repeats": args.repeats, "rows": rows,
            "environment": environment(args.threads, model)}


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# K/V storage with room against concatenation: {result['model']}, {env['dtype']}", "",
             (f"{machine(env)}, linear weights packed: {env['packed']}. Medians of "
              f"{result['repeats']} runs each, the two ways alternating; hit: lookup, the last {result['suffix']} "
              f"tokens' forward and the first token; decode: mean of {result['steps']} steps after it."), "",
             ("| cached tokens | hit room (ms) | hit concat (ms) | concat / room | decode room (ms/step) | "
              "decode concat (ms/step) | concat / room | same tokens |"), "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m, q = r["medians"], r["concat_over_room"]
        lines.append(f"| {r['cached']} | {m['room']['hit'] * 1000:.1f} | {m['concat']['hit'] * 1000:.1f} | "
                     f"{q['hit']:.2f} | {m['room']['decode'] * 1000:.1f} | {m['concat']['decode'] * 1000:.1f} | "
                     f"{q['decode']:.2f} | {'yes' if r['same_tokens'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, repeats=7)
    p.set_defaults(model=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    p.add_argument("--steps", type=int, default=8, help="decode steps timed after each hit")
    args = p.parse_args(argv)
    if min(args.lengths) < 16 or args.suffix < 1 or args.repeats < 1 or args.steps < 0:
        p.error("lengths (cached tokens) >= 16, one block; --suffix >= 1, --repeats >= 1, --steps >= 0")
    run_all(args, "kv_room", run_model, markdown)


if __name__ == "__main__":
    main()
