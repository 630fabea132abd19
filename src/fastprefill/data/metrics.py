"""Answer-quality metrics: SQuAD / LongBench QA F1 and exact match, passkey retrieval, pass@1.

``normalize_answer`` and the token F1 follow the official SQuAD evaluation script, which LongBench
reuses for its QA tasks (``qa_f1_score``): lowercase, drop punctuation, drop the articles
a/an/the, collapse whitespace; F1 over the bag of whitespace tokens. With several gold answers
the best score is taken.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

__all__ = ["exact_match", "needle_score", "normalize_answer", "pass_at_1", "qa_f1", "token_f1"]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lowercase, remove punctuation, articles (a, an, the) and extra whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between one prediction and one gold answer, after normalisation.

    Two answers that both normalise to nothing score 1 (as in the SQuAD script); otherwise no
    shared token scores 0.
    """
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _golds(golds: str | Iterable[str]) -> list[str]:
    gold_list = [golds] if isinstance(golds, str) else list(golds)
    if not gold_list:
        raise ValueError("golds must name at least one gold answer")
    return gold_list


def qa_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """Best token F1 of ``prediction`` over the gold answers (one string or several)."""
    return max(token_f1(prediction, gold) for gold in _golds(golds))


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 if ``prediction`` equals any gold answer after normalisation, else 0.0."""
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(gold) for gold in _golds(golds)))


def needle_score(output: str, passkey: str) -> float:
    """1.0 if the passkey's digits appear in ``output`` as a whole number, else 0.0.

    ``"The pass key is 71432."`` retrieves ``71432``; ``"714320"`` does not.
    """
    if not passkey.isdigit():
        raise ValueError(f"passkey must be a string of digits, got {passkey!r}")
    return float(re.search(rf"(?<!\d){passkey}(?!\d)", output) is not None)


def pass_at_1(passed: Iterable[bool | float]) -> float:
    """pass@1 with one greedy completion per problem: the fraction of problems that passed."""
    results = [float(p) for p in passed]
    if not results:
        raise ValueError("pass_at_1 needs at least one result")
    if any(r not in (0.0, 1.0) for r in results):
        raise ValueError("pass_at_1 takes one pass/fail result per problem (bools or 0/1)")
    return sum(results) / len(results)
