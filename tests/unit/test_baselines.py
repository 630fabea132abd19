"""Random drop and static pruning: equality with full prefill at keep=1, original positions
against the model's own forward, GemFilter selection against eager attention, matched budgets."""

from __future__ import annotations

import pytest
import torch

from fastprefill.engine import decoder_for
from fastprefill.errors import ConfigError
from fastprefill.methods.baselines import (
    GemFilter,
    RandomDrop,
    StaticPruning,
    equivalent_keep,
    matched_baselines,
)
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.pruning import keep_count


def test_random_subset_at_original_positions_matches_hf_forward(tiny_model, make_ids):
    """Non-contiguous kept positions: equal to the model's forward on the subset with position_ids."""
    n = 31
    ids = make_ids(n, 2)
    method = RandomDrop(keep=0.4, seed=5)
    keep = method.choose(n)
    assert keep.numel() == keep_count(0.4, n) and int(keep[-1]) == n - 1
    assert int((keep[1:] - keep[:-1]).max()) > 1  # really has gaps
    with torch.inference_mode():
        out = method.prefill(tiny_model, ids)
        decoder = decoder_for(tiny_model, out)
        sub = ids[:, keep]
        ref = tiny_model(sub, position_ids=keep[None]).logits[0, -1]
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
        # two decode steps at the true positions n, n + 1
        toks = [11, 23]
        for j, tok in enumerate(toks):
            got = decoder.step(tok)
            seq = torch.cat([sub, torch.tensor([toks[: j + 1]])], dim=1)
            pos = torch.cat([keep, torch.arange(n, n + j + 1)])[None]
            ref = tiny_model(seq, position_ids=pos).logits[0, -1]
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert out.stats.token_layers == keep.numel() * 4


def test_random_drop_is_seeded():
    assert torch.equal(RandomDrop(0.3, seed=1).choose(50), RandomDrop(0.3, seed=1).choose(50))
    assert not torch.equal(RandomDrop(0.3, seed=1).choose(50), RandomDrop(0.3, seed=2).choose(50))


@pytest.mark.parametrize(("n", "keep", "seed"), [(50, 0.3, 1), (2048, 0.47, 0), (7, 1.0, 3), (9, 0.1, 5)])
def test_random_scorer_keeps_the_subsets_of_a_seeded_randperm(n, keep, seed):
    """RandomDrop through RandomScorer keeps exactly what a CPU randperm's first K - 1 (+ the last)
    are, so random-drop runs recorded before the scorer existed choose the same tokens."""
    k = keep_count(keep, n)
    others = torch.randperm(n - 1, generator=torch.Generator().manual_seed(seed))[: k - 1]
    want = torch.cat([others.sort().values, torch.tensor([n - 1])])
    assert torch.equal(RandomDrop(keep, seed=seed).choose(n), want)


def test_static_pruning_selects_top_attention_and_pays_for_selection(tiny_llama, make_ids):
    n, s, keep = 24, 1, 0.25
    ids = make_ids(n, 3)
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
        run = StaticPruning(keep=keep, select_layer=s).run(tiny_llama, ids)
        out = run.output
        ref = tiny_llama(ids[:, want], position_ids=want[None]).logits[0, -1]
    for layer in range(4):
        assert torch.equal(run.state.cache.positions(layer).sort().values, want)
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
    assert out.stats.token_layers == n * (s + 1) + k * 4
    assert out.stats.extra["selection_token_layers"] == n * (s + 1)


def test_budgets_match_lazyllm(tiny_qwen2, make_ids):
    n, layers = 64, 4
    sched = ((0, 0.5), (2, 0.25))
    ids = make_ids(n, 4)
    with torch.inference_mode():
        lazy = LazyLLM(schedule=sched).prefill(tiny_qwen2, ids).stats.token_layers
        rd = RandomDrop(keep=equivalent_keep(sched, layers, n), seed=0).prefill(tiny_qwen2, ids).stats.token_layers
        sp = StaticPruning(keep=equivalent_keep(sched, layers, n, select_layer=0), select_layer=0)
        st = sp.prefill(tiny_qwen2, ids).stats.token_layers
    assert lazy == 64 + 32 + 32 + 16
    assert abs(rd - lazy) < layers and abs(st - lazy) < layers
    with pytest.raises(ConfigError, match="select_layer"):
        equivalent_keep(sched, layers, n, select_layer=2)


def test_matched_baselines_spend_lazyllm_budget_and_feed_the_demo(tiny_qwen2, make_ids):
    """One place builds the baselines at LazyLLM's budget; the CLI demo takes them from there."""
    from fastprefill.demo import demo_methods

    n, layers = 64, 4
    lazy = LazyLLM(schedule=((0, 0.5), (2, 0.25)))
    methods = matched_baselines(lazy, layers, n, static_select_layer=0, gemfilter_select_layer=0)
    assert list(methods) == ["static", "random", "gemfilter"]
    ids = make_ids(n, 8)
    with torch.inference_mode():
        budget = lazy.prefill(tiny_qwen2, ids).stats.token_layers
        spent = {name: m.prefill(tiny_qwen2, ids).stats.token_layers for name, m in methods.items()}
    assert all(abs(t - budget) < layers for t in spent.values()), (budget, spent)
    assert methods["static"].select_layer == methods["gemfilter"].select_layer == 0
    defaults = matched_baselines(lazy, layers, n)
    assert defaults["static"].select_layer == layers // 4 and defaults["gemfilter"].select_layer == 1  # 40% of 4
    with pytest.raises(ConfigError, match="static at the budget.*select_layer"):
        matched_baselines(lazy, layers, n, static_select_layer=2)
    with pytest.raises(ConfigError, match="gemfilter at the budget.*select_layer"):
        matched_baselines(lazy, layers, n, gemfilter_select_layer=2)
    demo = dict(demo_methods(tiny_qwen2, n))
    default = matched_baselines(LazyLLM(preset="default"), layers, n)
    assert demo["static pruning, same budget"] == default["static"]
    assert demo["random drop, same budget"] == default["random"]
    assert demo["GemFilter, same budget"] == default["gemfilter"]


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: RandomDrop(keep=0.0), r"\(0, 1\]"),
        (lambda: RandomDrop(keep=1.2), r"\(0, 1\]"),
        (lambda: RandomDrop(keep=0.5, seed=1.5), "seed"),
        (lambda: StaticPruning(keep=-1.0), r"\(0, 1\]"),
        (lambda: StaticPruning(keep=0.5, select_layer=-1), "select_layer"),
        (lambda: GemFilter(keep=0.0), r"keep.*\(0, 1\]"),
        (lambda: GemFilter(select_layer=-2), r"select_layer.*>= 0"),
        (lambda: GemFilter(select_layer=1.5), r"select_layer.*integer"),
        (lambda: GemFilter(select_depth=1.0), r"select_depth.*\[0, 1\)"),
        (lambda: GemFilter(select_depth=-0.5), r"select_depth.*\[0, 1\)"),
        (lambda: GemFilter(select_layer=2, select_depth=0.5), "not both"),
        (lambda: GemFilter(kernel=4), r"kernel.*odd integer >= 1"),
        (lambda: GemFilter(kernel=0), r"kernel.*odd integer >= 1"),
    ],
)
def test_baseline_validation(factory, match):
    with pytest.raises(ConfigError, match=match):
        factory()


def test_static_select_layer_out_of_range(tiny_llama, make_ids):
    with pytest.raises(ConfigError, match=r"allowed 0..3"):
        StaticPruning(keep=0.5, select_layer=4).prefill(tiny_llama, make_ids(8, 0))


# --- GemFilter ------------------------------------------------------------------------------------
def _gemfilter_reference(model, ids, layer, k, kernel=5):
    """GemFilter's selection computed eagerly from the model's own modules: layer ``layer``'s
    rotated queries and keys, ``repeat_kv``, last query's logits summed over heads, pooled, top-k."""
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    n = ids.shape[1]
    cfg = model.config
    h_q, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h_q
    h = model(ids, output_hidden_states=True).hidden_states[layer]  # (1, n, D), the input of `layer`
    block = model.model.layers[layer]
    x = block.input_layernorm(h)
    q = block.self_attn.q_proj(x).view(1, n, h_q, d).transpose(1, 2)
    kk = block.self_attn.k_proj(x).view(1, n, h_kv, d).transpose(1, 2)
    cos, sin = model.model.rotary_emb(h, torch.arange(n)[None])
    q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
    logits = (q[:, :, -1:] @ repeat_kv(kk, h_q // h_kv).transpose(-1, -2))[:, :, 0] * d**-0.5  # (1, H_q, n)
    pooled = F.avg_pool1d(logits.sum(1, keepdim=True), kernel, stride=1, padding=kernel // 2)[0, 0]  # (n,)
    pooled[-1] = float("inf")  # the last token is always kept (see GemFilter's docstring)
    return pooled.topk(k).indices.sort().values


@pytest.fixture(scope="module")
def peaked_models(tiny_llama, tiny_qwen2):
    """The tiny models with layer 1's query and key maps scaled up: peaked attention, under which
    summed logits and averaged probabilities rank tokens differently (on the plain tiny models
    the logits are so small that softmax is nearly linear in them)."""
    import copy

    out = {}
    for name, model in (("llama", tiny_llama), ("qwen2", tiny_qwen2)):
        model = copy.deepcopy(model)
        with torch.no_grad():
            model.model.layers[1].self_attn.q_proj.weight.mul_(4.0)
            model.model.layers[1].self_attn.k_proj.weight.mul_(4.0)
        out[name] = model
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", [5, 1])
def test_gemfilter_selects_as_an_eager_computation_and_renumbers_positions(peaked_models, family, kernel,
                                                                            make_ids):
    tiny_model = peaked_models[family]
    n, keep = 40, 0.3
    ids = make_ids(n, 9)
    k = keep_count(keep, n)
    with torch.inference_mode():
        want = _gemfilter_reference(tiny_model, ids, 1, k, kernel)
        run = GemFilter(keep=keep, kernel=kernel).run(tiny_model, ids)  # default depth 0.4: layer 1 of 4
        out, decoder = run.output, decoder_for(tiny_model, run.output)
        assert torch.equal(run.state.selected[0], want)
        if kernel > 1:  # the score and the pooling really move the choice away from StaticPruning's
            static = StaticPruning(keep=keep, select_layer=1).run(tiny_model, ids).state.selected[0]
            assert not torch.equal(static, want)
        # every layer ran on the kept tokens at positions 0..k-1: the model's own forward on the subset
        sub = ids[:, want]
        torch.testing.assert_close(out.logits, tiny_model(sub).logits[0, -1], atol=1e-4, rtol=0)
        for layer in range(4):
            assert torch.equal(run.state.cache.positions(layer), torch.arange(k))
        # decoding continues at k, k + 1
        toks = [11, 23]
        for j, tok in enumerate(toks):
            got = decoder.step(tok)
            ref = tiny_model(torch.cat([sub, torch.tensor([toks[: j + 1]])], dim=1)).logits[0, -1]
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert decoder.position == k + 2


def test_gemfilter_pays_for_its_selection_pass(tiny_llama, make_ids):
    from fastprefill.models.shape import ModelShape

    n, s, keep = 48, 2, 0.25
    run = GemFilter(keep=keep, select_layer=s).run(tiny_llama, make_ids(n, 10))
    out = run.output
    shape = ModelShape.from_config(tiny_llama.config)
    k = keep_count(keep, n)
    assert out.stats.token_layers == n * (s + 1) + k * 4
    assert out.stats.extra == {"kept": k, "selection_token_layers": n * (s + 1)}
    want = 4 * shape.layer_flops(k) + shape.head_flops(1) + (s + 1) * shape.layer_flops(n) + shape.scoring_flops(n)
    assert out.stats.flops == pytest.approx(want, rel=1e-12)
    assert int(run.state.counter.counts.sum()) == k * 4  # the probe ran into a throwaway cache


def test_gemfilter_selection_layer_and_validation(tiny_llama, make_ids):
    assert GemFilter().selection_layer(24) == 9 and GemFilter().selection_layer(28) == 11
    assert GemFilter(select_depth=0.5).selection_layer(24) == 12
    assert GemFilter(select_layer=3).selection_layer(24) == 3
    assert GemFilter(keep=0.2, select_layer=3, kernel=7).describe() == "gemfilter[keep=0.2,select_layer=3,kernel=7]"
    with pytest.raises(ConfigError, match=r"select_layer 4 out of range.*allowed 0..3"):
        GemFilter(keep=0.5, select_layer=4).prefill(tiny_llama, make_ids(8, 0))
