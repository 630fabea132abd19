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
