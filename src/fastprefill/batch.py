"""Batched decode: running generations decode together, one forward of the model per step.

Several :class:`~fastprefill.engine.Generation` s that decode with the model's own forward
(:class:`~fastprefill.methods.base.ModelDecoder` over an ordinary, not ragged, cache) are stacked
into one batch of **padded** K/V (:func:`fastprefill.cache.pad_caches`): layer ``l`` holds
``(B, H_kv, N_max + s, d)``, row ``i`` left-padded by ``N_max - N_i`` zero keys. Each step feeds
the ``(B, 1)`` last tokens with per-row position ids ``(B, 1)`` (each row's own next position)
and a ``(B, N_max + s + 1)`` attention mask that hides the pads, so each row attends exactly its
own keys, as when it decodes alone. The batch is kept across steps while its members stay the
same; when one joins or leaves, every row's K/V is written back into its own cache
(:func:`fastprefill.cache.unpad_row`) and the batch is stacked again. A generation that finishes
writes its row back before its prefix-cache store. A method with its own decode step (LazyLLM's
revival) or a ragged cache (pruned layers) decodes alone, one forward per step.

Padded rather than ragged: a ragged batch (one flat key list per layer with per-row offsets)
needs an attention kernel that takes offsets; the padded batch runs the model's own forward and
attention function unchanged. Exactness: the pads' keys are masked to weight zero, so each row
is its own computation; in float32 the tokens equal decoding each row alone (the tests assert
it), in bfloat16 a batched matrix product may round differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from fastprefill.cache import pad_caches, unpad_row
from fastprefill.engine import Generation, StreamEvent, TimingWindow
from fastprefill.methods.base import ModelDecoder

__all__ = ["DecodeBatch"]


class DecodeBatch:
    """One decode step for many generations at once (see the module docstring).

    Args:
        model: the model every member runs on.
        max_batch: rows in one forward at most (>= 1; 1 decodes every generation alone).
    """

    def __init__(self, model: PreTrainedModel, max_batch: int = 8) -> None:
        self.model = model
        self.max_batch = max_batch
        self.members: list[Generation] = []
        self._pads: list[int] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # (B, N) long: 1 for a row's keys, 0 for its pads

    @staticmethod
    def batchable(gen: Generation) -> bool:
        """Whether ``gen`` decodes with the model's forward over an ordinary cache (it may join a batch)."""
        return isinstance(gen.decoder, ModelDecoder) and gen.out is not None and not gen.out.ragged

    def step(self, gens: Sequence[Generation]) -> list[StreamEvent]:
        """One decode step of every generation in ``gens`` (prefilled, not finished): batchable
        ones in forwards of at most :attr:`max_batch` rows, the others alone. Returns their
        events in the order of ``gens``."""
        together = [g for g in gens if self.batchable(g)][: self.max_batch]
        if len(together) < 2:
            together = []
        if [id(g) for g in together] != [id(g) for g in self.members]:
            self._regroup(together, keep=gens)
        events: dict[int, StreamEvent] = {}
        if together:
            for gen, event in zip(together, self._forward(), strict=True):
                events[id(gen)] = event
        for gen in gens:
            if id(gen) not in events:
                events[id(gen)] = gen.step()
        if any(g.finished for g in self.members):
            left = [g for g in self.members if not g.finished]
            self._regroup(left, keep=left)
        return [events[id(g)] for g in gens]

    def release(self) -> None:
        """Write every member's K/V back into its own cache and empty the batch."""
        self._regroup([], keep=self.members)

    def _write_back(self, gen: Generation) -> None:
        if gen in self.members and self._cache is not None:
            row = self.members.index(gen)
            assert gen.out is not None
            unpad_row(self._cache, row, self._pads[row], gen.out.cache)

    def _regroup(self, gens: list[Generation], keep: Sequence[Generation]) -> None:
        """Write back the members that go on (``keep``; a finished one wrote itself back in
        ``on_finish``, a dropped one needs nothing) and stack ``gens`` (two or more) anew."""
        for gen in self.members:
            if not gen.finished and any(gen is k for k in keep):
                self._write_back(gen)
            gen.on_finish = None
        self.members, self._cache, self._mask, self._pads = [], None, None, []
        if len(gens) < 2:
            return
        caches = [g.out.cache for g in gens if g.out is not None]
        self._cache, self._pads = pad_caches(self.model.config, caches)
        n = self._cache.get_seq_length()
        self._mask = torch.ones((len(gens), n), dtype=torch.long, device=self.model.device)
        for row, pad in enumerate(self._pads):
            self._mask[row, :pad] = 0
        self.members = list(gens)
        for gen in gens:
            gen.on_finish = (lambda g=gen: self._write_back(g))

    def _forward(self) -> list[StreamEvent]:
        """One forward over the batch: ``(B, 1)`` tokens at each row's own position."""
        gens, device = self.members, self.model.device
        assert self._mask is not None and self._cache is not None
        ids = torch.tensor([[g.last_token] for g in gens], device=device)  # (B, 1)
        positions = torch.tensor([[g.decoder.position] for g in gens], device=device)  # (B, 1)
        mask = torch.cat([self._mask, self._mask.new_ones((len(gens), 1))], dim=1)  # (B, N + 1)
        with torch.inference_mode(), TimingWindow(device) as window:
            out = self.model(input_ids=ids, past_key_values=self._cache, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            tokens = torch.argmax(out.logits[:, -1].float(), dim=-1).tolist()  # (B,)
        self._mask = mask
        for gen in gens:
            gen.decoder.position += 1
        return [gen.accept(int(token), window.seconds) for gen, token in zip(gens, tokens, strict=True)]
