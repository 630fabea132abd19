"""The protocol every anchor runner shares (standard library only: it runs in each peer's venv).

A runner defines a :class:`System` (how to load, how to clear the prefix cache, how to generate
one token from token ids, what the system itself reports) and calls :func:`main`. The protocol,
the timing and the output format live here, so every system is measured the same way:

- the prompt set (``prompts.py``) holds pre-tokenized pairs (first, follow-up) that share a
  document as their prefix; groups by target length, each with one warm-up pair;
- per length: the warm-up pair once, untimed (a document that no measured pair uses);
- then ``--repeats`` times, for each pair: ``reset()`` (cold prefix cache), then the first
  prompt (kind ``cold``), then the follow-up (kind ``hit``: its document is cached now);
- TTFT (``ttft_s``) is the wall-clock time of one call that generates one token, greedily, from
  token ids already in the system's own input form (``time.perf_counter`` around the call and
  nothing else); ``own_ttft_s`` is what the system itself reports, where it reports something;
- a decode step (kind ``decode``, with ``--decode-tokens D`` > 0, for a system that defines
  :meth:`System.generate_n`): after the hit, the follow-up twice more on the same cache, once
  for one token and once for ``1 + D`` tokens (greedy, end-of-sequence ignored); ``step_s`` is
  the difference of the two wall times over ``D``: one decode step at the follow-up's length,
  with every per-call cost (the prompt, now all cached, and the hand-over) cancelled out.
  ``own_step_s`` is the system's own per-token figure where it reports one; ``tokens`` the
  ``1 + D`` ids.

With ``--serve`` the process stays up across rounds (``rounds.py``, ``run_all.sh`` with
``PERSISTENT=1``): it loads and runs every length's warm-up once, then runs the timed pairs once
per line it reads on stdin (``{"round": r, "out": path}``), each into its own file with its own
header, and answers each with a line ``{"done": path}`` on stdout (the console output goes to
stderr then). The timed calls are the same; what changes is that a round's process was warmed up
once, when it started, not at the start of that round.

Output JSONL: a header line (``{"type": "header", ...}``) then one line per timed run
(``{"type": "run", ...}``), flushed as each run ends.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["System", "main", "model_name_of", "read_prompts"]


class System:
    """One peer runtime. Subclasses set ``name`` and override the methods."""

    name = "?"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    # --- what the header says -------------------------------------------------------------
    def versions(self) -> dict[str, str]:
        """Package versions that matter (the first one is the system's own version)."""
        return {}

    def config(self) -> dict[str, Any]:
        """Settings that shape the measurement (dtype, cache settings, batch sizes...)."""
        return {}

    @property
    def dtype(self) -> str:
        return str(getattr(self.args, "dtype", ""))

    # --- the protocol -----------------------------------------------------------------------
    def load(self, max_prompt_tokens: int) -> None:
        """Load the model, ready to take prompts of up to ``max_prompt_tokens`` tokens."""
        raise NotImplementedError

    def reset(self) -> None:
        """Make the next request a cold one: nothing of earlier prompts is cached."""
        raise NotImplementedError

    def prepare(self, ids: list[int]) -> Any:
        """Turn token ids into the system's own input object (outside the timed window)."""
        return ids

    def generate_one(self, prepared: Any) -> Any:
        """The timed call: generate one token greedily; return the system's raw output."""
        raise NotImplementedError

    def generate_n(self, prepared: Any, n: int) -> Any:
        """Generate exactly ``n`` tokens greedily (end-of-sequence ignored); the raw output.
        A system that does not define it has no decode-step runs."""
        raise NotImplementedError

    def inspect_n(self, raw: Any) -> dict[str, Any]:
        """After :meth:`generate_n`: ``tokens`` (list of int) and, where known, ``own_step_s``
        (the system's own seconds per token after the first)."""
        raise NotImplementedError

    def inspect(self, raw: Any, ids: list[int]) -> dict[str, Any]:
        """After the timed call: ``first_token`` (int), and where known ``own_ttft_s`` and
        ``cached_tokens``, plus any system-specific ``extra`` dict."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def read_prompts(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the prompt pairs of a ``prompts.py`` file."""
    header: dict[str, Any] = {}
    pairs: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line)
            if item.get("type") == "header":
                header = item
            elif item.get("type") == "prompt":
                pairs.append(item)
    if not pairs:
        raise SystemExit(f"{path}: no prompts (make them with prompts.py)")
    return header, pairs


def model_name_of(model_dir: str | os.PathLike[str]) -> str:
    """The zoo name of a prepared fastprefill folder (its manifest), else the folder's name."""
    folder = Path(model_dir).expanduser()
    try:
        return str(json.loads((folder / "fastprefill.json").read_text())["name"])
    except (OSError, ValueError, KeyError):
        return folder.resolve().name


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-dir", required=True,
                   help="the prepared Hugging Face folder (~/.cache/fastprefill/models/<name>)")
    p.add_argument("--prompts", required=True, help="JSONL written by prompts.py for this model")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="times each pair is measured (default 3)")
    p.add_argument("--out", default=None, help="JSONL to write (header + one line per run; required without --serve)")
    p.add_argument("--lengths", type=int, nargs="*", default=None,
                   help="only these target lengths of the prompt set (default: all)")
    p.add_argument("--limit", type=int, default=None, help="only the first N pairs per length")
    p.add_argument("--name", default=None,
                   help="the system's name in the records (default: the runner's; e.g. a fastprefill method's row)")
    p.add_argument("--decode-tokens", type=int, default=32,
                   help="decode steps timed after each hit (0: none; default 32)")
    p.add_argument("--serve", action="store_true",
                   help="stay up across rounds: warm up once, then one round per stdin line (see the module docstring)")
    return p


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _bf16_units() -> str:
    """The CPU's bfloat16 matrix units from ``/proc/cpuinfo``'s flags: ``amx_bf16``, ``avx512_bf16``,
    ``none``, or ``unknown`` where the flags cannot be read (the same names as ``fastprefill.host``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return "amx_bf16" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "none"
    except OSError:
        pass
    return "unknown"


def _group(pairs: list[dict[str, Any]], args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    groups: dict[int, dict[str, Any]] = {}
    for p in pairs:
        g = groups.setdefault(int(p["length"]), {"warmup": None, "pairs": []})
        if p["role"] == "warmup":
            g["warmup"] = p
        else:
            g["pairs"].append(p)
    if args.lengths:
        missing = sorted(set(args.lengths) - set(groups))
        if missing:
            raise SystemExit(f"lengths {missing} are not in the prompt set (it has {sorted(groups)})")
        groups = {k: v for k, v in groups.items() if k in args.lengths}
    for length, g in groups.items():
        if args.limit is not None:
            g["pairs"] = g["pairs"][: args.limit]
        if g["warmup"] is None:
            raise SystemExit(f"length {length}: the prompt set has no warm-up pair")
    return dict(sorted(groups.items()))


def _clocked(call: Callable[[], Any]) -> tuple[float, Any]:
    """The wall-clock seconds of ``call()`` (``time.perf_counter`` around it and nothing else, the
    garbage collector paused so that no collection lands inside) and what it returned."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        raw = call()
        return time.perf_counter() - start, raw
    finally:
        gc.enable()


def _timed(system: System, ids: list[int]) -> tuple[float, dict[str, Any]]:
    prepared = system.prepare(ids)
    wall, raw = _clocked(lambda: system.generate_one(prepared))
    return wall, system.inspect(raw, ids)


def _decode_step(system: System, ids: list[int], steps: int) -> dict[str, Any]:
    """One decode-step measurement on a prompt whose K/V the system holds (see the module
    docstring): the ``step_s``, ``own_step_s`` and ``tokens`` of a ``decode`` run."""
    walls = []
    for n in (1, 1 + steps):
        prepared = system.prepare(ids)
        wall, raw = _clocked(lambda: system.generate_n(prepared, n))  # noqa: B023 (called at once)
        walls.append(wall)
    info = system.inspect_n(raw)
    if len(info["tokens"]) != 1 + steps:
        raise RuntimeError(f"{system.name} generated {len(info['tokens'])} tokens, asked for {1 + steps}")
    return {"step_s": (walls[1] - walls[0]) / steps, "own_step_s": info.get("own_step_s"),
            "tokens": [int(t) for t in info["tokens"]], "one_token_s": walls[0], "wall_s": walls[1]}


def _write(f: Any, item: dict[str, Any]) -> None:
    """One JSONL line, flushed (a run that dies keeps every line before it)."""
    f.write(json.dumps(item) + "\n")
    f.flush()


def _warm(system: System, g: dict[str, Any], decode_steps: int) -> None:
    """One length's warm-up pair, untimed: warms kernels and allocators at this length."""
    warm = g["warmup"]
    system.reset()
    for key in ("first", "followup"):
        _timed(system, warm[key]["ids"])
    if decode_steps:  # the decode path's first run
        _decode_step(system, warm["followup"]["ids"], 2)


def _pairs(system: System, length: int, g: dict[str, Any], f: Any, args: argparse.Namespace,
           meta: dict[str, Any], decode_steps: int) -> None:
    """One length's timed runs: per repeat and pair, a cold prompt, its hit and a decode step."""
    for repeat in range(args.repeats):
        for pair in g["pairs"]:
            system.reset()
            run = {"type": "run", "system": system.name, "version": meta["version"], "model": meta["model"],
                   "prompt_id": pair["id"], "length": length,
                   "shared_prefix_tokens": pair["shared_prefix_tokens"], "repeat": repeat,
                   "threads": args.threads, "dtype": system.dtype}  # what every run of this pair says
            for kind, key in (("cold", "first"), ("hit", "followup")):
                ids = pair[key]["ids"]
                wall, info = _timed(system, ids)
                _write(f, {**run, "prompt_tokens": len(ids), "kind": kind, "ttft_s": wall,
                           "own_ttft_s": info.get("own_ttft_s"), "first_token": info["first_token"],
                           "cached_tokens": info.get("cached_tokens"), "extra": info.get("extra", {})})
                own = info.get("own_ttft_s")
                print(f"  {length:>5} {pair['id']:<14} r{repeat} {kind:<4} {len(ids):>5} tok  "
                      f"wall {wall * 1000:8.1f} ms  own {'-' if own is None else f'{own * 1000:8.1f} ms'}"
                      f"  cached {info.get('cached_tokens')}  tok {info['first_token']}", flush=True)
            if decode_steps:
                step = _decode_step(system, pair["followup"]["ids"], decode_steps)
                _write(f, {**run, "prompt_tokens": len(pair["followup"]["ids"]), "kind": "decode", **step,
                           "first_token": step["tokens"][0]})
                own = step["own_step_s"]
                print(f"  {length:>5} {pair['id']:<14} r{repeat} step {decode_steps:>5} tok  "
                      f"wall {step['step_s'] * 1000:8.2f} ms  own "
                      f"{'-' if own is None else f'{own * 1000:8.2f} ms'}", flush=True)


def _acks() -> Any:
    """``--serve``'s answer channel: the process's stdout, which from now on is only that (anything
    else printed, by the runner or the system's libraries, goes to stderr)."""
    sys.stdout.flush()
    acks = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return acks


def _serve(system: System, groups: dict[int, dict[str, Any]], args: argparse.Namespace,
           header: dict[str, Any], decode_steps: int, acks: Any) -> None:
    """``--serve``: every warm-up once, then one round per stdin line, acknowledged on ``acks``."""
    for g in groups.values():
        _warm(system, g, decode_steps)
    acks.write(json.dumps({"ready": system.name}) + "\n")
    acks.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        order = json.loads(line)
        out = Path(order["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            _write(f, {**header, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "serve_round": int(order["round"]),
                       "warm_up": "once, when the process started (--serve)"})
            for length, g in groups.items():
                _pairs(system, length, g, f, args, header, decode_steps)
        print(f"wrote {out}", flush=True)
        acks.write(json.dumps({"done": str(out)}) + "\n")
        acks.flush()


def main(system_cls: type[System], parser: argparse.ArgumentParser | None = None) -> int:
    """Parse the shared CLI (plus the runner's own options), run the protocol, write the JSONL."""
    parser = parser or base_parser(system_cls.__doc__ or system_cls.name)
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1 or args.decode_tokens < 0:
        raise SystemExit("--threads and --repeats must be >= 1, --decode-tokens >= 0")
    if (args.out is None) != args.serve:
        raise SystemExit("give --out (one run) or --serve (rounds from stdin), not both or neither")
    acks = _acks() if args.serve else None
    prompt_header, pairs = read_prompts(args.prompts)
    model = model_name_of(args.model_dir)
    if prompt_header.get("model") not in (None, model):
        raise SystemExit(f"{args.prompts} was made for {prompt_header.get('model')!r}, not {model!r}")
    groups = _group(pairs, args)
    longest = max(len(p[k]["ids"]) for g in groups.values() for p in [g["warmup"], *g["pairs"]]
                  for k in ("first", "followup"))

    system = system_cls(args)
    if args.name:
        system.name = args.name
    decode_steps = args.decode_tokens if type(system).generate_n is not System.generate_n else 0
    t_load = time.perf_counter()
    system.load(longest)
    load_s = time.perf_counter() - t_load
    versions = system.versions()
    version = next(iter(versions.values()), "?")
    header = {
        "type": "header", "system": system.name, "version": version, "versions": versions,
        "model": model, "model_dir": str(Path(args.model_dir).expanduser()), "dtype": system.dtype,
        "threads": args.threads, "repeats": args.repeats, "decode_tokens": decode_steps, "config": system.config(),
        "prompts": str(args.prompts), "prompt_set": {k: v for k, v in prompt_header.items() if k != "type"},
        "lengths": list(groups), "pairs_per_length": {k: len(g["pairs"]) for k, g in groups.items()},
        "load_s": round(load_s, 3), "python": platform.python_version(), "executable": sys.executable,
        "cpu": _cpu_name(), "bf16_units": _bf16_units(), "host": socket.gethostname(), "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(f"[{system.name} {version}] {model}: loaded in {load_s:.1f} s; lengths {list(groups)}", flush=True)
    if args.serve:
        _serve(system, groups, args, header, decode_steps, acks)
        system.close()
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        _write(f, header)
        for length, g in groups.items():
            _warm(system, g, decode_steps)
            _pairs(system, length, g, f, args, header, decode_steps)
    system.close()
    print(f"wrote {out}", flush=True)
    return 0
