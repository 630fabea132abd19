"""Anchor rounds with every system's process kept up across them (``run_all.sh`` with ``PERSISTENT=1``).

Each system's runner starts once with ``--serve`` (``common.py``): the systems start one after
another, each loading its model and running every length's warm-up with nothing else running.
Then round ``r`` asks each system in turn, the order rotating as in ``run_all.sh`` (round ``r``
starts with the system at position ``r``), for one run of the timed pairs into
``run-<system>-round<r>.jsonl``, and waits for its answer before asking the next: one system
computes at a time, the others wait idle with their models in memory. A system whose process ends
or fails is reported, its partial file of that round removed, and it is left out of later rounds.
The console output of each system's process goes to ``run-<system>.log``.

The same timed calls as one process per round, without each round's load and warm-up: on a slow
host a round of the 1.5B at 2k and 4k then takes the time of its timed prompts only (vLLM's
start alone took 5 minutes there). Standard library only.

    python3 benchmarks/anchors/rounds.py --out DIR --rounds 5 \\
        --system fastprefill ".venv/bin/python benchmarks/anchors/fastprefill_run.py --model-dir ... --prompts ..." \\
        --system vllm ".venv-anchors/vllm/bin/python benchmarks/anchors/vllm_run.py ... --dtype float32"
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import IO, Any


class Served:
    """One system's ``--serve`` process: asked for a round on stdin, answering on stdout."""

    def __init__(self, name: str, command: str, out: Path) -> None:
        self.name = name
        self.log: IO[str] = open(out / f"run-{name}.log", "w", encoding="utf-8")  # noqa: SIM115 (kept open)
        self.proc = subprocess.Popen([*shlex.split(command), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.alive = True

    def answer(self) -> dict[str, Any] | None:
        """The process's next answer line; ``None`` where it ended instead."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.alive = False
            return None
        return json.loads(line)

    def ask(self, order: dict[str, Any]) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(order) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.alive = False
            return None
        return self.answer()

    def close(self) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        code = self.proc.wait()
        self.log.close()
        return code


def available_gib() -> float | None:
    """``MemAvailable`` of ``/proc/meminfo`` in GiB; ``None`` where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def run(systems: list[tuple[str, str]], out: Path, rounds: int, min_free_gib: float = 1.5) -> int:
    """Start every system (one after another), run ``rounds`` rounds, stop them; 0 when none failed.
    Stops before the rounds (``SystemExit``) where less than ``min_free_gib`` of memory is left
    with every system loaded: the idle systems' models stay in memory, and a first try of the 1.5B
    in float32 beside vLLM with its 4 GiB cache left too little, its hits and decode steps many
    times slower than alone (that run was stopped and nothing of it kept). Passing the check is
    no promise: a system may grow in its round beyond what it held after its warm-up."""
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    served: list[Served] = []
    for name, command in systems:
        print(f"== starting {name} (load and warm-up)", file=sys.stderr, flush=True)
        s = Served(name, command, out)
        if s.answer() is None:
            print(f"{name} FAILED to start: see {s.log.name}", file=sys.stderr, flush=True)
            status = 1
        served.append(s)
    free = available_gib()
    if free is not None and free < min_free_gib:
        for s in served:
            s.close()
        raise SystemExit(
            f"only {free:.1f} GiB of memory is left with every system loaded (under {min_free_gib} GiB): the rounds "
            "would time paging, not the systems. Give them less (e.g. VLLM_ARGS=\"... --kv-cache-gib 1\"), run fewer "
            "systems at once, or run without PERSISTENT=1 (one process per round).")
    left = "memory left unknown (/proc/meminfo unreadable)" if free is None else f"{free:.1f} GiB of memory left"
    print(f"== every system loaded; {left}", file=sys.stderr, flush=True)
    for rnd in range(rounds):
        for i in range(len(served)):
            s = served[(i + rnd) % len(served)]
            if not s.alive:
                continue
            path = out / f"run-{s.name}-round{rnd}.jsonl"
            print(f"== round {rnd}/{rounds}: {s.name}", file=sys.stderr, flush=True)
            if s.ask({"round": rnd, "out": str(path)}) is None:
                print(f"{s.name} FAILED in round {rnd}: see {s.log.name}", file=sys.stderr, flush=True)
                path.unlink(missing_ok=True)  # a partial file would pair only some prompts of this round
                status = 1
    for s in served:
        if s.close() != 0:
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the output folder (run files and logs)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--system", nargs=2, action="append", required=True, metavar=("NAME", "COMMAND"),
                   help="a system's name and its runner's command line, without --out and --serve (repeatable)")
    p.add_argument("--min-free-gib", type=float, default=1.5,
                   help="stop before the rounds where less memory is left with every system loaded (default 1.5)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    return run([(n, c) for n, c in args.system], Path(args.out), args.rounds, args.min_free_gib)


if __name__ == "__main__":
    raise SystemExit(main())
