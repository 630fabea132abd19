"""``fastprefill tune``: choose a method per prompt length by measured fidelity, not by knobs.

Full prefill and every candidate run on the user's own prompts (a JSONL file of raw prompts or
chat messages, or a packaged task). The prompts are split in two halves by a stable hash of
their id: the *choosing* half picks, per length bucket, the fastest candidate whose fidelity to
full prefill meets the target by the conservative end of its interval; the *held-out* half
reports that choice's TTFT ratio and fidelity. The result is a
:class:`~fastprefill.methods.auto.TuneProfile` that ``--method auto:profile=FILE`` serves.

- Fidelity: first-token agreement and identical answers are shares of prompts (Wilson score
  interval); first-token KL is a mean (percentile bootstrap interval).
- Speed: the median over prompts of full prefill's TTFT over the candidate's (the same run,
  the same prompt, the same threads; warm-up excluded: :func:`fastprefill.bench.runner.run_samples`).
- A bucket whose best qualifying candidate is not at least ``min_speedup`` faster runs full
  prefill (short prompts, where pruning cannot pay for itself).
- Runs are appended to a result file as they finish; an interrupted tune resumes.

Refused with a message: a prompts file that is not valid JSONL or has empty prompts, a bucket
with too few choosing prompts for the target's interval to reach it (the message says how
many), and a target that no candidate meets in any bucket (the message names the closest).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.bench.records import FULL, Record, RecordLog, environment
from fastprefill.bench.runner import PromptSample, Unscored, run_samples
from fastprefill.bench.summary import bootstrap_ci
from fastprefill.errors import ConfigError, PromptError
from fastprefill.host import dtype_name
from fastprefill.methods.auto import ProfileBucket, Target, TuneProfile
from fastprefill.methods.base import Method
from fastprefill.models.fingerprint import tokenizer_fingerprint, weights_fingerprint
from fastprefill.prompt import encode_prompt

__all__ = ["DEFAULT_BUCKETS", "DEFAULT_CANDIDATES", "Candidate", "TunePrompt", "choose", "load_prompts",
           "min_prompts", "split_of_prompt", "task_prompts", "tune", "wilson"]

#: Bucket limits in prompt tokens and their labels: a prompt goes to the first bucket whose limit
#: it does not exceed; the last bucket takes every longer prompt.
DEFAULT_BUCKETS: tuple[tuple[str, int | None], ...] = (("512", 768), ("1k", 1536), ("2k", 3072), ("4k", None))

#: The candidates tried by default: LazyLLM's paper schedule and its gentler and later-cut
#: presets, and GemFilter (the static peer). kvp (needs a trained predictor) and kvp-prefix (a
#: calibrated checkpoint) are added with ``--methods``.
DEFAULT_CANDIDATES: tuple[str, ...] = (
    "lazyllm:preset=gentle",
    "lazyllm:preset=late-half",
    "lazyllm:preset=four-stage",
    "lazyllm:preset=cut20k50-cut50k15+snap",
    "lazyllm:preset=cut30k20+snap",
    "gemfilter",
)


@dataclass(frozen=True)
class TunePrompt:
    """One prompt: ``id`` (stable), ``input_ids``, its length bucket, and its half: ``"choose"``,
    ``"report"``, or ``None`` for the half a stable hash of the id gives (:func:`split_of_prompt`)."""

    id: str
    input_ids: list[int]
    bucket: str
    half: str | None = None

    def __post_init__(self) -> None:
        if self.half not in (None, "choose", "report"):
            raise ConfigError(f"prompt {self.id}: half must be 'choose', 'report' or None, not {self.half!r}")


@dataclass(frozen=True)
class Candidate:
    """A candidate's figures on one half of one bucket (see :func:`measure`)."""

    method: str
    n: int
    ttft_ratio: float
    fidelity: float
    low: float
    high: float

    def meets(self, target: Target) -> bool:
        """Whether the conservative end of the interval meets ``target``."""
        return self.low >= target.value if target.is_floor else self.high <= target.value


def split_of_prompt(prompt_id: str) -> str:
    """``"choose"`` or ``"report"``: half the prompts each, by a stable hash of the id."""
    return "choose" if hashlib.sha256(prompt_id.encode()).digest()[0] % 2 == 0 else "report"


def bucket_of(n_tokens: int, buckets: Sequence[tuple[str, int | None]] = DEFAULT_BUCKETS) -> str:
    """The label of the bucket a ``n_tokens``-token prompt falls in."""
    return next(label for label, upto in buckets if upto is None or n_tokens <= upto)


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a share ``successes / n`` at a two-sided ``confidence``."""
    if n == 0:
        return (0.0, 1.0)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def min_prompts(target: Target) -> int:
    """The fewest prompts whose interval can meet ``target`` at all: for a share, all of them
    agreeing must put the Wilson lower end at the target; for KL, 8 (a bootstrap needs some)."""
    if not target.is_floor:
        return 8
    n = 1
    while wilson(n, n, target.confidence)[0] < target.value:
        n += 1
    return n


# --------------------------------------------------------------------------- prompts
def load_prompts(path: str | Path, tokenizer: PreTrainedTokenizerBase,
                 buckets: Sequence[tuple[str, int | None]] = DEFAULT_BUCKETS) -> list[TunePrompt]:
    """Read a JSONL file of prompts: each line ``{"prompt": "..."}`` (raw text, sent as one chat
    user message when the tokenizer has a template), ``{"messages": [{"role": ..., "content":
    ...}, ...]}`` (a chat), or a JSON string; an optional ``"id"``.

    Raises:
        ConfigError: the file is missing, a line is not JSON or has neither form, a prompt is
            empty (the message gives the line number).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no prompts file at {p}")
    prompts: list[TunePrompt] = []
    for number, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{number}: not valid JSON ({exc.msg}); give one JSON object per line") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise ConfigError(f'{p}:{number}: give {{"prompt": "..."}} or {{"messages": [...]}}')
        try:
            if "messages" in item:
                messages = item["messages"]
                if not isinstance(messages, list) or not messages or not all(
                        isinstance(m, dict) and isinstance(m.get("content"), str) and m["content"].strip()
                        for m in messages):
                    raise PromptError("the messages are empty or lack text content")
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = encode_prompt(tokenizer, item["prompt"], chat=True)[0].tolist()
        except PromptError as exc:
            raise ConfigError(f"{p}:{number}: {exc}") from None
        pid = str(item.get("id", number))
        prompts.append(TunePrompt(pid, ids, bucket_of(len(ids), buckets)))
    if not prompts:
        raise ConfigError(f"{p} holds no prompts")
    ids = [pr.id for pr in prompts]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{p}: prompt ids must be unique")
    return prompts


def task_prompts(task_name: str, tokenizer: PreTrainedTokenizerBase, lengths: Sequence[int], n: int,
                 split: str = "dev", seed: int = 0,
                 buckets: Sequence[tuple[str, int | None]] = DEFAULT_BUCKETS,
                 half: str | None = None) -> list[TunePrompt]:
    """``n`` prompts of a packaged task at each of ``lengths`` (the task's own prompt format), all
    in ``half`` (``None``: halves by hash). Ids are ``<split>:<sample id>@<length>``."""
    from fastprefill.data.tasks import get_task

    task = get_task(task_name)
    out = []
    for length in lengths:
        for sample in task.build(tokenizer, length, n, split=split, seed=seed):
            ids = list(sample.input_ids.reshape(-1).tolist()) if isinstance(sample.input_ids, torch.Tensor) \
                else list(sample.input_ids)
            out.append(TunePrompt(f"{split}:{sample.id}@{length}", ids, bucket_of(len(ids), buckets), half))
    return out


# --------------------------------------------------------------------------- choosing
def measure(records: Sequence[Record], method: str, target: Target) -> Candidate | None:
    """``method``'s figures against full prefill over ``records`` (one half of one bucket)."""
    full = {r.sample_id: r for r in records if r.method == FULL}
    rs = [r for r in records if r.method == method and r.sample_id in full]
    if not rs:
        return None
    ratio = float(np.median([full[r.sample_id].ttft_s / r.ttft_s for r in rs]))
    if target.measure == "kl":
        values = [float(r.extra.get("first_token_kl", 0.0)) for r in rs]
        low, high = bootstrap_ci(values) if len(values) > 1 else (values[0], values[0])
        return Candidate(method, len(rs), ratio, float(np.mean(values)), low, high)
    if target.measure == "first-token":
        hits = sum(r.extra["first_token"] == full[r.sample_id].extra["first_token"] for r in rs)
    else:
        hits = sum(r.output.strip() == full[r.sample_id].output.strip() for r in rs)
    low, high = wilson(hits, len(rs), target.confidence)
    return Candidate(method, len(rs), ratio, hits / len(rs), low, high)


def choose(records: Sequence[Record], prompts: Sequence[TunePrompt], methods: Mapping[str, str], target: Target,
           buckets: Sequence[tuple[str, int | None]] = DEFAULT_BUCKETS,
           min_speedup: float = 1.1) -> tuple[list[ProfileBucket], dict[str, list[Candidate]]]:
    """Pick each bucket's method on the choosing half and measure it on the held-out half (each
    prompt's ``half``, or halves by hash).

    Args:
        records: full prefill and every candidate on every prompt (record ``method`` = the
            candidate's name, ``sample_id`` = the prompt's id).
        methods: candidate name -> its method spec.
        min_speedup: a qualifying candidate slower than this (choosing half) leaves the bucket
            to full prefill.

    Returns:
        The buckets (for the profile) and, per bucket label, every candidate's figures on the
        choosing half (for the table and the plot).

    Raises:
        ConfigError: a bucket with prompts but fewer choosing ones than :func:`min_prompts`; no
            candidate meeting the target in any bucket (the closest is named).
    """
    half = {p.id: p.half or split_of_prompt(p.id) for p in prompts}
    bucket = {p.id: p.bucket for p in prompts}
    need = min_prompts(target)
    out: list[ProfileBucket] = []
    seen: dict[str, list[Candidate]] = {}
    met_somewhere = False
    closest: Candidate | None = None
    for label, upto in buckets:
        choose_recs = [r for r in records if bucket.get(r.sample_id) == label and half[r.sample_id] == "choose"]
        report_recs = [r for r in records if bucket.get(r.sample_id) == label and half[r.sample_id] == "report"]
        n_choose = len({r.sample_id for r in choose_recs})
        n_report = len({r.sample_id for r in report_recs})
        if n_choose + n_report == 0:
            out.append(ProfileBucket(label, upto, "full", "no prompts of this length: full prefill"))
            continue
        if n_choose < need:
            raise ConfigError(
                f"bucket {label}: {n_choose} prompts in the choosing half; the target {target.describe()} at "
                f"{target.confidence:.0%} confidence needs at least {need} there (about {2 * need} prompts of "
                "this length in all), or a lower target")
        cands = [c for name in methods if (c := measure(choose_recs, name, target)) is not None]
        seen[label] = cands
        ok = [c for c in cands if c.meets(target)]
        met_somewhere |= bool(ok)
        for c in cands:
            bound = c.low if target.is_floor else -c.high
            if closest is None or bound > (closest.low if target.is_floor else -closest.high):
                closest = c
        best = max(ok, key=lambda c: c.ttft_ratio, default=None)
        if best is None:
            reason = f"no candidate met {target.describe()}: full prefill"
            out.append(ProfileBucket(label, upto, "full", reason, n_choose=n_choose, n_report=n_report))
            continue
        if best.ttft_ratio < min_speedup:
            reason = f"the fastest that met the target ({best.method}, {best.ttft_ratio:.2f}x) is under {min_speedup:g}x"
            out.append(ProfileBucket(label, upto, "full", reason, n_choose=n_choose, n_report=n_report))
            continue
        held = measure(report_recs, best.method, target)
        out.append(ProfileBucket(
            label, upto, methods[best.method],
            f"the fastest of {len(ok)} meeting {target.describe()} on the choosing half "
            f"({best.fidelity:.2f} [{best.low:.2f}, {best.high:.2f}], {best.ttft_ratio:.2f}x)",
            ttft_ratio=held.ttft_ratio if held else None, fidelity=held.fidelity if held else None,
            fidelity_ci=(held.low, held.high) if held else None, n_choose=n_choose, n_report=n_report))
    if not met_somewhere and closest is not None:
        raise ConfigError(
            f"no candidate meets {target.describe()} in any length bucket; the closest is {closest.method} at "
            f"{closest.fidelity:.2f} [{closest.low:.2f}, {closest.high:.2f}] ({closest.ttft_ratio:.2f}x): lower the "
            "target, or serve full prefill")
    return out, seen


# --------------------------------------------------------------------------- running
def tune(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_name: str, prompts: Sequence[TunePrompt],
    candidates: Mapping[str, Method], specs: Mapping[str, str], target: Target, *, records_path: str | Path,
    threads: int, resume: bool = False, max_new_tokens: int | None = None, min_speedup: float = 1.1,
    buckets: Sequence[tuple[str, int | None]] = DEFAULT_BUCKETS, meta: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> tuple[TuneProfile, dict[str, list[Candidate]]]:
    """Run full prefill and every candidate on every prompt, then :func:`choose`.

    Args:
        candidates: name -> method (full prefill is added); specs: name -> the spec the profile
            records for it.
        records_path: the result file (``.jsonl``; appended as runs finish; ``resume`` continues it).
        max_new_tokens: tokens per run: 1 for the first-token and KL targets (prefill only),
            else 32 unless given.

    Returns:
        The profile and the choosing half's figures per bucket.
    """
    budget = max_new_tokens or (32 if target.measure == "identical" else 1)
    header = {"task": "tune", "model": model_name, "target": target.describe(), "n": len(prompts),
              "max_new_tokens": budget, "methods": {FULL: "full", **{k: specs[k] for k in candidates}},
              "prompts": [p.id for p in prompts], "warmup": 1, **environment(threads, model), **(dict(meta or {}))}
    log = RecordLog(records_path, header, resume=resume, overwrite=not resume,
                    match=("model", "dtype", "max_new_tokens", "methods", "prompts"))
    by_bucket: dict[str, list[TunePrompt]] = {}
    for p in prompts:
        by_bucket.setdefault(p.bucket, []).append(p)
    for label, group in by_bucket.items():
        samples = [PromptSample(p.id, p.input_ids) for p in group]
        run_samples(model, tokenizer, Unscored(), samples, candidates, length=None, max_new_tokens=budget,
                    progress=progress, desc=f"tune {label}", done={(r.sample_id, r.method) for r in log.records},
                    on_record=log.append)
    buckets_out, seen = choose(log.records, prompts, specs, target, buckets, min_speedup)
    profile = TuneProfile(model=model_name, fingerprint=weights_fingerprint(model),
                          tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), target=target,
                          buckets=tuple(buckets_out), meta={"records": str(records_path), **(dict(meta or {}))},
                          dtype=dtype_name(model.dtype))
    return profile, seen


def plot_frontier(seen: Mapping[str, Sequence[Candidate]], profile: TuneProfile, path: str | Path) -> Path:
    """Fidelity (y, with its interval) against TTFT ratio (x) of every candidate per bucket
    (choosing half), the target as a line and the chosen point marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [b.label for b in profile.buckets if b.label in seen]
    fig, axes = plt.subplots(1, max(1, len(labels)), figsize=(4.2 * max(1, len(labels)), 3.6), squeeze=False)
    chosen = {b.label: b.method for b in profile.buckets}
    spec_of = profile.meta.get("specs", {})
    for ax, label in zip(axes[0], labels, strict=False):
        for c in seen[label]:
            is_chosen = spec_of.get(c.method, c.method) == chosen[label]
            ax.errorbar([c.ttft_ratio], [c.fidelity], yerr=[[c.fidelity - c.low], [c.high - c.fidelity]],
                        fmt="*" if is_chosen else "o", ms=12 if is_chosen else 5, capsize=2,
                        color="C3" if is_chosen else "C0")
            ax.annotate(c.method, (c.ttft_ratio, c.fidelity), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axhline(profile.target.value, color="grey", ls="--", lw=0.8)
        ax.axvline(1.0, color="grey", ls=":", lw=0.8)
        ax.set_title(f"{label} tokens: {chosen[label]}", fontsize=8)
        ax.set_xlabel("TTFT ratio vs full prefill")
        ax.set_ylabel(profile.target.measure)
    fig.suptitle(f"{profile.model}: {profile.target.describe()} (choosing half)", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
