"""Token positions of character spans of a built prompt (the tokens a task calls gold).

The prompt is tokenised again with offsets, the way :class:`~fastprefill.data.tasks.sizing.Encoder`
tokenised it (``add_special_tokens`` only without a chat template), and must give back the
sample's ids. A token belongs to a span when its characters overlap it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastprefill.data.tasks.base import Sample
from fastprefill.data.tasks.sizing import Encoder
from fastprefill.errors import ConfigError

__all__ = ["span_of", "token_positions_in_spans"]


def span_of(sample: Sample, text: str) -> tuple[int, int]:
    """The character span ``[start, end)`` of ``text``'s one occurrence in ``sample.prompt``.

    Raises:
        ConfigError: ``text`` does not occur in the prompt exactly once.
    """
    start = sample.prompt.find(text)
    if start < 0 or sample.prompt.find(text, start + 1) >= 0:
        found = "not found" if start < 0 else "found more than once"
        raise ConfigError(f"sample {sample.id!r}: gold text {text[:40]!r}... {found} in the prompt")
    return start, start + len(text)


def token_positions_in_spans(sample: Sample, tokenizer: Any, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Ascending positions ``(G,)`` int64 of the prompt tokens that overlap any character span.

    Args:
        sample: a built sample (``prompt`` and the ``input_ids`` made from it).
        tokenizer: the fast tokenizer that built the sample (offsets needed).
        spans: ``[start, end)`` character spans of ``sample.prompt``.

    Raises:
        ConfigError: a tokenizer without offsets, or one that does not give back the sample's ids.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError("gold token positions need a fast tokenizer (character offsets)")
    enc = tokenizer(sample.prompt, add_special_tokens=not Encoder(tokenizer).chat, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(sample.input_ids):
        raise ConfigError(f"sample {sample.id!r}: this tokenizer does not give back the sample's ids; "
                          "use the tokenizer the sample was built with")
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)  # (T, 2)
    inside = torch.zeros(offsets.shape[0], dtype=torch.bool)
    for start, end in spans:
        inside |= (offsets[:, 1] > start) & (offsets[:, 0] < end) & (offsets[:, 1] > offsets[:, 0])
    return inside.nonzero().flatten()
