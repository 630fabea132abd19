"""Calibration and training text for KV predictors, disjoint from every reported evaluation.

Three sources (:func:`calibration_corpus`):

- **dev-split task prompts** (``task_share`` of the tokens, default at least 25%): prompts of
  the benchmark tasks (:data:`CALIBRATION_TASKS`, from the task registry, ``split="dev"``) in the
  chat template the tasks themselves use, built with seed ``1000 + seed`` so that they differ
  from the seed-0 dev prompts that dev sweeps and gates use; their sample ids are returned so a
  dev evaluation can leave them out. A predictor calibrated on plain text only never sees the
  template's special tokens or a question after a long context, which is what it is used on.
- **Wikipedia paragraphs**: SQuAD paragraphs of the data module's ``dev`` split (never the gold
  paragraph of a ``test`` question) and HotpotQA paragraphs whose titles appear in no ``test``
  record;
- **Python code**: the standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``).

The rest after the task prompts is split between Wikipedia and code by ``code_fraction``.
"""

from __future__ import annotations

import math
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from fastprefill.errors import ConfigError

__all__ = ["CALIBRATION_TASKS", "TASK_SEED_OFFSET", "Corpus", "calibration_corpus", "training_corpus"]

#: Tasks whose dev prompts go into calibration text (the tasks KV Prediction is evaluated on).
CALIBRATION_TASKS: tuple[str, ...] = ("singledoc-qa", "multidoc-qa", "humaneval")
#: Calibration builds its dev prompts with ``seed + TASK_SEED_OFFSET``.
TASK_SEED_OFFSET = 1000


@dataclass
class Corpus:
    """Calibration sequences and where they came from.

    Attributes:
        sequences: ``(1, N)`` int64 each (``N = seq_len``, or shorter for a task prompt).
        task_ids: the dev sample ids whose prompts are in ``sequences``.
        tokens: tokens per source (``"tasks"``, ``"wikipedia"``, ``"code"``).
    """

    sequences: list[torch.Tensor]
    task_ids: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)

    @property
    def task_share(self) -> float:
        """Share of the tokens that are dev task prompts."""
        total = sum(self.tokens.values())
        return self.tokens.get("tasks", 0) / total if total else 0.0


def _wikipedia_paragraphs() -> list[str]:
    """Wikipedia paragraphs outside every ``test`` split (see the module docstring)."""
    from fastprefill.data import sources
    from fastprefill.data.tasks import split_of

    texts = [text for key, text in sources.squad_paragraphs() if split_of(key) == "dev"]
    test_titles = {title for r in sources.hotpotqa() if split_of(r.id) == "test" for title, _ in r.paragraphs}
    texts += [text for title, text in sources.hotpotqa_paragraphs() if title not in test_titles]
    return texts


def _stdlib_sources(limit_chars: int, seed: int) -> list[str]:
    """Python standard-library sources (tests and site-packages excluded), shuffled by ``seed``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts)
    random.Random(seed).shuffle(files)
    out, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return out


def _task_prompts(
    tokenizer: PreTrainedTokenizerBase, n_tokens: int, seq_len: int, tasks: Sequence[str], seed: int
) -> tuple[list[torch.Tensor], list[str]]:
    """Dev prompts of ``tasks`` in turn, each cut to ``seq_len`` tokens, until ``n_tokens``."""
    from fastprefill.data.tasks import get_task

    if n_tokens <= 0 or not tasks:
        return [], []
    per_task = math.ceil(n_tokens / len(tasks) / max(1, seq_len // 4)) + 1
    pools = []
    for name in tasks:
        task = get_task(name)
        try:
            pools.append(task.build(tokenizer, seq_len if task.sized else None, per_task, split="dev",
                                    seed=seed + TASK_SEED_OFFSET))
        except ConfigError as exc:
            raise ConfigError(f"calibration prompts of {name!r} at seq_len={seq_len}: {exc} "
                              "(raise seq_len, or pass task_share=0)") from None
    seqs: list[torch.Tensor] = []
    ids: list[str] = []
    got = 0
    for row in range(per_task):
        for pool in pools:
            if got >= n_tokens:
                return seqs, ids
            if row < len(pool):
                prompt = pool[row].input_ids[:seq_len]
                seqs.append(torch.tensor(prompt, dtype=torch.long)[None])
                ids.append(pool[row].id)
                got += len(prompt)
    return seqs, ids


def calibration_corpus(
    tokenizer: PreTrainedTokenizerBase,
    n_tokens: int,
    seq_len: int,
    seed: int = 0,
    code_fraction: float = 0.5,
    task_share: float = 0.25,
    tasks: Sequence[str] = CALIBRATION_TASKS,
) -> Corpus:
    """About ``n_tokens`` of calibration text, shuffled (see the module docstring).

    Args:
        tokenizer: the base (= aux) tokenizer.
        n_tokens: total tokens wanted.
        seq_len: tokens per sequence (task prompts are cut to it and may be shorter).
        seed: text order and the dev prompts' selection.
        code_fraction: share of the non-task sequences cut from standard-library code.
        task_share: share of the tokens taken from dev-split task prompts (``0`` for none).
        tasks: the tasks those prompts come from.

    Raises:
        ConfigError: ``seq_len < 2``, ``n_tokens < seq_len``, a share outside ``[0, 1]``, or a
            task that cannot build a prompt of ``seq_len`` tokens.
    """
    if seq_len < 2 or n_tokens < seq_len:
        raise ConfigError(f"need seq_len >= 2 and n_tokens >= seq_len, got seq_len={seq_len}, n_tokens={n_tokens}")
    for name, share in (("task_share", task_share), ("code_fraction", code_fraction)):
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {share!r}")
    task_seqs, task_ids = _task_prompts(tokenizer, math.ceil(task_share * n_tokens), seq_len, tasks, seed)
    task_tokens = sum(int(s.shape[1]) for s in task_seqs)
    n_seq = max(0, math.ceil(max(0, n_tokens - task_tokens) / seq_len))
    n_code = round(n_seq * code_fraction)
    rng = random.Random(seed)

    def cut(texts: Sequence[str], count: int) -> list[torch.Tensor]:
        seqs: list[torch.Tensor] = []
        buf: list[int] = []
        for text in texts:
            buf += tokenizer.encode(text + "\n\n", add_special_tokens=False)
            while len(buf) >= seq_len and len(seqs) < count:
                seqs.append(torch.tensor(buf[:seq_len])[None])
                buf = buf[seq_len:]
            if len(seqs) >= count:
                break
        return seqs

    wiki_seqs: list[torch.Tensor] = []
    if n_seq - n_code > 0:
        wiki = _wikipedia_paragraphs()
        rng.shuffle(wiki)
        wiki_seqs = cut(wiki, n_seq - n_code)
    code_seqs = cut(_stdlib_sources(8 * seq_len * n_code + 1, seed), n_code) if n_code else []
    seqs = task_seqs + wiki_seqs + code_seqs
    rng.shuffle(seqs)
    tokens = {"tasks": task_tokens, "wikipedia": len(wiki_seqs) * seq_len, "code": len(code_seqs) * seq_len}
    return Corpus(seqs, task_ids, tokens)


def training_corpus(
    tokenizer: PreTrainedTokenizerBase, n_tokens: int, seq_len: int, seed: int = 0, code_fraction: float = 0.5,
    task_share: float = 0.25,
) -> list[torch.Tensor]:
    """The sequences of :func:`calibration_corpus` (same arguments): ``(1, N)`` int64 each."""
    return calibration_corpus(tokenizer, n_tokens, seq_len, seed, code_fraction, task_share).sequences
