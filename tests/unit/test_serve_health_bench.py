"""``benchmarks/serve_health.py``'s summary on hand-made trial rows: the median and slowest
seconds to 503 worked out by hand, a trial that never got its 503 shown as failed (never as a
fast one), the degraded trial's check, the tables, and the re-check of a committed run by verify."""

from __future__ import annotations

import pytest

from figures.results import parse_tables, verify_results
from reporting import write_rows
from serve_health import GOAL_S, markdown, summarize

HEADER = {"bench": "serve-health", "model": "m", "threads": 1, "procs": 2, "threads_per_rank": 1,
          "dtype": "bfloat16", "poll": 0.01, "give_up": 10.0}
REASON = "the default method 'runahead:procs=2' cannot run: rank 0 (pid 42) has gone"


def _trial(i, seconds, chat=503, **kw):
    """A default trial that saw its 503 after ``seconds`` (``seconds=None``: it never did)."""
    row = {"kind": "trial", "trial": i, "method": "default", "spec": "runahead:procs=2", "rank": i % 2, "pid": 40 + i,
           "seconds": seconds, "polls": 3, "health_http": 503 if seconds is not None else 200,
           "health_status": "unavailable" if seconds is not None else "ok", "reason": REASON if seconds else None,
           "ranks_up": seconds is None, "chat_http": chat, "chat_s": 0.01, "chat_said": "the rank pool failed",
           "error": None}
    return {**row, **kw}


def _degraded(i, health_http=200, status="degraded", chat=200, named=503):
    return {"kind": "trial", "trial": i, "method": "allowed", "spec": "runahead:procs=2", "rank": i % 2,
            "seconds": 0.02, "polls": 2, "health_http": health_http, "health_status": status, "reason": "...",
            "ranks_up": False, "chat_http": chat, "chat_s": 0.3, "chat_said": "full", "runahead_chat_http": named,
            "runahead_chat_said": "the rank pool failed", "error": None}


def test_median_and_slowest_of_the_default_trials_worked_out_by_hand():
    rows = [_trial(0, 0.030), _trial(1, 0.012), _trial(2, 0.500), _trial(3, 0.020), _degraded(4)]
    s = summarize(rows)
    assert s["trials"] == 4 and s["got_503"] == 4 and s["all_503"] is True
    assert s["median_s"] == pytest.approx(0.025) and s["max_s"] == pytest.approx(0.5)
    assert s["within_goal"] is True and s["chats_503"] == 4 and s["all_chats_503"] is True
    assert s["degraded_trials"] == 1 and s["degraded_ok"] is True


def test_slower_than_the_goal_is_not_within_it():
    s = summarize([_trial(0, 0.01), _trial(1, GOAL_S + 0.5)])
    assert s["all_503"] is True and s["within_goal"] is False and s["max_s"] == pytest.approx(GOAL_S + 0.5)


@pytest.mark.parametrize("failure", [
    {"seconds": None},  # /health kept saying 200 until the give-up
    {"error": "RuntimeError: the server exited", "seconds": None},  # its server never served
    {"health_http": 503, "health_status": "draining"},  # a 503, but not for the dead rank
])
def test_a_trial_without_its_503_is_failed_not_fast(failure):
    rows = [_trial(0, 0.02), _trial(1, 0.03), {**_trial(2, 0.004), **failure}]
    s = summarize(rows)
    assert s["got_503"] == 2 and s["all_503"] is False and s["within_goal"] is False
    assert s["max_s"] is None  # not 0.03: the failed trial is slower than any
    assert s["median_s"] == pytest.approx(0.03)  # the failed one sorts last: 0.02, 0.03, never
    (table, _) = parse_tables(markdown(rows, s, HEADER))
    assert [t["failed"] for t in table][:2] == ["", ""] and table[2]["failed"] != ""


def test_half_failed_trials_have_no_median():
    s = summarize([_trial(0, 0.02), _trial(1, None)])
    assert s["median_s"] is None and s["max_s"] is None and s["got_503"] == 1


def test_a_chat_that_was_answered_or_hung_is_counted_apart_from_the_503():
    s = summarize([_trial(0, 0.02), _trial(1, 0.02, chat=200), _trial(2, 0.02, chat=None)])
    assert s["all_503"] is True and s["chats_503"] == 1 and s["all_chats_503"] is False


@pytest.mark.parametrize("change", [{"health_http": 503, "status": "unavailable"}, {"chat": 503}, {"named": 200}])
def test_the_degraded_trial_must_say_degraded_answer_the_default_and_refuse_runahead(change):
    assert summarize([_trial(0, 0.02), _degraded(1, **change)])["degraded_ok"] is False
    assert summarize([_trial(0, 0.02)])["degraded_ok"] is False  # no degraded trial: not shown as ok


def test_no_trials_meet_nothing():
    s = summarize([])
    assert s["trials"] == 0 and s["all_503"] is False and s["within_goal"] is False and s["median_s"] is None


def test_the_tables_print_every_trial_and_the_summary():
    rows = [_trial(0, 0.030), _trial(1, None), _degraded(2)]
    (trials, total) = parse_tables(markdown(rows, summarize(rows), HEADER))
    assert [t["method"] for t in trials] == ["default", "default", "allowed"]
    assert trials[0]["seconds"] == "0.030" and trials[0]["status"] == "unavailable" and trials[0]["failed"] == ""
    assert trials[1]["seconds"] == "—" and trials[1]["failed"] == "yes"
    assert trials[2]["/health"] == "200" and trials[2]["runahead chat"] == "503" and trials[2]["failed"] == ""
    assert total == [{"trials": "2", "got 503": "1", "median s": "—", "slowest s": "—", "within goal": "no",
                      "chats 503": "2", "degraded trial ok": "yes"}]


def test_verify_remakes_a_committed_run_and_sees_an_edited_figure(tmp_path):
    rows = [_trial(0, 0.030), _trial(1, 0.012), _degraded(2)]
    summary = summarize(rows)
    write_rows(tmp_path / "serve_health_m.jsonl", HEADER, [*rows, summary])
    (tmp_path / "serve_health_m.md").write_text(markdown(rows, summary, HEADER))
    report = verify_results(tmp_path)
    assert report.ok and "serve_health_m.jsonl" in report.checked and "serve_health_m.md" in report.checked
    edited = {**summary, "max_s": 0.012}
    write_rows(tmp_path / "serve_health_m.jsonl", HEADER, [*rows, edited])
    (tmp_path / "serve_health_m.md").write_text(markdown(rows, edited, HEADER))
    report = verify_results(tmp_path)
    wheres = {m.where for m in report.mismatches}
    assert "summary[0].max_s" in wheres and any("slowest s" in w for w in wheres), [str(m) for m in report.mismatches]
