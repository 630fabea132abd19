"""Benchmark records on disk: JSON lines with a header line, appended as runs finish, resumable.

A result file is ``<stem>.jsonl``: the first line is ``{"header": {...}}`` (the task, the methods,
the command line, the git commit, the thread count and the machine, see :func:`environment`),
every further line one :class:`Record`. :class:`RecordLog` writes the header when a run starts
and appends each record as soon as it exists, so an interrupted run keeps what it measured and
``resume=True`` continues it, skipping the ``(sample, method)`` pairs already on disk.

:func:`read_rows` reads a summary file (rows of dicts under a header; the benchmark scripts write
them). :func:`result_name` chooses a run's file stem, so that a rerun with default settings never
replaces a committed result.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastprefill.errors import ConfigError

__all__ = [
    "FULL",
    "Record",
    "RecordLog",
    "command_line",
    "environment",
    "load_records",
    "read_rows",
    "result_name",
    "save_records",
]

#: The name of full prefill in every result file (the default reference of a summary).
FULL = "full"


@dataclass
class Record:
    """One (sample, method) run.

    ``extra`` holds the method's counters (JSON-friendly values only), ``first_token`` (the
    first generated id) and, for a run that is not its own reference, ``first_token_kl``
    (KL(reference || method) of the first-token distributions, in nats).
    """

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


#: The files a result stem may own (``<stem><suffix>``).
RESULT_SUFFIXES = (".jsonl", ".md", ".png", ".json", ".summary.json", ".summary.jsonl")


def result_name(out_dir: str | Path, default: str, *, name: str | None = None, resume: bool = False) -> str:
    """The file stem a benchmark run writes under ``out_dir``.

    A stem the user named (``name``) is taken as it is, and so is ``default`` when resuming: the
    caller then replaces or continues that file, as it was asked to. Otherwise a run never
    replaces another run's files: ``default`` if no ``<default><suffix>`` of
    :data:`RESULT_SUFFIXES` exists in ``out_dir``, else the first free ``<default>-run2``,
    ``<default>-run3``, ...
    """
    if name:
        return name
    if resume:
        return default
    stem, k = default, 1
    while any((Path(out_dir) / f"{stem}{suffix}").exists() for suffix in RESULT_SUFFIXES):
        k += 1
        stem = f"{default}-run{k}"
    return stem


def command_line() -> str:
    """The command that is running, as a user would type it from the repository root: each argument
    quoted as a shell needs it (``--settings 'last layer'``), so the line runs as recorded."""
    if not sys.argv:
        return ""
    first = sys.argv[0]
    if Path(first).parts[-2:] == ("cli", "__main__.py"):  # python -m fastprefill.cli: the installed command
        first = "fastprefill"
    if first.endswith(".py"):  # the script's path from the checkout's root, wherever it was started from
        script = Path(first).resolve()
        root = next((p for p in script.parents if (p / "pyproject.toml").exists()), None)
        first = f"python {script.relative_to(root) if root is not None else os.path.relpath(first)}"
    else:
        first = Path(first).name
    return " ".join([first, *(shlex.quote(a) for a in sys.argv[1:])])


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(threads: int, model: Any, device: Any = None) -> dict[str, Any]:
    """Where and how a benchmark ran (recorded in every result header): threads, versions, the
    CPU, the precision of ``model`` (a model, or its ``torch.dtype``) with the CPU's bfloat16
    capability (:func:`fastprefill.host.precision_report`), and whether its decoder blocks are
    compiled, its linear weights packed, its one- and two-row products on the few-row kernel, its
    attention on the C++ kernel or SDPA and its attention modules and decoder layers on fastprefill's
    fused forwards (``None`` when only a dtype is given); for a model on
    a GPU (or a dtype and a GPU ``device``) also ``"accelerator"``: the GPU, its driver, CUDA and
    cuDNN (:func:`fastprefill.host.accelerator_report`)."""
    import torch
    import transformers

    from fastprefill.host import accelerator_report, precision_report
    from fastprefill.models.adapters import blocks_compiled
    from fastprefill.models.attention import attention_backend
    from fastprefill.models.fused import attention_fused, layers_fused
    from fastprefill.models.packed import few_rows_used, linears_packed

    dtype = model if isinstance(model, torch.dtype) else model.dtype
    device = (device or "cpu") if isinstance(model, torch.dtype) else model.device
    accelerator = accelerator_report(device)
    return {
        "threads": threads,
        **precision_report(dtype, device),
        "compiled": None if isinstance(model, torch.dtype) else blocks_compiled(model),
        "packed": None if isinstance(model, torch.dtype) else linears_packed(model),
        "few_rows": None if isinstance(model, torch.dtype) else few_rows_used(model)[0],
        "attention": None if isinstance(model, torch.dtype) else attention_backend(model)[0],
        "attention_fused": None if isinstance(model, torch.dtype) else attention_fused(model),
        "layers_fused": None if isinstance(model, torch.dtype) else layers_fused(model),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "git_commit": _git_commit(),
        "command": command_line(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **({"accelerator": accelerator} if accelerator is not None else {}),
    }


def _record_line(record: Record) -> str:
    return json.dumps(asdict(record)) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save_records(path: str | Path, header: Mapping[str, Any], records: Iterable[Record]) -> None:
    """Write the header line then one JSON object per record, atomically."""
    text = json.dumps({"header": dict(header)}) + "\n" + "".join(_record_line(r) for r in records)
    _atomic_write(Path(path), text)


def load_records(path: str | Path, *, drop_torn_tail: bool = False) -> tuple[dict[str, Any], list[Record]]:
    """Read a result file: ``(header, records)``.

    Args:
        path: the ``.jsonl`` file.
        drop_torn_tail: ignore a last line that is cut short (not JSON and without its newline:
            a run killed while writing it) instead of refusing the file.

    Raises:
        ConfigError: the file is missing, its first line is not a ``{"header": ...}`` object, or
            a line is not a JSON record (the message names the line).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such result file")
    header, rows = read_rows(path, drop_torn_tail=drop_torn_tail)
    try:
        return header, [Record(**row) for row in rows]
    except TypeError as exc:
        raise ConfigError(f"{path}: a line is not a benchmark record ({exc})") from None


def read_rows(path: str | Path, *, drop_torn_tail: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a JSON-lines file with a header line: ``(header, rows)`` (rows as plain dicts).

    ``drop_torn_tail``: see :func:`load_records`.

    Raises:
        ConfigError: the first line is not a ``{"header": ...}`` object, or a line is not JSON.
    """
    text = Path(path).read_text()
    lines = text.splitlines()
    rows: list[Any] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            torn = i == len(lines) - 1 and not text.endswith("\n")
            if torn and drop_torn_tail:
                break
            cut = " (cut short: resume the run to drop it)" if torn else ""
            raise ConfigError(f"{path}: line {i + 1} is not JSON{cut}: {exc.msg}") from None
    first = rows[0] if rows and lines[0].strip() else None
    if not isinstance(first, dict) or "header" not in first:
        raise ConfigError(f"{path}: the first line must be a {{\"header\": ...}} object")
    return first["header"], rows[1:]


#: What a header written before a key was recorded means by its absence: every result made
#: before the dtype was recorded ran in float32.
LEGACY_HEADER: dict[str, Any] = {"dtype": "float32"}


class RecordLog:
    """An open result file: the header is on disk, :meth:`append` adds one record.

    Args:
        path: the ``.jsonl`` file.
        header: this run's header.
        resume: continue an existing file: its records are loaded (:attr:`records`, :attr:`done`)
            and new ones appended after them; the file's header is kept (:meth:`done` says what
            to skip). The values of ``match`` must equal the file's, or the run is refused. A
            last line cut short (a run killed while writing it) is dropped from the file.
        overwrite: when not resuming, replace an existing file (``False``: refuse it).
        match: header keys a resumed file must agree on (what was run, not when or where).
        grow: integer header keys among ``match`` that a resumed run may raise (``n``: samples
            are a prefix-stable choice, so a larger ``n`` runs the file's samples and then more).
            The file's header then takes the new value, and its ``extended`` list records the
            old value, this run's command and start time.

    Raises:
        ConfigError: resuming with a header that disagrees on a ``match`` key (or lowers a
            ``grow`` key), or an existing file with ``resume=False, overwrite=False``.
    """

    def __init__(
        self,
        path: str | Path,
        header: Mapping[str, Any],
        *,
        resume: bool = False,
        overwrite: bool = True,
        match: Sequence[str] = (),
        grow: Sequence[str] = (),
    ) -> None:
        self.path = Path(path)
        self.records: list[Record] = []
        if resume and self.path.exists():
            old, self.records = load_records(self.path, drop_torn_tail=True)
            grown: dict[str, Any] = {}
            for key in match:
                new, was = json.loads(json.dumps(header.get(key))), old.get(key, LEGACY_HEADER.get(key))
                if new == was:
                    continue
                if key in grow and isinstance(new, int) and isinstance(was, int) and new > was:
                    grown[key] = was
                    continue
                raise ConfigError(
                    f"resume: {self.path} was made with {key}={was!r}, not {header.get(key)!r}; "
                    + (f"{key} may only grow; " if key in grow else "")
                    + "run without resuming or write to another file"
                )
            self.header = old
            if grown:
                step = {f"from_{key}": was for key, was in grown.items()}
                step.update({k: header[k] for k in ("command", "started", "git_commit") if k in header})
                self.header = {**old, **{key: header[key] for key in grown},
                               "extended": [*old.get("extended", []), step]}
            if grown or not self.path.read_text().endswith("\n"):  # a torn last line is dropped
                save_records(self.path, self.header, self.records)
        elif self.path.exists() and not overwrite:
            raise ConfigError(f"{self.path} exists: resume it, or write to another file")
        else:
            self.header = dict(header)
            save_records(self.path, self.header, [])

    def done(self, length: int | None) -> set[tuple[str, str]]:
        """``(sample_id, method)`` pairs of prompt length ``length`` already in the file (a
        sample id names the same source item at every length)."""
        return {(r.sample_id, r.method) for r in self.records if r.length == length}

    def append(self, record: Record) -> None:
        """Add one record to the file (flushed at once) and to :attr:`records`."""
        with self.path.open("a") as f:
            f.write(_record_line(record))
        self.records.append(record)
