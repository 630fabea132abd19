"""The dev-sweep selection rule of ``benchmarks/lazyllm_bench.py`` (which schedule becomes ``default``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("lazyllm_bench")


def _row(method: str, diff: float, frac: float) -> dict:
    return {"method": method, "score_diff": diff, "token_layer_fraction": frac}


def test_picks_cheapest_schedule_within_tolerance(bench):
    rows = [_row("a", -0.005, 0.80), _row("b", 0.0, 0.65), _row("c", -0.10, 0.42)]
    out = bench.choose_default(rows, tolerance=0.01)
    assert out["chosen"] == "b" and out["qualifying"] == ["a", "b"]


def test_falls_back_to_smallest_loss_then_fewest_token_layers(bench):
    rows = [_row("a", -0.05, 0.80), _row("b", -0.05, 0.70), _row("c", -0.20, 0.42)]
    out = bench.choose_default(rows, tolerance=0.01)
    assert out["chosen"] == "b" and out["qualifying"] == [] and "no schedule" in out["rule"]


def test_sweep_candidates_are_valid_and_exclude_the_alias(bench):
    from fastprefill.methods.lazyllm import LazyLLM

    assert "default" not in bench.SWEEP and "keep-all" not in bench.SWEEP
    for name, sched in bench.SWEEP.items():
        assert LazyLLM(depth_schedule=sched, preset_name=name).resolved(24)


def test_empty_rows_raise(bench):
    with pytest.raises(ValueError, match="no sweep rows"):
        bench.choose_default([])


def _rec(method: str, sid: str, ttft: float, score: float, output: str, frac: float = 1.0):
    from fastprefill.bench.runner import Record

    return Record(method=method, length=2048, sample_id=sid, prompt_tokens=2048, ttft_s=ttft,
                  decode_s_per_token=0.1, total_s=ttft + 6.4, new_tokens=64, token_layer_fraction=frac,
                  prefill_flops=frac, peak_mem_mb=1.0, score=score, metrics={}, output=output,
                  extra={"revived_per_step": [4, 2]} if method != "full" else {})


def test_summarize_paired_counts_against_full(bench):
    recs = [_rec("full", "a", 4.0, 1.0, "x"), _rec("lazy", "a", 2.0, 1.0, " x "),
            _rec("full", "b", 8.0, 0.5, "y"), _rec("lazy", "b", 2.0, 0.0, "z")]
    rows = bench.summarize_paired(recs)
    (row,) = rows
    assert row["method"] == "lazy" and row["n"] == 2
    assert row["same_output_as_full"] == 0.5  # "x" == " x " after strip, "z" != "y"
    assert row["score_diff"] == pytest.approx(-0.25) and row["score_full"] == pytest.approx(0.75)
    assert row["speedup_median"] == pytest.approx(3.0)  # paired ratios 2 and 4
    assert row["total_s_median"] == pytest.approx(8.4) and row["total_full_s_median"] == pytest.approx(12.4)
    assert row["revived_per_step_mean"] == pytest.approx(3.0)
