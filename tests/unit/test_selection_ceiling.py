"""The selection-ceiling diagnostic: oracle selects keep their promises and bad settings are
refused (its policy row is LazyLLM itself, on the real model: tests/integration/)."""

from __future__ import annotations

import pytest
import torch

from fastprefill.data.tasks import get_task
from fastprefill.errors import ConfigError
from fastprefill.methods.lazyllm import LazyLLM
from research.ceiling import oracle_select, selection_ceiling


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


def test_selection_ceiling_refuses_bad_settings(tiny_llama):
    model = tiny_llama
    task = get_task("multidoc-qa")
    with pytest.raises(ConfigError, match="one-cut"):
        selection_ceiling(model, None, task, [], LazyLLM(schedule=((0, 0.5), (1, 0.3))))
    with pytest.raises(ConfigError, match="probe_depth"):
        selection_ceiling(model, None, task, [], LazyLLM(schedule=((0, 0.5),)), probe_depth=0.99)
    with pytest.raises(ConfigError, match="gold"):
        selection_ceiling(model, None, object(), [], LazyLLM(schedule=((0, 0.5),)))
