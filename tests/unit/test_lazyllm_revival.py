"""LazyLLM's decoding policies (``revival``: all, budget:R, none, catch-up): the at-most-once
invariant and the revival counters against the compute counter for each, each policy's own
counted promise, masked references for what ``none`` and ``catch-up`` attend, and keep-all
under every policy against full prefill and transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch

from fastprefill.cache import PositionKVCache
from fastprefill.engine import decoder_for, generate
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.attention import causal_mask

SCHEDULE = ((0, 0.5), (1, 0.25), (2, 0.1))
POLICIES = ("all", "budget:0", "budget:2", "none", "catch-up")
#: the policies with their own decode step (``none`` decodes with the model's forward)
REVIVING = ("all", "budget:0", "budget:2", "catch-up")



def _run(make_ids, model, lazy: LazyLLM, n: int = 40, steps: int = 8, seed: int = 4):
    """Prefill and ``steps`` greedy decode steps, checking at every step that the revival
    counters equal what the compute counter saw. Returns (the pruned prefill, per-step (L, t) deltas)."""
    sched = lazy.resolved(4)
    stage_of = torch.tensor([sum(layer > p for p, _ in sched) for layer in range(4)])  # (L,)
    deltas = []
    with torch.inference_mode():
        run = lazy.run(model, make_ids(n, seed))
        out = run.output
        st, tok = run.state, int(out.logits.argmax())
        for step in range(steps):
            t = n + step
            before = st.counter.counts[:, :t].clone()
            tok = int(out.decoder.step(tok).argmax())
            delta = st.counter.counts[:, :t] - before  # (L, t) earlier positions computed this step
            assert bool((st.counter.counts[:, t] == 1).all())  # the new token: every layer once
            assert int(delta.min()) >= 0
            touched = delta.sum(0) > 0
            assert int(touched.sum()) == st.revived_tokens_per_step[step]
            assert int(delta.sum()) == st.revived_token_layers_per_step[step]
            per_stage = torch.zeros(int(stage_of.max()) + 1, t, dtype=torch.int32).index_add_(0, stage_of, delta)
            assert int((per_stage > 0).sum()) == st.revived_token_stages_per_step[step]
            first = {p: int(delta[:, p].nonzero()[0]) for p in touched.nonzero().flatten().tolist()}
            assert {(p, layer) for s, p, layer in st.revivals if s == step} == set(first.items())
            deltas.append(delta)
    assert int(st.counter.counts.max()) == 1  # at most once, over the whole generation
    assert int(st.counter.counts.sum()) == out.stats.token_layers + 4 * steps + sum(st.revived_token_layers_per_step)
    assert bool((st.counter.counts[0] == 1).all())  # layer 0 (before any cut) computes everyone once
    for layer in range(4):  # the caches agree: no position stored twice at a layer
        pos = st.cache.positions(layer)
        assert pos.unique().numel() == pos.numel() == int(st.counter.counts[layer].sum())
    return run, deltas


@pytest.mark.parametrize("policy", REVIVING)
def test_every_policy_computes_each_token_layer_at_most_once(tiny_model, policy, make_ids):
    run, _ = _run(make_ids, tiny_model, LazyLLM(schedule=SCHEDULE, options={"revival": policy}))
    st = run.state
    stats = run.output.decoder.stats()
    assert stats["revived_token_layers_total"] == sum(st.revived_token_layers_per_step)
    assert stats["revived_tokens_total"] == sum(st.revived_tokens_per_step)
    if policy == "all":  # revivals happen, and a revived token went on through a later stage
        assert 0 < sum(st.revived_tokens_per_step) < sum(st.revived_token_stages_per_step)


def test_none_revives_nothing(tiny_model, make_ids):
    """``none`` has no decode step of its own: the model's forward decodes the pruned cache, so
    nothing deferred is ever computed (the paper's policy does revive on this prompt: see the
    budget test)."""
    lazy = LazyLLM(schedule=SCHEDULE, options={"revival": "none"})
    ids = make_ids(40, 4)
    with torch.inference_mode():
        run = lazy.run(tiny_model, ids)
        counts = run.state.counter.counts.clone()
    assert run.output.decoder is None and run.output.ragged
    res = generate(tiny_model, None, ids, lazy, max_new_tokens=8, stop_at_eos=False)
    assert len(res.token_ids) == 8 and "revived_tokens_total" not in res.timing.extra
    with torch.inference_mode():
        again = lazy.run(tiny_model, ids)
        decoder = decoder_for(tiny_model, again.output)
        for tok in res.token_ids[:-1]:
            decoder.step(tok)
    assert torch.equal(again.state.counter.counts, counts)  # decoding computed no deferred token-layer
    kept = run.output.stats.extra["kept_per_stage"][-1]
    assert len(again.state.aux) == 40 - kept  # every pruned token still deferred


def _most_per_stage(deltas) -> int:
    """The most earlier tokens computed in one stage at one step."""
    stage_of = torch.tensor([sum(layer > p for p, _ in SCHEDULE) for layer in range(4)])  # (L,)
    most = 0
    for delta in deltas:
        per_stage = torch.zeros(int(stage_of.max()) + 1, delta.shape[1], dtype=torch.int32).index_add_(0, stage_of, delta)
        most = max(most, int((per_stage > 0).sum(1).max()))
    return most


def test_budget_revives_at_most_r_per_stage_per_step(tiny_model, make_ids):
    sched = SCHEDULE
    _, paper = _run(make_ids, tiny_model, LazyLLM(schedule=sched))
    assert _most_per_stage(paper) > 1  # the paper's policy would revive more: both budgets bind
    for budget in (0, 1):
        run, deltas = _run(make_ids, tiny_model, LazyLLM(schedule=sched, options={"revival": f"budget:{budget}"}))
        assert _most_per_stage(deltas) == budget  # used up to R, never beyond
        st = run.state  # each step's sets hold only tokens with KV at the stage
        for (layer, _), chosen in zip(sched, st.selected):
            assert bool(st.cache.has(layer + 1, chosen).all())


def test_an_unbinding_budget_is_the_papers_policy(tiny_model, make_ids):
    """budget:R with R above any stage's revivals chooses and computes exactly as ``all``."""
    ids = make_ids(40, 4)
    paper = generate(tiny_model, None, ids, LazyLLM(schedule=SCHEDULE), max_new_tokens=12, stop_at_eos=False)
    wide = generate(tiny_model, None, ids, LazyLLM(schedule=SCHEDULE, options={"revival": "budget:1000"}),
                    max_new_tokens=12, stop_at_eos=False)
    assert wide.token_ids == paper.token_ids
    assert wide.timing.extra["revived_token_layers_per_step"] == paper.timing.extra["revived_token_layers_per_step"]
    tight = generate(tiny_model, None, ids, LazyLLM(schedule=SCHEDULE, options={"revival": "budget:1"}),
                     max_new_tokens=12, stop_at_eos=False)
    assert tight.timing.extra["revived_tokens_total"] < paper.timing.extra["revived_tokens_total"]


def test_catch_up_completes_every_prompt_token_at_the_first_step(tiny_model, make_ids):
    n = 40
    run, deltas = _run(make_ids, tiny_model, LazyLLM(schedule=SCHEDULE, options={"revival": "catch-up"}), n=n)
    st, out = run.state, run.output
    deferred = n * 4 - out.stats.token_layers  # prompt token-layers the prefill skipped
    assert int(deltas[0].sum()) == deferred == st.revived_token_layers_per_step[0] > 0
    assert st.revived_tokens_per_step[0] == n - out.stats.extra["kept_per_stage"][-1]
    assert sum(st.revived_tokens_per_step[1:]) == 0  # plain decoding after
    assert bool((st.counter.counts[:, :n] == 1).all())  # every prompt token, every layer, once
    assert len(st.aux) == 0
    for layer in range(4):
        assert sorted(st.cache.positions(layer).tolist()) == list(range(n + len(deltas)))


def _masked_reference(model, ids: torch.Tensor, kept_sets, sched, new_rows_see_all: bool, deferred_see_all: bool):
    """Every row through every layer with an explicit mask: a prompt row kept at the layer's stage
    attends (causally) the keys kept there; a prompt row deferred before the stage attends every
    key if ``deferred_see_all`` (it is computed by catch-up) and only itself otherwise (not computed
    at all); generated rows attend every key (``new_rows_see_all``) or the keys present there."""
    ad = DecoderAdapter(model)
    n_prompt = max(int(s.max()) for s in kept_sets) + 1
    total = int(ids.shape[1])
    pos = torch.arange(total)
    stage_sets = [pos[:n_prompt], *kept_sets]
    cache = PositionKVCache(ad.num_layers)
    with torch.inference_mode(), ad.attention_scope():
        h = ad.embed(ids)
        rot = ad.rotary(h, pos[None])
        for layer in range(ad.num_layers):
            s = sum(layer > p for p, _ in sched)
            active = torch.isin(pos, stage_sets[s]) | (pos >= n_prompt)  # rows holding KV after prefill
            present = torch.isin(pos, stage_sets[s])
            see = causal_mask(pos, pos)[0, 0].clone()  # (N, N)
            for i in range(total):
                if i >= n_prompt:
                    allowed = torch.ones(total, dtype=torch.bool) if new_rows_see_all else (present | (pos >= n_prompt))
                elif active[i]:
                    allowed = present
                else:
                    allowed = torch.ones(total, dtype=torch.bool) if deferred_see_all else pos == i
                see[i] &= allowed
            cache.stage(layer, pos)
            h = ad.layer(layer, h, pos[None], cache, mask=see[None, None], rotary=rot)
        return ad.head(h[:, -1:])[0, -1]


@pytest.mark.parametrize("policy", ["catch-up", "none"])
def test_catch_up_and_none_attend_what_the_masked_reference_attends(tiny_model, policy, make_ids):
    """catch-up: deferred tokens attend every key from their resume layer on, the kept tokens
    keep their prefill KV, the new tokens attend everything. none: the new tokens attend only
    the KV present (kept prompt tokens and generated ones)."""
    n, steps = 30, 3
    ids = make_ids(n, 9)
    lazy = LazyLLM(schedule=((0, 0.5), (2, 0.25)), options={"revival": policy})
    with torch.inference_mode():
        run = lazy.run(tiny_model, ids)
        out, decoder = run.output, decoder_for(tiny_model, run.output)
        kept = [s.clone() for s in run.state.selected]
        tokens, logits = [int(out.logits.argmax())], []
        for _ in range(steps):
            logits.append(decoder.step(tokens[-1]))
            tokens.append(int(logits[-1].argmax()))
    for step in range(steps):
        seq = torch.cat([ids, torch.tensor([tokens[: step + 1]])], dim=1)
        ref = _masked_reference(tiny_model, seq, kept, lazy.schedule, new_rows_see_all=policy == "catch-up",
                                deferred_see_all=policy == "catch-up")
        torch.testing.assert_close(logits[step], ref, atol=1e-4, rtol=0)
    # and the reference tells the policies apart (the masks matter)
    seq = torch.cat([ids, torch.tensor([tokens[:1]])], dim=1)
    other = _masked_reference(tiny_model, seq, kept, lazy.schedule, new_rows_see_all=policy != "catch-up",
                              deferred_see_all=policy != "catch-up")
    assert float((other - logits[0]).abs().max()) > 1e-3


@pytest.mark.parametrize("policy", POLICIES)
def test_keep_all_under_every_policy_equals_full_prefill_and_generate(tiny_model, policy, make_ids):
    ids = make_ids(29, 6)
    with torch.inference_mode():
        ref = FullPrefill().prefill(tiny_model, ids).logits
        expected = tiny_model.generate(ids, max_new_tokens=10, do_sample=False)[0, 29:].tolist()
    for lazy in (LazyLLM(preset="keep-all", options={"revival": policy}),
                 LazyLLM(schedule=((0, 1.0), (2, 1.0)), options={"revival": policy})):
        with torch.inference_mode():
            torch.testing.assert_close(lazy.prefill(tiny_model, ids).logits, ref, atol=1e-4, rtol=0)
        res = generate(tiny_model, None, ids, lazy, max_new_tokens=10, stop_at_eos=False)
        assert res.token_ids == expected
        assert res.timing.extra.get("revived_tokens_total", 0) == 0
