"""Benchmark tasks built from packaged public data, sized in tokens of the target tokenizer.

Four tasks (see :data:`TASKS`):

``multidoc-qa``
    LongBench-style multi-document QA on HotpotQA dev (distractor setting): the question's two
    gold paragraphs plus distractors (the record's own first, then random paragraphs of other
    records) until the prompt reaches the target length, in a seeded random order. LongBench's
    ``hotpotqa`` prompt. Scored by LongBench/SQuAD token F1.
``singledoc-qa``
    An answerable SQuAD v2 dev question; its paragraph sits at a seeded random position among
    paragraphs of other articles (LongBench ``multifieldqa_en`` prompt). F1 and exact match.
``needle``
    Passkey retrieval: ``"The pass key is 71432. Remember it. 71432 is the pass key."`` inserted
    at a sentence boundary at a given depth of Paul Graham essay text. Exact retrieval.
``humaneval``
    The HumanEval prompts as an instruction to complete the function (natural length, not
    sized). The completion is executed with the tests only through :mod:`.sandbox`. pass@1.
``humaneval-completion``
    The original HumanEval protocol (Chen et al., 2021): the raw problem prompt, no chat
    template; the model continues the function body, cut at the first line that starts a new
    top-level statement (``def``, ``class``, ``if``, ``print``, ``#``, a code fence). Outputs
    are shorter than ``humaneval``'s (no restated signature and docstring), so cheaper to decode.

Every prompt but ``humaneval-completion``'s is the user turn of the tokenizer's chat template when it has one
(``apply_chat_template(..., add_generation_prompt=True)``), else the raw text. ``Sample.input_ids``
are ``tokenizer(prompt, add_special_tokens=False)`` for templated prompts (the template already
holds BOS and the like, and this equals ``apply_chat_template(..., tokenize=True)``) and
``tokenizer(prompt)`` otherwise. A sized prompt has at most ``length`` ids and at least
``length - max(2, length // 256)`` (within 0.4 %), unless not one more word fits: whole
passages are added, then the next one is cut at a word boundary. The cut is found from one
batched tokenisation (with offsets) of the candidate passages, corrected by real tokenisations
of the whole prompt: about two per sample, so 50 samples of 4k tokens take a second or two.

**Splits.** Question records are split by a stable hash of their source id
(:func:`split_of`: SHA-256, ~20 % ``dev``, the rest ``test``); SQuAD by the id of the question's
paragraph, so ``dev`` and ``test`` never share a gold paragraph either. The needle haystacks come
from disjoint regions of the essay text (the first 20 % of its sentences for ``dev``). Distractor
pools are shared. Tune on ``dev``; report on ``test``.

**Determinism.** Samples depend only on (task, tokenizer, length, split, seed) and are stable in
``n``: ``build(n=5)[:3] == build(n=3)``. (Where in the tolerance window a prompt ends may depend
on the samples built before it in the same call, whose sizes tune the first guess.)
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastprefill.data import metrics, sources
from fastprefill.data.sandbox import run_python
from fastprefill.errors import ConfigError

__all__ = [
    "DEV_FRACTION",
    "SPLITS",
    "TASKS",
    "HumanEvalCompletionTask",
    "HumanEvalTask",
    "MultiDocQATask",
    "NeedleTask",
    "Sample",
    "SingleDocQATask",
    "Task",
    "build_samples",
    "cut_completion",
    "extract_code",
    "get_task",
    "humaneval_program",
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


# --------------------------------------------------------------------------- prompt encoding


class _Encoder:
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

    def word_counts(self, units: Sequence[_Unit]) -> list[list[int]]:
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


# --------------------------------------------------------------------------- sizing

_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class _Unit:
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
class _Overhead:
    """Tokens a unit adds beyond its own text and title (separators, "Passage i:" headers).

    Starts from a per-task guess and learns from every fitted sample of a build, so the first
    guess of the next sample lands close to the target.
    """

    per_unit: float

    def observe(self, extra_tokens: float, n_units: int) -> None:
        if n_units:
            self.per_unit = 0.5 * self.per_unit + 0.5 * extra_tokens / n_units


def _fit(
    encoder: _Encoder,
    render: Callable[[Sequence[_Unit]], str],
    units: Iterator[_Unit],
    length: int,
    describe: str,
    overhead: _Overhead,
) -> tuple[str, list[int], list[_Unit]]:
    """Fill the prompt with filler units, word by word, up to ``length`` tokens.

    ``render(chosen)`` builds the user message from the chosen units, in draw order (the last
    may be cut at a word boundary). The search runs over the flat word position ``p`` (whole
    units, then words of the next one): an estimate from per-unit token counts, corrected by
    each real measurement of the whole prompt, proposes ``p``; it stops at a prompt of at most
    ``length`` tokens and at least ``length - tolerance`` (or when no word more fits). Typically
    two or three tokenisations of the full prompt per sample. ``overhead`` improves the first
    guess and learns from the result.

    Returns:
        ``(prompt, ids, chosen units)``.

    Raises:
        ConfigError: the prompt without filler already exceeds ``length`` (the message names
            the minimum), or the source runs out of text before ``length`` is reached.
    """
    tolerance = max(2, length // 256)
    aim = length - tolerance / 2  # estimates err both ways: aim at the middle of the window
    memo: dict[int, tuple[str, list[int]]] = {}
    pool: list[_Unit] = []
    counts: list[list[int]] = []  # counts[i][w]: tokens of unit i's first w words (with title)
    first_word: list[int] = [0]  # first_word[i]: flat position of unit i's first word
    whole: list[int] = [0]  # whole[i]: estimated tokens of units < i (overheads excluded)

    def locate(p: int) -> tuple[int, int]:
        k = bisect.bisect_right(first_word, p) - 1
        return k, p - first_word[k]

    def chosen(p: int) -> list[_Unit]:
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
            f"length={length} is too small for {describe}: the prompt without filler text already "
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
            f"length={length} is too large for {describe}: the source text runs out at {measure(lo)} tokens"
        )
    prompt, ids = memo[lo]
    own, n_units = text_tokens(lo)
    overhead.observe(len(ids) - base - own, n_units)
    return prompt, ids, chosen(lo)


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
            if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
                raise ConfigError(f"{self.name}: length must be a positive int (tokens), got {length!r}")
        elif length is not None:
            raise ConfigError(
                f"{self.name} prompts have their natural length: pass length=None, got {length!r}"
            )
        return self._build(_Encoder(tokenizer), length, n, split, seed)

    @abstractmethod
    def source_ids(self, split: Split) -> frozenset[str]:
        """The ids of the source records whose questions go into ``split``."""

    @abstractmethod
    def _build(
        self, encoder: _Encoder, length: int | None, n: int | None, split: Split, seed: int
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


class _RecordTask(Task):
    """A task with one sample per source record, records split by :func:`split_of` of a key."""

    initial_overhead: ClassVar[float] = 0.0  # first guess of the tokens a filler unit adds

    @abstractmethod
    def _records(self) -> Sequence[Any]: ...

    @abstractmethod
    def _keys(self, record: Any) -> tuple[str, str]:
        """``(record id, split key)`` of a record."""

    @abstractmethod
    def _sample(
        self, encoder: _Encoder, overhead: _Overhead, record: Any, length: int | None, seed: int
    ) -> Sample: ...

    def _in_split(self, split: Split) -> list[Any]:
        return [r for r in self._records() if split_of(self._keys(r)[1]) == split]

    def source_ids(self, split: Split) -> frozenset[str]:
        return frozenset(self._keys(r)[0] for r in self._in_split(split))

    def _build(
        self, encoder: _Encoder, length: int | None, n: int | None, split: Split, seed: int
    ) -> list[Sample]:
        chosen = _pick(self._in_split(split), n, f"{self.name}/{split}/{seed}", self.name, split)
        overhead = _Overhead(per_unit=self.initial_overhead)
        return [self._sample(encoder, overhead, record, length, seed) for record in chosen]


def _qa_scores(sample: Sample, output_text: str) -> dict[str, float]:
    f1 = metrics.qa_f1(output_text, sample.answers)
    return {"score": f1, "f1": f1, "em": metrics.exact_match(output_text, sample.answers)}


# --------------------------------------------------------------------------- multidoc-qa

_HOTPOT_INSTRUCTION = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
_HOTPOT_TEMPLATE = (
    _HOTPOT_INSTRUCTION
    + "\n\nThe following are given passages.\n{context}\n\n"
    + _HOTPOT_INSTRUCTION
    + "\n\nQuestion: {input}\nAnswer:"
)


@dataclass(frozen=True)
class MultiDocQATask(_RecordTask):
    """LongBench-style multi-document QA on HotpotQA (see the module docstring)."""

    name: ClassVar[str] = "multidoc-qa"
    default_max_new_tokens: ClassVar[int] = 32
    initial_overhead: ClassVar[float] = 7.0  # "Passage 12:" and the line break

    def _records(self) -> Sequence[sources.HotpotRecord]:
        return sources.hotpotqa()

    def _keys(self, record: sources.HotpotRecord) -> tuple[str, str]:
        return record.id, record.id

    def _sample(
        self,
        encoder: _Encoder,
        overhead: _Overhead,
        record: sources.HotpotRecord,
        length: int | None,
        seed: int,
    ) -> Sample:
        assert length is not None
        rng = random.Random(f"{self.name}/{seed}/{record.id}")
        gold = [_Unit(text, rng.random(), title) for title, text in record.gold]

        def distractors() -> Iterator[_Unit]:
            used = {title for title, _ in record.paragraphs}
            for title, text in record.distractors:
                yield _Unit(text, rng.random(), title)
            pool = sources.hotpotqa_paragraphs()
            for _ in range(len(pool)):
                title, text = pool[rng.randrange(len(pool))]
                if title not in used:
                    used.add(title)
                    yield _Unit(text, rng.random(), title)

        def layout(chosen: Sequence[_Unit]) -> list[_Unit]:
            return sorted([*gold, *chosen], key=lambda u: u.key)

        def render(chosen: Sequence[_Unit]) -> str:
            passages = layout(chosen)
            context = "\n".join(f"Passage {i}:\n{u.title}\n{u.text}" for i, u in enumerate(passages, 1))
            return _HOTPOT_TEMPLATE.format(context=context, input=record.question)

        prompt, ids, chosen = _fit(
            encoder, render, distractors(), length, f"{self.name} (record {record.id})", overhead
        )
        titles = [u.title for u in layout(chosen)]
        return Sample(
            task=self.name,
            id=record.id,
            prompt=prompt,
            input_ids=ids,
            answers=(record.answer,),
            meta={
                "question": record.question,
                "type": record.type,
                "gold_titles": record.gold_titles,
                "gold_positions": tuple(i for i, t in enumerate(titles, 1) if t in record.gold_titles),
                "n_passages": len(titles),
            },
        )

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return _qa_scores(sample, output_text)


# --------------------------------------------------------------------------- singledoc-qa

_SQUAD_TEMPLATE = (
    "Read the following text and answer briefly.\n\n{context}\n\n"
    "Now, answer the following question based on the above text, only give me the answer and do "
    "not output any other words.\n\nQuestion: {input}\nAnswer:"
)


@dataclass(frozen=True)
class SingleDocQATask(_RecordTask):
    """SQuAD v2 (answerable) question, its paragraph among others (see the module docstring)."""

    name: ClassVar[str] = "singledoc-qa"
    default_max_new_tokens: ClassVar[int] = 32
    initial_overhead: ClassVar[float] = 1.0  # the blank line between paragraphs

    def _records(self) -> Sequence[sources.SquadQuestion]:
        return sources.squad()

    def _keys(self, record: sources.SquadQuestion) -> tuple[str, str]:
        return record.id, record.paragraph_key

    def _sample(
        self,
        encoder: _Encoder,
        overhead: _Overhead,
        question: sources.SquadQuestion,
        length: int | None,
        seed: int,
    ) -> Sample:
        assert length is not None
        rng = random.Random(f"{self.name}/{seed}/{question.id}")
        gold = _Unit(question.context, rng.random(), label=question.paragraph_key)
        article = question.paragraph_key.rpartition("/")[0]

        def others() -> Iterator[_Unit]:
            pool = [p for p in sources.squad_paragraphs() if p[0].rpartition("/")[0] != article]
            rng.shuffle(pool)
            for key, text in pool:
                yield _Unit(text, rng.random(), label=key)

        def layout(chosen: Sequence[_Unit]) -> list[_Unit]:
            return sorted([gold, *chosen], key=lambda u: u.key)

        def render(chosen: Sequence[_Unit]) -> str:
            context = "\n\n".join(u.text for u in layout(chosen))
            return _SQUAD_TEMPLATE.format(context=context, input=question.question)

        prompt, ids, chosen = _fit(
            encoder, render, others(), length, f"{self.name} (question {question.id})", overhead
        )
        keys = [u.label for u in layout(chosen)]
        return Sample(
            task=self.name,
            id=question.id,
            prompt=prompt,
            input_ids=ids,
            answers=question.answers,
            meta={
                "question": question.question,
                "paragraph_key": question.paragraph_key,
                "gold_position": keys.index(question.paragraph_key) + 1,
                "n_paragraphs": len(keys),
            },
        )

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        return _qa_scores(sample, output_text)


# --------------------------------------------------------------------------- needle

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
        self, encoder: _Encoder, length: int | None, n: int | None, split: Split, seed: int
    ) -> list[Sample]:
        assert length is not None
        count = len(self.depths) if n is None else n
        overhead = _Overhead(per_unit=0.0)
        return [self._sample(encoder, overhead, length, split, seed, i) for i in range(count)]

    def _sample(
        self, encoder: _Encoder, overhead: _Overhead, length: int, split: Split, seed: int, index: int
    ) -> Sample:
        rng = random.Random(f"{self.name}/{split}/{seed}/{index}")
        region = _needle_region(split)
        sentences = _essay_sentences()
        start = rng.choice(region)
        passkey = str(rng.randint(10_000, 99_999))
        depth = self._depth(index)
        needle = _NEEDLE.format(key=passkey)

        def haystack() -> Iterator[_Unit]:
            offset = start - region.start
            for j in range(len(region)):
                yield _Unit(sentences[region.start + (offset + j) % len(region)])

        def render(chosen: Sequence[_Unit]) -> str:
            texts = [u.text for u in chosen]
            at, _ = _needle_position(texts, depth)
            return _NEEDLE_TEMPLATE.format(context=" ".join([*texts[:at], needle, *texts[at:]]))

        prompt, ids, chosen = _fit(
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

    def depth_of(self, sample_id: str) -> float:
        """The requested needle depth of the sample with id ``"<split>-<seed>-<index>"``."""
        return self._depth(int(sample_id.rsplit("-", 1)[1]))

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        hit = metrics.needle_score(output_text, sample.answers[0])
        return {"score": hit, "retrieved": hit}


# --------------------------------------------------------------------------- humaneval

_HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, including its "
    "signature and any imports it needs, in a single ```python code block.\n\n```python\n{prompt}\n```"
)
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def _defines(code: str, entry_point: str) -> bool:
    """Whether ``code`` has a ``def entry_point(`` line."""
    return re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def extract_code(output: str, entry_point: str | None = None) -> str:
    """The code in a model's answer: the first fenced block that defines ``entry_point`` (else
    the first fenced block; an unclosed final block counts), or the raw output if there is none.
    A trailing ``if __name__ == "__main__":`` section is dropped."""
    blocks = _CODE_BLOCK.findall(output)
    code = output
    if blocks:
        code = blocks[0]
        if entry_point is not None:
            defining = [b for b in blocks if _defines(b, entry_point)]
            code = defining[0] if defining else code
    main = re.search(r"^if\s+__name__\s*==", code, re.MULTILINE)
    return code[: main.start()] if main else code


def humaneval_program(problem_prompt: str, code: str, test: str, entry_point: str) -> str:
    """The program that checks a completion: the problem prompt (imports, helpers, signature),
    then the completion (a whole function that redefines the stub, or the body that continues
    it), then the problem's tests and ``check(entry_point)``."""
    if _defines(code, entry_point):
        solution = problem_prompt.rstrip() + "\n\n\n" + code
    else:
        solution = problem_prompt + code
    return f"{solution.rstrip()}\n\n\n{test.strip()}\n\n\ncheck({entry_point})\n"


@dataclass(frozen=True)
class HumanEvalTask(_RecordTask):
    """HumanEval completion, executed in :func:`~fastprefill.data.sandbox.run_python`."""

    name: ClassVar[str] = "humaneval"
    default_max_new_tokens: ClassVar[int] = 512
    sized: ClassVar[bool] = False
    timeout: float = 10.0
    memory_mb: int = 1024

    def _records(self) -> Sequence[sources.HumanEvalProblem]:
        return sources.humaneval()

    def _keys(self, record: sources.HumanEvalProblem) -> tuple[str, str]:
        return record.task_id, record.task_id

    def _encode(self, encoder: _Encoder, problem: sources.HumanEvalProblem) -> tuple[str, list[int]]:
        """The prompt text and ids for ``problem``."""
        return encoder.encode(_HUMANEVAL_TEMPLATE.format(prompt=problem.prompt.rstrip()))

    def _code(self, sample: Sample, output_text: str) -> str:
        """The code of an output that is run after the problem prompt."""
        return extract_code(output_text, sample.meta["entry_point"])

    def _sample(
        self,
        encoder: _Encoder,
        overhead: _Overhead,
        problem: sources.HumanEvalProblem,
        length: int | None,
        seed: int,
    ) -> Sample:
        prompt, ids = self._encode(encoder, problem)
        return Sample(
            task=self.name,
            id=problem.task_id,
            prompt=prompt,
            input_ids=ids,
            answers=(problem.canonical_solution,),
            meta={"code_prompt": problem.prompt, "test": problem.test, "entry_point": problem.entry_point},
        )

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        program = humaneval_program(
            sample.meta["code_prompt"], self._code(sample, output_text), sample.meta["test"],
            sample.meta["entry_point"],
        )
        result = run_python(program, timeout=self.timeout, memory_mb=self.memory_mb)
        passed = float(result.passed)
        return {"score": passed, "passed": passed, "timeout": float(result.status == "timeout")}

    def stop(self, sample: Sample) -> Callable[[str], bool]:
        """True once the output holds a closed code block that defines the entry point.

        :func:`extract_code` scores the first such block, so later text (the explanation
        instruction-tuned models add after the code) cannot change the score."""
        entry_point = sample.meta["entry_point"]

        def closed_definition(text: str) -> bool:
            return any(m.group(0).endswith("```") and _defines(m.group(1), entry_point)
                       for m in _CODE_BLOCK.finditer(text))

        return closed_definition


#: Where a raw HumanEval continuation ends: a line that starts a new top-level statement.
COMPLETION_STOPS: tuple[str, ...] = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\n```", "\nassert ")


def cut_completion(text: str) -> str | None:
    """``text`` up to the first :data:`COMPLETION_STOPS` sequence, or ``None`` if there is none."""
    cuts = [i for i in (text.find(stop) for stop in COMPLETION_STOPS) if i >= 0]
    return text[: min(cuts)] if cuts else None


@dataclass(frozen=True)
class HumanEvalCompletionTask(HumanEvalTask):
    """HumanEval as code completion: raw prompt in, function body out (see the module doc)."""

    name: ClassVar[str] = "humaneval-completion"
    default_max_new_tokens: ClassVar[int] = 384

    def _encode(self, encoder: _Encoder, problem: sources.HumanEvalProblem) -> tuple[str, list[int]]:
        return problem.prompt, list(encoder.tokenizer(problem.prompt, add_special_tokens=False)["input_ids"])

    def _code(self, sample: Sample, output_text: str) -> str:
        body = cut_completion(output_text)
        return output_text if body is None else body

    def stop(self, sample: Sample) -> Callable[[str], bool]:
        """True once the continuation holds a stop sequence: what follows is never scored."""
        return lambda text: cut_completion(text) is not None


# --------------------------------------------------------------------------- registry

TASKS: dict[str, Task] = {
    task.name: task
    for task in (MultiDocQATask(), SingleDocQATask(), NeedleTask(), HumanEvalTask(), HumanEvalCompletionTask())
}


def get_task(name: str) -> Task:
    """The registered task called ``name``.

    Raises:
        ConfigError: no such task (the message lists the known ones).
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


def build_samples(
    task: str | Task,
    tokenizer: Any,
    length: int | None,
    n: int | None,
    split: Split = "test",
    seed: int = 0,
) -> list[Sample]:
    """``get_task(task).build(tokenizer, length, n, split, seed)`` (a :class:`Task` is used as is)."""
    resolved = get_task(task) if isinstance(task, str) else task
    return resolved.build(tokenizer, length, n, split=split, seed=seed)
