"""Document sessions: several questions over one shared document (prefix reuse workloads).

A *session* is one SQuAD v2 article cut to a token budget (its paragraphs in order, as many as
fit) and the answerable questions about the paragraphs kept, in a seeded order. Each question is
its own prompt, the document first (:func:`question_prompt`), so every prompt of a session shares
the document as a prefix (the demo, the peers' prompt sets). ``benchmarks/prefix_bench.py`` also
runs a session as a multi-turn chat and scores its answers.

Sessions come from the articles of one split (an article's split is :func:`split_of` of its
title; whole articles, so no document appears in both splits).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fastprefill.data import sources
from fastprefill.data.tasks.base import SPLITS, Split, split_of
from fastprefill.errors import ConfigError, is_int

__all__ = ["DocumentSession", "document_sessions", "question_prompt"]

_INSTRUCTION = "Read the following text and answer briefly."
_ASK = "Answer the question based on the text above, only give me the answer and do not output any other words."


@dataclass(frozen=True)
class DocumentSession:
    """One document and its questions.

    Attributes:
        id: ``"<article title>@<tokens>"``.
        document: the kept paragraphs, blank-line separated.
        questions: ``(question, answers)`` pairs, each answerable from ``document``.
    """

    id: str
    document: str
    questions: tuple[tuple[str, tuple[str, ...]], ...]


def question_prompt(session: DocumentSession, index: int) -> str:
    """The user message of question ``index``: the instruction, the document, the question."""
    question = session.questions[index][0]
    return f"{_INSTRUCTION}\n\n{session.document}\n\n{_ASK}\n\nQuestion: {question}\nAnswer:"


def document_sessions(
    tokenizer: Any, doc_tokens: int, n: int, questions: int, split: Split = "test", seed: int = 0,
) -> list[DocumentSession]:
    """``n`` sessions of documents of at most ``doc_tokens`` tokens with ``questions`` questions each.

    Articles are taken in a seeded order (stable in ``n``); an article too short for
    ``doc_tokens / 2`` tokens, or whose kept paragraphs have fewer than ``questions`` answerable
    questions, is skipped.

    Args:
        tokenizer: counts the document's tokens (the model's own tokenizer).
        doc_tokens: the document budget in tokens (>= 64).
        n: sessions (>= 1); questions: per session (>= 1).
        split: ``"dev"`` or ``"test"`` (by article).

    Raises:
        ConfigError: a bad argument, or too few articles in the split for ``n`` sessions.
    """
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
    for name, value, low in (("doc_tokens", doc_tokens, 64), ("n", n, 1), ("questions", questions, 1)):
        if not is_int(value, low):
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    by_paragraph: dict[str, list[sources.SquadQuestion]] = defaultdict(list)
    for q in sources.squad():
        by_paragraph[q.paragraph_key].append(q)
    articles: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key, text in sources.squad_paragraphs():
        articles[key.rpartition("/")[0]].append((key, text))
    titles = sorted(t for t in articles if split_of(t) == split)
    random.Random(f"sessions/{split}/{seed}").shuffle(titles)
    out: list[DocumentSession] = []
    for title in titles:
        kept: list[tuple[str, str]] = []
        used = 0
        for key, text in articles[title]:
            cost = len(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
            if used + cost > doc_tokens:
                break
            kept.append((key, text))
            used += cost
        if used < doc_tokens // 2:
            continue
        pool = [q for key, _ in kept for q in by_paragraph[key]]
        if len(pool) < questions:
            continue
        rng = random.Random(f"sessions/{title}/{seed}")
        chosen = rng.sample(pool, questions)
        out.append(DocumentSession(
            id=f"{title}@{doc_tokens}",
            document="\n\n".join(text for _, text in kept),
            questions=tuple((q.question, q.answers) for q in chosen),
        ))
        if len(out) == n:
            return out
    raise ConfigError(f"the {split} split has {len(out)} articles of >= {doc_tokens // 2} tokens with "
                      f"{questions} questions, asked for n={n}; lower doc_tokens, questions or n")
