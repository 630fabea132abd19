"""Every method's streams in one decode batch on the real SmolLM2-135M as the server loads it
(float32, its linear layers packed, fastprefill's attention forward): each stream's tokens equal
its tokens decoded alone (the tiny models' version is ``tests/unit/test_batch_methods.py``)."""

from __future__ import annotations

import torch

from fastprefill.batch import DecodeBatch
from tests.unit.test_batch_methods import _alone, _prefilled

#: (method spec, prompt length, new tokens)
CASES = (
    ("full", 23, 8),
    ("lazyllm:preset=default,revival=all", 61, 6),
    ("lazyllm:preset=default,revival=none", 50, 9),
    ("lazyllm:preset=default,revival=catch-up", 44, 7),
    ("lazyllm:preset=default,revival=budget:2", 57, 8),
    ("static:keep=0.5,select_layer=4", 29, 8),
    ("gemfilter:keep=0.5", 38, 7),
    ("kvp-prefix:layer=8", 27, 6),
)


def _ids(n: int, seed: int) -> torch.Tensor:
    """``(1, n)`` ids below 5000 (ordinary tokens of SmolLM2's vocabulary), seeded."""
    return torch.randint(0, 5000, (1, n), generator=torch.Generator().manual_seed(seed))


def test_every_methods_streams_decode_together_with_their_tokens_alone(smollm2):
    model, _ = smollm2
    want = _alone(model, _ids, CASES)
    gens = _prefilled(model, _ids, CASES)
    batch, widest = DecodeBatch(model, max_batch=len(CASES)), 0
    while live := [g for g in gens if not g.finished]:
        batch.step(live)
        widest = max(widest, len(batch.members))
    assert widest == len(CASES)
    assert dict(zip([c[0] for c in CASES], [g.choices[0].ids for g in gens], strict=True)) == dict(
        zip([c[0] for c in CASES], want, strict=True))
