"""Benchmark runner: methods beside full prefill, same process, same prompts, same threads.

Protocol (what every figure in ``benchmarks/results/`` follows):

- ``torch.set_num_threads(threads)`` is set explicitly before anything runs.
- Full prefill always runs, on the same samples, in the same process.
- Warm-up runs (``warmup`` per method, on the first sample) are discarded.
- For each sample every method runs once, in an order rotated per sample so no method is
  always first after a cache-cold step.
- TTFT comes from the engine (prefill + first token; the method's own overhead included).
- Each record holds the sample's score, TTFT, decode time, token-layer fraction, FLOPs and
  peak memory. The summary reports medians, the number of samples, and speedups as ratios to
  full prefill.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.engine import generate
from fastprefill.methods.base import Method
from fastprefill.methods.full import FullPrefill

FULL = "full"


@dataclass
class Record:
    """One (sample, method) run."""

    method: str
    length: int | None
    sample_id: str
    prompt_tokens: int
    ttft_s: float
    decode_s_per_token: float | None
    total_s: float
    new_tokens: int
    token_layer_fraction: float
    prefill_flops: float
    peak_mem_mb: float
    score: float
    metrics: dict[str, float]
    output: str
    extra: dict[str, Any] = field(default_factory=dict)


def command_line() -> str:
    """The command that is running, as a user would type it from the repository root."""
    if not sys.argv:
        return ""
    first = sys.argv[0]
    first = f"python {os.path.relpath(first)}" if first.endswith(".py") else Path(first).name
    return " ".join([first, *sys.argv[1:]])


def environment(threads: int) -> dict[str, Any]:
    """Where and how a benchmark ran (recorded in every result file)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "git_commit": commit,
        "command": command_line(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Process high-water mark (KiB on Linux): process-wide, monotone over the run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_samples(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Any,
    samples: Sequence[Any],
    methods: Mapping[str, Method],
    *,
    length: int | None,
    max_new_tokens: int,
    warmup: int = 1,
    progress: bool = True,
    desc: str = "",
    method_models: Mapping[str, PreTrainedModel] | None = None,
    done: Collection[tuple[str, str]] = (),
    on_record: Callable[[Record], None] | None = None,
    stop_at_eos: bool = True,
) -> list[Record]:
    """Run every method (full prefill included) on every sample; return the records.

    Args:
        task: a :mod:`fastprefill.data.tasks` task (``score(sample, text) -> dict``).
        samples: the task's samples (``input_ids``, ``id``).
        methods: name -> method. ``"full"`` is added if missing.
        method_models: name -> the model that method runs on, for methods that do not run on
            ``model`` (e.g. a smaller family member, same tokenizer); default ``model``.
        done: ``(sample_id, method)`` pairs to skip (a resumed run).
        on_record: called with each record as soon as it exists (to append it to a file).
        stop_at_eos: ``False`` generates exactly ``max_new_tokens`` (decoding benchmarks).

    Each record's ``extra["first_token"]`` is the first generated token id.
    """
    methods = dict(methods)
    methods.setdefault(FULL, FullPrefill())
    names = list(methods)
    runs_on = {name: (method_models or {}).get(name, model) for name in names}
    skip = {(str(s), str(m)) for s, m in done}
    todo = [(s, n) for s in samples for n in names if (str(s.id), n) not in skip]
    device = model.device
    if todo and warmup > 0:
        for name in names:
            for _ in range(warmup):
                generate(runs_on[name], tokenizer, samples[0].input_ids, methods[name], max_new_tokens=2)
    records: list[Record] = []
    bar = tqdm(total=len(todo), desc=desc or "bench", disable=not progress, unit="run")
    for i, sample in enumerate(samples):
        order = names[i % len(names):] + names[: i % len(names)]
        stop = task.stop(sample) if hasattr(task, "stop") else None
        for name in order:
            if (str(sample.id), name) in skip:
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            res = generate(runs_on[name], tokenizer, sample.input_ids, methods[name],
                           max_new_tokens=max_new_tokens, stop=stop, stop_at_eos=stop_at_eos)
            metrics = task.score(sample, res.text)
            t = res.timing
            records.append(
                Record(
                    method=name,
                    length=length,
                    sample_id=str(sample.id),
                    prompt_tokens=t.prompt_tokens,
                    ttft_s=t.ttft_s,
                    decode_s_per_token=t.decode_s_per_token,
                    total_s=t.total_s,
                    new_tokens=t.new_tokens,
                    token_layer_fraction=t.token_layer_fraction,
                    prefill_flops=t.prefill_flops,
                    peak_mem_mb=_peak_mem_mb(device),
                    score=float(metrics["score"]),
                    metrics={k: float(v) for k, v in metrics.items()},
                    output=res.text,
                    extra={**{k: v for k, v in t.extra.items() if isinstance(v, (int, float, str, list))},
                           "first_token": res.token_ids[0]},
                )
            )
            if on_record is not None:
                on_record(records[-1])
            bar.update(1)
    bar.close()
    return records


def run_benchmark(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task_name: str,
    methods: Mapping[str, Method],
    lengths: Sequence[int | None],
    n: int,
    *,
    split: str = "test",
    seed: int = 0,
    threads: int = 2,
    warmup: int = 1,
    max_new_tokens: int | None = None,
    out_dir: str | Path | None = None,
    name: str = "bench",
    meta: Mapping[str, Any] | None = None,
    progress: bool = True,
    stop_at_eos: bool = True,
) -> list[Record]:
    """Run a task at several lengths and write ``<name>.jsonl``, ``<name>.md`` and ``<name>.png``.

    Args:
        task_name: a task from :data:`fastprefill.data.tasks.TASKS`.
        methods: name -> method; full prefill is always added.
        lengths: prompt lengths in tokens of ``tokenizer`` (``None`` for tasks without one).
        n: samples per length.
        threads: the torch thread count, set explicitly.
        max_new_tokens: defaults to the task's own.
        meta: extra fields for the result header (model name, ...).
        stop_at_eos: ``False`` generates exactly ``max_new_tokens`` per run.
    """
    from fastprefill.bench.report import write_report
    from fastprefill.data.tasks import get_task

    torch.set_num_threads(threads)
    task = get_task(task_name)
    budget = max_new_tokens or task.default_max_new_tokens
    records: list[Record] = []
    for length in lengths:
        samples = task.build(tokenizer, length, n, split=split, seed=seed)
        records += run_samples(
            model, tokenizer, task, samples, methods, length=length, max_new_tokens=budget,
            warmup=warmup, progress=progress, desc=f"{task_name}@{length}", stop_at_eos=stop_at_eos,
        )
    header = {
        "task": task_name,
        "split": split,
        "seed": seed,
        "n": n,
        "lengths": list(lengths),
        "max_new_tokens": budget,
        "stop_at_eos": stop_at_eos,
        "warmup": warmup,
        "methods": {k: m.describe() for k, m in {FULL: FullPrefill(), **methods}.items()},
        **environment(threads),
        **(dict(meta) if meta else {}),
    }
    if out_dir is not None:
        write_report(Path(out_dir), name, header, records)
    return records


def save_jsonl(path: Path, header: Mapping[str, Any], records: Sequence[Record]) -> None:
    """Write the header line then one JSON object per record (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps({"header": dict(header)}) + "\n")
        for r in records:
            f.write(json.dumps(r.__dict__) + "\n")
    tmp.replace(path)


def load_jsonl(path: str | Path) -> tuple[dict[str, Any], list[Record]]:
    """Read a file written by :func:`save_jsonl`."""
    lines = Path(path).read_text().splitlines()
    header = json.loads(lines[0])["header"]
    return header, [Record(**json.loads(line)) for line in lines[1:] if line.strip()]
