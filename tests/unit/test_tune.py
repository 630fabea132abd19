"""``fastprefill tune`` and ``--method auto``: the chooser on synthetic records (the fastest that
meets the bound, never one that misses), the intervals, the refusals, the profile round trip
and ``auto`` in the engine (the end-to-end tune on SmolLM2 is in tests/integration/)."""

from __future__ import annotations

import json

import pytest
import torch

from fastprefill.bench.records import Record
from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.auto import ProfileBucket, Target, TuneProfile
from fastprefill.methods.registry import AutoMethod, make_method
from fastprefill.models.fingerprint import weights_fingerprint
from fastprefill.models.random import random_model
from fastprefill.tune import TunePrompt, choose, min_prompts, split_of_prompt, wilson

BUCKETS = (("short", 100), ("long", None))


def _rec(method: str, sid: str, ttft: float, first: int, kl: float = 0.0) -> Record:
    return Record(method=method, length=None, sample_id=sid, prompt_tokens=10, ttft_s=ttft, decode_s_per_token=None,
                  total_s=ttft, new_tokens=1, token_layer_fraction=1.0, prefill_flops=1.0, peak_mem_mb=0.0,
                  score=0.0, metrics={}, output=str(first), extra={"first_token": first, "first_token_kl": kl})


def _workload(n: int, agree: dict[str, float], speed: dict[str, float], bucket: str = "long"):
    """``n`` prompts in ``bucket``; candidate ``m`` agrees with full on the first ``agree[m]`` share
    of each half and is ``speed[m]`` times faster."""
    prompts = [TunePrompt(f"p{i}", [1] * (50 if bucket == "short" else 500), bucket) for i in range(n)]
    records = []
    halves: dict[str, list[str]] = {"choose": [], "report": []}
    for p in prompts:
        halves[split_of_prompt(p.id)].append(p.id)
    for ids in halves.values():
        for rank, sid in enumerate(ids):
            records.append(_rec("full", sid, 1.0, 7))
            for m, share in agree.items():
                records.append(_rec(m, sid, 1.0 / speed[m], 7 if rank < share * len(ids) else 8))
    return prompts, records


def test_wilson_and_the_prompts_a_target_needs():
    lo, hi = wilson(9, 10)
    assert lo == pytest.approx(0.5958, abs=1e-3) and hi == pytest.approx(0.9821, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)
    need = min_prompts(Target("first-token", 0.9))
    assert wilson(need, need)[0] >= 0.9 > wilson(need - 1, need - 1)[0]
    assert need == 35 and min_prompts(Target("first-token", 0.7)) == 9 and min_prompts(Target("kl", 0.1)) == 8


def test_choose_picks_the_fastest_candidate_that_meets_the_bound():
    specs = {"exact-slow": "lazyllm:preset=gentle", "good": "lazyllm:preset=four-stage", "fast-bad": "gemfilter"}
    prompts, records = _workload(200, {"exact-slow": 1.0, "good": 0.97, "fast-bad": 0.6},
                                 {"exact-slow": 1.3, "good": 1.8, "fast-bad": 2.5})
    buckets, seen = choose(records, prompts, specs, Target("first-token", 0.9), BUCKETS)
    long = buckets[1]
    assert long.method == "lazyllm:preset=four-stage"  # 2.5x misses the bound; 1.8x is the fastest that meets it
    assert long.ttft_ratio == pytest.approx(1.8) and long.fidelity_ci[0] >= 0.9 - 0.03
    assert {c.method: c.meets(Target("first-token", 0.9)) for c in seen["long"]} == {
        "exact-slow": True, "good": True, "fast-bad": False}
    assert buckets[0].method == "full" and "no prompts" in buckets[0].reason
    # a faster candidate that misses the bound is never chosen, even when nothing else is fast
    _, records = _workload(200, {"good": 0.97, "fast-bad": 0.6}, {"good": 1.05, "fast-bad": 3.0})
    buckets, _ = choose(records, prompts, {"good": "x", "fast-bad": "y"}, Target("first-token", 0.9), BUCKETS)
    assert buckets[1].method == "full" and "under 1.1x" in buckets[1].reason


def test_explicit_halves_override_the_hash():
    """Prompts marked ``half`` (choose on one split, report on another) are split as marked: a
    candidate perfect on the choosing prompts and wrong on every reported one is chosen, and its
    held-out figure is the reported prompts' 0."""
    prompts = [TunePrompt(f"p{i}", [1] * 500, "long", "choose" if i < 40 else "report") for i in range(60)]
    records = [_rec("full", p.id, 1.0, 7) for p in prompts]
    records += [_rec("c", p.id, 0.5, 7 if p.half == "choose" else 8) for p in prompts]
    buckets, seen = choose(records, prompts, {"c": "lazyllm:preset=gentle"}, Target("first-token", 0.9), BUCKETS)
    assert buckets[1].method == "lazyllm:preset=gentle" and buckets[1].n_choose == 40 and buckets[1].n_report == 20
    assert buckets[1].fidelity == 0.0 and seen["long"][0].n == 40
    with pytest.raises(ConfigError, match="half"):
        TunePrompt("x", [1], "long", "train")


def test_choose_refuses_too_few_prompts_and_an_unmet_target():
    prompts, records = _workload(20, {"good": 1.0}, {"good": 2.0})
    with pytest.raises(ConfigError, match=r"needs at least 35 there"):
        choose(records, prompts, {"good": "x"}, Target("first-token", 0.9), BUCKETS)
    prompts, records = _workload(120, {"a": 0.5, "b": 0.7}, {"a": 2.0, "b": 1.5})
    with pytest.raises(ConfigError, match=r"no candidate meets first-token >= 0.9.*closest is b at 0\.7"):
        choose(records, prompts, {"a": "x", "b": "y"}, Target("first-token", 0.9), BUCKETS)


def test_kl_target_is_a_ceiling_on_the_upper_end():
    prompts = [TunePrompt(f"p{i}", [1] * 500, "long") for i in range(60)]
    records = [r for p in prompts for r in (_rec("full", p.id, 1.0, 7), _rec("low", p.id, 0.5, 7, kl=0.02),
                                            _rec("high", p.id, 0.3, 7, kl=0.5))]
    buckets, _ = choose(records, prompts, {"low": "L", "high": "H"}, Target("kl", 0.1), BUCKETS)
    assert buckets[1].method == "L"


def _profile(model, tok_fp="t", methods=("full", "lazyllm:preset=keep-all")) -> TuneProfile:
    return TuneProfile(model="tiny", fingerprint=weights_fingerprint(model), tokenizer_fingerprint=tok_fp,
                       target=Target("first-token", 0.7),
                       buckets=(ProfileBucket("short", 20, methods[0]), ProfileBucket("long", None, methods[1])))


def test_profile_round_trip_and_refusals(tmp_path, tiny_llama):
    path = _profile(tiny_llama).save(tmp_path / "p.json")
    again = TuneProfile.load(path)
    assert again == _profile(tiny_llama)
    assert again.bucket(20).label == "short" and again.bucket(21).label == "long"
    with pytest.raises(ConfigError, match="no tuning profile"):
        TuneProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not a readable"):
        TuneProfile.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(ConfigError, match="not a fastprefill tuning profile"):
        TuneProfile.load(tmp_path / "other.json")
    with pytest.raises(ConfigError, match="ascending"):
        TuneProfile("m", "f", "t", Target("kl", 0.1), (ProfileBucket("a", None, "full"), ProfileBucket("b", 5, "x")))
    for bad in ("first-token", "first-token=x", "speed=0.9", "first-token=1.5"):
        with pytest.raises(ConfigError):
            Target.parse(bad)


def test_auto_chooses_per_prompt_length_and_refuses_another_model(tmp_path, tiny_llama):
    path = _profile(tiny_llama).save(tmp_path / "p.json")
    auto = make_method(f"auto:profile={path}")
    assert isinstance(auto, AutoMethod)
    short = generate(tiny_llama, None, torch.arange(10)[None], auto, max_new_tokens=3, stop_at_eos=False)
    long = generate(tiny_llama, None, torch.arange(40)[None], auto, max_new_tokens=3, stop_at_eos=False)
    assert short.timing.method == "full" and long.timing.method == "lazyllm[keep-all]"
    assert long.token_ids == generate(tiny_llama, None, torch.arange(40)[None], max_new_tokens=3,
                                      stop_at_eos=False).token_ids
    other = random_model("llama", seed=1)
    with pytest.raises(ConfigError, match="weights differ"):
        generate(other, None, torch.arange(10)[None], auto, max_new_tokens=1)
    with pytest.raises(ConfigError, match="auto needs a tuning profile"):
        make_method("auto")
    with pytest.raises(ConfigError, match="no tuning profile"):
        make_method(f"auto:profile={tmp_path / 'nope.json'}")


