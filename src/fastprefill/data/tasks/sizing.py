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
    search = _Search(encoder, render, units, overhead)
    if search.base > length:
        raise ConfigError(
            f"length={length} is too small for {sample_name}: the prompt without filler text already "
            f"has {search.base} tokens; use length >= {search.base}"
        )
    lo, hi = 0, None  # measure(lo) <= length; measure(hi) > length (None: not found yet)
    correction = 0.0
    for _ in range(64):
        # Draw candidates (counted in one batched call per chunk) until they overfill the prompt.
        while hi is None and not search.exhausted:
            missing = length + length // 32 + 16 - (search.estimate(search.first_word[-1]) + correction)
            if missing <= 0:
                break
            search.draw(missing)
        limit = search.first_word[-1] if hi is None else hi - 1
        if limit <= lo:
            break
        guess = search.largest_fit(lo, limit, aim, correction)
        if hi is not None and guess >= hi - 1 and hi - lo > 2:
            guess = (lo + hi) // 2  # the estimate keeps pointing at the bound: bisect
        tokens = search.measure(guess)
        correction = tokens - search.estimate(guess)
        if tokens <= length:
            lo = guess
            if length - tokens <= tolerance:
                break
        else:
            hi = guess
    if hi is None and lo == search.first_word[-1] and search.exhausted and length - search.measure(lo) > tolerance:
        raise ConfigError(
            f"length={length} is too large for {sample_name}: the source text runs out at {search.measure(lo)} tokens"
        )
    prompt, ids = search.memo[lo]
    own, n_units = search.text_tokens(lo)
    overhead.observe(len(ids) - search.base - own, n_units)
    return prompt, ids, search.chosen(lo)


class _Search:
    """One :func:`fit_prompt` search: the units drawn so far with their word counts, and the real
    measurements of the prompt by flat word position ``p`` (whole units, then words of the next)."""

    def __init__(self, encoder: Encoder, render: Callable[[Sequence[Unit]], str], units: Iterator[Unit],
                 overhead: Overhead) -> None:
        self.encoder, self.render, self.units, self.overhead = encoder, render, units, overhead
        self.memo: dict[int, tuple[str, list[int]]] = {}
        self.pool: list[Unit] = []
        self.counts: list[list[int]] = []  # counts[i][w]: tokens of unit i's first w words (with title)
        self.first_word: list[int] = [0]  # first_word[i]: flat position of unit i's first word
        self.whole: list[int] = [0]  # whole[i]: estimated tokens of units < i (overheads excluded)
        self.exhausted = False  # the source has no more units
        self.base = self.measure(0)  # the prompt without filler

    def locate(self, p: int) -> tuple[int, int]:
        """``(unit index, words of it)`` of flat position ``p``."""
        k = bisect.bisect_right(self.first_word, p) - 1
        return k, p - self.first_word[k]

    def chosen(self, p: int) -> list[Unit]:
        """The units up to ``p``, the last one cut at a word boundary."""
        k, words = self.locate(p)
        if not words:
            return self.pool[:k]
        return [*self.pool[:k], dataclasses.replace(self.pool[k], text=_truncate_words(self.pool[k].text, words))]

    def measure(self, p: int) -> int:
        """The real token count of the prompt filled up to ``p`` (tokenized once per ``p``)."""
        if p not in self.memo:
            self.memo[p] = self.encoder.encode(self.render(self.chosen(p)))
        return len(self.memo[p][1])

    def text_tokens(self, p: int) -> tuple[int, int]:
        """(tokens of the units' own text up to ``p``, how many units that is)."""
        k, words = self.locate(p)
        return self.whole[k] + (self.counts[k][words] if words else 0), k + (1 if words else 0)

    def estimate(self, p: int) -> float:
        """The estimated token count of the prompt filled up to ``p``."""
        own, n_units = self.text_tokens(p)
        return self.base + own + n_units * self.overhead.per_unit

    def draw(self, missing: float) -> None:
        """Draw units worth about ``missing`` tokens from the source and count their words."""
        chunk, chars = [], 0.0
        while chars < 4.0 * missing:  # ~4 characters per token for English text
            unit = next(self.units, None)
            if unit is None:
                self.exhausted = True
                break
            chunk.append(unit)
            chars += len(unit.title) + len(unit.text) + 1
        for unit, unit_counts in zip(chunk, self.encoder.word_counts(chunk)):
            self.pool.append(unit)
            self.counts.append(unit_counts)
            self.first_word.append(self.first_word[-1] + len(unit_counts) - 1)
            self.whole.append(self.whole[-1] + unit_counts[-1])

    def largest_fit(self, lo: int, limit: int, aim: float, correction: float) -> int:
        """The largest ``p`` in ``(lo, limit]`` whose corrected estimate is at most ``aim``; at least ``lo + 1``."""
        left, right = lo + 1, limit
        if self.estimate(left) + correction > aim:
            return left
        while left < right:
            mid = (left + right + 1) // 2
            if self.estimate(mid) + correction <= aim:
                left = mid
            else:
                right = mid - 1
        return left
