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
