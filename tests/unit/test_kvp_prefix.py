"""kvp-prefix (SwiftKV-style KV Prediction): exactness at l = L, zero-shot maps, least squares,
decoding, checkpoints, resumable calibration and refused inputs."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from fastprefill.engine import decoder_for, generate
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction.prefix import (
    KVPrefix,
    PrefixCalibration,
    PrefixPredictor,
    calibrate_prefix,
    prefix_errors,
)
from fastprefill.methods.kv_prediction.prefix.calibrate import choose_rank
from fastprefill.methods.registry import make_method
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.kv import prefix_kv, rotate_keys
from fastprefill.models.random import random_model
from fastprefill.models.shape import ModelShape


def _corpus(make_ids, n: int, length: int, seed: int) -> list[torch.Tensor]:
    return [make_ids(length, seed * 1000 + i) for i in range(n)]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, tiny_qwen2, make_ids):
    """kvp-prefix at l = 1 on the tiny qwen2, calibrated on random token text."""
    out = tmp_path_factory.mktemp("prefix") / "l1"
    method = calibrate_prefix(tiny_qwen2, out, PrefixCalibration(layer=1, checkpoint_every=4),
                              corpus=_corpus(make_ids, 24, 128, 1), heldout=_corpus(make_ids, 4, 128, 2),
                              progress=False)
    return out, method


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("n", [1, 2, 29])
def test_all_layers_exact_equals_full_prefill(tiny_model, n, make_ids):
    """l = L predicts nothing: logits equal full prefill within 1e-5, and so do 6 decode steps."""
    ids = make_ids(n, 3)
    got, want = make_method("kvp-prefix:layer=4").prefill(tiny_model, ids), FullPrefill().prefill(tiny_model, ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    assert got.stats.token_layers == got.stats.total_token_layers == 4 * n
    tok = int(want.logits.argmax())
    got_decoder, want_decoder = decoder_for(tiny_model, got), decoder_for(tiny_model, want)
    for _ in range(6):
        a, b = got_decoder.step(tok), want_decoder.step(tok)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        tok = int(b.argmax())


def test_zero_shot_map_is_the_layers_own_projection(tiny_model, make_ids):
    """Zero-shot map of layer j on h_l is exactly k_proj_j(norm_j(h_l)) (and v_proj_j), and at
    j = l it is the layer's true pre-rotation K and V."""
    ad = DecoderAdapter(tiny_model)
    ids = make_ids(17, 4)
    with torch.no_grad():
        true_kv, _ = prefix_kv(tiny_model, ids)
        for l in range(4):
            pred = PrefixPredictor.zero_shot(tiny_model, l)
            hidden = _hidden_at(tiny_model, ids, l)
            got = pred.predict(ad, hidden)
            assert sorted(got) == list(range(l, 4))
            for j, (k, v) in got.items():
                layer = tiny_model.model.layers[j]
                x = layer.input_layernorm(hidden)
                assert torch.equal(k, ad.split_heads(layer.self_attn.k_proj(x)))
                assert torch.equal(v, ad.split_heads(layer.self_attn.v_proj(x)))
            torch.testing.assert_close(got[l][0], true_kv[l][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[l][1], true_kv[l][1], atol=1e-5, rtol=1e-5)


def _hidden_at(model, ids, l):
    """The input of layer l (the output of layer l - 1) from the model's own forward."""
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True)
    return out.hidden_states[l]


def _reference(model, ids, predictor, steps, tail=1):
    """An independent kvp-prefix: the model's own forward builds the exact cache, layers >= l get
    the predicted KV for tokens 0..T-1-tail, the last ``tail`` tokens and the decode steps run
    model(...)."""
    ad = DecoderAdapter(model)
    l, n = predictor.layer, ids.shape[1] - tail + 1
    with torch.no_grad():
        true_kv, _ = prefix_kv(model, ids[:, :n - 1])
        hidden = _hidden_at(model, ids[:, :n - 1], l)
        pred = predictor.predict(ad, hidden)
        kv = [pred[j] if j >= l else true_kv[j] for j in range(len(true_kv))]
        cache = DynamicCache(config=model.config)
        cos, sin = model.model.rotary_emb(hidden, position_ids=torch.arange(n - 1)[None])
        for j, (k, v) in enumerate(kv):
            cache.update(rotate_keys(k, cos, sin), v, j)
        logits = [model(input_ids=ids[:, -tail:], past_key_values=cache, use_cache=True).logits[0, -1]]
        for _ in range(steps):
            tok = torch.tensor([[int(logits[-1].argmax())]])
            logits.append(model(input_ids=tok, past_key_values=cache, use_cache=True).logits[0, -1])
    return logits


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_prefill_and_decode_agree_with_reference(tiny_model, layer, make_ids):
    ids = make_ids(26, 5)
    method = make_method(f"kvp-prefix:layer={layer}")
    ref = _reference(tiny_model, ids, PrefixPredictor.zero_shot(tiny_model, layer), steps=6)
    out = method.prefill(tiny_model, ids)
    decoder = decoder_for(tiny_model, out)
    torch.testing.assert_close(out.logits, ref[0].float(), atol=1e-5, rtol=0)
    for fed, want in itertools.pairwise(ref):  # the reference's own greedy tokens fed to both
        got = decoder.step(int(fed.argmax()))
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tail", [2, 7])
def test_exact_tail_agrees_with_reference(tiny_model, tail, make_ids):
    """tail = W: the last W prompt tokens run every layer over the predicted rows (the model's own
    forward on them is the reference); prefill and decode match it, and the counts add up."""
    ids = make_ids(26, 5)
    method = make_method(f"kvp-prefix:layer=1,tail={tail}")
    ref = _reference(tiny_model, ids, PrefixPredictor.zero_shot(tiny_model, 1), steps=4, tail=tail)
    out = method.prefill(tiny_model, ids)
    decoder = decoder_for(tiny_model, out)
    torch.testing.assert_close(out.logits, ref[0].float(), atol=1e-5, rtol=0)
    for fed, want in itertools.pairwise(ref):
        torch.testing.assert_close(decoder.step(int(fed.argmax())), want.float(), atol=1e-5, rtol=0)
    L = tiny_model.config.num_hidden_layers
    assert out.stats.token_layers == 1 * 26 + (L - 1) * tail
    one = make_method("kvp-prefix:layer=1").prefill(tiny_model, ids).stats
    assert one.flops < out.stats.flops < FullPrefill().prefill(tiny_model, ids).stats.flops


def test_tail_covering_the_prompt_is_full_prefill(tiny_model, make_ids):
    ids = make_ids(12, 8)
    got = make_method("kvp-prefix:layer=1,tail=12").prefill(tiny_model, ids)
    torch.testing.assert_close(got.logits, FullPrefill().prefill(tiny_model, ids).logits, atol=1e-5, rtol=0)
    assert got.stats.extra["predicted_layers"] == 0


def test_engine_generate_and_stats(tiny_llama, make_ids):
    ids = make_ids(31, 6)
    res = generate(tiny_llama, None, ids, method=make_method("kvp-prefix:layer=2"), max_new_tokens=6, stop_at_eos=False)
    assert len(res.token_ids) == 6
    shape = ModelShape.from_config(tiny_llama.config)
    n, l, L = 31, 2, 4
    assert res.timing.stats.token_layers == l * n + (L - l)
    d_kv = shape.num_kv_heads * shape.head_dim
    map_flops = 2.0 * 2 * (L - l) * (n - 1) * (shape.hidden_size + 1) * d_kv
    want = l * shape.layer_flops(n) + map_flops + (L - l) * shape.layer_flops(1, n) + shape.head_flops(1)
    assert res.timing.stats.flops == pytest.approx(want)
    assert res.timing.stats.extra["map_flops"] == pytest.approx(map_flops)
    assert res.timing.stats.flops < shape.causal_prefill_flops(n)


# --------------------------------------------------------------------------- least squares
def test_least_squares_beats_zero_shot_on_heldout_text(calibrated, tiny_qwen2, make_ids):
    out, method = calibrated
    held = _corpus(make_ids, 4, 128, 7)  # not the calibration's nor the report's sequences
    fitted, zero = method.bind(tiny_qwen2), PrefixPredictor.zero_shot(tiny_qwen2, 1)
    e_fit, e_zero = prefix_errors(tiny_qwen2, fitted, held), prefix_errors(tiny_qwen2, zero, held)
    assert e_fit["layers"] == [1, 2, 3]
    for w in ("k", "v"):
        for j, (a, b) in enumerate(zip(e_fit[w], e_zero[w])):
            assert a <= b + 1e-6, (w, j, a, b)
        assert e_fit[w][-1] < 0.95 * e_zero[w][-1]  # a real improvement where there is something to fit
        for r2, rel in zip(e_fit[f"r2_{w}"], e_fit[w]):
            assert r2 <= 1.0 and (rel > 0 or r2 == pytest.approx(1.0))
    report = json.loads((out / "config.json").read_text())["heldout_errors"]
    assert set(report) == {"zero-shot", "least-squares", "sequences"}
    assert all(a <= b + 1e-6 for a, b in zip(report["least-squares"]["v"], report["zero-shot"]["v"]))


def test_reduced_rank_correction(tmp_path, tiny_llama, make_ids):
    corpus, held = _corpus(make_ids, 16, 128, 8), _corpus(make_ids, 3, 128, 9)
    method = calibrate_prefix(tiny_llama, tmp_path / "r", PrefixCalibration(layer=1, rank=4), corpus=corpus,
                              heldout=held, progress=False)
    state = load_file(str(next((tmp_path / "r").glob("predictor-*.safetensors"))))
    assert state["k.2.a"].shape == (65, 4) and state["k.2.b"].shape == (4, 32)
    assert all(t.dtype == torch.float16 for t in state.values())
    e_fit = prefix_errors(tiny_llama, method.bind(tiny_llama), held)
    e_zero = prefix_errors(tiny_llama, PrefixPredictor.zero_shot(tiny_llama, 1), held)
    assert all(a <= b + 1e-6 for a, b in zip(e_fit["v"], e_zero["v"]))


def test_rank_choice_fits_the_size_budget():
    shape = ModelShape(num_layers=28, hidden_size=1536, num_heads=12, num_kv_heads=2, head_dim=128,
                       intermediate_size=8960, vocab_size=151936, max_positions=32768)
    assert choose_rank(shape, 18, None, 20.0) is None  # 10 layers at full rank: 15.7 MB
    r = choose_rank(shape, 8, None, 20.0)
    assert r is not None and r % 8 == 0 and 2 * 20 * (1537 + 256) * r * 2 <= 20e6
    with pytest.raises(ConfigError, match="max_mb"):
        choose_rank(shape, 8, 200, 20.0)


# --------------------------------------------------------------------------- checkpoints
def test_checkpoint_records_layer_and_shape(calibrated, tiny_qwen2, make_ids):
    out, method = calibrated
    config = json.loads((out / "config.json").read_text())
    assert config["variant"] == "prefix" and config["layer"] == 1 and config["complete"]
    assert config["base"]["shape"] == ModelShape.from_config(tiny_qwen2.config).to_json()
    assert config["layers_done"] == [1, 2, 3]
    assert (out / config["weights"]).stat().st_size <= 20e6
    assert not (out / "calib-stats.pt").exists()
    spec = make_method(f"kvp-prefix:predictor={out}")
    assert spec.layer == 1 and "l=1" in spec.describe()
    ids = make_ids(20, 10)
    torch.testing.assert_close(spec.prefill(tiny_qwen2, ids).logits, method.prefill(tiny_qwen2, ids).logits)


class _Killed(Exception):
    pass


class _DiesAfter(list):
    """A corpus whose iteration raises after ``k`` sequences (a kill mid-calibration)."""

    def __init__(self, items, k):
        super().__init__(items)
        self.k = k

    def __getitem__(self, index):
        items = super().__getitem__(index)
        if not isinstance(index, slice):
            return items

        def gen():
            for i, item in enumerate(items):
                if i == self.k:
                    raise _Killed
                yield item

        return gen()


def test_calibration_resumes_after_a_kill(tmp_path, tiny_llama, make_ids):
    corpus = _corpus(make_ids, 10, 64, 11)
    cfg = PrefixCalibration(layer=2, checkpoint_every=3)
    whole = calibrate_prefix(tiny_llama, tmp_path / "whole", cfg, corpus=corpus, heldout=[], progress=False)
    with pytest.raises(_Killed):
        calibrate_prefix(tiny_llama, tmp_path / "cut", cfg, corpus=_DiesAfter(corpus, 7), heldout=[], progress=False)
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["complete"] is False
    with pytest.raises(ConfigError, match="unfinished"):
        KVPrefix(predictor=str(tmp_path / "cut"))
    with pytest.raises(ConfigError, match="already holds"):
        calibrate_prefix(tiny_llama, tmp_path / "cut", cfg, corpus=corpus, heldout=[], progress=False)
    resumed = calibrate_prefix(tiny_llama, tmp_path / "cut", cfg, corpus=corpus, heldout=[], resume=True,
                               progress=False)
    ids = make_ids(21, 12)
    torch.testing.assert_close(resumed.prefill(tiny_llama, ids).logits, whole.prefill(tiny_llama, ids).logits,
                               atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- refused inputs
def test_bad_inputs_are_config_errors(calibrated, tiny_llama, tmp_path, make_ids):
    out, _ = calibrated
    with pytest.raises(ConfigError, match="layer=L .*predictor=DIR.*train-kvp"):
        make_method("kvp-prefix")
    with pytest.raises(ConfigError, match="layer must be an int >= 0"):
        make_method("kvp-prefix:layer=-1")
    for bad in ("0", "-3"):
        with pytest.raises(ConfigError, match="tail must be an int >= 1"):
            make_method(f"kvp-prefix:layer=1,tail={bad}")
    with pytest.raises(ConfigError, match="not an integer"):
        make_method("kvp-prefix:layer=1,tail=lots")
    with pytest.raises(ConfigError, match=r"in \[0, 4\]"):
        make_method("kvp-prefix:layer=5").prefill(tiny_llama, make_ids(8, 0))
    with pytest.raises(ConfigError, match="weights differ"):  # same shape, other weights
        make_method(f"kvp-prefix:predictor={out}").prefill(tiny_llama, make_ids(8, 0))
    shallow = random_model("qwen2", num_hidden_layers=2)
    with pytest.raises(ConfigError, match="shape"):
        make_method(f"kvp-prefix:predictor={out}").prefill(shallow, make_ids(8, 0))
    with pytest.raises(ConfigError, match="calibrated for layer=1"):
        make_method(f"kvp-prefix:layer=2,predictor={out}")
    with pytest.raises(ConfigError, match="no KV Prediction checkpoint"):
        make_method(f"kvp-prefix:predictor={tmp_path / 'nothing'}")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in out.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = next(broken.glob("predictor-*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="sha256"):
        make_method(f"kvp-prefix:predictor={broken}")


def test_calibrated_fill_in_the_pruning_loop_is_kvp_prefix(calibrated, tiny_qwen2, make_ids):
    """LazyLLM's fill=calibrated:DIR with one cut after layer l - 1 keeping the last W tokens gives
    the calibrated kvp-prefix's logits; a checkpoint of another source layer is refused."""
    from fastprefill.methods.lazyllm import LazyLLM

    out, _ = calibrated
    ids = make_ids(30, 13)
    lazy = LazyLLM(schedule=((0, 0.01),), options={"keep_recent": 5, "revival": "none", "fill": f"calibrated:{out}"})
    with torch.inference_mode():
        got = lazy.prefill(tiny_qwen2, ids)
        want = KVPrefix(predictor=str(out), tail=5).prefill(tiny_qwen2, ids)
        zero = LazyLLM(schedule=((0, 0.01),), options={"keep_recent": 5, "revival": "none",
                                                        "fill": "zero-shot"}).prefill(tiny_qwen2, ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    assert float((zero.logits - got.logits).abs().max()) > 1e-4  # the calibrated maps are really used
    wrong = LazyLLM(schedule=((1, 0.01),), options={"revival": "none", "fill": f"calibrated:{out}"})
    with pytest.raises(ConfigError, match="maps from layer 1.*layer 2 needed"):
        wrong.prefill(tiny_qwen2, ids)


def test_fill_share_fills_the_highest_ranked_pruned_tokens(calibrated, tiny_qwen2, make_ids):
    """fill_share=s gives filled rows to ceil(s * pruned) pruned tokens, the best-ranked ones, at
    every later layer (counted in the cache and the stat); s = 1 is the whole fill, and a partial
    fill is neither the whole fill nor dropping."""
    import math

    from fastprefill.methods.lazyllm import LazyLLM
    from fastprefill.methods.pruning.options import PruneOptions
    from fastprefill.methods.pruning.prefill import _filled_rows, progressive_prefill
    from fastprefill.methods.pruning.select import top_k_keep

    ranked = torch.tensor([5.0, 1.0, float("inf"), 3.0, 4.0, 2.0])
    drop = torch.tensor([True, True, False, True, False, True]).nonzero().flatten()  # the dropped rows' indices
    assert _filled_rows(ranked, drop, 0.5).tolist() == [0, 3]  # dropped 0, 1, 3, 5: the top 2 by score
    assert _filled_rows(ranked, drop, 1.0).tolist() == [0, 1, 3, 5]
    assert _filled_rows(ranked, drop, 0.01).tolist() == [0]

    out, _ = calibrated
    ids = make_ids(40, 21)
    n, layers = 40, 4

    def lazy(**extra):
        opts = {"revival": "none", "fill": f"calibrated:{out}", **extra}
        return LazyLLM(schedule=((0, 0.25),), options=opts).prefill(tiny_qwen2, ids)

    with torch.inference_mode():
        whole, default, part = lazy(fill_share=1.0), lazy(), lazy(fill_share=0.5)
        dropped = LazyLLM(schedule=((0, 0.25),), options={"revival": "none"}).prefill(tiny_qwen2, ids)
        state = progressive_prefill(DecoderAdapter(tiny_qwen2), ids, ((0, 0.25),), top_k_keep,
                                    PruneOptions(revival="none", fill=f"calibrated:{out}", fill_share=0.5)).state
    torch.testing.assert_close(whole.logits, default.logits, atol=0, rtol=0)
    kept = part.stats.extra["kept_per_stage"][0]
    pruned = n - kept
    filled = math.ceil(0.5 * pruned)
    assert part.stats.extra["filled_token_layers"] == filled * (layers - 1)
    assert whole.stats.extra["filled_token_layers"] == pruned * (layers - 1)
    for j in range(1, layers):
        assert int(state.cache.positions(j).numel()) == kept + filled
    assert float((part.logits - whole.logits).abs().max()) > 1e-5
    assert float((part.logits - dropped.logits).abs().max()) > 1e-5
    assert part.stats.flops < whole.stats.flops


def test_fill_share_is_validated():
    from fastprefill.methods.pruning.options import PruneOptions

    for bad in (0, 1.5, -0.1, "half", True):
        with pytest.raises(ConfigError, match="fill_share must be a number in"):
            PruneOptions(revival="none", fill="zero-shot", fill_share=bad)
    with pytest.raises(ConfigError, match="fill_share=0.5 needs a fill policy"):
        PruneOptions(fill_share=0.5)
    assert "fill_share=0.5" in PruneOptions(revival="none", fill="zero-shot", fill_share=0.5).describe()
    assert make_method("lazyllm:revival=none,fill=zero-shot,fill_share=0.25").options.fill_share == 0.25


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_fills_flops_are_dropping_plus_the_maps_plus_attention_to_the_filled_rows(calibrated, tiny_qwen2, share,
                                                                                   make_ids):
    """Counted: a fill's FLOPs = dropping's + the maps' for the filled rows + the kept rows'
    attention to the filled rows before them, at every layer after the cut."""
    from fastprefill.methods.pruning.options import PruneOptions
    from fastprefill.methods.pruning.prefill import progressive_prefill
    from fastprefill.methods.pruning.select import top_k_keep
    from fastprefill.methods.research.fill import Fill, FillMaps

    out, _ = calibrated
    ad = DecoderAdapter(tiny_qwen2)
    ids = make_ids(48, 5)
    schedule = ((0, 0.25),)
    fill = PruneOptions(revival="none", fill=f"calibrated:{out}", fill_share=share)
    with torch.inference_mode():
        filled = progressive_prefill(ad, ids, schedule, top_k_keep, fill)
        dropped = progressive_prefill(ad, ids, schedule, top_k_keep, PruneOptions(revival="none"))
    kept = filled.state.selected[-1]
    assert torch.equal(kept, dropped.state.selected[-1])  # the cut is the same
    present = filled.state.cache.positions(3)
    filled_pos = present[~torch.isin(present, kept)].sort().values
    pairs = sum(int((filled_pos < q).sum()) for q in kept.tolist())
    shape = ModelShape.from_config(tiny_qwen2.config)
    maps = FillMaps(Fill.parse(f"calibrated:{out}"), ad, 1)
    want = dropped.output.stats.flops + maps.flops(int(filled_pos.numel())) + 3 * shape.attention_flops(pairs)  # layers 1..3
    assert pairs > 0
    assert filled.output.stats.flops == pytest.approx(want, rel=1e-12)
