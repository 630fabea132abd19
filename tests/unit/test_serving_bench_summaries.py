"""The summaries of two serving benchmarks, on hand-made rows, and their re-check by verify:
``benchmarks/serve_n.py`` (:func:`serve_n.summarize`, :func:`serve_n.table`) and
``benchmarks/third_party_clients.py`` (:mod:`client_scores`: the in-process comparison of
lm-eval's answers and log-likelihoods, LangChain's usage, rescored from per-sample records)."""

from __future__ import annotations

import json
import math

import pytest

from client_scores import (
    gen_summary,
    langchain_summary,
    ll_summary,
    lm_eval_exact_match,
    lm_eval_ll_results,
    rescore_row,
)
from figures.results import parse_table, verify_results
from reporting import write_rows
from serve_n import summarize, table

# --------------------------------------------------------------------------- serve_n


def _request(prompt: int, n: int, client: float, server: float | None = None, tokens: int = 100) -> dict:
    return {"prompt": prompt, "n": n, "client_ttft_s": client, "server_ttft_s": server if server is not None else client,
            "prompt_tokens": tokens, "completion_tokens": 8 * n, "answers": [""] * n}


ROWS = [_request(0, 1, 1.0, tokens=100), _request(0, 4, 1.5, tokens=100),
        _request(1, 4, 2.4, tokens=110), _request(1, 1, 2.0, tokens=110),
        _request(2, 1, 4.0, 3.0, tokens=120), _request(2, 4, 4.4, 3.3, tokens=120),
        _request(3, 1, 9.0, tokens=130)]  # prompt 3 has no n=4 answer: not a pair
HEADER = {"bench": "serve-n", "model": "m", "dtype": "bfloat16", "prompts": 4, "tokens": 128, "n": 4}


def test_serve_n_summary_pairs_prompts_measured_both_ways():
    s = summarize([*ROWS, {"kind": "summary", "pairs": 99}], 4)  # a committed summary row is not a request
    assert s["kind"] == "summary" and s["pairs"] == 3
    assert s["client_ttft_s_n1"] == 2.0 and s["client_ttft_s_n"] == 2.4
    assert s["ratio_median"] == pytest.approx(1.2) and s["ratio_max"] == pytest.approx(1.5)
    assert s["server_ttft_s_n1"] == 2.0 and s["server_ttft_s_n"] == 2.4
    assert s["prompt_tokens_median"] == 110  # over every request, the unpaired one too


def test_serve_n_summary_and_table_without_server_ttft():
    rows = [{**r, "server_ttft_s": None} for r in ROWS]
    s = summarize(rows, 4)
    assert s["server_ttft_s_n1"] is None and s["server_ttft_s_n"] is None
    (row,) = parse_table(table(s, HEADER))
    assert row["server TTFT n=1 (s)"] == "—" and row["ratio n=4 / 1"] == "1.20x" and row["ratio max"] == "1.50x"
    assert row["client TTFT n=1 (s)"] == "2.000" and row["pairs"] == "3" and row["prompt tokens"] == "110"


def test_verify_remakes_a_serve_n_summary_and_table(tmp_path):
    summary = summarize(ROWS, 4)
    write_rows(tmp_path / "serve_n_m.jsonl", HEADER, [*ROWS, summary])
    (tmp_path / "serve_n_m.md").write_text(table(summary, HEADER))
    report = verify_results(tmp_path)
    assert report.ok and set(report.checked) == {"serve_n_m.jsonl", "serve_n_m.md"}
    write_rows(tmp_path / "serve_n_m.jsonl", HEADER, [*ROWS, {**summary, "ratio_max": 1.4}])
    md = tmp_path / "serve_n_m.md"
    assert "| 3 | 110 | 2.000 |" in md.read_text()
    md.write_text(md.read_text().replace("| 3 | 110 | 2.000 |", "| 3 | 110 | 2.100 |"))
    found = {(m.file, m.where) for m in verify_results(tmp_path).mismatches}
    assert found == {("serve_n_m.jsonl", "summary.ratio_max"), ("serve_n_m.md", "row 1 column 'client TTFT n=1 (s)'")}


# --------------------------------------------------------------------------- third-party clients


GEN = [  # lm-eval's exact match of the server's answer (em_server) is taken as it logged it
    {"doc_id": 0, "id": "a", "answers": ["Paris"], "server": "Paris.", "em_server": 1.0, "inprocess": "Paris."},
    {"doc_id": 1, "id": "b", "answers": ["the Nile"], "server": "Nile", "em_server": 0.0, "inprocess": "The Nile"},
    {"doc_id": 2, "id": "c", "answers": ["42"], "server": "42", "em_server": 0.0, "inprocess": "41"},
]
LL = [
    {"doc_id": 0, "id": "a", "loglik_server": -2.0, "greedy_server": True, "loglik_whole": -2.5, "greedy_whole": True,
     "loglik_chunked": -2.0, "greedy_chunked": True},
    {"doc_id": 1, "id": "b", "loglik_server": -4.0, "greedy_server": False, "loglik_whole": -3.0,
     "greedy_whole": True, "loglik_chunked": -4.25, "greedy_chunked": False},
]


def test_lm_eval_exact_match_ignores_case_punctuation_and_outer_space():
    assert lm_eval_exact_match(" Paris. ", ["paris"]) == 1.0
    assert lm_eval_exact_match("The Nile", ["Nile"]) == 0.0


def test_gen_summary_counts_and_scores_both_sides():
    s = gen_summary(GEN)
    assert s["n"] == 3 and s["identical"] == 1
    assert [r["em_inprocess"] for r in s["samples"]] == [1.0, 1.0, 0.0]
    assert s["exact_match_rescored_differently"] == 1  # sample 2: "42" matches, lm-eval logged 0
    assert s["exact_match_lm_eval"] == pytest.approx(1 / 3) and s["exact_match_inprocess"] == pytest.approx(2 / 3)
    assert s["squad_scores"]["em_server"] == pytest.approx(1.0)  # SQuAD normalization drops "the"
    assert s["squad_scores"]["em_inprocess"] == pytest.approx(2 / 3)


def test_ll_summary_compares_both_ways_and_lm_evals_aggregates():
    results = {"perplexity,none": math.exp(3.0), "acc,none": 0.5}
    s = ll_summary(LL, results)
    assert s["perplexity_lm_eval"] == results["perplexity,none"] and s["acc_lm_eval"] == 0.5
    assert s["perplexity_inprocess"] == pytest.approx(math.exp(2.75))
    assert s["acc_inprocess"] == 1.0 and s["same_greedy_flag"] == 1
    assert s["max_abs_loglik_diff"] == 1.0 and s["mean_abs_loglik_diff"] == 0.75
    assert s["max_abs_loglik_diff_chunked"] == 0.25 and s["same_greedy_flag_chunked"] == 2
    assert lm_eval_ll_results(LL) == pytest.approx(results)


TURNS = {"request_fields": ["messages", "model"], "turns": [
    {"usage": {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 0},
               "fastprefill": {"prefix_cache": "miss", "ttft_s": 1.0}}},
    {"usage": {"prompt_tokens": 50, "prompt_tokens_details": None, "fastprefill": {"prefix_cache": "miss"}}}]}


def test_langchain_summary_reads_each_turns_usage():
    s = langchain_summary(TURNS)
    assert s["cached_tokens"] == [0, None] and s["prompt_tokens"] == [20, 50]
    assert s["prefix_cache"] == ["miss", "miss"] and s["server_ttft_s"] == [1.0, None]
    assert s["later_turns_hit"] is False


def _clients_run(out):
    gen, ll = gen_summary(GEN), ll_summary(LL, {"perplexity,none": math.exp(3.0), "acc,none": 0.5})
    row = {"method": "full",
           "gen": {"results": {"exact_match,strip": gen["exact_match_lm_eval"]}, "inprocess": gen,
                   "scores_equal": False},
           "ll": {"results": {"perplexity,none": math.exp(3.0), "acc,none": 0.5}, "inprocess": ll,
                  "scores_equal": False},
           "langchain": {"seconds": 3.0, **langchain_summary(TURNS)}}
    out.mkdir()
    (out / "full").mkdir()
    (out / "full" / "langchain.json").write_text(json.dumps(TURNS))
    path = out / "third_party_clients.json"
    path.write_text(json.dumps({"model": "m", "rows": [row]}))
    return path, row


def test_rescore_row_remakes_every_derived_value(tmp_path):
    _, row = _clients_run(tmp_path / "run")
    again = rescore_row(row, tmp_path / "run")
    assert again["gen"]["inprocess"] == row["gen"]["inprocess"] and again["gen"]["scores_equal"] is False
    assert again["ll"]["inprocess"] == row["ll"]["inprocess"] and again["ll"]["scores_equal"] is False
    assert again["langchain"] == {k: v for k, v in row["langchain"].items() if k != "seconds"}


def test_verify_finds_a_changed_client_score_or_a_sample_lm_eval_logged_otherwise(tmp_path):
    path, row = _clients_run(tmp_path / "third_party_clients")
    report = verify_results(tmp_path)
    assert report.ok and report.checked == ["third_party_clients/third_party_clients.json"]
    row["gen"]["inprocess"]["identical"] = 2
    row["ll"]["inprocess"]["max_abs_loglik_diff"] = 0.5
    row["ll"]["results"]["acc,none"] = 1.0  # not lm-eval's mean of its samples
    path.write_text(json.dumps({"rows": [row]}))
    log = tmp_path / "third_party_clients" / "full" / "gen" / "m" / "samples_fastprefill_squad_gen_x.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text("".join(json.dumps({"doc_id": s["doc_id"], "resps": [[s["server"]]], "exact_match": s["em_server"]})
                           + "\n" for s in GEN[:2]) + json.dumps({"doc_id": 2, "resps": [["43"]], "exact_match": 0.0}))
    found = {m.where.removeprefix("rows[full].") for m in verify_results(tmp_path).mismatches}
    assert found == {
        "gen.inprocess.identical",
        # the log's answer to question 2: its own text, F1, exact match, and lm-eval's 0 is right for it
        "gen.inprocess.samples[2].server", "gen.inprocess.squad_scores.f1_server",
        "gen.inprocess.squad_scores.em_server", "gen.inprocess.exact_match_rescored_differently",
        "ll.inprocess.max_abs_loglik_diff",
        "ll.inprocess.acc_lm_eval", "ll.results.acc,none",  # lm-eval's aggregate is not its samples' mean
    }


class _MergingTokenizer:
    """Greedy longest match over a fixed vocabulary that merges ``:`` and ``p`` into ``:p``."""

    vocab: tuple[str, ...] = ("Answer", ":p", ":", "p", " ", "−", "1", " p")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        ids, i = [], 0
        while i < len(text):
            best = max((v for v in self.vocab if text.startswith(v, i)), key=len)
            ids.append(self.vocab.index(best))
            i += len(best)
        return {"input_ids": ids}


def test_the_in_process_side_scores_the_ids_lm_eval_sends_where_a_token_merges_across_the_boundary():
    """``Answer:`` + ``p − 1``: the whole text starts ``Answer``, ``:p``; lm-eval sends the
    context's ``Answer``, ``:`` and then the whole text's ids past two (``p`` is lost), so the
    request is not the whole text's tokenization; a trailing space moves to the continuation."""
    from client_inprocess import lm_eval_request

    tok = _MergingTokenizer()
    ids, n_ctx = lm_eval_request(tok, "Answer:", "p − 1")
    assert n_ctx == 2 and [tok.vocab[i] for i in ids] == ["Answer", ":", " ", "−", " ", "1"]
    assert tok("Answer:p − 1")["input_ids"][:2] == [0, 1]  # the whole text merges
    ids, n_ctx = lm_eval_request(tok, "Answer: ", "p")
    assert n_ctx == 2 and [tok.vocab[i] for i in ids] == ["Answer", ":", " p"]


def test_mixed_load_scheduler_specs_map_to_server_flags():
    from serve_load_mixed import server_flags

    assert server_flags("fifo", 8192) == ["--scheduler", "fifo", "--prefill-chunk", "8192"]
    assert server_flags("interleaved:chunk=512:nopause:decode=1.5", 8192) == [
        "--scheduler", "interleaved", "--no-prefill-pauses", "--decode-interval", "1.5",
        "--prefill-chunk", "512"]
    for bad in ("eager", "interleaved:decode=fast", "interleaved:chunk=-1", "fifo:pause"):
        with pytest.raises(ValueError, match="scheduler spec"):
            server_flags(bad, 512)


def test_mixed_load_summary_reports_stream_gaps_only_where_recorded():
    from serve_load_mixed import summarize

    def row(kind, i, ttft, gap=None, phase="mixed", text="a"):
        r = {"scheduler": "interleaved", "phase": phase, "kind": kind, "i": i, "ttft_s": ttft, "text": text}
        return r if gap is None else {**r, "max_gap_s": gap}

    ref = [{"scheduler": "fifo", "phase": "sequential", "kind": k, "i": 0, "text": "a"} for k in ("short", "long")]
    old = summarize(ref + [row("short", 0, 0.1), row("long", 0, 4.0), row("long", 0, 2.0, phase="long_alone")],
                    ["interleaved"])[0]
    assert "short_max_gap_p50_s" not in old and old["long_ttft_growth"] == 2.0 and old["same_answers"] == "2/2"
    new = summarize(ref + [row("short", 0, 0.1, gap=0.4), row("long", 0, 4.0, gap=9.0, text="b")], ["interleaved"])[0]
    assert new["short_max_gap_p50_s"] == new["short_max_gap_p99_s"] == 0.4  # the long stream's gap is not a short's
    assert new["same_answers"] == "1/2"
