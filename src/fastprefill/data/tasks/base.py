"""The task contract (:class:`Task`, :class:`Sample`), the dev/test splits and record picking.

**Splits.** Question records are split by a stable hash of their source id
(:func:`split_of`: SHA-256, ~20 % ``dev``, the rest ``test``); SQuAD by the id of the question's
paragraph, so ``dev`` and ``test`` never share a gold paragraph either. The needle haystacks come
from disjoint regions of the essay text (the first 20 % of its sentences for ``dev``). Distractor
pools are shared. Tune on ``dev``; report on ``test``.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastprefill.data.tasks.sizing import Encoder, Overhead
from fastprefill.errors import ConfigError, is_int

__all__ = [
    "DEV_FRACTION",
    "SPLITS",
    "RecordTask",
    "Sample",
    "Split",
    "Task",
    "split_of",
]

Split = Literal["dev", "test"]
SPLITS: tuple[Split, ...] = ("dev", "test")
DEV_FRACTION = 0.2


@dataclass(frozen=True)
class Sample:
    """One prompt ready for the engine, with what is needed to score the output.

    ``prompt`` is the final text (chat template applied); ``input_ids`` are its token ids.
    ``answers`` are the gold answers (for ``humaneval``, the canonical solution). ``meta`` holds
    task details (question, positions, passkey, tests...); treat it as read-only.
    """

    task: str
    id: str
    prompt: str
    input_ids: list[int]
    answers: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)


def split_of(record_id: str) -> Split:
    """The split of a source record: ``"dev"`` for ~20 % of ids (stable SHA-256 hash), else ``"test"``."""
    bucket = int.from_bytes(hashlib.sha256(record_id.encode("utf-8")).digest()[:8], "big") % 10_000
    return "dev" if bucket < DEV_FRACTION * 10_000 else "test"


# --------------------------------------------------------------------------- the task contract


class Task(ABC):
    """A benchmark task: builds prompts of a given token length and scores model outputs.

    Subclasses set ``name``, ``default_max_new_tokens`` and ``sized`` (whether ``length`` applies)
    and implement :meth:`source_ids`, :meth:`_build` and :meth:`score`.
    """

    name: ClassVar[str]
    default_max_new_tokens: ClassVar[int]
    sized: ClassVar[bool] = True

    def build(
        self, tokenizer: Any, length: int | None, n: int | None, split: Split = "test", seed: int = 0
    ) -> list[Sample]:
        """Build ``n`` samples (all of the split if ``None``) of at most ``length`` prompt tokens.

        Args:
            tokenizer: the target model's ``PreTrainedTokenizerBase``.
            length: the prompt length in tokens (chat template included); must be ``None`` for
                unsized tasks (``humaneval``).
            n: how many samples; ``None`` for every record of the split.
            split: ``"dev"`` to tune on, ``"test"`` to report on.
            seed: the selection and layout seed.

        Raises:
            ConfigError: a bad argument, or ``length`` too small for a sample (the message
                names the minimum).
        """
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        if n is not None and (not isinstance(n, int) or n < 0):
            raise ConfigError(f"n must be a non-negative int or None, got {n!r}")
        if self.sized:
            if not is_int(length, 1):
                raise ConfigError(f"{self.name}: length must be a positive int (tokens), got {length!r}")
        elif length is not None:
            raise ConfigError(
                f"{self.name} prompts have their natural length: pass length=None, got {length!r}"
            )
        return self._build(Encoder(tokenizer), length, n, split, seed)

    @abstractmethod
    def source_ids(self, split: Split) -> frozenset[str]:
        """The ids of the source records whose questions go into ``split``."""

    @abstractmethod
    def _build(
        self, encoder: Encoder, length: int | None, n: int | None, split: Split, seed: int
    ) -> list[Sample]: ...

    @abstractmethod
    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        """Score one generated output; ``"score"`` (in [0, 1]) is the primary metric."""

    def stop(self, sample: Sample) -> Callable[[str], bool] | None:
        """A predicate on the text generated so far that is True once more tokens cannot change
        :meth:`score` (passed to :func:`fastprefill.engine.generate` as ``stop``); ``None``
        (the default) generates up to EOS or the token budget."""
        return None


def _pick(records: Sequence[Any], n: int | None, rng_name: str, task: str, split: str) -> list[Any]:
    """A seeded random order of the split's records, of which the first ``n`` (stable in ``n``)."""
    order = list(records)
    random.Random(rng_name).shuffle(order)
    if n is None:
        return order
    if n > len(order):
        raise ConfigError(f"{task}: split {split!r} has {len(order)} records, asked for n={n}")
    return order[:n]


class RecordTask(Task):
    """A task with one sample per source record, records split by :func:`split_of` of a key."""

    initial_overhead: ClassVar[float] = 0.0  # first guess of the tokens a filler unit adds

    @abstractmethod
    def _records(self) -> Sequence[Any]: ...

    @abstractmethod
    def _keys(self, record: Any) -> tuple[str, str]:
        """``(record id, split key)`` of a record."""

    @abstractmethod
    def _sample(
        self, encoder: Encoder, overhead: Overhead, record: Any, length: int | None, seed: int
    ) -> Sample: ...

    def _in_split(self, split: Split) -> list[Any]:
        return [r for r in self._records() if split_of(self._keys(r)[1]) == split]

    def source_ids(self, split: Split) -> frozenset[str]:
        return frozenset(self._keys(r)[0] for r in self._in_split(split))

    def _build(
        self, encoder: Encoder, length: int | None, n: int | None, split: Split, seed: int
    ) -> list[Sample]:
        chosen = _pick(self._in_split(split), n, f"{self.name}/{split}/{seed}", self.name, split)
        overhead = Overhead(per_unit=self.initial_overhead)
        return [self._sample(encoder, overhead, record, length, seed) for record in chosen]
