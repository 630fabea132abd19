"""Benchmark runner: methods beside full prefill, same process, same prompts, same threads.

Protocol (what every figure in ``benchmarks/results/`` follows):

- the torch thread count is set explicitly (:func:`~fastprefill.host.set_threads`) before anything runs.
- Full prefill always runs, on the same samples, in the same process.
- Warm-up runs (``warmup`` per method, on the first sample) are discarded.
- For each sample every method runs once, in an order rotated per sample so no method is
  always first after a cache-cold step.
- TTFT comes from the engine's timing window (prefill + first token; the method's own
  overhead included): every run goes through :func:`fastprefill.engine.generate`.
- Each record holds the sample's score, TTFT, decode time, token-layer fraction, FLOPs, peak
  memory, the first token and, for a run that is not its own reference, the KL divergence of
  the reference's first-token distribution from the method's (computed in-process).
- When the task knows its gold tokens (``gold_token_positions(sample, tokenizer)``), a pruning
  method's record also holds the share of them still computed after each cut.
- Records are appended to the result file as they come; an interrupted run resumes.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.bench.records import FULL, Record, RecordLog, environment
from fastprefill.bench.report import write_report
from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.host import keep_freed_memory, set_threads
from fastprefill.methods.base import Method
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.pruning import recording_kept_positions

__all__ = ["RESUME_GROW", "RESUME_MATCH", "PromptSample", "Unscored", "first_token_kl", "gold_kept_shares",
           "run_benchmark", "run_samples"]

#: Header keys a resumed :func:`run_benchmark` file must share with the new run.
RESUME_MATCH = ("task", "split", "seed", "n", "lengths", "max_new_tokens", "stop_at_eos", "methods", "dtype")
#: Of those, the ones a resumed run may raise: tasks choose the first ``n`` of a seeded order,
#: so a larger ``n`` keeps the file's samples and adds more.
RESUME_GROW = ("n",)


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || method) in nats between two ``(V,)`` first-token logit vectors."""
    ref = reference_logits.float().log_softmax(-1)
    logp = logits.float().log_softmax(-1)
    return float((ref.exp() * (ref - logp)).sum())


def gold_kept_shares(gold: torch.Tensor, kept_positions: Sequence[torch.Tensor]) -> list[float]:
    """Share of the ``gold`` positions ``(G,)`` present in each kept set ``(K_s,)`` (1.0 without gold)."""
    gold = gold.cpu()
    return [float(torch.isin(gold, kept.cpu()).float().mean()) if gold.numel() else 1.0 for kept in kept_positions]


@dataclass(frozen=True)
class PromptSample:
    """A prompt without a task behind it: ``id`` and ``input_ids``."""

    id: str
    input_ids: list[int]


class Unscored:
    """A task for timing only: every answer scores 0 (``{"score": 0.0}``)."""

    def score(self, sample: Any, text: str) -> dict[str, float]:
        return {"score": 0.0}


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Process high-water mark (KiB on Linux): process-wide, monotone over the run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _references(reference: str | Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    refs = {n: reference if isinstance(reference, str) else reference.get(n, "") for n in names}
    bad = {n: r for n, r in refs.items() if r not in names}
    if bad:
        raise ConfigError(f"reference: every method's reference must be one of the methods {list(names)}; got {bad}")
    return refs


def run_samples(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
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
    reference: str | Mapping[str, str] = FULL,
) -> list[Record]:
    """Run every method (full prefill included) on every sample; return the records.

    Args:
        task: a :mod:`fastprefill.data.tasks` task (``score(sample, text) -> dict``, optionally
            ``stop(sample)``).
        samples: the task's samples (``input_ids``, ``id``).
        methods: name -> method. ``"full"`` is added if missing.
        method_models: name -> the model that method runs on, for methods that do not run on
            ``model`` (e.g. a smaller family member, same tokenizer); default ``model``.
        done: ``(sample_id, method)`` pairs to skip (a resumed run).
        on_record: called with each record as soon as it is complete (to append it to a file).
        stop_at_eos: ``False`` generates exactly ``max_new_tokens`` (decoding benchmarks).
        reference: the method whose first-token distribution every other is compared with, or
            a mapping method -> its reference (each one of ``methods``).

    Each record's ``extra["first_token"]`` is the first generated token id. A run whose
    reference is another method also gets ``extra["first_token_kl"]``, KL(reference || run) of
    the first-token distributions, when the reference ran on the same sample in this call and
    both distributions have the same vocabulary size; a record waits (is not yet handed to
    ``on_record``) until its reference has run on the sample. When ``task`` has
    ``gold_token_positions(sample, tokenizer)``, a run whose prefill kept a subset of the prompt
    (pruning methods, inside :func:`~fastprefill.methods.pruning.recording_kept_positions`) gets
    ``extra["gold_kept_share_per_stage"]``: the share of the gold tokens present after each cut
    (:func:`gold_kept_shares`); the kept positions themselves are not recorded.

    Raises:
        ConfigError: a reference that is not one of the methods.
    """
    methods = dict(methods)
    methods.setdefault(FULL, FullPrefill())
    names = list(methods)
    refs = _references(reference, names)
    needed = set(refs.values())
    runs_on = {name: (method_models or {}).get(name, model) for name in names}
    skip = {(str(s), str(m)) for s, m in done}
    todo = [(s, n) for s in samples for n in names if (str(s.id), n) not in skip]
    if todo and warmup > 0:
        for name in names:
            for _ in range(warmup):
                generate(runs_on[name], tokenizer, samples[0].input_ids, methods[name], max_new_tokens=2)
    records: list[Record] = []
    gold_of = getattr(task, "gold_token_positions", None)
    bar = tqdm(total=len(todo), desc=desc or "bench", disable=not progress, unit="run")
    for i, sample in enumerate(samples):
        order = names[i % len(names):] + names[: i % len(names)]
        stop = task.stop(sample) if hasattr(task, "stop") else None
        gold = gold_of(sample, tokenizer) if gold_of is not None else None
        awaiting = _AwaitingReference(refs, records, on_record)
        for name in order:
            if (str(sample.id), name) in skip:
                continue
            record, logits = _run_once(
                runs_on[name], tokenizer, task, sample, name, methods[name], device=model.device, length=length,
                max_new_tokens=max_new_tokens, stop=stop, stop_at_eos=stop_at_eos, gold=gold)
            awaiting.add(record, logits, is_reference=name in needed)
            bar.update(1)
        awaiting.release()  # the reference ran in an earlier (resumed) session
    bar.close()
    return records


def _run_once(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, task: Any, sample: Any, name: str,
    method: Method, *, device: torch.device, length: int | None, max_new_tokens: int,
    stop: Callable[[str], bool] | None, stop_at_eos: bool, gold: torch.Tensor | None,
) -> tuple[Record, torch.Tensor]:
    """One run of ``method`` on ``sample``: its record (see :func:`run_samples`) and its ``(V,)``
    first-token logits."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with recording_kept_positions():
        res = generate(model, tokenizer, sample.input_ids, method, max_new_tokens=max_new_tokens, stop=stop,
                       stop_at_eos=stop_at_eos)
    metrics = task.score(sample, res.text)
    t = res.timing
    extra = {k: v for k, v in t.extra.items() if k != "kept_positions" and isinstance(v, (int, float, str, list))}
    if gold is not None and t.extra.get("kept_positions"):
        extra["gold_kept_share_per_stage"] = gold_kept_shares(gold, t.extra["kept_positions"])
    record = Record(
        method=name,
        length=length,
        sample_id=str(sample.id),
        prompt_tokens=t.prompt_tokens,
        ttft_s=t.ttft_s,
        decode_s_per_token=t.decode_s_per_token,
        total_s=t.total_s,
        new_tokens=t.new_tokens,
        token_layer_fraction=t.stats.fraction,
        prefill_flops=t.stats.flops,
        peak_mem_mb=_peak_mem_mb(device),
        score=float(metrics["score"]),
        metrics={k: float(v) for k, v in metrics.items()},
        output=res.text,
        extra={**extra, "first_token": res.token_ids[0]},
    )
    return record, res.first_logits


class _AwaitingReference:
    """One sample's records that wait for their reference's first-token logits, appended to
    ``records`` (and handed to ``on_record``) as soon as the reference has run (with
    ``extra["first_token_kl"]`` when the vocabularies match)."""

    def __init__(self, refs: Mapping[str, str], records: list[Record],
                 on_record: Callable[[Record], None] | None) -> None:
        self.refs, self.records, self.on_record = refs, records, on_record
        self.logits_of: dict[str, torch.Tensor] = {}  # this sample's reference distributions
        self.waiting: list[tuple[Record, torch.Tensor]] = []

    def add(self, record: Record, logits: torch.Tensor, is_reference: bool) -> None:
        """Take a finished run; emit every record whose reference has run."""
        if is_reference:
            self.logits_of[record.method] = logits
        self.waiting.append((record, logits))
        still: list[tuple[Record, torch.Tensor]] = []
        for rec, own in self.waiting:
            ref = self.refs[rec.method]
            if ref == rec.method:
                self.emit(rec)
            elif ref in self.logits_of:
                if self.logits_of[ref].shape == own.shape:
                    rec.extra["first_token_kl"] = first_token_kl(self.logits_of[ref], own)
                self.emit(rec)
            else:
                still.append((rec, own))
        self.waiting = still

    def emit(self, record: Record) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    def release(self) -> None:
        """Emit the records still waiting (their reference ran in an earlier session)."""
        for rec, _ in self.waiting:
            self.emit(rec)
        self.waiting = []


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
    resume: bool = False,
) -> list[Record]:
    """Run a task at several lengths; with ``out_dir``, write ``<name>.jsonl`` (appended as runs
    finish), then ``<name>.md`` and ``<name>.png``.

    Args:
        task_name: a task from :data:`fastprefill.data.tasks.TASKS`.
        methods: name -> method; full prefill is always added.
        lengths: prompt lengths in tokens of ``tokenizer`` (``None`` for tasks without one).
        n: samples per length.
        threads: the torch thread count, set explicitly.
        max_new_tokens: defaults to the task's own.
        meta: extra fields for the result header (model name, ...).
        stop_at_eos: ``False`` generates exactly ``max_new_tokens`` per run.
        resume: continue ``<name>.jsonl`` (same task, split, seed, lengths, budget and methods;
            the same ``n`` or a larger one, which extends the file: see :class:`RecordLog`),
            skipping the runs it holds; without it an existing file is replaced.

    Returns:
        Every record of the result (those of a resumed file included).

    Raises:
        ConfigError: resuming a file made with other settings.
    """
    from fastprefill.data.tasks import get_task

    set_threads(threads)
    keep_freed_memory()
    task = get_task(task_name)
    budget = max_new_tokens or task.default_max_new_tokens
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
        **environment(threads, model),
        **(dict(meta) if meta else {}),
    }
    log = (RecordLog(Path(out_dir) / f"{name}.jsonl", header, resume=resume, match=RESUME_MATCH, grow=RESUME_GROW)
           if out_dir else None)
    records: list[Record] = list(log.records) if log else []
    for length in lengths:
        samples = task.build(tokenizer, length, n, split=split, seed=seed)
        records += run_samples(
            model, tokenizer, task, samples, methods, length=length, max_new_tokens=budget,
            warmup=warmup, progress=progress, desc=f"{task_name}@{length}", stop_at_eos=stop_at_eos,
            done=log.done(length) if log else (), on_record=log.append if log else None,
        )
    if log is not None:
        write_report(Path(out_dir), name, log.header, records, save=False)
    return records
