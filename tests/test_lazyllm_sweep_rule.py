"""The dev-sweep selection rule (:func:`fastprefill.bench.selection.choose_default`: which schedule
becomes ``default``), the sweep's candidate table and the LazyLLM script's argument parsing."""

from __future__ import annotations

import pytest

from fastprefill.bench.records import Record
from fastprefill.bench.selection import choose_default
from fastprefill.bench.summary import Summary, summarize
from fastprefill.errors import ConfigError


def _rec(method: str, score: float, frac: float) -> Record:
    return Record(method=method, length=2048, sample_id="a", prompt_tokens=2048, ttft_s=1.0,
                  decode_s_per_token=0.1, total_s=2.0, new_tokens=4, token_layer_fraction=frac,
                  prefill_flops=frac, peak_mem_mb=1.0, score=score, metrics={}, output="")


def _sweep(*candidates: tuple[str, float, float]) -> list[Summary]:
    """Summaries of candidates (name, score difference to full, token-layer fraction), full scoring 0.5."""
    return summarize([_rec("full", 0.5, 1.0)] + [_rec(m, 0.5 + d, f) for m, d, f in candidates])


def test_picks_cheapest_schedule_within_tolerance():
    out = choose_default(_sweep(("a", -0.005, 0.80), ("b", 0.0, 0.65), ("c", -0.10, 0.42)), tolerance=0.01)
    assert out["chosen"] == "b" and out["qualifying"] == ["a", "b"]


def test_falls_back_to_smallest_loss_then_fewest_token_layers():
    out = choose_default(_sweep(("a", -0.05, 0.80), ("b", -0.05, 0.70), ("c", -0.20, 0.42)), tolerance=0.01)
    assert out["chosen"] == "b" and out["qualifying"] == [] and "no schedule" in out["rule"]


def test_only_the_reference_raises():
    with pytest.raises(ConfigError, match="no sweep candidates"):
        choose_default(_sweep())


def test_sweep_candidates_are_valid_and_exclude_the_alias(load_bench):
    from fastprefill.methods.lazyllm import LazyLLM

    bench = load_bench("lazyllm_bench")
    assert "default" not in bench.SWEEP and "keep-all" not in bench.SWEEP
    for name, sched in bench.SWEEP.items():
        assert LazyLLM(depth_schedule=sched, preset_name=name).resolved(24)


def test_script_arguments_parse(load_bench):
    parser = load_bench("lazyllm_bench").build_parser()
    for command in ("equivalence", "curve", "needle", "decode", "sweep", "speed"):
        args = parser.parse_args([command, "--model", "smollm2-135m", "--lengths", "512", "--n", "2",
                                  "--out", "/tmp/x", "--resume"])
        assert args.command == command and args.lengths == [512] and args.out == "/tmp/x" and args.resume
    args = parser.parse_args(["curve", "--presets", "default", "--no-baselines", "--static-depth", "0.5"])
    assert args.presets == ["default"] and args.no_baselines and args.out.endswith("benchmarks/results")
    with pytest.raises(SystemExit):
        parser.parse_args(["sweep", "--schedules", "not-a-schedule"])
