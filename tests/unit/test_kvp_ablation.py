"""The KV Prediction cache ablation (:mod:`research.ablation`), the per-layer error plot
and the KVP script's argument parsing."""

from __future__ import annotations

import json

import pytest
import torch

from fastprefill.errors import ConfigError
from fastprefill.models.kv import prefix_kv
from reporting import (
    label_lifts,
    merge_eval_summaries,
    plot_layer_errors,
    plot_score_vs_flops,
    redraw_layer_plot,
)
from research.ablation import ablation_table, ablation_variants, run_ablation


def _kv(fill: float, layers: int = 4, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer l: K = fill + l, V = -(fill + l), each (1, 2, n, 3)."""
    return [(torch.full((1, 2, n, 3), fill + l), torch.full((1, 2, n, 3), -(fill + l))) for l in range(layers)]


def _source(x: torch.Tensor) -> str:
    """Which list an entry came from: 'p' (fill 100) or 't' (fill 0), from its magnitude."""
    return "p" if float(x.abs().flatten()[0]) >= 100 else "t"


def test_each_variant_swaps_only_its_part():
    pred, true = _kv(100.0), _kv(0.0)
    sink = 2
    got = {name: build(pred, true) for name, build in ablation_variants(sink).items()}
    L = len(true)
    for name, kv in got.items():
        assert len(kv) == L, name
        for l, (k, v) in enumerate(kv):
            assert k.shape == true[l][0].shape and v.shape == true[l][1].shape, name
            assert float(k.flatten()[-1]) in (float(l), 100.0 + l), name  # layer order kept
    assert all(_source(k) == "t" and _source(v) == "t" for k, v in got["true KV (sanity)"])
    assert all(_source(k) == "p" and _source(v) == "p" for k, v in got["predicted K and V"])
    assert all(_source(k) == "t" and _source(v) == "p" for k, v in got["predicted V only"])
    assert all(_source(k) == "p" and _source(v) == "t" for k, v in got["predicted K only"])
    lower = got["predicted in the lower half of layers only"]
    upper = got["predicted in the upper half of layers only"]
    assert [_source(k) for k, _ in lower] == ["p", "p", "t", "t"]
    assert [_source(k) for k, _ in upper] == ["t", "t", "p", "p"]
    for k, v in got[f"predicted, first {sink} positions exact"]:
        assert (k[:, :, :sink].abs() < 100).all() and (k[:, :, sink:].abs() >= 100).all()
        assert (v[:, :, :sink].abs() < 100).all() and (v[:, :, sink:].abs() >= 100).all()


def test_run_ablation_exact_prediction_agrees_and_noise_does_not(tiny_llama):
    prompts = [torch.arange(1, 17).reshape(1, -1), torch.arange(20, 44).reshape(1, -1)]
    variants = ablation_variants(sink=2)
    exact = run_ablation(tiny_llama, lambda ids: prefix_kv(tiny_llama, ids)[0], prompts, variants, progress=False)
    assert [r["variant"] for r in exact] == list(variants)
    for row in exact:  # every cache is the true one: the first token is full prefill's
        assert row["first_token_agreement"] == 1.0, row
        assert abs(row["median_kl_nats"]) < 1e-5 and abs(row["mean_kl_nats"]) < 1e-5, row

    def noisy(ids):
        g = torch.Generator().manual_seed(0)
        return [(k + 3 * torch.randn(k.shape, generator=g), v + 3 * torch.randn(v.shape, generator=g))
                for k, v in prefix_kv(tiny_llama, ids)[0]]

    rows = {r["variant"]: r for r in run_ablation(tiny_llama, noisy, prompts, variants, progress=False)}
    assert abs(rows["true KV (sanity)"]["mean_kl_nats"]) < 1e-5
    assert rows["predicted K and V"]["mean_kl_nats"] > 1e-3
    table = ablation_table({"task": "t", "split": "dev", "n": 2, "command": "c"}, list(rows.values()), "T")
    assert table.startswith("# T, t (dev), n=2") and "| true KV (sanity) | 100% |" in table


def test_layer_plot_draws_only_methods_with_errors(tmp_path):
    no_errors = {"full": {"n": 3}, "aux": {"n": 3}}
    header = {"task": "t", "split": "test", "summary": no_errors}
    assert plot_layer_errors(header, str(tmp_path / "none")) is None
    assert not (tmp_path / "none_layers.png").exists()
    kvp = {"rel_error_k": [0.1, 0.5], "rel_error_v": [0.7, 1.1], "rel_error_prompts": 2}
    header["summary"] = {**no_errors, "kvp": kvp}
    assert plot_layer_errors(header, str(tmp_path / "some")) == tmp_path / "some_layers.png"
    assert (tmp_path / "some_layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_redraw_layer_plot_names_its_input_problems(tmp_path):
    wrong = tmp_path / "kvp_x.json"
    wrong.write_text("{}")
    with pytest.raises(ConfigError, match="expected an eval summary file"):
        redraw_layer_plot(wrong)
    empty = tmp_path / "kvp_x.summary.json"
    empty.write_text('{"task": "t", "split": "test", "summary": {"full": {"n": 1}}}')
    with pytest.raises(ConfigError, match="no method has per-layer errors"):
        redraw_layer_plot(empty)
    ok = tmp_path / "kvp_y.summary.json"
    ok.write_text('{"task": "t", "split": "test", "summary": {"kvp": {"rel_error_k": [0.2], '
                  '"rel_error_v": [0.9], "rel_error_prompts": 1}}}')
    assert redraw_layer_plot(ok) == tmp_path / "kvp_y_layers.png"
    assert (tmp_path / "kvp_y_layers.png").exists()


def _eval_summary(path, methods, n=100):
    """An eval .summary.json with ``methods``: name -> (model, accuracy, flops, speedup)."""
    path.write_text(json.dumps({
        "task": "singledoc-qa", "split": "test", "length": 1024, "n": n, "seed": 0,
        "methods": {k: [m, "full"] for k, (m, *_) in methods.items()},
        "summary": {k: {"accuracy": a, "median_ttft_flops": f, "median_speedup_vs_full": x}
                    for k, (_, a, f, x) in methods.items()}}))
    return path


def test_merged_score_vs_flops_takes_each_method_once_and_refuses_other_prompts(tmp_path):
    new = _eval_summary(tmp_path / "new.summary.json", {"full": ("b", 0.7, 100.0, 1.0), "prefix": ("b", 0.6, 50.0, 1.9)})
    old = _eval_summary(tmp_path / "old.summary.json", {"full": ("b", 0.5, 90.0, 1.0), "kvp-c": ("b", 0.0, 30.0, 2.9)})
    rows = merge_eval_summaries([new, old])
    assert [(r["method"], r["file"]) for r in rows] == [
        ("full", "new.summary.json"), ("prefix", "new.summary.json"), ("kvp-c", "old.summary.json")]
    assert rows[0]["accuracy"] == 0.7  # the first file wins a shared name
    out = plot_score_vs_flops(rows, tmp_path / "p.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = _eval_summary(tmp_path / "other.summary.json", {"full": ("b", 0.7, 100.0, 1.0)}, n=50)
    with pytest.raises(ConfigError, match="ran on other prompts"):
        merge_eval_summaries([new, other])
    with pytest.raises(ConfigError, match="no 'full' method"):
        plot_score_vs_flops(rows[1:], tmp_path / "q.png", "t")


def test_label_lifts_separate_close_labels_only():
    points = [(0.30, 0.0), (0.28, 0.0), (0.15, 1.0), (0.9, 0.0), (0.5, 60.0)]
    lifts = label_lifts(points)
    assert lifts[3] == 0.0 and lifts[4] == 0.0  # far from the others: untouched
    placed = [(x, y + lift) for (x, y), lift in zip(points, lifts)]
    for i, (x, y) in enumerate(placed):
        for px, py in placed[i + 1:]:
            assert not (abs(x - px) < 0.3 and abs(y - py) < 4.0)
    assert sorted(lifts[:3]) == [0.0, 4.0, 8.0]


def test_script_arguments_parse_and_errors_exit(tmp_path):
    import kvp_bench as bench
    parser = bench.build_parser()
    assert parser.parse_args(["train", "--pair", "smoke", "--out", "d"]).cmd == "train"
    assert parser.parse_args(["rope", "--pair", "lp", "--out", "r"]).out == "r"
    assert parser.parse_args(["ablate", "--predictor", "p"]).out.endswith("benchmarks/results")
    args = parser.parse_args(["--threads", "1", "eval", "--model", "m", "--method", "a=m:full", "--resume"])
    assert args.method == ["a=m:full"] and args.resume and args.threads == 1
    assert parser.parse_args(["layers", "x.summary.json"]).summary == "x.summary.json"
    with pytest.raises(SystemExit, match="expected an eval summary file"):
        bench.main(["layers", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="expected NAME=MODEL:full"):
        bench._parse_method("broken")
