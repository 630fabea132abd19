"""Token-budget fitting: fill a prompt with filler text up to a length in tokens.

A sized prompt has at most ``length`` ids and at least ``length - max(2, length // 256)``
(within 0.4 %), unless not one more word fits: whole filler units (passages, paragraphs,
sentences) are added, then the next one is cut at a word boundary. The cut is found from one
batched tokenisation (with offsets) of the candidate units, corrected by real tokenisations of
the whole prompt (see :func:`fit_prompt`).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastprefill.errors import ConfigError

__all__ = ["Encoder", "Overhead", "Unit", "fit_prompt"]


class Encoder:
    """User message -> prompt text (chat template if any) -> token ids, for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, message: str) -> tuple[str, list[int]]:
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
            )
        else:
            text = message
        ids = self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"]
        return text, list(ids)

    def word_counts(self, units: Sequence[Unit]) -> list[list[int]]:
        """For each unit, ``counts[w]``: the tokens of its title line and first ``w`` words
        (``counts[0] == 0``), from one batched tokenisation with offsets (proportional
        estimates for tokenizers without offsets)."""
        if not units:
            return []
        heads = [f"{u.title}\n" if u.title else "" for u in units]
        texts = [head + u.text for head, u in zip(heads, units)]
        if getattr(self.tokenizer, "is_fast", False):
            batch = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            starts = [[start for start, _ in offsets] for offsets in batch["offset_mapping"]]
        else:
            starts = [None] * len(units)
        result = []
        for head, unit, text, token_starts in zip(heads, units, texts, starts):
            ends = [len(head) + m.end() for m in _WORD.finditer(unit.text)]
            if token_starts is None:
                total = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                result.append([0] + [round(total * (i + 1) / len(ends)) for i in range(len(ends))])
            else:
                result.append([0] + [bisect.bisect_left(token_starts, end) for end in ends])
        return result


_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Unit:
    """A piece of filler text (passage, paragraph, sentence) and its place in the final order."""

    text: str
    key: float = 0.0  # units are laid out in ascending key order
    title: str = ""  # rendered (and counted) on its own line before the text
    label: str = ""  # identifies the unit; not rendered


def _truncate_words(text: str, n_words: int) -> str:
    """The first ``n_words`` whitespace-separated words of ``text`` (inner spacing kept)."""
    if n_words <= 0:
        return ""
    ends = [m.end() for m in _WORD.finditer(text)]
    return text[: ends[min(n_words, len(ends)) - 1]] if ends else ""


@dataclass
class Overhead:
    """Tokens a unit adds beyond its own text and title (separators, "Passage i:" headers).

    Starts from a per-task guess and learns from every fitted sample of a build, so the first
    guess of the next sample lands close to the target.
    """

    per_unit: float

    def observe(self, extra_tokens: float, n_units: int) -> None:
        if n_units:
            self.per_unit = 0.5 * self.per_unit + 0.5 * extra_tokens / n_units


def fit_prompt(
    encoder: Encoder,
    render: Callable[[Sequence[Unit]], str],
    units: Iterator[Unit],
    length: int,
    sample_name: str,
    overhead: Overhead,
) -> tuple[str, list[int], list[Unit]]:
    """Fill the prompt with filler units, word by word, up to ``length`` tokens.

    ``render(chosen)`` builds the user message from the chosen units, in draw order (the last
    may be cut at a word boundary). The search runs over the flat word position ``p`` (whole
    units, then words of the next one): an estimate from per-unit token counts, corrected by
    each real measurement of the whole prompt, proposes ``p``; it stops at a prompt of at most
    ``length`` tokens and at least ``length - tolerance`` (or when no word more fits).
    ``overhead`` improves the first guess and learns from the result (see docs/decisions.md for
    what the search costs).

    Returns:
        ``(prompt, ids, chosen units)``.

    Raises:
        ConfigError: the prompt without filler already exceeds ``length`` (the message names
            the minimum), or the source runs out of text before ``length`` is reached.
    """
    tolerance = max(2, length // 256)
    aim = length - tolerance / 2  # estimates err both ways: aim at the middle of the window
    memo: dict[int, tuple[str, list[int]]] = {}
    pool: list[Unit] = []
    counts: list[list[int]] = []  # counts[i][w]: tokens of unit i's first w words (with title)
    first_word: list[int] = [0]  # first_word[i]: flat position of unit i's first word
    whole: list[int] = [0]  # whole[i]: estimated tokens of units < i (overheads excluded)

    def locate(p: int) -> tuple[int, int]:
        k = bisect.bisect_right(first_word, p) - 1
        return k, p - first_word[k]

    def chosen(p: int) -> list[Unit]:
        k, words = locate(p)
        if not words:
            return pool[:k]
        return [*pool[:k], dataclasses.replace(pool[k], text=_truncate_words(pool[k].text, words))]

    def measure(p: int) -> int:
        if p not in memo:
            memo[p] = encoder.encode(render(chosen(p)))
        return len(memo[p][1])

    base = measure(0)
    if base > length:
        raise ConfigError(
            f"length={length} is too small for {sample_name}: the prompt without filler text already "
            f"has {base} tokens; use length >= {base}"
        )

    def text_tokens(p: int) -> tuple[int, int]:
        """(tokens of the units' own text up to ``p``, how many units that is)."""
        k, words = locate(p)
        return whole[k] + (counts[k][words] if words else 0), k + (1 if words else 0)

    def estimate(p: int) -> float:
        own, n_units = text_tokens(p)
        return base + own + n_units * overhead.per_unit

    lo, hi = 0, None  # measure(lo) <= length; measure(hi) > length (None: not found yet)
    correction = 0.0
    exhausted = False
    for _ in range(64):
        # Draw candidates (counted in one batched call per chunk) until they overfill the prompt.
        while hi is None and not exhausted:
            missing = length + length // 32 + 16 - (estimate(first_word[-1]) + correction)
            if missing <= 0:
                break
            chunk, chars = [], 0.0
            while chars < 4.0 * missing:  # ~4 characters per token for English text
                unit = next(units, None)
                if unit is None:
                    exhausted = True
                    break
                chunk.append(unit)
                chars += len(unit.title) + len(unit.text) + 1
            for unit, unit_counts in zip(chunk, encoder.word_counts(chunk)):
                pool.append(unit)
                counts.append(unit_counts)
                first_word.append(first_word[-1] + len(unit_counts) - 1)
                whole.append(whole[-1] + unit_counts[-1])
        limit = first_word[-1] if hi is None else hi - 1
        if limit <= lo:
            break
        # Largest p in (lo, limit] whose corrected estimate fits; at least lo + 1.
        left, right = lo + 1, limit
        if estimate(left) + correction > aim:
            guess = left
        else:
            while left < right:
                mid = (left + right + 1) // 2
                if estimate(mid) + correction <= aim:
                    left = mid
                else:
                    right = mid - 1
            guess = left
        if hi is not None and guess >= hi - 1 and hi - lo > 2:
            guess = (lo + hi) // 2  # the estimate keeps pointing at the bound: bisect
        tokens = measure(guess)
        correction = tokens - estimate(guess)
        if tokens <= length:
            lo = guess
            if length - tokens <= tolerance:
                break
        else:
            hi = guess
    if hi is None and lo == first_word[-1] and exhausted and length - measure(lo) > tolerance:
        raise ConfigError(
            f"length={length} is too large for {sample_name}: the source text runs out at {measure(lo)} tokens"
        )
    prompt, ids = memo[lo]
    own, n_units = text_tokens(lo)
    overhead.observe(len(ids) - base - own, n_units)
    return prompt, ids, chosen(lo)
