"""Random drop and static pruning: equality with full prefill at keep=1, original positions
against the model's own forward, GemFilter selection against eager attention, matched budgets."""

from __future__ import annotations

import pytest
import torch

from fastprefill.errors import ConfigError
from fastprefill.methods.baselines import RandomDrop, StaticPruning, equivalent_keep, matched_baselines
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.pruning import keep_count


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_random_subset_at_original_positions_matches_hf_forward(tiny_model):
    """Non-contiguous kept positions: equal to the model's forward on the subset with position_ids."""
    n = 31
    ids = _ids(n, 2)
    method = RandomDrop(keep=0.4, seed=5)
    keep = method.choose(n)
    assert keep.numel() == keep_count(0.4, n) and int(keep[-1]) == n - 1
    assert int((keep[1:] - keep[:-1]).max()) > 1  # really has gaps
    with torch.inference_mode():
        out = method.prefill(tiny_model, ids)
        sub = ids[:, keep]
        ref = tiny_model(sub, position_ids=keep[None]).logits[0, -1]
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
        # two decode steps at the true positions n, n + 1
        toks = [11, 23]
        for j, tok in enumerate(toks):
            got = method.decode(out.state, tok)
            seq = torch.cat([sub, torch.tensor([toks[: j + 1]])], dim=1)
            pos = torch.cat([keep, torch.arange(n, n + j + 1)])[None]
            ref = tiny_model(seq, position_ids=pos).logits[0, -1]
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert out.stats.token_layers == keep.numel() * 4


def test_random_drop_is_seeded():
    assert torch.equal(RandomDrop(0.3, seed=1).choose(50), RandomDrop(0.3, seed=1).choose(50))
    assert not torch.equal(RandomDrop(0.3, seed=1).choose(50), RandomDrop(0.3, seed=2).choose(50))


def test_static_pruning_selects_top_attention_and_pays_for_selection(tiny_llama):
    n, s, keep = 24, 1, 0.25
    ids = _ids(n, 3)
    eager = tiny_llama.config._attn_implementation
    try:
        tiny_llama.config._attn_implementation = "eager"
        att = tiny_llama(ids, output_attentions=True).attentions[s][0, :, -1].mean(0)  # (n,)
    finally:
        tiny_llama.config._attn_implementation = eager
    k = keep_count(keep, n)
    att[-1] = float("inf")
    want = att.topk(k).indices.sort().values
    with torch.inference_mode():
        out = StaticPruning(keep=keep, select_layer=s).prefill(tiny_llama, ids)
        ref = tiny_llama(ids[:, want], position_ids=want[None]).logits[0, -1]
    for layer in range(4):
        assert torch.equal(out.state.cache.positions(layer).sort().values, want)
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
    assert out.stats.token_layers == n * (s + 1) + k * 4
    assert out.stats.extra["selection_token_layers"] == n * (s + 1)


def test_budgets_match_lazyllm(tiny_qwen2):
    n, layers = 64, 4
    sched = ((0, 0.5), (2, 0.25))
    ids = _ids(n, 4)
    with torch.inference_mode():
        lazy = LazyLLM(schedule=sched).prefill(tiny_qwen2, ids).stats.token_layers
        rd = RandomDrop(keep=equivalent_keep(sched, layers, n), seed=0).prefill(tiny_qwen2, ids).stats.token_layers
        sp = StaticPruning(keep=equivalent_keep(sched, layers, n, select_layer=0), select_layer=0)
        st = sp.prefill(tiny_qwen2, ids).stats.token_layers
    assert lazy == 64 + 32 + 32 + 16
    assert abs(rd - lazy) < layers and abs(st - lazy) < layers
    with pytest.raises(ConfigError, match="select_layer"):
        equivalent_keep(sched, layers, n, select_layer=2)


def test_matched_baselines_spend_lazyllm_budget_and_feed_the_demo(tiny_qwen2):
    """One place builds the baselines at LazyLLM's budget; the CLI demo takes them from there."""
    from fastprefill.cli import demo_methods

    n, layers = 64, 4
    lazy = LazyLLM(schedule=((0, 0.5), (2, 0.25)))
    methods = matched_baselines(lazy, layers, n, static_select_layer=0)
    assert list(methods) == ["static", "random"]
    ids = _ids(n, 8)
    with torch.inference_mode():
        budget = lazy.prefill(tiny_qwen2, ids).stats.token_layers
        spent = {name: m.prefill(tiny_qwen2, ids).stats.token_layers for name, m in methods.items()}
    assert all(abs(t - budget) < layers for t in spent.values()), (budget, spent)
    assert methods["static"].select_layer == 0
    assert matched_baselines(lazy, layers, n)["static"].select_layer == layers // 4  # the default
    with pytest.raises(ConfigError, match="select_layer"):
        matched_baselines(lazy, layers, n, static_select_layer=2)
    demo = dict(demo_methods(tiny_qwen2, n))
    default = matched_baselines(LazyLLM.preset("default"), layers, n)
    assert demo["static pruning, same budget"] == default["static"]
    assert demo["random drop, same budget"] == default["random"]


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: RandomDrop(keep=0.0), r"\(0, 1\]"),
        (lambda: RandomDrop(keep=1.2), r"\(0, 1\]"),
        (lambda: RandomDrop(keep=0.5, seed=1.5), "seed"),
        (lambda: StaticPruning(keep=-1.0), r"\(0, 1\]"),
        (lambda: StaticPruning(keep=0.5, select_layer=-1), "select_layer"),
    ],
)
def test_baseline_validation(factory, match):
    with pytest.raises(ConfigError, match=match):
        factory()


def test_static_select_layer_out_of_range(tiny_llama):
    with pytest.raises(ConfigError, match=r"allowed 0..3"):
        StaticPruning(keep=0.5, select_layer=4).prefill(tiny_llama, _ids(8, 0))
