"""The test suite, in three groups (docs/architecture.md, "How the tests are grouped"):

- ``unit/``: no real model (random tiny models, pure logic);
- ``integration/``: the real smollm2-135m, servers, child processes and torchrun ranks;
- ``meta/``: the repository itself (import layers, docstrings, the README, committed figures,
  result names).

Shared fixtures are in ``conftest.py``; helpers that several test files use are modules of this
package (``kvp_helpers``, ``blend_helpers``, ``integration/serving``), imported as
``tests.<module>``, and :func:`random_ids` here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The repository's root folder.
REPO = Path(__file__).resolve().parents[1]


def random_ids(n: int, seed: int, vocab: int = 128) -> torch.Tensor:
    """``(1, n)`` int64 token ids drawn uniformly from ``[0, vocab)`` by a generator seeded with
    ``seed`` (the same ids on every machine): prompts for the random models
    (:mod:`fastprefill.models.random`, vocabulary 128)."""
    import torch

    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
