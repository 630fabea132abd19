"""Prompts of random token ids, for benchmarks that time a method on no task."""

from __future__ import annotations

import torch

from fastprefill.bench.runner import PromptSample
from fastprefill.errors import ConfigError


def random_samples(vocab: int, length: int, n: int, seed: int, low: int = 100) -> list[PromptSample]:
    """``n`` prompts of ``length`` token ids drawn uniformly from ``[low, vocab)`` (seeded)."""
    if not 0 <= low < vocab:
        raise ConfigError(f"random_samples: low must lie in [0, vocab={vocab}), got {low}")
    gen = torch.Generator().manual_seed(seed)
    return [PromptSample(str(i), torch.randint(low, vocab, (length,), generator=gen).tolist()) for i in range(n)]
