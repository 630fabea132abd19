"""Helpers shared by the KV Prediction tests of unit/ and integration/: the identity method and
its comparison with full prefill, a byte-level tokenizer stand-in and a tiny training run (also
run in a child process that the test kills)."""

from __future__ import annotations

import copy

import torch

from fastprefill.engine import decoder_for
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction import AuxSpec, KVPrediction, KVPredictor
from fastprefill.methods.kv_prediction.auxiliary.train import TrainConfig, train_kvp
from fastprefill.models.shape import ModelShape
from tests import random_ids


def identity_predictor(shape: ModelShape) -> KVPredictor:
    """Identity maps between two models of the same ``shape`` (the corenet identity check)."""
    pred = KVPredictor(shape, shape, layer_map=tuple(range(shape.num_layers)))
    with torch.no_grad():
        for lin in [*pred.k_maps, *pred.v_maps]:
            lin.weight.copy_(torch.eye(pred.out_features))
            lin.bias.zero_()
    return pred


def identity_method(model) -> KVPrediction:
    aux = copy.deepcopy(model)
    return KVPrediction(identity_predictor(ModelShape.from_config(model.config)), AuxSpec.model("copy"), aux)


def compare_with_full(model, method, ids, steps=8, atol=1e-5):
    got, want = method.prefill(model, ids), FullPrefill().prefill(model, ids)
    torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=0)
    tok = int(want.logits.argmax())
    got_decoder, want_decoder = decoder_for(model, got), decoder_for(model, want)
    with torch.no_grad():
        for _ in range(steps):
            a, b = got_decoder.step(tok), want_decoder.step(tok)
            torch.testing.assert_close(a, b, atol=atol, rtol=0)
            tok = int(b.argmax())
    return got


class ByteTokenizer:
    """Minimal tokenizer stand-in for the checks (vocab + encode)."""

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift

    def __len__(self) -> int:
        return 128

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): (i + self.shift) % 128 for i in range(128)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [(ord(c) + self.shift) % 128 for c in text]


def train_tiny(base, out, steps=4, resume=False, aux=None, **kw):
    """Train a KV predictor for ``base`` into ``out`` on six random sequences (a checkpoint every
    2 steps); ``aux`` defaults to ``base`` without two layers."""
    corpus = [random_ids(32, 200 + s) for s in range(6)]
    cfg = TrainConfig(lsq_tokens=6 * 32, steps=steps, seq_len=32, lr=1e-3, checkpoint_every=2)
    return train_kvp(base, aux or AuxSpec.layer_drop(2), out, tokenizer=ByteTokenizer(), base_name="tiny",
                     config=cfg, corpus=corpus, resume=resume, progress=False, **kw)
