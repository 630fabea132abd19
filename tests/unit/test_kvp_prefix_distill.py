"""KL distillation of kvp-prefix maps: the training forward is kvp-prefix's own prefill, the
distilled maps lower the KL they are trained on, the checkpoint keeps the best held-out maps and
loads as an ordinary kvp-prefix predictor, the run resumes after a kill, bad inputs are refused."""

from __future__ import annotations

import pytest
import torch

from fastprefill.errors import ConfigError
from fastprefill.methods.kv_prediction.checkpoint import read_checkpoint
from fastprefill.methods.kv_prediction.prefix import KVPrefix, PrefixCalibration, calibrate_prefix
from fastprefill.methods.kv_prediction.prefix.distill import (
    PrefixDistillation,
    _Maps,
    _tail_logprobs,
    distill_prefix,
    prefix_targets,
    tail_kl,
)
from fastprefill.models.adapters import DecoderAdapter


@pytest.fixture(scope="module")
def lsq(tmp_path_factory, tiny_qwen2, make_ids):
    """A least-squares kvp-prefix checkpoint at l = 1 (full rank) on the tiny qwen2."""
    out = tmp_path_factory.mktemp("distill") / "lsq"
    calibrate_prefix(tiny_qwen2, out, PrefixCalibration(layer=1), corpus=[make_ids(96, i) for i in range(12)],
                     heldout=[], progress=False)
    return out


@pytest.fixture(scope="module")
def targets(tiny_qwen2, make_ids):
    train = prefix_targets(tiny_qwen2, 1, [make_ids(80, 100 + i) for i in range(4)], progress=False)
    heldout = prefix_targets(tiny_qwen2, 1, [make_ids(80, 200 + i) for i in range(2)], progress=False)
    return train, heldout


def _mean_kl(model, maps, targets, tail):
    ad = DecoderAdapter(model)
    with torch.no_grad(), ad.attention_scope():
        return float(sum(tail_kl(ad, maps, t, t.length, tail) for t in targets) / len(targets))


@pytest.mark.parametrize("tail", [1, 8])
def test_training_forward_is_kvp_prefix_prefill(tiny_qwen2, lsq, tail, make_ids):
    """At the prompt's end the training forward's last row is KVPrefix(tail=W).prefill's logits."""
    ids = make_ids(70, 7)
    target = prefix_targets(tiny_qwen2, 1, [ids], progress=False)[0]
    _, state, _ = read_checkpoint(lsq)
    maps = _Maps(tiny_qwen2, 1, state)
    ad = DecoderAdapter(tiny_qwen2)
    with torch.no_grad(), ad.attention_scope():
        got = _tail_logprobs(ad, maps, target, 70, tail)
    want = torch.log_softmax(KVPrefix(predictor=str(lsq), tail=tail).prefill(tiny_qwen2, ids).logits, -1)
    assert got.shape == (tail, tiny_qwen2.config.vocab_size)
    torch.testing.assert_close(got[-1], want, atol=1e-4, rtol=1e-4)


def test_reference_rows_are_full_prefill(tiny_qwen2, make_ids):
    """The targets' last layer output, through the head, is the model's own forward."""
    ids = make_ids(50, 3)
    target = prefix_targets(tiny_qwen2, 1, [ids], progress=False)[0]
    ad = DecoderAdapter(tiny_qwen2)
    with torch.no_grad():
        want = tiny_qwen2(ids).logits[0].float()
        got = ad.head(target.h_final)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_distillation_lowers_the_training_kl_and_keeps_the_best(tiny_qwen2, lsq, targets, tmp_path, make_ids):
    train, heldout = targets
    cfg = PrefixDistillation(steps=30, batch=2, lr=3e-3, tail=8, end_share=1.0, eval_every=10)
    _, state, _ = read_checkpoint(lsq)
    before = _mean_kl(tiny_qwen2, _Maps(tiny_qwen2, 1, state), train, 8)
    method = distill_prefix(tiny_qwen2, lsq, tmp_path / "d", cfg, train, heldout, task_ids=["x-1"], progress=False)
    config, new_state, _ = read_checkpoint(tmp_path / "d")
    record = config["distillation"]
    assert [r["step"] for r in record["curve"]] == [0, 10, 20, 30]
    best = min(record["curve"], key=lambda r: r["tail_kl"])
    assert record["best_step"] == best["step"]
    # the stored maps are the best ones: their held-out KL is the curve's minimum (float16 storage)
    stored = _mean_kl(tiny_qwen2, _Maps(tiny_qwen2, 1, new_state), heldout, 8)
    assert stored == pytest.approx(best["tail_kl"], rel=1e-2, abs=1e-4)
    assert best["tail_kl"] <= record["curve"][0]["tail_kl"]
    # the maps moved and lowered the KL they were trained on
    last = _Maps(tiny_qwen2, 1, new_state)
    if record["best_step"] > 0:
        assert _mean_kl(tiny_qwen2, last, train, 8) < before
    else:  # nothing beat least squares on the held-out prompts: the stored maps are the source's
        for key, value in state.items():
            torch.testing.assert_close(new_state[key], value.to(torch.float16))
    assert "x-1" in config["task_ids"]
    assert method.bind(tiny_qwen2).describe() == "distilled"
    assert KVPrefix(predictor=str(tmp_path / "d")).prefill(tiny_qwen2, make_ids(40, 1)).logits.shape == (128,)


def test_distillation_lowers_training_kl(tiny_qwen2, lsq, targets, tmp_path):
    """Selected on the training prompts themselves, 30 steps must beat the least-squares maps."""
    train, _ = targets
    cfg = PrefixDistillation(steps=30, batch=2, lr=3e-3, tail=8, end_share=1.0, eval_every=30)
    _, state, _ = read_checkpoint(lsq)
    before = _mean_kl(tiny_qwen2, _Maps(tiny_qwen2, 1, state), train, 8)
    distill_prefix(tiny_qwen2, lsq, tmp_path / "d", cfg, train, train, progress=False)
    config, new_state, _ = read_checkpoint(tmp_path / "d")
    assert config["distillation"]["best_step"] == 30
    assert _mean_kl(tiny_qwen2, _Maps(tiny_qwen2, 1, new_state), train, 8) < 0.9 * before
    assert all(p.requires_grad for p in tiny_qwen2.parameters())  # the model is left as it was


class _DiesAfter:
    def __init__(self, items, k):
        self.items, self.k, self.calls = items, k, 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        self.calls += 1
        if self.calls > self.k:
            raise KeyboardInterrupt
        return self.items[index]


def test_distillation_resumes_after_a_kill(tiny_qwen2, lsq, targets, tmp_path):
    train, heldout = targets
    cfg = PrefixDistillation(steps=12, batch=1, lr=3e-3, tail=8, eval_every=4)
    distill_prefix(tiny_qwen2, lsq, tmp_path / "whole", cfg, train, heldout, progress=False)
    with pytest.raises(KeyboardInterrupt):
        # 5 reads by the length check (the sequence protocol), then one per step: dies in step 7
        distill_prefix(tiny_qwen2, lsq, tmp_path / "cut", cfg, _DiesAfter(train, 11), heldout, progress=False)
    assert read_checkpoint(tmp_path / "cut")[0]["distillation"]["step"] == 4
    with pytest.raises(ConfigError, match="resume"):
        distill_prefix(tiny_qwen2, lsq, tmp_path / "cut", cfg, train, heldout, progress=False)
    distill_prefix(tiny_qwen2, lsq, tmp_path / "cut", cfg, train, heldout, resume=True, progress=False)
    whole, cut = read_checkpoint(tmp_path / "whole"), read_checkpoint(tmp_path / "cut")
    assert [r["tail_kl"] for r in whole[0]["distillation"]["curve"]] == pytest.approx(
        [r["tail_kl"] for r in cut[0]["distillation"]["curve"]], rel=1e-5)
    for key, value in whole[1].items():
        torch.testing.assert_close(cut[1][key], value)


def test_bad_inputs(tiny_qwen2, lsq, targets, tmp_path, make_ids):
    train, heldout = targets
    for bad in ({"steps": 0}, {"lr": 0.0}, {"tail": 0}, {"end_share": 1.5}, {"batch": 0}):
        with pytest.raises(ConfigError, match="PrefixDistillation"):
            PrefixDistillation(**bad)
    cfg = PrefixDistillation(steps=2, tail=8)
    with pytest.raises(ConfigError, match="must differ"):
        distill_prefix(tiny_qwen2, lsq, lsq, cfg, train, heldout, progress=False)
    with pytest.raises(ConfigError, match="at least one"):
        distill_prefix(tiny_qwen2, lsq, tmp_path / "a", cfg, [], heldout, progress=False)
    with pytest.raises(ConfigError, match="longer than tail=100"):
        distill_prefix(tiny_qwen2, lsq, tmp_path / "b", PrefixDistillation(tail=100), train, heldout,
                       progress=False)
    distill_prefix(tiny_qwen2, lsq, tmp_path / "c", cfg, train, heldout, progress=False)
    with pytest.raises(ConfigError, match="already distilled"):
        distill_prefix(tiny_qwen2, tmp_path / "c", tmp_path / "e", cfg, train, heldout, progress=False)
    full = tmp_path / "l4"
    calibrate_prefix(tiny_qwen2, full, PrefixCalibration(layer=4), corpus=[make_ids(64, 1)], heldout=[], progress=False)
    with pytest.raises(ConfigError, match="no maps to distill"):
        distill_prefix(tiny_qwen2, full, tmp_path / "g", cfg, train, heldout, progress=False)
    with pytest.raises(ConfigError, match="another model|differ|shape"):
        from fastprefill.models.random import random_model
        distill_prefix(random_model("qwen2", seed=5), lsq, tmp_path / "f", cfg, train, heldout, progress=False)


