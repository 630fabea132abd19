"""How often a greedy answer depends on its decode batch or on the prefix cache, per dtype.

Each prompt of the task is answered greedily (full prefill, ``--max-new-tokens`` tokens, no stop
at the end-of-sequence token) three ways on the same model:

- **alone**: cold, decoded alone (``generate`` with a fresh, empty prefix cache, which stores the
  prompt's whole blocks after the answer);
- **hit**: the same prompt again over that cache: its cached blocks reused, only the suffix
  (fewer than ``--block-tokens`` tokens) prefilled over them, decoded alone;
- **batched**: the hit once more (the same prefill), decoded in one
  :class:`~fastprefill.batch.DecodeBatch` with the hits of the next ``--batch - 1`` prompts
  (every step a batch of ``--batch`` rows: equal budgets, no early stop).

So ``hit`` against ``alone`` is what the cache changes, and ``batched`` against ``hit`` what the
decode batch changes (the same prefill, only the decode step's company differs). ``--row-floor``
runs the model with :func:`fastprefill.models.row_floor.set_row_floor` (its packed products never
compute fewer rows than the floor); float32 is then loaded packed.

A row per prompt and dtype holds the three answers' token ids and the decode times; the summary
counts, per dtype, the answers that differ (and where they part), and the decode seconds per
token alone and per batched step (medians).

    python benchmarks/answer_variance.py --model qwen2.5-coder-0.5b --task multidoc-qa --length 768 --n 52

Writes ``benchmarks/results/answer_variance_<model>_<task>_<length>.jsonl`` (or ``<--name>``)
with a header, ``.summary.json`` and ``.md``; ``benchmarks/verify.py`` re-derives the last two
from the rows (:func:`summarize`, :func:`markdown`).
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

from fastprefill.batch import DecodeBatch
from fastprefill.bench.records import environment, read_rows, result_name
from fastprefill.data.tasks import TASKS, get_task
from fastprefill.engine import Generation, generate
from fastprefill.errors import ConfigError
from fastprefill.host import DTYPES, keep_freed_memory, set_threads
from fastprefill.methods.full import FullPrefill
from fastprefill.models import load as load_model
from fastprefill.models.row_floor import set_row_floor
from fastprefill.prefix_cache import PrefixCache

RESULTS = Path(__file__).resolve().parent / "results"
#: the three ways a prompt is answered; the first is the reference


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two answers differ (a length difference counts), ``None`` when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _alone_and_hit(model: Any, ids: torch.Tensor, budget: int, cache: PrefixCache) -> dict[str, Any]:
    cold = generate(model, None, ids, FullPrefill(), budget, stop_at_eos=False, prefix_cache=cache)
    hit = generate(model, None, ids, FullPrefill(), budget, stop_at_eos=False, prefix_cache=cache)
    if hit.timing.cached_tokens == 0:
        raise ConfigError(f"the second run of a {ids.shape[1]}-token prompt did not hit the prefix cache")
    return {"alone": cold.token_ids, "hit": hit.token_ids, "cached_tokens": hit.timing.cached_tokens,
            "alone_decode_s_per_token": cold.timing.decode_s_per_token}


def _batched(model: Any, prompts: Sequence[torch.Tensor], caches: Sequence[PrefixCache],
             budget: int) -> tuple[list[list[int]], float]:
    """Each prompt prefilled alone over its cache (a hit), then all decoded together; their
    answers and the seconds per batched step."""
    gens = [Generation(model, None, ids, FullPrefill(), budget, stop_at_eos=False, prefix_cache=cache)
            for ids, cache in zip(prompts, caches, strict=True)]
    for gen in gens:
        gen.prefill(None)
        gen.first_events()
    batch, steps, start = DecodeBatch(model, max_batch=len(gens)), 0, time.perf_counter()
    while live := [g for g in gens if not g.finished]:
        batch.step(live)
        if len(batch.members) != len(gens) and any(not g.finished for g in gens):
            raise ConfigError(f"a batched step ran {len(batch.members)} rows, not {len(gens)}")
        steps += 1
    return [g.choices[0].ids for g in gens], (time.perf_counter() - start) / max(steps, 1)


def measure(model: Any, samples: Sequence[Any], budget: int, batch: int, block_tokens: int,
            dtype: str, on_rows: Any = None) -> list[dict[str, Any]]:
    """One row per sample: its three answers (see the module docstring) and decode timings;
    ``on_rows(rows)`` is called with each group's rows as they are made."""
    rows: list[dict[str, Any]] = []
    for start in range(0, len(samples) - batch + 1, batch):
        group = samples[start:start + batch]
        prompts = [torch.tensor([s.input_ids], device=model.device) for s in group]
        # one fresh cache per prompt: no other prompt's blocks (the prompts share a template's start)
        caches = [PrefixCache(max_bytes=1 << 30, block_tokens=block_tokens) for _ in group]
        singles = [_alone_and_hit(model, ids, budget, cache) for ids, cache in zip(prompts, caches, strict=True)]
        together, step_s = _batched(model, prompts, caches, budget)
        made = [{"dtype": dtype, "sample_id": str(s.id), "prompt_tokens": int(ids.shape[1]), "group": start // batch,
                 **single, "batched": tokens, "batched_step_s": step_s}
                for s, ids, single, tokens in zip(group, prompts, singles, together, strict=True)]
        rows += made
        if on_rows is not None:
            on_rows(made)
        print(f"{dtype} {len(rows)}/{len(samples)}", flush=True)
    return rows


def summarize(header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per dtype: prompts, how many ``hit`` answers differ from ``alone`` and ``batched`` ones from
    ``hit`` (count, share, how many at the first token, the median index of the first differing
    token), and the decode seconds per token alone and per batched step (medians)."""
    out: dict[str, Any] = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        entry: dict[str, Any] = {"prompts": len(mine),
                                 "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in mine),
                                 "cached_tokens_median": statistics.median(r["cached_tokens"] for r in mine)}
        for way, ref in (("hit", "alone"), ("batched", "hit")):
            where = [first_difference(r[ref], r[way]) for r in mine]
            parted = [w for w in where if w is not None]
            entry[way] = {"differ": len(parted), "share": len(parted) / len(mine),
                          "first_token_differs": sum(w == 0 for w in parted),
                          "median_first_difference": statistics.median(parted) if parted else None}
        entry["alone_decode_s_per_token"] = statistics.median(r["alone_decode_s_per_token"] for r in mine)
        entry["batched_step_s"] = statistics.median(r["batched_step_s"] for r in mine)
        entry["batched_tokens_per_s_over_alone"] = (header["batch"] / entry["batched_step_s"]) / (
            1.0 / entry["alone_decode_s_per_token"])
        out[dtype] = entry
    return out


def markdown(summary: Mapping[str, Any], header: Mapping[str, Any]) -> str:
    """The summary as a table, one row per dtype."""
    lines = [(f"Greedy answers of {header['model']} on {header['task']} (prompts of at most {header['length']} tokens, "
              f"{header['max_new_tokens']} new tokens, {header['threads']} thread(s)). Hit: the prompt again over the "
              f"prefix cache ({header['block_tokens']}-token blocks), against its cold answer. Batched: the hit decoded "
              f"in a batch of {header['batch']} prompts, against the hit decoded alone. "
              f"Row floor: {header.get('row_floor') or 'off'}."),
             "",
             ("| dtype | prompts | hit differs | hit, first token differs | batched differs | "
             "batched, median first differing token | decode s/token alone | batched step s | "
             "batched tokens/s over alone |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for dtype, e in summary.items():
        hit, bat = e["hit"], e["batched"]
        where = "-" if bat["median_first_difference"] is None else f"{bat['median_first_difference']:.1f}"
        lines.append(f"| {dtype} | {e['prompts']} | {hit['differ']} ({100 * hit['share']:.0f}%) | "
                     f"{hit['first_token_differs']} | {bat['differ']} ({100 * bat['share']:.0f}%) | {where} | "
                     f"{e['alone_decode_s_per_token']:.4f} | {e['batched_step_s']:.4f} | "
                     f"{e['batched_tokens_per_s_over_alone']:.2f}x |")
    return "\n".join(lines) + "\n"


def write_summary(path: Path) -> dict[str, Any]:
    """The ``.summary.json`` and ``.md`` beside the rows file ``path``, made from its rows."""
    header, rows = read_rows(path)
    summary = summarize(header, rows)
    stem = path.name.removesuffix(".jsonl")
    path.with_name(f"{stem}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    path.with_name(f"{stem}.md").write_text(markdown(summary, header))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--task", default="multidoc-qa", choices=list(TASKS))
    p.add_argument("--length", type=int, default=768, help="prompt tokens")
    p.add_argument("--n", type=int, default=52, help="prompts (a multiple of --batch; the rest are dropped)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated, each from: " + ", ".join(DTYPES))
    p.add_argument("--batch", type=int, default=4, help="rows of the decode batch (>= 2)")
    p.add_argument("--block-tokens", type=int, default=16, help="the prefix cache's block size")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--split", default="test", choices=["dev", "test"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--row-floor", default=None,
                   help="pad every packed product to at least this many rows (an integer, or 'auto'; "
                        "fastprefill.models.row_floor.set_row_floor); float32 is then loaded packed")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default=None,
                   help="result file stem (default answer_variance_<model>_<task>_<length>[_floor])")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"error: unknown dtype {bad[0]!r}; choose from {', '.join(DTYPES)}")
    if args.batch < 2 or args.n < args.batch or args.max_new_tokens < 2:
        raise SystemExit("error: need --batch >= 2, --n >= --batch and --max-new-tokens >= 2")
    floor = args.row_floor
    if floor is not None and floor != "auto":
        if not floor.isdigit() or int(floor) < 1:
            raise SystemExit(f"error: --row-floor must be an integer >= 1 or 'auto', got {floor!r}")
        floor = int(floor)

    set_threads(args.threads)
    keep_freed_memory()
    default = f"answer_variance_{args.model}_{args.task}_{args.length}" + ("_floor" if floor is not None else "")
    stem = result_name(args.out, default, name=args.name)
    path = Path(args.out) / f"{stem}.jsonl"
    header: dict[str, Any] | None = None
    floors: dict[str, int | None] = {}
    for dtype in dtypes:
        model, tok = load_model(args.model, dtype=dtype, pack=True if floor is not None else None)
        floors[dtype] = set_row_floor(model, floor) if floor is not None else None
        samples = get_task(args.task).build(tok, args.length, args.n, split=args.split, seed=args.seed)
        if header is None:
            header = {"bench": "answer_variance", "model": args.model, "task": args.task, "length": args.length,
                      "n": args.n, "split": args.split, "seed": args.seed, "batch": args.batch,
                      "block_tokens": args.block_tokens, "max_new_tokens": args.max_new_tokens,
                      "dtypes": dtypes, "row_floor": floor, **environment(args.threads, model)}
            header.pop("dtype", None)  # the rows name theirs
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"header": header}) + "\n")

        def append(made: list[dict[str, Any]], floor_set: int | None = floors[dtype]) -> None:
            with path.open("a") as f:  # each group's rows at once: a run cut short keeps what it made
                f.writelines(json.dumps({**r, "row_floor": floor_set}) + "\n" for r in made)

        measure(model, samples, args.max_new_tokens, args.batch, args.block_tokens, dtype, append)
        del model
    print(markdown(write_summary(path), header or {}))


if __name__ == "__main__":
    main()
