"""KV Prediction: identity reproduction, layer maps, least squares, checkpoints, error paths."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction import (
    AuxSpec,
    CheckpointError,
    KVPrediction,
    KVPredictor,
    TokenizerMismatchError,
    check_tokenizers,
    default_layer_map,
    validate_layer_map,
)
from fastprefill.methods.kv_prediction.auxiliary.fit import fit_least_squares, kv_relative_errors
from fastprefill.methods.kv_prediction.auxiliary.train import base_logits_on_kv
from fastprefill.methods.kv_prediction.checkpoint import read_checkpoint
from fastprefill.models.kv import prefix_kv, rotate_keys, unrotate_keys
from fastprefill.models.shape import ModelShape
from tests.kvp_helpers import ByteTokenizer, compare_with_full, identity_method, train_tiny


# --------------------------------------------------------------------------- identity
def test_identity_predictor_reproduces_base(tiny_model, make_ids):
    """aux = copy of base, identity maps: logits equal base-only through prefill and 8 decode steps."""
    method = identity_method(tiny_model)
    out = compare_with_full(tiny_model, method, make_ids(23, 1))
    s = out.stats
    assert s.token_layers == 4 and s.total_token_layers == 23 * 4  # the base ran one token per layer
    assert s.extra["aux_token_layers"] == 22 * 4
    shape = ModelShape.from_config(tiny_model.config)
    assert s.flops < shape.causal_prefill_flops(23) + method.predictor.flops(22) + shape.head_flops(1)
    assert s.flops == pytest.approx(s.extra["aux_flops"] + s.extra["predictor_flops"] + s.extra["base_flops"])


def test_identity_through_engine_matches_full(tiny_llama, make_ids):
    ids = make_ids(31, 2)
    full = generate(tiny_llama, None, ids, max_new_tokens=8, stop_at_eos=False)
    kvp = generate(tiny_llama, None, ids, method=identity_method(tiny_llama), max_new_tokens=8, stop_at_eos=False)
    assert kvp.token_ids == full.token_ids
    assert kvp.timing.stats.token_layers == 4


def test_single_token_prompt_is_plain_prefill(tiny_llama, make_ids):
    compare_with_full(tiny_llama, identity_method(tiny_llama), make_ids(1, 3), steps=2)


def test_perturbed_predictor_changes_logits(tiny_llama, make_ids):
    """The predicted KV is really used: a non-identity map changes the first-token logits."""
    method = identity_method(tiny_llama)
    with torch.no_grad():
        method.predictor.v_maps[2].bias.add_(0.5)
    ids = make_ids(23, 4)
    assert (method.prefill(tiny_llama, ids).logits - FullPrefill().prefill(tiny_llama, ids).logits).abs().max() > 1e-3


def test_rotate_unrotate_roundtrip(tiny_llama):
    k = torch.randn(1, 2, 9, 16)
    pos = torch.arange(100, 109)[None]
    cos, sin = tiny_llama.model.rotary_emb(k, position_ids=pos)
    torch.testing.assert_close(unrotate_keys(rotate_keys(k, cos, sin), cos, sin), k, atol=1e-6, rtol=0)
    assert (rotate_keys(k, cos, sin) - k).abs().max() > 1e-2


# --------------------------------------------------------------------------- layer map / shapes
def test_default_layer_map_is_proportional_and_monotone():
    assert default_layer_map(12, 24) == tuple(l // 2 for l in range(24))
    assert default_layer_map(24, 28) == tuple((l * 24) // 28 for l in range(28))
    assert default_layer_map(4, 4) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("layer_map", "match"),
    [((0, 1, 2), "length 4"), ((0, 1, 2, 4), "out of range"), ((0, -1, 1, 2), "out of range"),
     ((0, 2, 1, 3), "monotone"), ((0, 1, 1.5, 2), "must be an int")],
)
def test_layer_map_validation(layer_map, match):
    with pytest.raises(ConfigError, match=match):
        validate_layer_map(layer_map, num_aux=4, num_base=4)


def test_predictor_shapes_and_wrong_aux_shape(tiny_llama, tiny_qwen2):
    base = ModelShape.from_config(tiny_llama.config)
    aux = ModelShape(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=8,
                     intermediate_size=64, vocab_size=128, max_positions=512)
    pred = KVPredictor(aux, base)
    assert pred.layer_map == (0, 0, 1, 1)
    out = pred([(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))] * 2)
    assert len(out) == 4 and all(k.shape == v.shape == (1, 2, 5, 16) for k, v in out)
    with pytest.raises(CheckpointError, match="aux model of shape"):
        KVPrediction(pred, AuxSpec.model("x"), tiny_qwen2)
    with pytest.raises(ConfigError, match="aux is required"):
        KVPrediction(pred, AuxSpec.model("x"), None)
    with pytest.raises(ConfigError, match="stride"):
        AuxSpec.layer_drop(0)


# --------------------------------------------------------------------------- KVP-LP aux
def test_drop_layers_shares_weights_and_matches_manual_loop(tiny_qwen2, make_ids):
    aux = AuxSpec.layer_drop(2).build(tiny_qwen2)
    assert aux.config.num_hidden_layers == 2 and tiny_qwen2.config.num_hidden_layers == 4
    assert len(tiny_qwen2.model.layers) == 4  # original untouched
    assert aux.model.layers[1].mlp.up_proj.weight is tiny_qwen2.model.layers[2].mlp.up_proj.weight
    assert [l.self_attn.layer_idx for l in aux.model.layers] == [0, 1]
    assert tiny_qwen2.model.layers[2].self_attn.layer_idx == 2
    ids = make_ids(11, 5)
    with torch.no_grad():
        got = aux(ids).logits
        h = tiny_qwen2.model.embed_tokens(ids)
        pos = torch.arange(11)[None]
        rot = tiny_qwen2.model.rotary_emb(h, pos)
        mask = torch.ones(11, 11, dtype=torch.bool).tril()[None, None]
        for i in (0, 2):
            h = tiny_qwen2.model.layers[i](h, attention_mask=mask, position_ids=pos, position_embeddings=rot)
        want = tiny_qwen2.lm_head(tiny_qwen2.model.norm(h))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- least squares
def test_least_squares_recovers_planted_linear_map(tiny_llama):
    """Base KV = A·(aux KV) + b exactly: the fit recovers A and b (with bias) to float rounding."""
    base = ModelShape.from_config(tiny_llama.config)
    aux = ModelShape(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=8,
                     intermediate_size=64, vocab_size=128, max_positions=512)
    planted = KVPredictor(aux, base)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in planted.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))

    def pairs():
        for s in range(6):
            g = torch.Generator().manual_seed(100 + s)
            aux_kv = [(torch.randn(1, 1, 20, 8, generator=g), torch.randn(1, 1, 20, 8, generator=g)) for _ in range(2)]
            yield aux_kv, planted(aux_kv)

    fitted = KVPredictor(aux, base)
    assert fit_least_squares(fitted, pairs(), ridge=0.0) == 120
    for a, b in zip(fitted.parameters(), planted.parameters()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_pre_rotation_map_beats_rotated_map(make_ids):
    """Evidence for the rotary choice: aux = base with another rope_theta, so layer-0 keys before
    rotation are identical while rotated keys differ by a position-dependent rotation. A
    least-squares map on pre-rotation keys is exact on held-out data; one on rotated keys is not."""
    cfg = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
           "tie_word_embeddings": True}
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig(**cfg, rope_theta=10000.0)).eval()
    aux = AutoModelForCausalLM.from_config(LlamaConfig(**cfg, rope_theta=100.0)).eval()
    aux.load_state_dict(base.state_dict())
    train = [make_ids(64, s) for s in range(8)]
    held_out = [make_ids(64, 50 + s) for s in range(3)]

    def rotated(model, ids):
        kv, _ = prefix_kv(model, ids)
        cos, sin = model.model.rotary_emb(kv[0][1], position_ids=torch.arange(ids.shape[1])[None])
        return [(rotate_keys(k, cos, sin), v) for k, v in kv]

    def rel_err(pred, get):
        num = den = 0.0
        for ids in held_out:
            x, y = get(aux, ids), get(base, ids)
            k_hat = pred(x)[0][0]
            num += float((k_hat - y[0][0]).pow(2).sum())
            den += float(y[0][0].pow(2).sum())
        return (num / den) ** 0.5

    shape = ModelShape.from_config(base.config)
    errors = {}
    with torch.no_grad():
        for name, get in (("pre", lambda m, i: prefix_kv(m, i)[0]), ("rotated", rotated)):
            pred = KVPredictor(shape, shape)
            fit_least_squares(pred, ((get(aux, ids), get(base, ids)) for ids in train), ridge=1e-6)
            errors[name] = rel_err(pred, get)
    assert errors["pre"] < 1e-3
    assert errors["rotated"] > 0.1 > 100 * errors["pre"]


# --------------------------------------------------------------------------- training + checkpoints


def test_training_forward_on_true_kv_is_the_base_forward(tiny_model, make_ids):
    """The training loss's base pass (every layer on given KV) equals the base's own forward when
    given the base's own KV, and its gradient reaches the KV of earlier positions."""
    ids = make_ids(24, seed=3)
    with torch.no_grad():
        true_kv, _ = prefix_kv(tiny_model, ids)
        ref = tiny_model(ids).logits.float()
        torch.testing.assert_close(base_logits_on_kv(tiny_model, ids, true_kv), ref, atol=1e-5, rtol=0)
    kv = [(k.clone().requires_grad_(True), v.clone().requires_grad_(True)) for k, v in true_kv]
    base_logits_on_kv(tiny_model, ids, kv)[0, 10].sum().backward()  # position 10's logits
    k0, v0 = kv[0]
    assert v0.grad[:, :, :11].abs().sum() > 0  # it reads positions <= 10 ...
    assert v0.grad[:, :, 11:].abs().sum() == 0 and k0.grad[:, :, 11:].abs().sum() == 0  # ... and nothing later


def test_train_lp_checkpoint_roundtrip_and_plot(tiny_llama, tmp_path, make_ids):
    method = train_tiny(tiny_llama, tmp_path / "ck")
    config, _, train_state = read_checkpoint(tmp_path / "ck", with_train_state=True)
    assert config["step"] == 4 and config["base"]["name"] == "tiny" and config["layer_map"] == [0, 0, 1, 1]
    assert config["aux"]["spec"] == {"kind": "layer_drop", "name": None, "stride": 2}
    assert len(train_state["history"]) == 4 and (tmp_path / "ck" / "loss.png").stat().st_size > 0
    assert all(p.requires_grad for p in tiny_llama.parameters())  # flags restored
    loaded = KVPrediction.load(tmp_path / "ck")
    for a, b in zip(loaded.predictor.parameters(), method.predictor.parameters()):
        assert torch.equal(a, b)
    ids = make_ids(20, 7)
    torch.testing.assert_close(loaded.prefill(tiny_llama, ids).logits, method.prefill(tiny_llama, ids).logits)
    loaded.save(tmp_path / "copy")
    again = KVPrediction.load(tmp_path / "copy")
    assert all(torch.equal(a, b) for a, b in zip(again.predictor.parameters(), loaded.predictor.parameters()))
    # trained maps predict the base KV better than the untrained (random) initial maps
    aux = AuxSpec.layer_drop(2).build(tiny_llama)
    fresh = KVPredictor(ModelShape.from_config(aux.config), ModelShape.from_config(tiny_llama.config))
    held = [make_ids(32, 300)]
    trained_err = kv_relative_errors(tiny_llama, aux, loaded.predictor, held)
    fresh_err = kv_relative_errors(tiny_llama, aux, fresh, held)
    assert sum(trained_err["k"]) < sum(fresh_err["k"]) and sum(trained_err["v"]) < sum(fresh_err["v"])


def test_resume_continues_to_same_result(tiny_llama, tmp_path):
    """Training 4 steps, then resuming to 6, equals training 6 steps straight (atomic checkpoints)."""
    straight = train_tiny(tiny_llama, tmp_path / "a", steps=6)
    train_tiny(tiny_llama, tmp_path / "b", steps=4)
    files_before = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert not any(name.endswith(".tmp") for name in files_before)
    resumed = train_tiny(tiny_llama, tmp_path / "b", steps=6, resume=True)
    assert read_checkpoint(tmp_path / "b")[0]["step"] == 6
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("predictor-")) == [
        "predictor-000006.safetensors"]
    for a, b in zip(straight.predictor.parameters(), resumed.predictor.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(CheckpointError, match="already holds"):
        train_tiny(tiny_llama, tmp_path / "b", steps=6)


def test_missing_and_corrupted_checkpoints(tiny_llama, tmp_path):
    with pytest.raises(CheckpointError, match="config.json missing"):
        KVPrediction.load(tmp_path / "nothing")
    train_tiny(tiny_llama, tmp_path / "ck", steps=0)
    cfg_path = tmp_path / "ck" / "config.json"
    config = json.loads(cfg_path.read_text())
    weights = tmp_path / "ck" / config["weights"]
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        KVPrediction.load(tmp_path / "ck")
    weights.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        KVPrediction.load(tmp_path / "ck")
    cfg_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        KVPrediction.load(tmp_path / "ck")


def test_wrong_base_is_refused(tiny_llama, tmp_path, make_ids):
    train_tiny(tiny_llama, tmp_path / "ck", steps=0)
    method = KVPrediction.load(tmp_path / "ck")
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(1.01)
    with pytest.raises(CheckpointError, match="fingerprint"):
        method.prefill(other, make_ids(10, 8))
    deeper = AutoModelForCausalLM.from_config(LlamaConfig(**{**tiny_llama.config.to_dict(), "num_hidden_layers": 6}))
    with pytest.raises(CheckpointError, match="base model of shape"):
        method.prefill(deeper.eval(), make_ids(10, 8))
    method.prefill(tiny_llama, make_ids(10, 8))  # the right base works


def test_tokenizer_mismatch_is_refused(tiny_llama, tmp_path):
    check_tokenizers(ByteTokenizer(), ByteTokenizer())
    with pytest.raises(TokenizerMismatchError, match="same|differently|tokenizer"):
        check_tokenizers(ByteTokenizer(), ByteTokenizer(shift=1))
    aux = copy.deepcopy(tiny_llama)
    with pytest.raises(TokenizerMismatchError):
        train_tiny(tiny_llama, tmp_path / "c", steps=0, aux=aux, aux_tokenizer=ByteTokenizer(shift=1))
    train_tiny(tiny_llama, tmp_path / "c", steps=0, aux=aux, aux_tokenizer=ByteTokenizer(), aux_name="copy")
    KVPrediction.load(tmp_path / "c", aux=aux, aux_tokenizer=ByteTokenizer(), base_tokenizer=ByteTokenizer())
    with pytest.raises(TokenizerMismatchError):
        KVPrediction.load(tmp_path / "c", aux=aux, aux_tokenizer=ByteTokenizer(shift=3))
    with pytest.raises(CheckpointError, match="not 'copy'"):
        KVPrediction.load(tmp_path / "c", aux=AutoModelForCausalLM.from_config(tiny_llama.config))


def test_aux_alone_baseline_runs_the_aux_only(tiny_llama, make_ids):
    """AuxAlone (the paper's baseline) equals full prefill + greedy decoding of the aux model."""
    from fastprefill.methods.kv_prediction import AuxAlone

    ids = make_ids(19, 9)
    method = AuxAlone(AuxSpec.layer_drop(2))
    got = generate(tiny_llama, None, ids, method=method, max_new_tokens=6, stop_at_eos=False)
    aux = AuxSpec.layer_drop(2).build(tiny_llama)
    want = generate(aux, None, ids, max_new_tokens=6, stop_at_eos=False)
    assert got.token_ids == want.token_ids and got.timing.stats.token_layers == 0
    assert got.timing.stats.flops == want.timing.stats.flops
    with pytest.raises(ConfigError, match="AuxAlone.aux"):
        AuxAlone("qwen")
