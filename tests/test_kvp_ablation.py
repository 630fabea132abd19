"""The cache variants of ``benchmarks/kvp_bench.py ablate``: each swaps exactly the part it names."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("kvp_bench")


def _kv(fill: float, layers: int = 4, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer l: K = fill + l, V = -(fill + l), each (1, 2, n, 3)."""
    return [(torch.full((1, 2, n, 3), fill + l), torch.full((1, 2, n, 3), -(fill + l))) for l in range(layers)]


def _source(x: torch.Tensor) -> str:
    """Which list an entry came from: 'p' (fill 100) or 't' (fill 0), from its magnitude."""
    return "p" if float(x.abs().flatten()[0]) >= 100 else "t"


def test_each_variant_swaps_only_its_part(bench):
    pred, true = _kv(100.0), _kv(0.0)
    sink = 2
    got = {name: build(pred, true) for name, build in bench.ablation_variants(sink).items()}
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


def test_layer_plot_draws_only_methods_with_errors(bench, tmp_path):
    no_errors = {"full": {"n": 3}, "aux": {"n": 3}}
    header = {"task": "t", "split": "test", "summary": no_errors}
    assert bench._layer_plot(header, str(tmp_path / "none")) is None
    assert not (tmp_path / "none_layers.png").exists()
    kvp = {"rel_error_k": [0.1, 0.5], "rel_error_v": [0.7, 1.1], "rel_error_prompts": 2}
    header["summary"] = {**no_errors, "kvp": kvp}
    assert bench._layer_plot(header, str(tmp_path / "some")) == tmp_path / "some_layers.png"
    assert (tmp_path / "some_layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layers_command_names_its_input_problems(bench, tmp_path):
    wrong = tmp_path / "kvp_x.json"
    wrong.write_text("{}")
    with pytest.raises(SystemExit, match="expected an eval summary file"):
        bench.main(["layers", str(wrong)])
    empty = tmp_path / "kvp_x.summary.json"
    empty.write_text('{"task": "t", "split": "test", "summary": {"full": {"n": 1}}}')
    with pytest.raises(SystemExit, match="no method has per-layer errors"):
        bench.main(["layers", str(empty)])
    ok = tmp_path / "kvp_y.summary.json"
    ok.write_text('{"task": "t", "split": "test", "summary": {"kvp": {"rel_error_k": [0.2], '
                  '"rel_error_v": [0.9], "rel_error_prompts": 1}}}')
    bench.main(["layers", str(ok)])
    assert (tmp_path / "kvp_y_layers.png").exists()
