"""Every method that must be exact in its lossless setting, through one parametrized test.

A table of methods (in the spirit of kvpress's ``default_presses``): each entry, configured to
keep everything, must give full prefill's first-token logits (float32, max abs diff <= 1e-4) and
transformers' own greedy ``generate`` tokens, on the tiny Llama and Qwen2 configs. A new method
is covered by adding a row.
"""

from __future__ import annotations

import pytest
import torch

from fastprefill.engine import generate
from fastprefill.methods.baselines import RandomDrop, StaticPruning
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.runahead import KVRunahead, SequenceParallel

LOSSLESS = {
    "full": FullPrefill(),
    "lazyllm-empty-schedule": LazyLLM(),
    "lazyllm-keep-all-preset": LazyLLM.preset("keep-all"),
    "lazyllm-keep-1.0-at-layers-1-2": LazyLLM(schedule=((1, 1.0), (2, 1.0))),
    "random-keep-1": RandomDrop(keep=1.0, seed=3),
    "static-keep-1": StaticPruning(keep=1.0, select_layer=1),
    "runahead-1-rank": KVRunahead(procs=1),
    "tsp-1-rank": SequenceParallel(procs=1),
}


@pytest.mark.parametrize("name", list(LOSSLESS))
def test_lossless_setting_equals_full_prefill_and_hf_generate(tiny_model, name):
    method = LOSSLESS[name]
    ids = torch.randint(0, 128, (1, 41), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = FullPrefill().prefill(tiny_model, ids).logits
        got = method.prefill(tiny_model, ids).logits
    assert float((got - ref).abs().max()) <= 1e-4
    hf = tiny_model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, 41:].tolist()
    res = generate(tiny_model, None, ids, method, max_new_tokens=10, stop_at_eos=False)
    assert res.token_ids == hf
    assert res.timing.token_layers >= 41 * 4 if name.startswith("static") else res.timing.token_layers == 41 * 4
