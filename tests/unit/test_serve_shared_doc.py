"""``benchmarks/serve_shared_doc.py``'s summary on hand-made rows: the per-round ratios against
numbers worked out by hand, their medians and min-max over rounds, a failed or missing request
shown as failed (never as a fast one), and the re-check of a committed run by verify."""

from __future__ import annotations

import json

import pytest

from figures.results import parse_tables, verify_results
from reporting import write_rows
from serve_shared_doc import GOALS, markdown, summarize, token_counts

HEADER = {"bench": "serve-shared-doc", "model": "m", "requests": 4, "tokens": 512, "spread": 1.0,
          "follow_delay": 0.5, "follow_tokens": 64, "threads": 2, "dtype": "bfloat16", "server_args": []}


def _req(rnd, cell, i, ttft, ok=True, cached=0):
    row = {"kind": "request", "round": rnd, "cell": cell, "i": i, "session": f"s{rnd}", "question": i, "ok": ok}
    return {**row, "ttft_s": ttft, "cached_tokens": cached} if ok else {**row, "error": "APIError: boom"}


def _round(rnd, burst, alone, b, c, computed, doc=500, own=(10, 12, 11, 13)):
    rows = [_req(rnd, "together", i, t) for i, t in enumerate(burst)]
    rows.append({"kind": "cell", "round": rnd, "cell": "together", "requests": len(own), "document_tokens": doc,
                 "own_tokens": list(own), "computed_tokens": computed, "cached_tokens": 0, "shared_tokens": 1400})
    rows.append(_req(rnd, "alone", 0, alone))
    rows += [_req(rnd, "followup_a", 0, 0.9), {**_req(rnd, "followup_b", 1, b, cached=496),
                                                "a_streaming_when_sent": True}, _req(rnd, "followup_c", 2, c)]
    return rows


def test_a_round_gives_the_ratios_worked_out_by_hand():
    (r, total) = summarize(_round(0, [1.0, 1.2, 1.4, 3.0], alone=1.0, b=0.3, c=0.2, computed=600))
    assert r["ideal_tokens"] == 500 + 46 and r["prefilled_tokens"] == 600
    assert r["prefill_ratio"] == pytest.approx(600 / 546)
    assert r["together_ttft_median_s"] == pytest.approx(1.3) and r["together_ttft_max_s"] == 3.0
    assert r["median_ratio"] == pytest.approx(1.3) and r["slowest_ratio"] == pytest.approx(3.0)
    assert r["followup_ratio"] == pytest.approx(1.5) and r["followup_b_cached_tokens"] == 496
    assert r["followup_b_while_a_streams"] is True and r["failed"] is None
    assert total["round"] == "all" and total["rounds"] == 1 and total["rounds_failed"] == 0
    assert total["prefill_ratio_met"] is True  # 1.099 <= 1.1
    assert total["slowest_ratio_met"] is False  # 3.0 > 2


def test_ratios_are_paired_per_round_then_the_median_and_range_over_rounds():
    # the server drifts: round 1 is twice as slow everywhere, which pairing within the round cancels
    rows = (_round(0, [1.0, 1.0, 1.2, 1.2], alone=1.0, b=0.3, c=0.3, computed=546)
            + _round(1, [2.0, 2.0, 2.4, 2.4], alone=2.0, b=0.6, c=0.3, computed=1092)
            + _round(2, [1.0, 1.0, 1.0, 1.0], alone=0.5, b=0.2, c=0.2, computed=600))
    *per, total = summarize(rows)
    assert [p["median_ratio"] for p in per] == pytest.approx([1.1, 1.1, 2.0])
    assert total["median_ratio_median"] == pytest.approx(1.1)
    assert total["median_ratio_min"] == pytest.approx(1.1) and total["median_ratio_max"] == pytest.approx(2.0)
    assert total["median_ratio_met"] is True and total["median_ratio_n"] == 3
    assert total["followup_ratio_median"] == pytest.approx(1.0) and total["followup_ratio_max"] == pytest.approx(2.0)
    assert total["prefill_ratio_median"] == pytest.approx(600 / 546) and total["prefill_ratio_max"] == pytest.approx(2.0)


@pytest.mark.parametrize("change", ["failed", "missing"])
def test_a_failed_or_missing_burst_request_fails_the_round_not_speeds_it_up(change):
    rows = _round(0, [1.0, 1.0, 1.0, 9.0], alone=1.0, b=0.3, c=0.2, computed=546)
    slow = next(r for r in rows if r.get("cell") == "together" and r["i"] == 3)
    rows.remove(slow)
    if change == "failed":
        rows.append(_req(0, "together", 3, None, ok=False))
    (r, total) = summarize(rows)
    assert r["failed"] == "together: 1 of 4 failed or missing"
    for key in ("prefill_ratio", "median_ratio", "slowest_ratio", "together_ttft_max_s"):
        assert r[key] is None  # not 1.0: the slow request did not become a fast one
    assert r["followup_ratio"] == pytest.approx(1.5)  # the other cells still count
    assert total["rounds_failed"] == 1 and total["median_ratio_n"] == 0 and total["median_ratio_met"] is None
    (table, goals) = parse_tables(markdown([r, total], HEADER))
    assert table[0]["failed"] == "together: 1 of 4 failed or missing" and table[0]["median / alone"] == "—"
    assert {g["ratio"]: g["met"] for g in goals}["median_ratio"] == "—"


def test_a_failed_alone_or_follow_up_empties_only_its_own_ratios():
    rows = _round(0, [1.0, 1.0, 1.0, 1.0], alone=1.0, b=0.3, c=0.2, computed=546)
    rows = [_req(0, "alone", 0, None, ok=False) if r.get("cell") == "alone" else r for r in rows]
    rows = [r for r in rows if r.get("cell") != "followup_a"]  # A gone: B was not sent after its first token
    (r, _) = summarize(rows)
    assert r["median_ratio"] is None and r["slowest_ratio"] is None and r["followup_ratio"] is None
    assert r["prefill_ratio"] == pytest.approx(1.0)
    assert r["failed"] == "alone: 1 of 1 failed or missing; followup_a: 1 of 1 failed or missing"


def test_the_table_prints_every_round_and_every_goal():
    rows = _round(0, [1.0, 1.2, 1.4, 3.0], alone=1.0, b=0.3, c=0.2, computed=600)
    (table, goals) = parse_tables(markdown(summarize(rows), HEADER))
    assert table[0]["prefilled / ideal"] == "1.10" and table[0]["median / alone"] == "1.30"
    assert table[0]["B / C"] == "1.50" and table[0]["failed"] == ""
    assert [g["ratio"] for g in goals] == list(GOALS)
    assert {g["ratio"]: g["met"] for g in goals} == {"prefill_ratio": "yes", "median_ratio": "yes",
                                                     "slowest_ratio": "no", "followup_ratio": "yes"}


class _Tok:
    """Characters as tokens; the chat template wraps the message."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<u>{messages[0]['content']}</u><a>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(ch) for ch in text]}


def test_token_counts_split_the_shared_document_from_each_question():
    counts = token_counts(_Tok(), ["DOC q1", "DOC q22"])
    assert counts == {"document_tokens": len("<u>DOC q"), "own_tokens": [len("1</u><a>"), len("22</u><a>")]}
    assert token_counts(_Tok(), ["DOC"]) == {"document_tokens": len("<u>DOC</u><a>"), "own_tokens": [0]}


def test_verify_remakes_a_committed_run_and_sees_an_edited_figure(tmp_path):
    rows = (_round(0, [1.0, 1.2, 1.4, 3.0], alone=1.0, b=0.3, c=0.2, computed=600)
            + _round(1, [1.0, 1.0, 1.0, 1.0], alone=1.0, b=0.3, c=0.3, computed=546))
    summary = summarize(rows)
    write_rows(tmp_path / "serve_shared_doc_m.jsonl", HEADER, [*rows, *summary])
    (tmp_path / "serve_shared_doc_m.md").write_text(markdown(summary, HEADER))
    report = verify_results(tmp_path)
    assert report.ok and "serve_shared_doc_m.jsonl" in report.checked and "serve_shared_doc_m.md" in report.checked
    edited = [{**s, "median_ratio": 0.5} if s["round"] == 0 else s for s in summary]
    write_rows(tmp_path / "serve_shared_doc_m.jsonl", HEADER, [*rows, *edited])
    (tmp_path / "serve_shared_doc_m.md").write_text(markdown(edited, HEADER).replace("| 3.000 |", "| 0.300 |"))
    report = verify_results(tmp_path)
    wheres = {m.where for m in report.mismatches}
    assert "summary[0].median_ratio" in wheres and any("together slowest" in w for w in wheres), json.dumps(
        [str(m) for m in report.mismatches])
