"""The bench harness (records, paired summaries, runner, report) and the method registry, on
synthetic records and tiny models."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from fastprefill.bench.records import Record, RecordLog, load_records, save_records
from fastprefill.bench.report import markdown_table, write_report
from fastprefill.bench.runner import Unscored, first_token_kl, run_benchmark, run_samples
from fastprefill.bench.summary import bootstrap_ci, summarize
from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method, parse_spec
from reporting import (
    method_entry,
    needle_by_depth,
    needle_depth,
    paired_row,
    references_by_model,
    write_paired_rows,
    write_rows,
)
from samples import random_samples
from tests import REPO

RESULTS = REPO / "benchmarks" / "results"


def _rec(method: str, sid: str, ttft: float, score: float, frac: float = 1.0, flops: float = 100.0,
         output: str = "x", length: int | None = 1024, **extra) -> Record:
    return Record(method=method, length=length, sample_id=sid, prompt_tokens=1000, ttft_s=ttft,
                  decode_s_per_token=0.01, total_s=ttft + 0.1, new_tokens=10, token_layer_fraction=frac,
                  prefill_flops=flops, peak_mem_mb=1.0, score=score, metrics={"score": score}, output=output,
                  extra=dict(extra))


# --------------------------------------------------------------------------- summaries
def test_summary_ratios_and_paired_difference():
    recs = []
    for i, (f_t, m_t) in enumerate([(1.0, 0.5), (2.0, 1.0), (3.0, 1.0)]):
        recs.append(_rec("full", str(i), f_t, 1.0))
        recs.append(_rec("fast", str(i), m_t, [1.0, 0.0, 1.0][i], frac=0.4, flops=40.0))
    full, fast = summarize(recs)
    assert full.method == "full" and full.is_reference and full.speedup == pytest.approx(1.0)
    assert fast.n == 3 and fast.n_paired == 3 and fast.reference == "full"
    assert fast.ttft_median_s == pytest.approx(1.0)
    assert fast.speedup == pytest.approx(2.0)  # median(full)=2.0 / median(fast)=1.0
    assert fast.speedup_paired_median == pytest.approx(2.0)  # ratios 2, 2, 3
    assert fast.score_diff == pytest.approx(-1 / 3)
    assert fast.ideal_speedup == pytest.approx(2.5)
    assert fast.realised_over_ideal == pytest.approx(0.8)
    assert fast.flops_ratio == pytest.approx(0.4)
    assert "| 1024 | fast | 3 |" in markdown_table([full, fast])
    # totals (TTFT + 0.1): full 1.1, 2.1, 3.1 against 0.6, 1.1, 1.1
    assert fast.total_speedup_paired_median == pytest.approx(2.1 / 1.1) and fast.slower_total_share == 0.0
    slow = [dataclasses.replace(r, total_s=r.total_s * (3.0 if r.sample_id == "1" else 1.0)) if r.method == "fast"
            else r for r in recs]
    _, fast = summarize(slow)
    assert fast.slower_total_share == pytest.approx(1 / 3)  # sample 1: 3.3 s against 2.1 s
    assert paired_row(fast)["slower_total_share"] == pytest.approx(1 / 3)
    assert paired_row(fast)["total_speedup_median"] == pytest.approx(1.1 / 0.6)  # ratios 1.83, 0.64, 2.82


def test_summary_fidelity_first_token_identical_answers_and_kl():
    recs = [_rec("full", "a", 4.0, 1.0, output="x", first_token=7),
            _rec("lazy", "a", 2.0, 1.0, output=" x ", first_token=7, first_token_kl=0.5),
            _rec("full", "b", 8.0, 0.5, output="y", first_token=3),
            _rec("lazy", "b", 2.0, 0.0, output="z", first_token=9, first_token_kl=1.5),
            _rec("full", "c", 8.0, 0.5, output="w", first_token=3),
            _rec("lazy", "c", 2.0, 0.0, output="w", first_token=3, first_token_kl=4.0)]
    _, lazy = summarize(recs)
    assert lazy.first_token_agreement == pytest.approx(2 / 3)
    assert lazy.identical_answers == pytest.approx(2 / 3)  # "x" == " x " after strip, "z" != "y"
    assert lazy.first_token_kl_median == pytest.approx(1.5) and lazy.first_token_kl_n == 3
    row = markdown_table([lazy]).splitlines()[-1]
    assert row.endswith("| 67% | 67% | 1.500 |")
    old = summarize([_rec("full", "a", 1.0, 1.0), _rec("m", "a", 1.0, 1.0)])[1]  # files without these extras
    assert old.first_token_agreement is None and old.first_token_kl_median is None


def test_paired_row_keys_and_counters():
    recs = [_rec("full", "a", 4.0, 1.0, output="x"), _rec("lazy", "a", 2.0, 1.0, output=" x ", revived_per_step=[4, 2]),
            _rec("full", "b", 8.0, 0.5, output="y"), _rec("lazy", "b", 2.0, 0.0, output="z", revived_per_step=[3])]
    rows = [paired_row(s) for s in summarize(recs) if not s.is_reference]
    (row,) = rows
    assert row["method"] == "lazy" and row["n"] == 2
    assert row["same_output_as_full"] == 0.5
    assert row["score_diff"] == pytest.approx(-0.25) and row["score_full"] == pytest.approx(0.75)
    assert row["speedup_median"] == pytest.approx(3.0)  # paired ratios 2 and 4
    assert row["total_s_median"] == pytest.approx(2.1) and row["total_full_s_median"] == pytest.approx(6.1)
    assert row["revived_per_step_mean"] == pytest.approx(3.0)  # mean of the per-run means 3 and 3


def test_summary_with_a_reference_per_method_and_order():
    recs = [_rec("full", "a", 4.0, 1.0, first_token=1), _rec("small", "a", 1.0, 0.5, first_token=2),
            _rec("kvp", "a", 0.5, 0.0, first_token=2), _rec("full", "b", 6.0, 1.0, first_token=1),
            _rec("small", "b", 2.0, 0.5, first_token=1), _rec("kvp", "b", 0.5, 0.0, first_token=1)]
    refs = {"full": "full", "small": "full", "kvp": "small"}
    by_ref = summarize(recs, reference=refs, order=["full", "small", "kvp"])
    assert [s.method for s in by_ref] == ["full", "small", "kvp"]
    kvp = by_ref[2]
    assert kvp.reference == "small" and kvp.speedup_paired_median == pytest.approx(3.0)  # ratios 2 and 4
    assert kvp.first_token_agreement == 1.0
    vs_full = {s.method: s for s in summarize(recs)}
    entry = method_entry(kvp, vs_full["kvp"])
    assert entry["median_speedup_vs_reference"] == pytest.approx(3.0)
    assert entry["median_speedup_vs_full"] == pytest.approx(10.0)  # ratios 8 and 12
    assert entry["first_token_agreement_with_reference"] == 1.0 and entry["reference"] == "small"
    with pytest.raises(ConfigError, match="no reference method given for 'kvp'"):
        summarize(recs, reference={"full": "full", "small": "full"})


def test_references_by_model_reproduces_the_committed_kvp_header():
    header = json.loads((RESULTS / "kvp_singledoc-qa_1024.summary.json").read_text())
    specs = header["methods"]
    refs = references_by_model({n: m for n, (m, _) in specs.items()}, {n for n, (_, s) in specs.items() if s == "full"})
    assert refs == header["references"]
    with pytest.raises(ConfigError, match="no full prefill of"):
        references_by_model({"full": "a", "kvp": "b"}, {"full"})


def test_bootstrap_ci_brackets_mean_and_shrinks_with_n():
    rng = torch.Generator().manual_seed(0)
    small = (torch.rand(20, generator=rng) - 0.3).tolist()
    big = (torch.rand(2000, generator=rng) - 0.3).tolist()
    lo, hi = bootstrap_ci(small)
    assert lo < sum(small) / len(small) < hi
    lo2, hi2 = bootstrap_ci(big)
    assert (hi2 - lo2) < (hi - lo)
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5)


def test_needle_by_depth_reads_the_depth_from_the_sample_id():
    recs = [_rec(m, f"test-0-{i}", 1.0, float(i % 2 == 0 or m == "full"), length=1024)
            for i in range(10) for m in ("full", "lazy")]
    rows = needle_by_depth(recs)
    assert sum(r["n"] for r in rows) == 20
    for row in rows:
        ids = [i for i in range(10) if needle_depth(f"test-0-{i}") == row["depth"]]
        expect = [1.0 if row["method"] == "full" else float(i % 2 == 0) for i in ids]
        assert row["n"] == len(ids) and row["retrieved"] == pytest.approx(sum(expect) / len(expect))


# --------------------------------------------------------------------------- records on disk
def test_write_report_round_trip(tmp_path):
    recs = [_rec("full", "a", 1.0, 1.0), _rec("fast", "a", 0.5, 1.0)]
    write_report(tmp_path, "r", {"task": "t", "threads": 2}, recs)
    header, back = load_records(tmp_path / "r.jsonl")
    assert header["threads"] == 2 and back == recs
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "fast" in (tmp_path / "r.md").read_text()
    json.loads((tmp_path / "r.jsonl").read_text().splitlines()[1])
    write_paired_rows(tmp_path / "r.summary.jsonl", {"task": "t"}, summarize(recs))
    lines = (tmp_path / "r.summary.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"header": {"task": "t"}} and [json.loads(x)["method"] for x in lines[1:]] == ["fast"]


def test_committed_record_files_load():
    header, recs = load_records(RESULTS / "lazyllm_curve_qwen2.5-coder-0.5b_2048.jsonl")
    assert header["task"] == "multidoc-qa" and len(recs) == 350 and all(isinstance(r, Record) for r in recs)
    with pytest.raises(ConfigError, match="header"):
        load_records(RESULTS / "runahead_ttft.jsonl")
    with pytest.raises(ConfigError, match="no such result file"):
        load_records(RESULTS / "nope.jsonl")


def test_a_run_killed_mid_line_resumes_without_its_torn_record(tmp_path):
    path = tmp_path / "run.jsonl"
    header = {"task": "t", "n": 2}
    log = RecordLog(path, header)
    log.append(_rec("full", "a", 1.0, 1.0))
    log.append(_rec("lazy", "a", 0.5, 1.0))
    with path.open("a") as f:
        f.write('{"method": "full", "sample_id": "b", "ttf')  # killed while writing
    with pytest.raises(ConfigError, match=r"line 4 is not JSON \(cut short: resume the run to drop it\)"):
        load_records(path)
    again = RecordLog(path, header, resume=True, match=("task", "n"))
    assert again.records == log.records and again.done(1024) == {("a", "full"), ("a", "lazy")}
    again.append(_rec("full", "b", 1.0, 1.0))
    assert load_records(path) == (header, [*log.records, again.records[-1]])  # the torn line is gone
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")  # damage inside: refused
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        RecordLog(path, header, resume=True, match=("task", "n"))
    path.write_text(lines[0] + "\n" + json.dumps({"method": "full"}) + "\n")
    with pytest.raises(ConfigError, match="not a benchmark record"):
        load_records(path)


def test_record_log_appends_resumes_and_refuses_mismatches(tmp_path):
    path = tmp_path / "run.jsonl"
    header = {"task": "t", "n": 2, "command": "first"}
    log = RecordLog(path, header)
    log.append(_rec("full", "a", 1.0, 1.0))
    log.append(_rec("full", "a", 1.0, 1.0, length=2048))
    assert load_records(path) == (header, log.records)  # on disk at once
    again = RecordLog(path, {**header, "command": "second"}, resume=True, match=("task", "n"))
    assert again.header["command"] == "first" and again.records == log.records
    assert again.done(1024) == {("a", "full")} and again.done(2048) == {("a", "full")} and again.done(None) == set()
    with pytest.raises(ConfigError, match="made with n=2, not 3"):
        RecordLog(path, {**header, "n": 3}, resume=True, match=("task", "n"))
    with pytest.raises(ConfigError, match="made with n=2, not 1; n may only grow"):
        RecordLog(path, {**header, "n": 1}, resume=True, match=("task", "n"), grow=("n",))
    with pytest.raises(ConfigError, match="made with task='t', not 'u'"):
        RecordLog(path, {**header, "task": "u", "n": 3}, resume=True, match=("task", "n"), grow=("n",))
    assert load_records(path)[0] == header  # a refused resume leaves the file alone
    with pytest.raises(ConfigError, match="exists"):
        RecordLog(path, header, overwrite=False)
    grown = RecordLog(path, {**header, "n": 5, "command": "more"}, resume=True, match=("task", "n"), grow=("n",))
    assert grown.records == log.records and grown.done(1024) == {("a", "full")}
    assert grown.header == {**header, "n": 5, "extended": [{"from_n": 2, "command": "more"}]}
    assert load_records(path) == (grown.header, log.records)
    assert "extended from n=2 by `more`" in markdown_table([], {**grown.header, "task": "t"})
    RecordLog(path, header)  # a fresh run replaces the file
    assert load_records(path) == (header, [])
    write_rows(tmp_path / "rows.jsonl", {"h": 1}, [{"a": 1}])
    save_records(tmp_path / "s.jsonl", header, log.records)
    assert load_records(tmp_path / "s.jsonl")[1] == log.records


# --------------------------------------------------------------------------- runner
def test_generate_returns_the_first_token_logits(tiny_llama):
    ids = list(range(1, 20))
    res = generate(tiny_llama, None, ids, FullPrefill(), max_new_tokens=3)
    with torch.no_grad():
        expect = tiny_llama(torch.tensor([ids])).logits[0, -1]
    assert res.first_logits.shape == (128,) and res.first_logits.dtype == torch.float32
    assert res.first_logits.device.type == "cpu"
    torch.testing.assert_close(res.first_logits, expect, rtol=1e-5, atol=1e-5)
    assert res.token_ids[0] == int(expect.argmax())


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
    # the same computation: KL 0 for the copy, none for the reference itself
    assert all(abs(r.extra["first_token_kl"]) < 1e-6 for r in recs if r.method == "again")
    assert all("first_token_kl" not in r.extra for r in recs if r.method == "full")


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.softmax(p_logits.double(), -1)
    return float((p * (p.log() - torch.log_softmax(q_logits.double(), -1))).sum())


def test_run_samples_other_model_resume_stream_and_kl(tiny_llama, tiny_qwen2):
    """A method pinned to another model runs on it; done pairs are skipped; records stream out
    once their reference ran, with KL(reference || method) of the two models' distributions."""
    task = SimpleNamespace(score=lambda s, text: {"score": 0.0})
    samples = [SimpleNamespace(id=str(i), input_ids=list(range(1, 12 + i))) for i in range(3)]
    streamed: list[Record] = []
    recs = run_samples(tiny_llama, None, task, samples, {"other": FullPrefill()}, length=None,
                       max_new_tokens=2, warmup=0, progress=False, method_models={"other": tiny_qwen2},
                       done=[("0", "full")], on_record=streamed.append)
    assert [(r.method, r.sample_id) for r in recs] == [(r.method, r.sample_id) for r in streamed]
    assert sorted((r.method, r.sample_id) for r in recs) == [
        ("full", "1"), ("full", "2"), ("other", "0"), ("other", "1"), ("other", "2")]
    # run order per sample (rotated): other (full done before) / full, other / other, full; on
    # sample 2 "other" is held until full ran (its KL below needs full's logits)
    assert [(r.method, r.sample_id) for r in recs] == [
        ("other", "0"), ("full", "1"), ("other", "1"), ("other", "2"), ("full", "2")]
    for r in recs:  # each first token is its own model's greedy choice
        model = tiny_qwen2 if r.method == "other" else tiny_llama
        ids = torch.tensor([samples[int(r.sample_id)].input_ids])
        with torch.no_grad():
            assert r.extra["first_token"] == int(model(ids).logits[0, -1].argmax())
    by = {(r.method, r.sample_id): r for r in recs}
    assert "first_token_kl" not in by[("other", "0")].extra  # its reference ran in an earlier session
    for sid in ("1", "2"):
        ids = torch.tensor([samples[int(sid)].input_ids])
        with torch.no_grad():
            expect = _kl(tiny_llama(ids).logits[0, -1], tiny_qwen2(ids).logits[0, -1])
        assert expect > 1e-3
        assert by[("other", sid)].extra["first_token_kl"] == pytest.approx(expect, rel=1e-4)


def test_run_samples_refuses_an_unknown_reference(tiny_llama):
    samples = [SimpleNamespace(id="0", input_ids=[1, 2, 3])]
    with pytest.raises(ConfigError, match="reference"):
        run_samples(tiny_llama, None, Unscored(), samples, {}, length=None, max_new_tokens=1,
                    reference="nope", progress=False)


def test_first_token_kl_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(50, generator=g), torch.randn(50, generator=g)
    assert first_token_kl(p, q) == pytest.approx(_kl(p, q), rel=1e-5)
    assert first_token_kl(p, p) == pytest.approx(0.0, abs=1e-6)


def test_random_samples_are_seeded_and_in_range():
    a, b = random_samples(128, 16, 3, seed=1), random_samples(128, 16, 3, seed=1)
    assert a == b and all(len(s.input_ids) == 16 and min(s.input_ids) >= 100 for s in a)
    with pytest.raises(ConfigError, match="low"):
        random_samples(50, 4, 1, seed=0)


class _Counting(FullPrefill):
    """Full prefill that counts its prefills (to see which runs a resumed benchmark repeats)."""

    calls = 0

    def prefill(self, model, input_ids):
        type(self).calls += 1
        return super().prefill(model, input_ids)


def test_run_benchmark_appends_and_resumes(tiny_llama, tmp_path, monkeypatch):
    from fastprefill.data import tasks

    class Task:
        default_max_new_tokens = 2

        def build(self, tokenizer, length, n, split, seed):
            return [SimpleNamespace(id=str(i), input_ids=list(range(1, length + i))) for i in range(n)]

        def score(self, sample, text):
            return {"score": 0.0}

    monkeypatch.setattr(tasks, "get_task", lambda name: Task())
    kw = {"threads": torch.get_num_threads(), "warmup": 0, "out_dir": tmp_path, "name": "b", "progress": False}
    full = run_benchmark(tiny_llama, None, "fake", {"c": _Counting()}, [8, 12], 2, **kw)
    path = tmp_path / "b.jsonl"
    header, on_disk = load_records(path)
    assert on_disk == full and len(full) == 8 and header["lengths"] == [8, 12]
    assert (tmp_path / "b.md").exists() and (tmp_path / "b.png").exists()
    # interrupt: keep the header and the first 3 records, then resume
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))
    _Counting.calls = 0
    resumed = run_benchmark(tiny_llama, None, "fake", {"c": _Counting()}, [8, 12], 2, resume=True, **kw)
    assert resumed[:3] == full[:3]
    assert sorted((r.length, r.sample_id, r.method) for r in resumed) == sorted(
        (r.length, r.sample_id, r.method) for r in full)
    assert _Counting.calls == sum(r.method == "c" for r in full[3:])  # only the missing runs
    assert load_records(path)[1] == resumed
    with pytest.raises(ConfigError, match="made with n=2, not 1; n may only grow"):
        run_benchmark(tiny_llama, None, "fake", {"c": _Counting()}, [8, 12], 1, resume=True, **kw)
    # a larger n extends the file: the first samples are the same (prefix-stable), only the new one runs
    _Counting.calls = 0
    grown = run_benchmark(tiny_llama, None, "fake", {"c": _Counting()}, [8, 12], 3, resume=True, **kw)
    assert grown[:8] == resumed and _Counting.calls == 2
    assert sorted((r.length, r.sample_id) for r in grown[8:]) == [(8, "2"), (8, "2"), (12, "2"), (12, "2")]
    header, on_disk = load_records(path)
    assert on_disk == grown and header["n"] == 3 and [e["from_n"] for e in header["extended"]] == [2]


# --------------------------------------------------------------------------- registry and CLI
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
    assert main(["bench", "verify"]) == 2  # needs a checkout: names the script that checks figures
    err = capsys.readouterr().err
    assert "no such file" in err and "unknown keys" in err and "known methods" in err
    assert "python benchmarks/verify.py" in err
    assert "Traceback" not in err


def test_cli_bench_config_files_parse():
    from fastprefill.cli import build_parser
    from fastprefill.cli.bench import bench_config

    for path in sorted((REPO / "benchmarks" / "configs").glob("*.toml")):
        cfg = bench_config(build_parser().parse_args(["bench", "--config", str(path)]))
        assert cfg["name"] == path.stem and cfg["out"] == "benchmarks/results"


# --------------------------------------------------------------------------- gold-token share
def test_run_samples_records_the_share_of_gold_tokens_kept_per_stage(tiny_llama):
    """Known answers: a cut keeping exactly its protected tokens {0, 1, 2, 39} keeps half of the
    gold tokens {0, 1, 10, 20}; random drop keeps the gold tokens its seeded choice holds; full
    prefill records no share; no tensor reaches a record."""
    from fastprefill.methods.baselines import RandomDrop
    from fastprefill.methods.lazyllm import LazyLLM

    gold = [0, 1, 10, 20]
    task = SimpleNamespace(score=lambda s, text: {"score": 0.0},
                           gold_token_positions=lambda s, tok: torch.tensor(gold))
    samples = [SimpleNamespace(id="a", input_ids=list(range(1, 41)))]
    drop = RandomDrop(keep=0.5, seed=0)
    methods = {"cut": LazyLLM(schedule=((1, 0.1),), options={"sinks": 3}),
               "two": LazyLLM(schedule=((1, 0.5), (2, 0.1)), options={"sinks": 3}), "random": drop}
    recs = {r.method: r for r in run_samples(tiny_llama, None, task, samples, methods, length=None,
                                             max_new_tokens=2, warmup=0, progress=False)}
    assert recs["cut"].extra["gold_kept_share_per_stage"] == [0.5]
    two = recs["two"].extra["gold_kept_share_per_stage"]
    assert len(two) == 2 and two[0] >= 0.5 and two[1] == 0.5  # the last stage keeps exactly {0, 1, 2, 39}
    kept = set(drop.choose(40).tolist())
    assert recs["random"].extra["gold_kept_share_per_stage"] == [sum(p in kept for p in gold) / 4]
    assert "gold_kept_share_per_stage" not in recs["full"].extra
    for rec in recs.values():
        assert "kept_positions" not in rec.extra
        json.dumps(rec.extra)
    # outside the runner a prefill keeps its timings serialisable: no kept positions reported
    res = generate(tiny_llama, None, samples[0].input_ids, methods["cut"], max_new_tokens=2)
    assert "kept_positions" not in res.timing.extra
    json.dumps(res.timing.to_dict())


def test_summary_averages_the_gold_share_per_stage():
    recs = [_rec("full", "a", 2.0, 1.0), _rec("lazy", "a", 1.0, 1.0, gold_kept_share_per_stage=[0.5, 0.25]),
            _rec("full", "b", 2.0, 1.0), _rec("lazy", "b", 1.0, 1.0, gold_kept_share_per_stage=[1.0, 0.75]),
            _rec("full", "c", 2.0, 1.0), _rec("lazy", "c", 1.0, 1.0)]  # a run that did not record it
    full, lazy = summarize(recs)
    assert lazy.gold_kept_share_per_stage == pytest.approx([0.75, 0.5])
    assert full.gold_kept_share_per_stage is None
    assert "gold_kept_share_per_stage" not in lazy.counters
    assert paired_row(lazy)["gold_kept_share_per_stage"] == pytest.approx([0.75, 0.5])
