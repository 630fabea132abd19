"""QA F1 / exact match (SQuAD and LongBench normalisation), passkey retrieval and pass@1."""

from __future__ import annotations

import pytest

from fastprefill.data.metrics import exact_match, needle_score, normalize_answer, pass_at_1, qa_f1, token_f1


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Cat sat.", "cat sat"),
        ("  an   apple,  a  pear; the plum!  ", "apple pear plum"),
        ("Theatre anthem", "theatre anthem"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, normalized: str) -> None:
    assert normalize_answer(text) == normalized


def test_f1_identical_is_one_and_disjoint_is_zero() -> None:
    assert qa_f1("Barack Obama", "Barack Obama") == 1.0
    assert qa_f1("Barack Obama", "George Bush") == 0.0


def test_f1_partial_overlap_by_hand() -> None:
    # prediction {cat, sat} ("the" dropped), gold {cat, sat, on, mat}: P = 2/2, R = 2/4, F1 = 2/3.
    assert qa_f1("the cat sat", "cat sat on mat") == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: P = 1/3, R = 1/1, F1 = 1/2.
    assert token_f1("paris paris paris", "paris") == pytest.approx(0.5)


def test_f1_ignores_case_punctuation_and_articles() -> None:
    assert qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    assert qa_f1("A  dog.", "the dog") == 1.0


def test_f1_takes_the_best_gold() -> None:
    golds = ["Denver Broncos", "Broncos", "the Denver Broncos team"]
    assert qa_f1("Broncos", golds) == 1.0
    # "Denver" vs the three golds: F1 2/3 (P 1, R 1/2), 0, and 1/2 (P 1, R 1/3): the best is 2/3.
    assert qa_f1("Denver", golds) == pytest.approx(2 / 3)


def test_f1_empty_cases() -> None:
    assert qa_f1("", "Paris") == 0.0
    assert token_f1("the", "a") == 1.0  # both normalise to nothing
    with pytest.raises(ValueError, match="at least one gold"):
        qa_f1("Paris", [])


def test_exact_match() -> None:
    assert exact_match("The Paris!", "paris") == 1.0
    assert exact_match("Paris, France", "Paris") == 0.0
    assert exact_match("France", ["Paris", "france."]) == 1.0
    assert exact_match("Lyon", ("Paris", "France")) == 0.0


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("The pass key is 71432.", 1.0),
        ("71432", 1.0),
        ("pass key: 71432 (I think)", 1.0),
        ("714320", 0.0),
        ("The pass key is 7143.", 0.0),
        ("", 0.0),
    ],
)
def test_needle_score(output: str, expected: float) -> None:
    assert needle_score(output, "71432") == expected


def test_needle_score_rejects_non_digit_keys() -> None:
    with pytest.raises(ValueError, match="digits"):
        needle_score("abc", "7a")


def test_pass_at_1() -> None:
    assert pass_at_1([True, False, True, True]) == 0.75
    assert pass_at_1([1.0, 0.0]) == 0.5
    with pytest.raises(ValueError):
        pass_at_1([])
    with pytest.raises(ValueError):
        pass_at_1([0.5])
