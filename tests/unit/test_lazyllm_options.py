"""LazyLLM's selection options (score window, pooling, sinks, recent tokens, accumulation, decode
protection) against an eager reimplementation on the tiny models, keep-all with every option
against full prefill, and the option fields' validation, spec strings and labels."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import DEFAULT_PRESET, LATE_SCHEDULES, PRESETS, SELECTIONS, LazyLLM
from fastprefill.methods.pruning import (
    keep_count,
    pool_in_position_order,
    probe_scores,
    resolve_depth_schedule,
    schedule_token_layers,
)
from fastprefill.methods.pruning.scorers import AttentionScorer, last_query_attention, window_attention
from fastprefill.methods.registry import make_method
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.random import random_model

FAMILIES = ("llama", "qwen2")



@pytest.fixture(scope="module")
def eager_models():
    """The same seeded tiny models as the ``tiny_*`` fixtures, with transformers' eager attention."""
    out = {}
    for family in FAMILIES:
        model = random_model(family)
        model.set_attn_implementation("eager")
        out[family] = model
    return out


# --- the eager reference ------------------------------------------------------------------------
def _ref_pool(values: torch.Tensor, kernel: int) -> torch.Tensor:
    """Mean over the existing neighbours within ``kernel // 2`` on each side, one entry at a time."""
    h = kernel // 2
    return torch.stack([values[max(0, i - h): i + h + 1].mean() for i in range(values.numel())])


def _eager_progressive(model, ids: torch.Tensor, schedule, window=1, pool=1, sinks=0, recent=0, accumulate=False):
    """Progressive pruning written out eagerly: every row through every layer with transformers'
    eager attention, pruned keys masked, the attention weights read by a hook; at each cut the
    selection is recomputed from those weights in plain Python. Returns (kept sets, logits)."""
    n, layers = int(ids.shape[1]), model.model.layers
    prune = dict(schedule)
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.register_forward_hook(lambda mod, inp, out, i=i: captured.__setitem__(i, out[1]))
             for i, layer in enumerate(layers)]
    present = torch.ones(n, dtype=torch.bool)  # tokens computed at the current layer
    acc = torch.zeros(n)
    kept_sets = []
    try:
        with torch.no_grad():
            pos = torch.arange(n)
            h = model.model.embed_tokens(ids)
            rot = model.model.rotary_emb(h, position_ids=pos[None])
            for i, layer in enumerate(layers):
                allowed = (pos[None, :] <= pos[:, None]) & present[None, :] | torch.eye(n, dtype=torch.bool)
                fmask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
                h = layer(h, attention_mask=fmask, position_ids=pos[None], position_embeddings=rot)
                rows = present.nonzero().flatten()  # ascending positions
                weights = captured[i][0]  # (H, n, n)
                score = weights[:, rows[-window:], :].mean(dim=(0, 1))  # (n,), 0 at absent keys
                acc = acc + score if accumulate else score
                if i not in prune:
                    continue
                row = _ref_pool(acc[rows], pool) if pool > 1 else acc[rows]
                acc = torch.zeros(n)
                forced = (rows < sinks) | (rows >= n - recent)
                forced[-1] = True
                k = max(keep_count(prune[i], n), int(forced.sum()))
                if k < rows.numel():
                    row = row.masked_fill(forced, float("inf"))
                    keep = rows[torch.topk(row, k).indices.sort().values]
                    present = torch.zeros(n, dtype=torch.bool)
                    present[keep] = True
                kept_sets.append(present.nonzero().flatten())
            logits = model.lm_head(model.model.norm(h[:, -1:]))[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    return kept_sets, logits


# --- the scorer beside SDPA -----------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("window", [1, 5, 64])
def test_window_scores_equal_eager_attention(family, window, eager_models, tiny_llama, tiny_qwen2, make_ids):
    """The last W queries' probabilities over the whole prompt, averaged over heads and queries,
    equal transformers' eager attention weights at every layer (W larger than T: all rows)."""
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]
    ids = make_ids(37, 2)
    with torch.no_grad():
        eager = eager_models[family](ids, output_attentions=True).attentions
    ad = DecoderAdapter(model)
    for layer in range(ad.num_layers):
        got = probe_scores(ad, ids, layer, scorer=AttentionScorer(window))
        ref = eager[layer][0, :, -window:, :].mean(dim=(0, 1))
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
        assert float(got.sum()) == pytest.approx(1.0, abs=1e-5)


def test_window_scorer_with_a_mask_equals_per_row_softmax():
    """Boolean-mask path under GQA: each of the last W rows masked on its own (explicit loop)."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 6, 5, 8, generator=g), torch.randn(1, 2, 11, 8, generator=g)
    mask = torch.rand(1, 1, 5, 11, generator=g) > 0.5
    mask[..., 0] = True
    got = window_attention(q, k, mask, 0.3, window=3)
    rows = []
    for h in range(6):
        for t in (2, 3, 4):
            logits = (q[0, h, t] @ k[0, h // 3].T) * 0.3
            rows.append(torch.softmax(logits.masked_fill(~mask[0, 0, t], float("-inf")), -1))
    torch.testing.assert_close(got[0], torch.stack(rows).mean(0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(AttentionScorer(1)(q, k, mask, 0.3), last_query_attention(q, k, mask, 0.3))
    torch.testing.assert_close(window_attention(q, k, mask, 0.3, window=1), last_query_attention(q, k, mask, 0.3))


def test_pooling_in_position_order_among_candidates():
    """Storage order shuffled, non-candidates skipped: the eager per-entry mean over neighbours."""
    g = torch.Generator().manual_seed(0)
    positions = torch.randperm(20, generator=g)
    scores = torch.rand(20, generator=g)
    among = torch.rand(20, generator=g) > 0.3
    got = pool_in_position_order(scores, positions, among, 5)
    idx = among.nonzero().flatten()
    order = idx[positions[idx].argsort()]
    torch.testing.assert_close(got[order], _ref_pool(scores[order], 5))
    assert torch.equal(got[~among], scores[~among])
    assert pool_in_position_order(scores, positions, among, 1) is scores


# --- prefill selection against the eager reference ------------------------------------------------
CASES = {
    "window": {"score_window": 6},
    "pool": {"pool_kernel": 5},
    "sinks+recent": {"sinks": 3, "keep_recent": 4},
    "accumulate": {"accumulate": True},
    "all": {"score_window": 4, "pool_kernel": 3, "sinks": 2, "keep_recent": 3, "accumulate": True},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_selection_equals_eager_reimplementation(family, case, eager_models, tiny_llama, tiny_qwen2,
                                                         make_ids):
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]
    opts = CASES[case]
    schedule = ((1, 0.5), (2, 0.25))
    ids = make_ids(40, 11)
    lazy = LazyLLM(schedule=schedule, options=opts)
    with torch.inference_mode():
        run = lazy.run(model, ids)
        out = run.output
    ref_sets, ref_logits = _eager_progressive(
        eager_models[family], ids, schedule, window=opts.get("score_window", 1), pool=opts.get("pool_kernel", 1),
        sinks=opts.get("sinks", 0), recent=opts.get("keep_recent", 0), accumulate=opts.get("accumulate", False))
    assert [s.tolist() for s in run.state.selected] == [s.tolist() for s in ref_sets]
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-4, rtol=0)
    # the option changes the selection: the paper's rule picks another set on the same prompt
    with torch.inference_mode():
        paper = LazyLLM(schedule=schedule).run(model, ids)
    assert [s.tolist() for s in paper.state.selected] != [s.tolist() for s in run.state.selected]
    if "sinks" in opts:
        for kept in run.state.selected:
            assert set(range(opts["sinks"])) | set(range(40 - opts["keep_recent"], 40)) <= set(kept.tolist())


def test_protected_tokens_raise_the_keep_count(tiny_llama, make_ids):
    """More protected tokens than the keep count: all of them stay, and nothing else."""
    with torch.inference_mode():
        run = LazyLLM(schedule=((1, 0.1),), options={"sinks": 5, "keep_recent": 6}).run(tiny_llama, make_ids(30, 1))
    out = run.output
    assert run.state.selected[0].tolist() == [0, 1, 2, 3, 4, *range(24, 30)]
    assert out.stats.extra["kept_per_stage"] == [11]
    assert out.stats.token_layers == 2 * 30 + 2 * 11


# --- decoding: the new token's accumulated, pooled, protected score --------------------------------
@dataclass
class _Recording(LazyLLM):
    """LazyLLM that records every (scores, k) its selection receives."""

    calls: list = field(default_factory=list)

    def select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        self.calls.append((scores.clone(), k))
        return super().select(scores, k)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_score_equals_eager_attention_of_the_new_token(family, eager_models, tiny_llama, tiny_qwen2,
                                                              make_ids):
    """At a cut ending stage 0 every key is present at every layer, so the new token's attention
    there is the full model's: summed over layers 0..p (accumulate), pooled, the sinks, the
    prompt's last tokens and every generated token (decode_protect) at +inf."""
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]
    n, steps, p = 30, 5, 1
    lazy = _Recording(schedule=((p, 0.3),), options={"accumulate": True, "pool_kernel": 3, "sinks": 2,
                                                     "keep_recent": 3, "decode_protect": True, "score_window": 4})
    ids = make_ids(n, 21)
    with torch.inference_mode():
        out = lazy.prefill(model, ids)
        tokens = [int(out.logits.argmax())]
        for _ in range(steps):
            tokens.append(int(out.decoder.step(tokens[-1]).argmax()))
    assert len(lazy.calls) == 1 + steps  # one cut at prefill, one per decode step
    for step in range(steps):
        t = n + step
        seq = torch.cat([ids, torch.tensor([tokens[: step + 1]])], dim=1)  # (1, t + 1)
        with torch.no_grad():
            att = eager_models[family](seq, output_attentions=True).attentions
        ref = _ref_pool(sum(att[layer][0, :, -1, :].mean(0) for layer in range(p + 1)), 3)
        forced = torch.zeros(t + 1, dtype=torch.bool)
        forced[:2] = True
        forced[n - 3:] = True  # the prompt's last 3, every generated token, the new one
        got, k = lazy.calls[1 + step]
        assert torch.equal(torch.isinf(got), forced)
        torch.testing.assert_close(got[~forced], ref[~forced], atol=1e-6, rtol=1e-5)
        assert k == max(keep_count(0.3, t + 1), int(forced.sum()))


def test_decode_protect_keeps_sinks_recent_and_generated_in_every_stage(tiny_qwen2, make_ids):
    """Counted: at every step every stage's set holds the protected positions; without
    decode_protect generated tokens do drop out (so the check can fail)."""
    n, steps = 40, 10
    sched = ((0, 0.3), (2, 0.1))

    def run(protect: bool):
        lazy = LazyLLM(schedule=sched, options={"sinks": 2, "keep_recent": 3, "decode_protect": protect})
        missing = []
        with torch.inference_mode():
            out = lazy.run(tiny_qwen2, make_ids(n, 8))
            st, tok = out.state, int(out.output.logits.argmax())
            for step in range(steps):
                tok = int(out.output.decoder.step(tok).argmax())
                t = n + step
                for chosen in st.selected:
                    got = set(chosen.tolist())
                    assert {0, 1, n - 3, n - 2, n - 1, t} <= got  # sinks and recent: kept anyway
                    missing += [p for p in range(n, t + 1) if p not in got]
        assert int(st.counter.counts.max()) == 1
        return missing

    assert run(True) == []
    assert run(False) != []


# --- keep-all with every option -------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_keep_everything_with_every_option_equals_full_and_generate(family, tiny_llama, tiny_qwen2, make_ids):
    """Cuts that keep every token, all options on: full prefill's logits and transformers' tokens."""
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]
    ids = make_ids(33, 4)
    lazy = LazyLLM(schedule=((0, 1.0), (2, 1.0)), options={"score_window": 8, "pool_kernel": 5, "sinks": 2,
                                                           "keep_recent": 4, "accumulate": True, "decode_protect": True})
    with torch.inference_mode():
        ref = FullPrefill().prefill(model, ids).logits
        got = lazy.prefill(model, ids).logits
        expected = model.generate(ids, max_new_tokens=10, do_sample=False)[0, 33:].tolist()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    res = generate(model, None, ids, lazy, max_new_tokens=10, stop_at_eos=False)
    assert res.token_ids == expected
    assert res.timing.stats.token_layers == res.timing.stats.total_token_layers


# --- fields, spec strings, presets, labels --------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"score_window": 0}, r"score_window must be an integer in 1\.\.64"),
        ({"score_window": 65}, r"score_window must be an integer in 1\.\.64"),
        ({"score_window": 2.0}, "score_window"),
        ({"pool_kernel": 4}, r"pool_kernel must be odd"),
        ({"pool_kernel": 17}, r"pool_kernel must be an integer in 1\.\.15"),
        ({"sinks": -1}, r"sinks must be an integer in 0 or more"),
        ({"keep_recent": True}, "keep_recent"),
        ({"accumulate": 1}, "accumulate must be true or false"),
        ({"decode_protect": "yes"}, "decode_protect must be true or false"),
        ({"revival": "budget"}, r"revival 'budget' is not a policy; allowed: all, budget:R, none, catch-up"),
        ({"revival": "budget:-1"}, "not a policy"),
        ({"revival": "some"}, "not a policy"),
        ({"revival": 3}, "revival must be a string"),
    ],
)
def test_option_validation_names_the_field_and_range(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LazyLLM(options=kwargs)


def test_spec_strings_set_every_field():
    m = make_method("lazyllm:schedule=6:0.3,score_window=16,pool_kernel=7,sinks=4,keep_recent=16,"
                    "accumulate=true,decode_protect=on,revival=budget:8")
    assert m.schedule == ((6, 0.3),)
    o = m.options
    assert (o.score_window, o.pool_kernel, o.sinks, o.keep_recent) == (16, 7, 4, 16)
    assert o.accumulate and o.decode_protect and str(o.revival) == "budget:8"
    assert m.describe() == ("lazyllm[6:0.3 score_window=16,pool_kernel=7,sinks=4,keep_recent=16,accumulate=True,"
                            "decode_protect=True,revival=budget:8]")
    m = make_method("lazyllm:preset=paper,revival=catch-up")
    assert m.depth_schedule == PRESETS["four-stage"] and str(m.options.revival) == "catch-up"
    assert m.describe() == "lazyllm[paper revival=catch-up]"
    snap = make_method("lazyllm:preset=cut30k20,selection=snap")
    assert snap == LazyLLM(preset="cut30k20+snap") and snap.describe() == "lazyllm[cut30k20+snap]"
    o = snap.options
    assert (o.score_window, o.pool_kernel, o.sinks, o.keep_recent) == (16, 7, 4, 16)
    assert make_method("lazyllm:preset=cut30k20+snap,sinks=8").describe() == "lazyllm[cut30k20+snap sinks=8]"
    assert make_method("lazyllm:schedule=6:0.3,selection=snap").options.score_window == 16
    assert make_method("lazyllm:preset=cut30k20+snap,sinks=0").options.sinks == 0  # an override to the paper's value
    for bad, match in [("lazyllm:sinks=many", "option 'sinks': not an integer: 'many'"),
                       ("lazyllm:accumulate=maybe", "option .accumulate.: not a boolean"),
                       ("lazyllm:window=3", r"no option\(s\) \['window'\]"),
                       ("lazyllm:selection=fast", "unknown LazyLLM selection"),
                       ("lazyllm:preset=cut30k20+snap,selection=paper", "give one"),
                       ("lazyllm:preset=paper,pool_kernel=2", "pool_kernel must be odd"),
                       ("lazyllm:preset=paper,schedule=2:0.5", "preset or schedule, not both")]:
        with pytest.raises(ConfigError, match=match):
            make_method(bad)


def test_defaults_and_existing_presets_keep_the_papers_rule():
    default = LazyLLM()
    assert default.options == type(default.options)()  # every option off
    assert default.depth_schedule == PRESETS[DEFAULT_PRESET] and default == make_method("lazyllm")
    for name in PRESETS:
        m = LazyLLM(preset=name)
        assert m.options == type(m.options)() and "+" not in m.describe() and " " not in m.describe()
    assert LazyLLM(preset="default").describe() == "lazyllm[four-stage]"
    assert LazyLLM(preset="paper").depth_schedule == LazyLLM(preset="four-stage").depth_schedule
    assert set(SELECTIONS) >= {"paper", "snap"} and SELECTIONS["paper"] == {}


@pytest.mark.parametrize("layers", [24, 28, 30])
def test_late_schedules_compute_at_most_47_percent(layers):
    """The later-cut family fits the >= 2x budget on each model's depth (0.48 is the dev rule's)."""
    assert len(LATE_SCHEDULES) >= 6
    for name in LATE_SCHEDULES:
        sched = resolve_depth_schedule(PRESETS[name], layers)
        assert schedule_token_layers(sched, layers, 2048) / (layers * 2048) <= 0.47, name


# --- fill policies: pruned tokens keep predicted K/V rows at later layers -------------------------
@pytest.mark.parametrize(("layer", "tail"), [(1, 4), (2, 7)])
def test_fill_with_the_last_w_kept_is_kvp_prefix(tiny_model, layer, tail, make_ids):
    """One cut after layer l - 1 keeping only the last W tokens, the others filled with kvp-prefix's
    zero-shot maps from the cut's hidden state, is kvp-prefix(layer=l, tail=W): the same logits and
    greedy tokens."""
    from fastprefill.methods.kv_prediction.prefix import KVPrefix

    ids = make_ids(30, 12)
    lazy = LazyLLM(schedule=((layer - 1, 0.01),), options={"keep_recent": tail, "revival": "none", "fill": "zero-shot"})
    with torch.inference_mode():
        run = lazy.run(tiny_model, ids)
        want = KVPrefix(layer=layer, tail=tail).prefill(tiny_model, ids)
    assert run.state.selected[0].tolist() == list(range(30 - tail, 30))
    torch.testing.assert_close(run.output.logits, want.logits, atol=1e-5, rtol=0)
    got = generate(tiny_model, None, ids, lazy, max_new_tokens=6, stop_at_eos=False)
    ref = generate(tiny_model, None, ids, KVPrefix(layer=layer, tail=tail), max_new_tokens=6, stop_at_eos=False)
    assert got.token_ids == ref.token_ids
    assert run.output.stats.extra["filled_token_layers"] == (30 - tail) * (4 - layer)
    assert run.output.exact_tokens == 0  # nothing filled or pruned is exact: a prefix cache keeps none of it
    # and without the fill the same cut drops the pruned tokens: other logits
    with torch.inference_mode():
        drop = LazyLLM(schedule=((layer - 1, 0.01),), options={"keep_recent": tail}).prefill(tiny_model, ids)
    assert float((drop.logits - want.logits).abs().max()) > 1e-3


def test_fill_refusals(tiny_llama, make_ids):
    with pytest.raises(ConfigError, match="needs revival=none"):
        LazyLLM(schedule=((1, 0.5),), options={"fill": "zero-shot"})
    with pytest.raises(ConfigError, match="not a policy"):
        LazyLLM(schedule=((1, 0.5),), options={"fill": "calibrated", "revival": "none"})
    lazy = LazyLLM(schedule=((0, 0.5), (1, 0.3)), options={"fill": "zero-shot", "revival": "none"})
    with pytest.raises(ConfigError, match="one-cut schedules"):
        lazy.prefill(tiny_llama, make_ids(20, 1))
