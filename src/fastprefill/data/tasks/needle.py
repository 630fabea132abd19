"""``needle``: passkey retrieval in Paul Graham essay text.

The needle ``"The pass key is 71432. Remember it. 71432 is the pass key."`` (a random five-digit
key) is inserted at the sentence boundary closest to a given depth of the haystack. Scored by
exact retrieval of the key.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fastprefill.data import metrics, sources
from fastprefill.data.tasks.base import DEV_FRACTION, Sample, Split, Task
from fastprefill.data.tasks.sizing import Encoder, Overhead, Unit, fit_prompt
from fastprefill.data.tasks.spans import span_of, token_positions_in_spans
from fastprefill.errors import ConfigError

__all__ = ["NeedleTask"]

_NEEDLE_TEMPLATE = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it "
    "and memorize it. I will quiz you about it.\n\n{context}\n\n"
    "What is the pass key? Answer with the pass key only."
)
_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
_SENTENCE_BOUNDARY = re.compile(r"(?<=[.!?])\s+|(?<=[a-z][.!?])(?=[A-Z])")


@functools.cache
def _essay_sentences() -> tuple[str, ...]:
    """The Paul Graham essays split at sentence ends (also where paragraphs run together)."""
    return tuple(s for s in _SENTENCE_BOUNDARY.split(sources.paul_graham_text()) if s.strip())


def _needle_region(split: Split) -> range:
    sentences = _essay_sentences()
    cut = int(len(sentences) * DEV_FRACTION)
    return range(cut) if split == "dev" else range(cut, len(sentences))


def _needle_position(texts: Sequence[str], depth: float) -> tuple[int, float]:
    """The sentence boundary closest to ``depth`` (a fraction of the characters) and its actual depth."""
    ends = [0]
    for text in texts:
        ends.append(ends[-1] + len(text) + 1)
    if ends[-1] == 0:
        return 0, 0.0
    target = depth * ends[-1]
    at = min(range(len(ends)), key=lambda i: abs(ends[i] - target))
    return at, ends[at] / ends[-1]


@dataclass(frozen=True)
class NeedleTask(Task):
    """Passkey retrieval in essay text; sample ``i`` uses ``depths[i % len(depths)]``."""

    name: ClassVar[str] = "needle"
    default_max_new_tokens: ClassVar[int] = 16
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)

    def __post_init__(self) -> None:
        if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(
                f"NeedleTask.depths must be a non-empty tuple of fractions in [0, 1], got {self.depths!r}"
            )

    def source_ids(self, split: Split) -> frozenset[str]:
        """Ids ``"s<index>"`` of the essay sentences the split's haystacks are made of."""
        return frozenset(f"s{i}" for i in _needle_region(split))

    def _build(
        self, encoder: Encoder, length: int | None, n: int | None, split: Split, seed: int
    ) -> list[Sample]:
        assert length is not None
        count = len(self.depths) if n is None else n
        overhead = Overhead(per_unit=0.0)
        return [self._sample(encoder, overhead, length, split, seed, i) for i in range(count)]

    def _sample(
        self, encoder: Encoder, overhead: Overhead, length: int, split: Split, seed: int, index: int
    ) -> Sample:
        rng = random.Random(f"{self.name}/{split}/{seed}/{index}")
        region = _needle_region(split)
        sentences = _essay_sentences()
        start = rng.choice(region)
        passkey = str(rng.randint(10_000, 99_999))
        depth = self._depth(index)
        needle = _NEEDLE.format(key=passkey)

        def haystack() -> Iterator[Unit]:
            offset = start - region.start
            for j in range(len(region)):
                yield Unit(sentences[region.start + (offset + j) % len(region)])

        def render(chosen: Sequence[Unit]) -> str:
            texts = [u.text for u in chosen]
            at, _ = _needle_position(texts, depth)
            return _NEEDLE_TEMPLATE.format(context=" ".join([*texts[:at], needle, *texts[at:]]))

        prompt, ids, chosen = fit_prompt(
            encoder, render, haystack(), length, f"{self.name} (sample {index})", overhead
        )
        _, actual_depth = _needle_position([u.text for u in chosen], depth)
        return Sample(
            task=self.name,
            id=f"{split}-{seed}-{index}",
            prompt=prompt,
            input_ids=ids,
            answers=(passkey,),
            meta={"passkey": passkey, "depth": depth, "actual_depth": actual_depth, "start_sentence": start},
        )

    def _depth(self, index: int) -> float:
        return self.depths[index % len(self.depths)]

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        hit = metrics.needle_score(output_text, sample.answers[0])
        return {"score": hit, "retrieved": hit}

    def gold_token_positions(self, sample: Sample, tokenizer: Any) -> torch.Tensor:
        """Ascending positions ``(G,)`` of the needle sentence's tokens.

        Args:
            tokenizer: the tokenizer ``sample`` was built with (a fast one: offsets are used).
        """
        span = span_of(sample, _NEEDLE.format(key=sample.answers[0]))
        return token_positions_in_spans(sample, tokenizer, [span])
