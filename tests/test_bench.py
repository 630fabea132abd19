"""Benchmark runner/report and the method registry, on synthetic records and a tiny model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fastprefill.bench.report import bootstrap_ci, markdown_table, summarize, write_report
from fastprefill.bench.runner import Record, load_jsonl, run_samples
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method, parse_spec


def _rec(method: str, sid: str, ttft: float, score: float, frac: float = 1.0, flops: float = 100.0) -> Record:
    return Record(method=method, length=1024, sample_id=sid, prompt_tokens=1000, ttft_s=ttft,
                  decode_s_per_token=0.01, total_s=ttft + 0.1, new_tokens=10, token_layer_fraction=frac,
                  prefill_flops=flops, peak_mem_mb=1.0, score=score, metrics={"score": score}, output="x")


def test_summary_ratios_and_paired_difference():
    recs = []
    for i, (f_t, m_t) in enumerate([(1.0, 0.5), (2.0, 1.0), (3.0, 1.0)]):
        recs.append(_rec("full", str(i), f_t, 1.0))
        recs.append(_rec("fast", str(i), m_t, [1.0, 0.0, 1.0][i], frac=0.4, flops=40.0))
    full, fast = summarize(recs)
    assert full.method == "full" and full.speedup == pytest.approx(1.0)
    assert fast.n == 3
    assert fast.ttft_median_s == pytest.approx(1.0)
    assert fast.speedup == pytest.approx(2.0)  # median(full)=2.0 / median(fast)=1.0
    assert fast.speedup_paired_median == pytest.approx(2.0)  # ratios 2, 2, 3
    assert fast.score_diff_vs_full == pytest.approx(-1 / 3)
    assert fast.ideal_speedup == pytest.approx(2.5)
    assert fast.realised_over_ideal == pytest.approx(0.8)
    assert fast.flops_ratio == pytest.approx(0.4)
    assert "| 1024 | fast | 3 |" in markdown_table([full, fast])


def test_bootstrap_ci_brackets_mean_and_shrinks_with_n():
    rng = torch.Generator().manual_seed(0)
    small = (torch.rand(20, generator=rng) - 0.3).tolist()
    big = (torch.rand(2000, generator=rng) - 0.3).tolist()
    lo, hi = bootstrap_ci(small)
    assert lo < sum(small) / len(small) < hi
    lo2, hi2 = bootstrap_ci(big)
    assert (hi2 - lo2) < (hi - lo)
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5)


def test_write_report_round_trip(tmp_path):
    recs = [_rec("full", "a", 1.0, 1.0), _rec("fast", "a", 0.5, 1.0)]
    write_report(tmp_path, "r", {"task": "t", "threads": 2}, recs)
    header, back = load_jsonl(tmp_path / "r.jsonl")
    assert header["threads"] == 2 and back == recs
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "fast" in (tmp_path / "r.md").read_text()
    json.loads((tmp_path / "r.jsonl").read_text().splitlines()[1])


def test_run_samples_pairs_full_with_each_method(tiny_llama):
    task = SimpleNamespace(score=lambda s, text: {"score": 1.0 if s.id == "0" else 0.0})
    samples = [SimpleNamespace(id=str(i), input_ids=list(range(1, 20 + i))) for i in range(3)]
    recs = run_samples(tiny_llama, None, task, samples, {"again": FullPrefill()}, length=None,
                       max_new_tokens=3, warmup=1, progress=False)
    assert sorted((r.method, r.sample_id) for r in recs) == sorted(
        (m, str(i)) for m in ("full", "again") for i in range(3))
    assert all(r.new_tokens == 3 and r.ttft_s > 0 for r in recs)
    by = {(r.method, r.sample_id): r for r in recs}
    assert by[("full", "2")].output == by[("again", "2")].output
    assert by[("full", "0")].score == 1.0 and by[("full", "1")].score == 0.0


def test_run_samples_other_model_resume_and_stream(tiny_llama, tiny_qwen2):
    """A method pinned to another model runs on it; done pairs are skipped; records stream out."""
    task = SimpleNamespace(score=lambda s, text: {"score": 0.0})
    samples = [SimpleNamespace(id=str(i), input_ids=list(range(1, 12 + i))) for i in range(2)]
    streamed: list[Record] = []
    recs = run_samples(tiny_llama, None, task, samples, {"other": FullPrefill()}, length=None,
                       max_new_tokens=2, warmup=0, progress=False, method_models={"other": tiny_qwen2},
                       done=[("0", "full")], on_record=streamed.append)
    assert [(r.method, r.sample_id) for r in recs] == [(r.method, r.sample_id) for r in streamed]
    assert sorted((r.method, r.sample_id) for r in recs) == [("full", "1"), ("other", "0"), ("other", "1")]
    for r in recs:  # each first token is its own model's greedy choice
        model = tiny_qwen2 if r.method == "other" else tiny_llama
        ids = torch.tensor([samples[int(r.sample_id)].input_ids])
        with torch.no_grad():
            assert r.extra["first_token"] == int(model(ids).logits[0, -1].argmax())


def test_registry_parses_and_validates():
    assert parse_spec("lazyllm:preset=default, x=1") == ("lazyllm", {"preset": "default", "x": "1"})
    assert isinstance(make_method("full"), FullPrefill)
    with pytest.raises(ConfigError, match="known methods"):
        make_method("nope")
    with pytest.raises(ConfigError, match="key=value"):
        make_method("full:oops")
    with pytest.raises(ConfigError, match="no option"):
        make_method("full:keep=0.5")


def test_cli_errors_exit_2_without_traceback(capsys, tmp_path):
    from fastprefill.cli import main

    assert main(["bench", "--config", str(tmp_path / "missing.toml")]) == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('modle = "x"\n')
    assert main(["bench", "--config", str(bad)]) == 2
    assert main(["generate", "hi", "--method", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "unknown keys" in err and "known methods" in err
    assert "Traceback" not in err
