"""KV Prediction reports and variants beyond the paper: centred R², errors after least squares
and after the gradient phase, maps from aux hidden states, the dev gate, the kvp-prefix l-sweep,
the CLI's message for a bare ``kvp`` and KV Prediction in the demo (the calibration text and
``train-kvp`` on the real model are in tests/integration/)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fastprefill.cli import main
from fastprefill.demo import demo_prefix_layer
from fastprefill.errors import ConfigError
from fastprefill.methods.kv_prediction import AuxSpec, KVPrediction, KVPredictor
from fastprefill.methods.kv_prediction.auxiliary.fit import fit_least_squares, kv_relative_errors
from fastprefill.methods.kv_prediction.auxiliary.train import TrainConfig, train_kvp
from fastprefill.methods.kv_prediction.prefix import KVPrefix
from fastprefill.methods.registry import make_method
from fastprefill.models.kv import attention_inputs, prefix_kv
from fastprefill.models.shape import ModelShape
from reporting import error_summary
from research.kvp import GATE_V_ERROR, dev_gate, l_sweep
from tests.kvp_helpers import ByteTokenizer


def _copy_pair(make_ids, model, source):
    """aux = a copy of the base, identity layer map, maps fitted by least squares from ``source``."""
    aux = copy.deepcopy(model)
    shape = ModelShape.from_config(model.config)
    pred = KVPredictor(shape, shape, layer_map=tuple(range(shape.num_layers)), source=source)
    fit_least_squares(pred, ((pred.features(aux, ids)[0], prefix_kv(model, ids)[0])
                             for ids in [make_ids(96, s) for s in range(4)]), ridge=0.0)
    return aux, pred


@pytest.mark.parametrize("source", ["hidden", "hidden2"])
def test_hidden_state_maps_recover_the_base_kv(tiny_model, source, make_ids):
    """K and V are linear in the layer's normalised attention input, so with aux = base the
    least-squares maps from hidden states are exact (R² = 1) where KV-to-KV maps need not be."""
    aux, pred = _copy_pair(make_ids, tiny_model, source)
    assert pred.in_features == (1 if source == "hidden" else 2) * tiny_model.config.hidden_size
    errors = kv_relative_errors(tiny_model, aux, pred, [make_ids(40, 99)])
    assert max(errors["k"] + errors["v"]) < 1e-4
    assert min(errors["r2_k"] + errors["r2_v"]) > 1 - 1e-6
    method = KVPrediction(pred, AuxSpec.model("copy"), aux)
    ids = make_ids(30, 98)
    full = make_method("full").prefill(tiny_model, ids).logits
    torch.testing.assert_close(method.prefill(tiny_model, ids).logits, full, atol=1e-4, rtol=0)


def test_attention_inputs_are_what_the_projections_read(tiny_qwen2, make_ids):
    ids = make_ids(12, 5)
    inputs, _ = attention_inputs(tiny_qwen2, ids)
    kv, _ = prefix_kv(tiny_qwen2, ids)
    for layer, x, (k, _) in zip(tiny_qwen2.model.layers, inputs, kv):
        got = layer.self_attn.k_proj(x).view(1, 12, 2, -1).transpose(1, 2)
        torch.testing.assert_close(got, k, atol=1e-5, rtol=1e-5)


def test_r2_is_centred(tiny_llama, make_ids):
    """R² divides the squared error by the energy around each feature's mean over tokens, the
    relative error by the raw energy (checked against a direct computation)."""
    aux, pred = _copy_pair(make_ids, tiny_llama, "kv")
    with torch.no_grad():
        pred.v_maps[0].weight.mul_(0.5)
    ids = make_ids(40, 97)
    errors = kv_relative_errors(tiny_llama, aux, pred, [ids])
    with torch.no_grad():
        y = prefix_kv(tiny_llama, ids)[0][0][1][0].transpose(0, 1).reshape(40, -1).double()  # (N, H*d)
        yh = pred(pred.features(aux, ids)[0])[0][1][0].transpose(0, 1).reshape(40, -1).double()
    sse = float((yh - y).pow(2).sum())
    assert errors["v"][0] == pytest.approx((sse / float(y.pow(2).sum())) ** 0.5, rel=1e-6)
    assert errors["r2_v"][0] == pytest.approx(1 - sse / float((y - y.mean(0)).pow(2).sum()), rel=1e-6)
    assert error_summary({"v": [0.2, 0.4], "r2_v": [0.5, 0.7]}) == pytest.approx({"mean_v": 0.3, "mean_r2_v": 0.6})


def test_train_reports_errors_after_least_squares_and_after_gradient(tiny_llama, tmp_path, make_ids):
    cfg = TrainConfig(lsq_tokens=6 * 32, steps=2, seq_len=32, lr=1e-3, checkpoint_every=2, source="hidden")
    train_kvp(tiny_llama, AuxSpec.layer_drop(2), tmp_path / "ck", tokenizer=ByteTokenizer(), config=cfg,
              corpus=[make_ids(32, s) for s in range(6)], heldout=[make_ids(32, 50), make_ids(32, 51)], progress=False)
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["source"] == "hidden"
    report = config["heldout_errors"]
    assert set(report) == {"least_squares", "after_gradient"}
    for phase in report.values():
        assert set(phase) == {"k", "v", "r2_k", "r2_v"} and len(phase["v"]) == 4
    loaded = KVPrediction.load(tmp_path / "ck")
    assert loaded.predictor.source == "hidden"
    assert error_summary(report["least_squares"])["mean_v"] > 0


def test_bad_train_config():
    with pytest.raises(ConfigError, match="source"):
        TrainConfig(source="logits")
    with pytest.raises(ConfigError, match="task_share"):
        TrainConfig(task_share=1.5)


def test_dev_gate_passes_an_exact_predictor_and_fails_noise(tiny_llama, make_ids):
    aux, pred = _copy_pair(make_ids, tiny_llama, "hidden")
    prompts = [make_ids(24, 60 + i) for i in range(3)]
    good = dev_gate(tiny_llama, KVPrediction(pred, AuxSpec.model("copy"), aux), prompts, [make_ids(32, 70)],
                    progress=False)
    assert good.passed and good.mean_v_error < 1e-4 and good.first_token_agreement == 1.0 and good.n_prompts == 3
    assert "PASS" in good.describe()
    with torch.no_grad():
        for lin in pred.v_maps:
            lin.weight.add_(torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(1)))
    bad = dev_gate(tiny_llama, KVPrediction(pred, AuxSpec.model("copy"), aux), prompts, [make_ids(32, 70)],
                   progress=False)
    assert not bad.passed and bad.mean_v_error > GATE_V_ERROR and "FAIL" in bad.describe()
    assert json.dumps(bad.to_json())


def test_l_sweep_rows(tiny_qwen2, make_ids):
    prompts = [make_ids(20, 80 + i) for i in range(2)]
    rows = l_sweep(tiny_qwen2, prompts, [1, 4], progress=False, extra=[(1, KVPrefix(layer=1, tail=20))])
    assert [r["layer"] for r in rows] == [1, 4, 1]
    # the extra row (a tail covering the whole prompt: full prefill) is scored against the same
    # prompts' references, beside the zero-shot row at its l
    covered = rows[2]
    assert "tail=20" in covered["method"] and covered["first_token_agreement"] == 1.0
    assert covered["median_kl_nats"] < 1e-6 < rows[0]["median_kl_nats"]
    exact = rows[1]
    assert exact["first_token_agreement"] == 1.0 and exact["median_kl_nats"] < 1e-6
    assert exact["ttft_flops_fraction"] == pytest.approx(1.0)
    assert rows[0]["ttft_flops_fraction"] < 0.5 and rows[0]["n"] == 2


def test_generate_kvp_without_predictor_says_what_to_pass(capsys):
    assert main(["generate", "hello", "--method", "kvp"]) == 2
    err = capsys.readouterr().err
    assert "kvp:predictor=DIR" in err and "fastprefill train-kvp" in err and "from_spec" not in err


def test_demo_prefix_layer():
    assert demo_prefix_layer(30) == 20 and demo_prefix_layer(24) == 16 and demo_prefix_layer(4) == 3


def test_demo_shows_kv_prediction(tiny_qwen2):
    from fastprefill.demo import demo_methods

    methods = [m for _, m in demo_methods(tiny_qwen2, 64)]
    assert KVPrefix(layer=3) in methods


