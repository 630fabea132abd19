"""The soak benchmark (``benchmarks/serve_soak.py``): its verdict on made-up rows, its file
names, a short soak against a real ``fastprefill serve`` subprocess, and the committed soak
results re-summarized from their rows."""

from __future__ import annotations

import json

import pytest

import serve_soak as soak
from fastprefill.bench.records import read_rows
from tests import REPO

RESULTS = REPO / "benchmarks" / "results"


def _header(**over) -> dict:
    return {"started": "t", "command": "python benchmarks/serve_soak.py", "model": "m", "threads": 1, "queue": 2,
            "server_timeout_s": 60.0, "prefix_cache_mb": 64.0, "clients": 4, "seed": 0, "big_every_s": 30.0,
            "sample_every_s": 5.0, "cpu": "x", "torch": "t", "git_commit": "g", "warmup_s": 10.0,
            "goal_growth": soak.GOAL_GROWTH, **over}


def _request(kind: str, status: int | None, t: float = 1.0, **extra) -> dict:
    return {"row": "request", "kind": kind, "status": status, "t": t, "latency_s": 0.5, "deliberate": False, **extra}


def _sample(t: float, rss: float, fds: int = 10) -> dict:
    return {"row": "sample", "t": t, "rss_mb": rss, "server_rss_mb": rss, "children": 0, "fds": fds, "threads": 8}


END = {"row": "end", "server_exit_code": 0, "server_tracebacks": 0, "server_requests_total": {"ok": 2.0}}
RSS = [_sample(0.0, 900.0), _sample(5.0, 990.0), _sample(10.0, 1000.0), _sample(20.0, 1050.0, fds=12),
       _sample(30.0, 1040.0)]


def test_a_clean_soak_passes_and_its_rss_growth_is_max_over_the_end_of_warm_up():
    rows = [_request("chat", 200, key="k", answer="a"), _request("chat_stream", 200, complete=True, key="k",
                                                                  answer="a"),
            _request("chat", 429), _request("abandon", None, deliberate=True),
            _request("disconnect_stream", 200, deliberate=True), _request("invalid_json", 400),
            _request("big_body", 413), *RSS, END]
    s = soak.summarize(_header(), rows)
    assert s["pass"] and s["failures"] == [], s["failures"]
    assert s["requests"] == 7 and s["statuses"] == {"200": 3, "400": 1, "413": 1, "429": 1, "left": 1}
    assert s["by_kind"]["chat"] == {"200": 1, "429": 1} and s["by_kind"]["abandon"] == {"left": 1}
    assert set(s["checks"].values()) == {0}
    rss = s["rss"]
    assert (rss["baseline_mb"], rss["baseline_t"], rss["max_mb"], rss["last_mb"]) == (1000.0, 10.0, 1050.0, 1040.0)
    assert rss["growth_max"] == pytest.approx(1.05) and rss["growth_last"] == pytest.approx(1.04)
    assert rss["warmup_peak_mb"] == 990.0 and rss["start_mb"] == 900.0
    assert rss["slope_mb_per_min"] == pytest.approx(60 * 2.0)  # 1000 -> 1050 -> 1040 at 10, 20, 30 s
    assert (rss["fds_baseline"], rss["fds_max"]) == (10, 12)
    assert s["latency_s"]["chat"]["p50"] == 0.5 and s["answers_varying"] == [] and s["answer_keys"] == 1
    table = soak.markdown(s, _header(), "soak.png")
    assert "soak: PASS" in table and "| answered with a 500 | 0 | 0 | ✓ |" in table and "![RSS over time](soak.png)" in table
    assert "| chat | 2 | 1 |" in table and "| 1.050 | <= 1.1 | ✓ |" in table


def test_the_soak_fails_on_a_500_no_answer_a_cut_stream_an_accepted_bad_request_or_rss_growth():
    rows = [_request("chat", 500), _request("chat", None, error="ReadTimeout"), _request("chat", 504),
            _request("chat_stream", 200, complete=False), _request("deep_json", 200),
            _request("abandon", None, deliberate=True),  # a deliberate disconnect is no failure
            _request("chat", 200, key="k", answer="a"), _request("lazyllm", 200, key="k", answer="b"),
            _sample(0.0, 900.0), _sample(10.0, 1000.0), _sample(20.0, 1150.0),
            {**END, "server_exit_code": 1, "server_tracebacks": 2}]
    s = soak.summarize(_header(), rows)
    c = s["checks"]
    assert (c["status_500"], c["other_5xx"], c["no_answer"], c["streams_cut_short"], c["bad_accepted"]) == (1, 1, 1, 1, 1)
    assert c["unexpected_status"] == 4  # the 500, the no answer, the 504 and the accepted bad one (a cut stream got 200)
    assert not s["pass"] and s["answers_varying"] == ["k"]
    assert "RSS grew 1.150x after warm-up (goal <= 1.1)" in s["failures"]
    assert "server exit code 1" in s["failures"] and "2 tracebacks in the server's log" in s["failures"]
    assert "Failures: " in soak.markdown(s, _header())
    no_rss = soak.summarize(_header(), [_request("chat", 200), _sample(0.0, 900.0), END])
    assert no_rss["failures"] == ["fewer than 2 RSS samples after warm-up"]


def test_result_files_never_replace_an_earlier_run_unless_named(tmp_path):
    args = soak.parse_args(["--out", str(tmp_path)])
    assert soak._files(args) == (tmp_path, "serve_soak_smollm2-135m")
    (tmp_path / "serve_soak_smollm2-135m.jsonl").write_text("{}\n")
    assert soak._files(args) == (tmp_path, "serve_soak_smollm2-135m-run2")
    assert soak._files(soak.parse_args(["--out", str(tmp_path), "--name", "serve_soak_smollm2-135m"])) == (
        tmp_path, "serve_soak_smollm2-135m")
    named = tmp_path / "sub" / "mine.jsonl"
    assert soak._files(soak.parse_args(["--out", str(named)])) == (tmp_path / "sub", "mine")
    with pytest.raises(SystemExit):
        soak.parse_args(["--duration", "10", "--warmup", "10"])
    with pytest.raises(SystemExit):
        soak.parse_args(["--server-timeout", "300", "--client-timeout", "300"])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_short_soak_answers_every_request_and_refuses_every_bad_one(tmp_path):
    """20 s of every kind of request against ``fastprefill serve`` (smollm2-135m, one torch
    thread): no 500, no request without an answer, every status the expected one. RSS growth
    is not judged over 20 s."""
    out = tmp_path / "soak.jsonl"
    summary, md = soak.run(soak.parse_args(["--duration", "20", "--warmup", "6", "--sample-every", "1",
                                            "--big-every", "6", "--out", str(out)]))
    assert summary["checks"] == {**{k: 0 for k in soak.ZERO}, "server_exit_code": 0, "server_tracebacks": 0}, summary
    assert set(summary["failures"]) <= {f for f in summary["failures"] if f.startswith("RSS grew")}
    assert set(summary["by_kind"]) == {*soak.KINDS, soak.BIG}, summary["by_kind"]  # every kind came up
    assert summary["statuses"].get("200", 0) > 0 and summary["statuses"].get("413", 0) >= 2
    assert {"growth_max", "growth_last", "baseline_mb", "max_mb", "last_mb", "slope_mb_per_min"} <= set(summary["rss"])
    assert summary["server_requests_total"].get("error", 0) == 0
    header, rows = read_rows(out)
    assert header["command"] and header["server_command"].startswith("fastprefill serve --model smollm2-135m")
    assert json.loads((tmp_path / "soak.summary.json").read_text()) == json.loads(json.dumps(summary))
    assert md == tmp_path / "soak.md" and (tmp_path / "soak.png").stat().st_size > 0
    assert soak.summarize(header, rows) == summary  # the verdict comes from the rows alone


def test_committed_soak_results_reproduce_from_their_rows():
    committed = sorted(RESULTS.glob("serve_soak_*.jsonl"))
    if not committed:
        pytest.skip("no committed soak result")
    for path in committed:
        header, rows = read_rows(path)
        summary = soak.summarize(header, rows)
        stem = path.name.removesuffix(".jsonl")
        assert json.loads(json.dumps(summary)) == json.loads((RESULTS / f"{stem}.summary.json").read_text()), path.name
        assert soak.markdown(summary, header, f"{stem}.png") == (RESULTS / f"{stem}.md").read_text(), path.name
