"""``benchmarks/prefill_chunks.py``: its summary on hand-made rows (counted), the rotated order,
the check of its files by ``benchmarks/verify.py``, and one prompt measured on a tiny random model
in float32 (a chunked prefill is the whole one's computation)."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest

from figures.results import verify_results
from prefill_chunks import measure_prompt, rotated, summarize, table, write

#: prompt -> setting -> (ttft_s, chunk_s, first token); prompt 2 has no whole run
TIMES = {
    0: {None: (1.0, [1.0], 7), 128: (1.5, [0.4, 0.5, 0.6], 7), 256: (1.2, [0.5, 0.7], 7)},
    1: {None: (2.0, [2.0], 9), 128: (2.4, [0.7, 0.8, 0.9], 9), 256: (3.0, [1.2, 1.8], 8)},
    2: {128: (4.0, [1.0, 1.5, 1.5], 3), 256: (2.0, [0.9, 1.1], 3)},
}


def _rows() -> list[dict]:
    rows = []
    for prompt, settings in TIMES.items():
        whole_token = settings.get(None, (0, [], None))[2]
        for position, (chunk, (ttft, chunk_s, token)) in enumerate(settings.items()):
            rows.append({"prompt": prompt, "position": position, "setting": "whole" if chunk is None else str(chunk),
                         "chunk": chunk, "prompt_tokens": 300 + prompt, "ttft_s": ttft, "chunk_s": chunk_s,
                         "max_chunk_s": max(chunk_s), "n_chunks": len(chunk_s), "first_token": token,
                         "first_token_equals_whole": token == whole_token,
                         "max_abs_logit_diff_vs_whole": 0.0 if chunk is None else 0.01 * (prompt + 1)})
    return rows


def test_the_summary_counts_each_setting_and_pairs_ratios_with_the_whole_prefill():
    summary = summarize(_rows())
    assert [s["setting"] for s in summary] == ["whole", "128", "256"]
    assert [s["n"] for s in summary] == [2, 3, 3]
    assert [s["n_paired"] for s in summary] == [2, 2, 2]  # prompt 2 has no whole run to pair with
    whole, c128, c256 = summary
    assert whole["ttft_ratio_median"] == whole["ttft_ratio_max"] == 1.0
    assert c128["ttft_ratio_median"] == pytest.approx(statistics.median([1.5, 1.2]))
    assert c256["ttft_ratio_median"] == pytest.approx(statistics.median([1.2, 1.5]))
    assert c256["ttft_ratio_max"] == pytest.approx(1.5)
    assert c128["ttft_s_median"] == 2.4 and whole["ttft_s_median"] == 1.5
    assert c128["max_chunk_s_median"] == 0.9 and c128["max_chunk_s_max"] == 1.5
    assert c256["max_chunk_s_median"] == 1.1 and c256["max_chunk_s_max"] == 1.8
    assert [s["n_chunks_median"] for s in summary] == [1, 3, 2]
    assert [s["first_token_equals_whole"] for s in summary] == [2, 2, 1]  # prompt 1 at 256: 8 != 9
    assert c256["max_abs_logit_diff_vs_whole"] == pytest.approx(0.03) and whole["max_abs_logit_diff_vs_whole"] == 0
    assert all(s["max_chunk_s_median"] <= s["max_chunk_s_max"] for s in summary)


def test_a_summary_without_whole_runs_has_no_ratio():
    rows = [r for r in _rows() if r["chunk"] is not None]
    assert all(s["ttft_ratio_median"] is None and s["n_paired"] == 0 for s in summarize(rows))
    assert "| 128 | 2.400 | - |" in table(summarize(rows), {"model": "m", "dtype": "float32", "tokens": 512,
                                                                "prompts": 3, "threads": 2})


def test_the_rotated_order_puts_every_setting_at_every_position_once():
    settings = [None, 128, 256, 512]
    orders = [rotated(settings, i) for i in range(len(settings))]
    assert orders[0] == settings and orders[1] == [128, 256, 512, None]
    for position in range(len(settings)):
        assert sorted((o[position] or 0) for o in orders) == [0, 128, 256, 512]
    assert rotated(settings, -1) == [512, None, 128, 256]


def test_verify_remakes_the_summary_and_table_and_finds_a_change(tmp_path):
    header = {"bench": "prefill-chunks", "model": "m", "dtype": "float32", "tokens": 512, "prompts": 3,
              "threads": 2, "command": "python benchmarks/prefill_chunks.py"}
    write(tmp_path, "prefill_chunks_m", header, _rows())
    report = verify_results(tmp_path)
    assert report.ok and len(report.checked) == 3
    md = tmp_path / "prefill_chunks_m.md"
    md.write_text(md.read_text().replace("| 128 | 2.400 |", "| 128 | 2.500 |"))
    summary = tmp_path / "prefill_chunks_m.summary.jsonl"
    summary.write_text(summary.read_text().replace('"n_paired": 2', '"n_paired": 3', 1))
    found = {(m.file, m.where) for m in verify_results(tmp_path).mismatches}
    assert found == {("prefill_chunks_m.md", "row 2 column 'TTFT median (s)'"),
                     ("prefill_chunks_m.summary.jsonl", "rows[0].n_paired")}


def test_one_prompt_chunked_gives_the_whole_prefills_first_token(tiny_llama, make_ids):
    ticks = []
    rows = measure_prompt(tiny_llama, None, make_ids(61, 5), 1, [None, 16, 40], SimpleNamespace(update=lambda: ticks.append(1)))
    assert [r["chunk"] for r in rows] == [16, 40, None] and [r["position"] for r in rows] == [0, 1, 2]
    assert len(ticks) == 3
    for r in rows:
        assert r["n_chunks"] == (1 if r["chunk"] is None else math.ceil(61 / r["chunk"]))
        assert len(r["chunk_s"]) == r["n_chunks"] and r["max_chunk_s"] == max(r["chunk_s"])
        assert r["prompt_tokens"] == 61 and r["ttft_s"] > 0
        assert r["first_token_equals_whole"] and r["max_abs_logit_diff_vs_whole"] < 1e-4
