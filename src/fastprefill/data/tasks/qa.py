"""Question answering over long contexts: ``multidoc-qa`` (HotpotQA) and ``singledoc-qa`` (SQuAD v2).

``multidoc-qa``
    LongBench-style multi-document QA on HotpotQA dev (distractor setting): the question's two
    gold paragraphs plus distractors (the record's own first, then random paragraphs of other
    records) until the prompt reaches the target length, in a seeded random order. LongBench's
    ``hotpotqa`` prompt. Scored by LongBench/SQuAD token F1.
``singledoc-qa``
    An answerable SQuAD v2 dev question; its paragraph sits at a seeded random position among
    paragraphs of other articles (LongBench ``multifieldqa_en`` prompt). F1 and exact match.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fastprefill.data import metrics, sources
from fastprefill.data.tasks.base import RecordTask, Sample
from fastprefill.data.tasks.sizing import Encoder, Overhead, Unit, fit_prompt
from fastprefill.data.tasks.spans import span_of, token_positions_in_spans

__all__ = ["MultiDocQATask", "SingleDocQATask"]



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
class MultiDocQATask(RecordTask):
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
        encoder: Encoder,
        overhead: Overhead,
        record: sources.HotpotRecord,
        length: int | None,
        seed: int,
    ) -> Sample:
        assert length is not None
        rng = random.Random(f"{self.name}/{seed}/{record.id}")
        gold = [Unit(text, rng.random(), title) for title, text in record.gold]

        def distractors() -> Iterator[Unit]:
            used = {title for title, _ in record.paragraphs}
            for title, text in record.distractors:
                yield Unit(text, rng.random(), title)
            pool = sources.hotpotqa_paragraphs()
            for _ in range(len(pool)):
                title, text = pool[rng.randrange(len(pool))]
                if title not in used:
                    used.add(title)
                    yield Unit(text, rng.random(), title)

        def layout(chosen: Sequence[Unit]) -> list[Unit]:
            return sorted([*gold, *chosen], key=lambda u: u.key)

        def render(chosen: Sequence[Unit]) -> str:
            passages = layout(chosen)
            context = "\n".join(f"Passage {i}:\n{u.title}\n{u.text}" for i, u in enumerate(passages, 1))
            return _HOTPOT_TEMPLATE.format(context=context, input=record.question)

        prompt, ids, chosen = fit_prompt(
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

    def gold_token_positions(self, sample: Sample, tokenizer: Any) -> torch.Tensor:
        """Ascending positions ``(G,)`` of the gold passages' tokens, each passage's title line
        included (``"<title>\\n<text>"``, not its ``Passage i:`` header).

        Args:
            tokenizer: the tokenizer ``sample`` was built with (a fast one: offsets are used).
        """
        record = {r.id: r for r in sources.hotpotqa()}[sample.id]
        spans = [span_of(sample, f"\n{title}\n{text}") for title, text in record.gold]
        return token_positions_in_spans(sample, tokenizer, [(start + 1, end) for start, end in spans])


# --------------------------------------------------------------------------- singledoc-qa

_SQUAD_TEMPLATE = (
    "Read the following text and answer briefly.\n\n{context}\n\n"
    "Now, answer the following question based on the above text, only give me the answer and do "
    "not output any other words.\n\nQuestion: {input}\nAnswer:"
)


@dataclass(frozen=True)
class SingleDocQATask(RecordTask):
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
        encoder: Encoder,
        overhead: Overhead,
        question: sources.SquadQuestion,
        length: int | None,
        seed: int,
    ) -> Sample:
        assert length is not None
        rng = random.Random(f"{self.name}/{seed}/{question.id}")
        gold = Unit(question.context, rng.random(), label=question.paragraph_key)
        article = question.paragraph_key.rpartition("/")[0]

        def others() -> Iterator[Unit]:
            pool = [p for p in sources.squad_paragraphs() if p[0].rpartition("/")[0] != article]
            rng.shuffle(pool)
            for key, text in pool:
                yield Unit(text, rng.random(), label=key)

        def layout(chosen: Sequence[Unit]) -> list[Unit]:
            return sorted([gold, *chosen], key=lambda u: u.key)

        def render(chosen: Sequence[Unit]) -> str:
            context = "\n\n".join(u.text for u in layout(chosen))
            return _SQUAD_TEMPLATE.format(context=context, input=question.question)

        prompt, ids, chosen = fit_prompt(
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
