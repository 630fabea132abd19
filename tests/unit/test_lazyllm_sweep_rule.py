"""The dev-sweep selection rules (:func:`research.selection.choose_default` and the
fidelity rule :func:`~research.selection.choose_by_fidelity`: which schedule becomes
``default``), the sweeps' candidate tables and the LazyLLM script's argument parsing."""

from __future__ import annotations

import pytest

from fastprefill.bench.records import Record
from fastprefill.bench.summary import Summary, summarize
from fastprefill.errors import ConfigError
from research.selection import (
    FIDELITY_BUDGET,
    FIDELITY_CANDIDATES,
    choose_by_fidelity,
    choose_default,
    describe_choice,
    fidelity_methods,
)


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


def test_sweep_candidates_are_valid_and_exclude_the_alias():
    import lazyllm_bench as bench
    from fastprefill.methods.lazyllm import LazyLLM
    assert "default" not in bench.SWEEP and "keep-all" not in bench.SWEEP
    for name, sched in bench.SWEEP.items():
        assert LazyLLM(depth_schedule=sched, label=name).resolved(24)


def test_script_arguments_parse():
    import lazyllm_bench

    parser = lazyllm_bench.build_parser()
    for command in ("equivalence", "curve", "needle", "decode", "sweep", "fidelity-sweep", "speed"):
        args = parser.parse_args([command, "--model", "smollm2-135m", "--lengths", "512", "--n", "2",
                                  "--out", "/tmp/x", "--resume"])
        assert args.command == command and args.lengths == [512] and args.out == "/tmp/x" and args.resume
    args = parser.parse_args(["curve", "--presets", "default", "--no-baselines", "--static-depth", "0.5"])
    assert args.presets == ["default"] and args.no_baselines and args.out.endswith("benchmarks/results")
    with pytest.raises(SystemExit):
        parser.parse_args(["sweep", "--schedules", "not-a-schedule"])


# --- the fidelity rule (choose_by_fidelity) -------------------------------------------------------
def _fid(method: str, sid: str, frac: float, first: int, output: str, kl: float | None = None) -> Record:
    extra = {"first_token": first}
    if kl is not None:
        extra["first_token_kl"] = kl
    return Record(method=method, length=2048, sample_id=sid, prompt_tokens=2048, ttft_s=1.0,
                  decode_s_per_token=0.1, total_s=2.0, new_tokens=4, token_layer_fraction=frac,
                  prefill_flops=frac, peak_mem_mb=1.0, score=0.5, metrics={}, output=output, extra=extra)


def _fidelity_sweep(*candidates: tuple[str, float, int, int, float]) -> list[Summary]:
    """Four prompts; a candidate (name, token-layer fraction, first tokens equal to full's, answers
    identical to full's, KL) agrees with full on its first ``first`` / ``same`` prompts."""
    recs = [_fid("full", str(i), 1.0, i, f"answer {i}") for i in range(4)]
    for name, frac, first, same, kl in candidates:
        recs += [_fid(name, str(i), frac, i if i < first else 99, f"answer {i}" if i < same else "other", kl)
                 for i in range(4)]
    return summarize(recs)


def test_fidelity_rule_picks_the_highest_agreement_within_the_budget():
    out = choose_by_fidelity(_fidelity_sweep(
        ("over-budget", 0.50, 4, 4, 0.0),  # perfect but computes 50%: not eligible
        ("good", 0.45, 4, 3, 0.2),  # 1.0 + 0.75
        ("cheap", 0.30, 3, 3, 0.1),  # 0.75 + 0.75
    ))
    assert out["chosen"] == "good" and out["eligible"] == ["cheap", "good"]
    assert [r["method"] for r in out["ranking"]] == ["good", "cheap"]
    assert out["ranking"][0]["fidelity"] == 1.75 and "48%" in out["rule"]
    assert "over-budget" not in out["eligible"]
    assert describe_choice(out).startswith("chosen: good (highest first-token agreement")


def test_fidelity_rule_ties_go_to_lower_kl_then_fewer_token_layers():
    # equal fidelity (first-token and identical shares traded): lower KL wins despite more token-layers
    out = choose_by_fidelity(_fidelity_sweep(("a", 0.30, 4, 2, 0.5), ("b", 0.45, 3, 3, 0.1)))
    assert out["chosen"] == "b"
    # equal fidelity and KL: fewer token-layers
    out = choose_by_fidelity(_fidelity_sweep(("a", 0.40, 3, 3, 0.1), ("b", 0.35, 3, 3, 0.1)))
    assert out["chosen"] == "b"
    # a candidate without KL records ranks after one with them at equal fidelity
    out = choose_by_fidelity(_fidelity_sweep(("a", 0.30, 3, 3, None), ("b", 0.45, 3, 3, 2.0)))
    assert out["chosen"] == "b"


def test_fidelity_rule_says_when_nothing_is_within_the_budget():
    out = choose_by_fidelity(_fidelity_sweep(("a", 0.62, 4, 4, 0.0), ("b", 0.55, 4, 4, 0.0)))
    assert out["chosen"] is None and out["eligible"] == [] and out["ranking"] == []
    assert "no candidate computes <= 48%" in out["rule"] and "b at 55.0%" in out["rule"]
    assert describe_choice(out).startswith("chosen: none")
    with pytest.raises(ConfigError, match="no sweep candidates"):
        choose_by_fidelity(_fidelity_sweep())
    no_first = summarize([_rec("full", 0.5, 1.0), _rec("m", 0.5, 0.4)])
    with pytest.raises(ConfigError, match="no first tokens"):
        choose_by_fidelity(no_first)


@pytest.mark.parametrize("layers", [24, 28, 30])
def test_fidelity_candidates_fit_the_budget_and_build(layers):
    from fastprefill.methods.lazyllm import LazyLLM
    from fastprefill.methods.pruning import schedule_token_layers

    methods = fidelity_methods()
    assert len(methods) == len(FIDELITY_CANDIDATES) >= 12
    for key, lazy in methods.items():
        name = key.removeprefix("lazyllm-")
        assert lazy == LazyLLM(preset=name)  # each candidate is a preset by the same name
        sched = lazy.resolved(layers)
        assert schedule_token_layers(sched, layers, 2048) / (layers * 2048) <= FIDELITY_BUDGET
    assert {m.options.score_window for m in methods.values()} == {1, 16}  # the paper's rule and the snap bundles
    with pytest.raises(ConfigError, match="not fidelity candidates"):
        fidelity_methods(["four-stage"])


def test_fidelity_sweep_and_decode_arguments():
    import lazyllm_bench as bench
    parser = bench.build_parser()
    args = parser.parse_args(["fidelity-sweep", "--candidates", "cut30k20", "cut30k20+snap", "--n", "2"])
    assert args.candidates == ["cut30k20", "cut30k20+snap"]
    assert len(parser.parse_args(["fidelity-sweep"]).candidates) == len(FIDELITY_CANDIDATES)
    with pytest.raises(SystemExit):
        parser.parse_args(["fidelity-sweep", "--candidates", "four-stage"])
    args = parser.parse_args(["decode", "--revivals", "all", "catch-up", "budget:4", "--eos"])
    assert args.eos and args.revivals == ["all", "catch-up", "budget:4"]
    methods = bench.revival_methods(["cut30k20+snap"], args.revivals)
    assert list(methods) == ["lazyllm-cut30k20+snap", "lazyllm-cut30k20+snap/catch-up", "lazyllm-cut30k20+snap/budget:4"]
    assert str(methods["lazyllm-cut30k20+snap/budget:4"].options.revival) == "budget:4"
