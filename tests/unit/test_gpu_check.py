"""``benchmarks/gpu_check.py`` on the CPU with tiny configs: every exactness check passes in both
dtypes, the TTFT table has one row per (model, length, method) with the method's counted work
(full prefill's FLOPs are the cost model's causal prefill), the result files are written, a
check fails on a real difference and passes a near-tie, and bad arguments are refused."""

from __future__ import annotations

import json

import pytest
import torch

import gpu_check
from fastprefill.models.shape import ModelShape


def test_the_device_check_runs_on_the_cpu_with_tiny_configs(tmp_path):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--lengths", "48", "--repeats", "1",
                           "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu_check_cpu_tiny.json").read_text())
    checks = [(r["model"], r["dtype"], r["check"]) for r in doc["exactness"]]
    assert len(set(checks)) == len(checks) == 2 * 2 * 6  # models x dtypes x checks
    assert all(r["passed"] for r in doc["exactness"])
    bitwise = [r for r in doc["exactness"] if r["check"] in ("paused", "persisted", "layer-loop")]
    assert all(r["bitwise_equal"] for r in bitwise)

    rows = doc["ttft"]
    labels = [label for label, _ in gpu_check.table_methods(8)]
    assert [(r["model"], r["tokens"], r["method"]) for r in rows] == [
        (model, 48, label) for model in ("llama-tiny", "qwen2-tiny") for label in labels]
    assert all(r["ttft_median_s"] > 0 and len(r["ttft_s"]) == 1 for r in rows)
    by = {(r["model"], r["method"]): r for r in rows}
    full = by["llama-tiny", "full prefill"]
    shape = ModelShape.from_config(gpu_check.build(gpu_check.TINY_SHAPES["llama-tiny"], "meta", torch.float32).config)
    assert full["flops"] == shape.causal_prefill_flops(48) and full["speedup_vs_full"] == 1.0
    hit = by["llama-tiny", "prefix-cache hit"]
    assert hit["cached_tokens"] == 32 and hit["token_layer_fraction"] == 16 / 48  # the tail of 16 computed
    lazy = by["llama-tiny", "LazyLLM, the paper's rule"]
    assert lazy["token_layer_fraction"] < 1 and lazy["flops_vs_full"] < 1
    assert doc["header"]["bench"] == "gpu-check" and doc["header"]["device"] == "cpu"
    md = (tmp_path / "gpu_check_cpu_tiny.md").read_text()
    assert md.count("| llama-tiny | 48 |") == len(labels) and "## Exactness" in md


def test_a_check_fails_on_a_difference_and_passes_a_near_tie():
    ref = torch.tensor([10.0, 0.0, -1.0])
    assert gpu_check._compare("c", ref, ref + 0.1, "bfloat16")["passed"]  # within 5% of 10
    assert not gpu_check._compare("c", ref, ref + 1.0, "bfloat16")["passed"]
    assert not gpu_check._compare("c", ref, ref + 1e-6, "float32", bitwise=True)["passed"]
    split = gpu_check._compare("c", ref, None, "bfloat16", [1, 2, 3], [5.0, 0.2, 4.0], [1, 7, 8])
    assert split["passed"] and split["first_token_split"] == 1  # the reference's top two 0.2 apart
    assert not gpu_check._compare("c", ref, None, "bfloat16", [1, 2, 3], [5.0, 3.0, 4.0], [1, 7, 8])["passed"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cuda"], "sees no CUDA device"),
    (["--device", "xpu:0"], "--device must be"),
    (["--device", "cpu", "--tiny", "--models", "llama-2-7b"], "unknown"),
    (["--device", "cpu", "--repeats", "0"], "must be >= 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    if torch.cuda.is_available() and argv[1] == "cuda":
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cells_past_the_budget_are_skipped_and_recorded(tmp_path):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--lengths", "32", "--repeats", "1", "--dtypes", "float32",
                           "--models", "qwen2-tiny", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu_check_cpu_tiny.json").read_text())
    assert len(doc["ttft"]) == len(gpu_check.table_methods(8))
    assert all(r["error"] == "skipped: past --budget-s" for r in doc["ttft"])
    assert "skipped: past --budget-s" in (tmp_path / "gpu_check_cpu_tiny.md").read_text()
