"""The selection-ceiling diagnostic: oracle selects keep their promises, and the policy row is LazyLLM itself."""

from __future__ import annotations

import pytest
import torch

from fastprefill.bench.runner import first_token_kl
from fastprefill.data.tasks import get_task
from fastprefill.errors import ConfigError
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.pruning import keep_count
from research.ceiling import ORACLES, oracle_select, selection_ceiling, summarize_ceiling


def test_oracle_select_keeps_protected_and_ranks_by_priority_then_first():
    inf = float("inf")
    scores = torch.tensor([inf, 5.0, 4.0, 3.0, 2.0, 1.0, -inf, inf])
    # the cut's own order would keep 1 and 2 besides the protected 0 and 7
    assert oracle_select()(scores, 4).tolist() == [0, 1, 2, 7]
    priority = torch.tensor([0.0, 0.1, 0.2, 0.9, 0.8, 0.3, 99.0, 0.0])
    assert oracle_select(priority=priority)(scores, 4).tolist() == [0, 3, 4, 7]  # never the -inf candidate 6
    first = torch.tensor([5, 6])
    assert oracle_select(first=first)(scores, 4).tolist() == [0, 1, 5, 7]  # 5 first, then the cut's best
    assert oracle_select(priority=priority, first=first)(scores, 4).tolist() == [0, 3, 5, 7]


@pytest.mark.integration
def test_selection_ceiling_on_smollm2_multidoc(smollm2):
    model, tok = smollm2
    task = get_task("multidoc-qa")
    samples = task.build(tok, 512, 2, split="dev")
    lazy = LazyLLM(depth_schedule=((0.3, 0.6),), options={"score_window": 16, "pool_kernel": 7, "sinks": 4, "keep_recent": 16})
    rows = selection_ceiling(model, tok, task, samples, lazy, probe_depth=0.6)
    assert [r.selection for r in rows] == list(ORACLES) * 2
    for i, sample in enumerate(samples):
        mine = rows[3 * i: 3 * i + 3]
        ids = torch.tensor([sample.input_ids])
        with torch.inference_mode():
            reference = model(ids).logits[0, -1]
        # the policy row is LazyLLM's own prefill
        assert mine[0].first_token_kl == pytest.approx(first_token_kl(reference, lazy.prefill(model, ids).logits), abs=1e-5)
        # the same cut and budget under every selection
        assert len({r.token_layer_fraction for r in mine}) == 1
        gold = task.gold_token_positions(sample, tok)
        room = keep_count(0.6, ids.shape[1]) - 4 - 16
        assert gold.numel() <= room
        assert mine[1].gold_kept_share == 1.0  # the gold oracle keeps every gold token when they fit
    summary = summarize_ceiling(rows)
    assert [s["selection"] for s in summary] == list(ORACLES) and all(s["n"] == 2 for s in summary)


def test_selection_ceiling_refuses_bad_settings(tiny_llama):
    model = tiny_llama
    task = get_task("multidoc-qa")
    with pytest.raises(ConfigError, match="one-cut"):
        selection_ceiling(model, None, task, [], LazyLLM(schedule=((0, 0.5), (1, 0.3))))
    with pytest.raises(ConfigError, match="probe_depth"):
        selection_ceiling(model, None, task, [], LazyLLM(schedule=((0, 0.5),)), probe_depth=0.99)
    with pytest.raises(ConfigError, match="gold"):
        selection_ceiling(model, None, object(), [], LazyLLM(schedule=((0, 0.5),)))
