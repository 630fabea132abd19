"""A decode step beside another process that takes the host's memory, with the model's weights
locked in memory (``fastprefill serve --mlock``: :func:`fastprefill.host.lock_in_memory`) and
without, in one process, interleaved; and what locking costs the host.

A float32 zoo model's weights are pages of its mapped checkpoint (page cache): when another
process needs the memory, the kernel drops them and reads them from disk again at their next
use. Each round times ``--steps`` one-token decode steps over a ``--length``-token prompt's cache
(the cache cropped back after each, so every step is the same) in three settings:

- ``idle``: nothing else running, weights not locked;
- ``pressure``: a second process holding all but ``--margin-gib`` of ``MemAvailable``, weights
  not locked;
- ``pressure, locked``: the same, after the weights were locked (its ``MemAvailable`` is read
  after the lock, so it takes what the host has left).

Per setting the median step, its paired ratio over ``idle`` with the range, and the greedy token;
beside them ``MemAvailable`` before and after the lock, ``VmLck`` and the bytes locked.

    python benchmarks/locked_weights.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fastprefill.bench.records import environment
from fastprefill.host import lock_in_memory
from fastprefill.models import load as load_model
from packed_bench import machine, parser, run_all
from reporting import paired_ratios

SETTINGS = ("idle", "pressure", "pressure, locked")
#: The second process: takes argv[1] bytes, writes every page, says so, holds them until stdin closes.
HOG = ("import sys; n = int(sys.argv[1]); b = bytearray(n); b[::4096] = b'\\x01' * len(range(0, n, 4096)); "
       "print('ready', flush=True); sys.stdin.read()")


def meminfo_gib(key: str) -> float:
    """A ``/proc/meminfo`` (``MemAvailable``) or ``/proc/self/status`` (``VmLck``, ``RssAnon``) value in GiB."""
    source = "/proc/self/status" if key.startswith(("Vm", "Rss")) else "/proc/meminfo"
    line = next(ln for ln in Path(source).read_text().splitlines() if ln.startswith(key + ":"))
    return int(line.split()[1]) / (1 << 20)


def _hog(margin_gib: float) -> tuple[subprocess.Popen, float]:
    take = max(0.0, meminfo_gib("MemAvailable") - margin_gib)
    proc = subprocess.Popen([sys.executable, "-c", HOG, str(int(take * (1 << 30)))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout is None or proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit(f"the memory-taking process did not start (asked for {take:.1f} GiB)")
    return proc, take


def _steps(model: Any, cache: Any, nxt: torch.Tensor, length: int, steps: int) -> tuple[float, int]:
    """The median of ``steps`` one-token decode steps on ``cache`` (cropped back to ``length`` after each)."""
    seconds, token = [], -1
    with torch.inference_mode():
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            seconds.append(time.perf_counter() - t0)
            token = int(out.logits[0, -1].argmax())
            cache.crop(-1)  # back to the prompt's cache (transformers crops by a negative count)
    return statistics.median(seconds), token


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(name, dtype=args.dtype, progress=False)
    ids = torch.randint(100, 20000, (1, args.length), generator=torch.Generator().manual_seed(args.length))
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    weights = [*model.parameters(), *model.buffers()]
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    tokens: dict[str, int] = {}
    memory: list[dict[str, float]] = []
    for _ in range(args.rounds):
        for setting in SETTINGS:
            anon = meminfo_gib("RssAnon")
            locked = lock_in_memory(weights) if setting.endswith("locked") else None
            hog, took = _hog(args.margin_gib) if setting != "idle" else (None, 0.0)
            try:
                if locked is not None:
                    memory.append({"locked_gib": locked.bytes / (1 << 30), "vmlck_gib": meminfo_gib("VmLck"),
                                   "own_added_gib": meminfo_gib("RssAnon") - anon, "hog_gib": took})
                seconds, tokens[setting] = _steps(model, cache, nxt, args.length, args.steps)
                times[setting].append(seconds)
            finally:
                if hog is not None:
                    hog.communicate("")
                if locked is not None:
                    locked.unlock()
            print(f"{name} {setting}: {seconds * 1000:.1f} ms a step", flush=True)
    avail = {"before": meminfo_gib("MemAvailable")}
    locked = lock_in_memory(weights)
    avail["locked"] = meminfo_gib("MemAvailable")
    locked.unlock()
    paired = {s: paired_ratios(times[s], times["idle"]) for s in SETTINGS}
    return {"model": name, "length": args.length, "steps": args.steps, "rounds": args.rounds,
            "margin_gib": args.margin_gib, "times": times, "tokens": tokens, "memory": memory,
            "mem_available_gib": avail,
            "medians": {s: statistics.median(t) for s, t in times.items()},
            "paired": {s: [p["ratio"], p["min"], p["max"]] for s, p in paired.items()},
            "environment": environment(args.threads, model)}


def markdown(result: dict[str, Any]) -> str:
    env, mem, avail = result["environment"], result["memory"], result["mem_available_gib"]
    title = f"# A decode step beside a process that takes the memory, weights locked or not: {result['model']}, {env['dtype']}"
    lines = [title, "",
             (f"{machine(env)}. One process; per round and setting the median of {result['steps']} one-token decode "
              f"steps over a {result['length']}-token prompt's cache; {result['rounds']} rounds, the settings in "
              f"turn. Pressure: a second process holding all but {result['margin_gib']:g} GiB of MemAvailable. "
              "Paired: per round, the setting's step over idle's, median [min, max]."), "",
             "| setting | step (ms, median) | / idle (paired median) | range | next token | rounds |",
             "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        ratio, lo, hi = result["paired"][s]
        lines.append(f"| {s} | {result['medians'][s] * 1000:.1f} | {ratio:.2f} | [{lo:.2f}, {hi:.2f}] "
                     f"| {result['tokens'][s]} | {len(result['times'][s])} |")
    med = {k: statistics.median(m[k] for m in mem) for k in ("locked_gib", "vmlck_gib", "own_added_gib", "hog_gib")}
    lines += ["", ("| locked (GiB) | VmLck (GiB) | own memory the lock added (RssAnon, GiB) "
                   "| MemAvailable before the lock (GiB) | after (GiB) "
                   "| taken by the other process, locked rounds (GiB, median) |"), "|---|---|---|---|---|---|",
              (f"| {med['locked_gib']:.2f} | {med['vmlck_gib']:.2f} | {med['own_added_gib']:.2f} | {avail['before']:.2f} "
               f"| {avail['locked']:.2f} | {med['hog_gib']:.2f} |")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, repeats=1)
    p.add_argument("--length", type=int, default=512, help="prompt tokens whose cache the steps decode over")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per round and setting")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--margin-gib", type=float, default=1.0, help="memory the other process leaves the host")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.length < 1 or args.margin_gib < 0.5:
        p.error("--rounds, --steps and --length take at least 1, --margin-gib at least 0.5")
    run_all(args, "locked_weights", run_model, markdown,
            stem=lambda name, result: f"locked_weights_{name}_{result['environment']['dtype']}")


if __name__ == "__main__":
    main()
