"""Batched decode: running generations decode together, one forward of the model per step.

The answers of several :class:`~fastprefill.engine.Generation` s (their
:class:`~fastprefill.engine.Branch` es) that decode with the model's own forward
(:class:`~fastprefill.methods.base.ModelDecoder` over an ordinary, not ragged, cache) are stacked
as rows into one batch of **padded** K/V (:func:`fastprefill.cache.pad_caches`): layer ``l`` holds
``(B, H_kv, N_max + s, d)``, row ``i`` left-padded by ``N_max - N_i`` zero keys. Each step feeds
the ``(B, 1)`` last tokens with per-row position ids ``(B, 1)`` (each row's own next position)
and a ``(B, N_max + s + 1)`` attention mask that hides the pads, so each row attends exactly its
own keys, as when it decodes alone, and picks its token from its own ``(V,)`` logits row with its
own sampler (:meth:`fastprefill.sampling.Choice.pick`: its parameters, its seeded generator). The batch is kept across steps while its members stay the
same; when one joins or leaves, every row's K/V is written back into its own cache
(:func:`fastprefill.cache.unpad_row`) and the batch is stacked again. An answer that finishes
writes its row back (before its generation's prefix-cache store). A method with its own decode step (LazyLLM's
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
from fastprefill.engine import Branch, Generation, StreamEvent, TimingWindow
from fastprefill.methods.base import ModelDecoder

__all__ = ["DecodeBatch"]


class DecodeBatch:
    """One decode step for many answers at once (see the module docstring).

    Args:
        model: the model every member runs on.
        max_batch: rows in one forward at most (>= 1; 1 decodes every answer alone).
    """

    def __init__(self, model: PreTrainedModel, max_batch: int = 8) -> None:
        self.model = model
        self.max_batch = max_batch
        self.members: list[Branch] = []
        self._pads: list[int] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # (B, N) long: 1 for a row's keys, 0 for its pads

    @staticmethod
    def batchable(branch: Branch) -> bool:
        """Whether ``branch`` decodes with the model's forward over an ordinary cache (it may join a batch)."""
        return isinstance(branch.decoder, ModelDecoder) and not branch.ragged

    def step(self, gens: Sequence[Generation]) -> list[list[StreamEvent]]:
        """One decode step of every live answer of ``gens`` (prefilled, not finished): batchable
        ones in forwards of at most :attr:`max_batch` rows, the others alone. Returns each
        generation's events (one per answer that stepped), in the order of ``gens``."""
        rows = [b for g in gens for b in g.live]
        together = [b for b in rows if self.batchable(b)][: self.max_batch]
        if len(together) < 2:
            together = []
        if [id(b) for b in together] != [id(b) for b in self.members]:
            self._regroup(together, keep=rows)
        events: dict[int, StreamEvent] = {}
        if together:
            for branch, event in zip(together, self._forward(), strict=True):
                events[id(branch)] = event
        for branch in rows:
            if id(branch) not in events:
                events[id(branch)] = branch.step()
        if any(b.finished for b in self.members):
            left = [b for b in self.members if not b.finished]
            self._regroup(left, keep=left)
        return [[events[id(b)] for b in rows if b.gen is g] for g in gens]

    def release(self) -> None:
        """Write every member's K/V back into its own cache and empty the batch."""
        self._regroup([], keep=self.members)

    def _write_back(self, branch: Branch) -> None:
        if branch in self.members and self._cache is not None:
            row = self.members.index(branch)
            unpad_row(self._cache, row, self._pads[row], branch.decoder.cache)

    def _regroup(self, branches: list[Branch], keep: Sequence[Branch]) -> None:
        """Write back the members that go on (``keep``; a finished one wrote itself back in
        ``on_finish``, a dropped one needs nothing) and stack ``branches`` (two or more) anew."""
        for branch in self.members:
            if not branch.finished and any(branch is k for k in keep):
                self._write_back(branch)
            branch.on_finish = None
        self.members, self._cache, self._mask, self._pads = [], None, None, []
        if len(branches) < 2:
            return
        self._cache, self._pads = pad_caches(self.model.config, [b.decoder.cache for b in branches])
        n = self._cache.get_seq_length()
        self._mask = torch.ones((len(branches), n), dtype=torch.long, device=self.model.device)
        for row, pad in enumerate(self._pads):
            self._mask[row, :pad] = 0
        self.members = list(branches)
        for branch in branches:
            branch.on_finish = (lambda b=branch: self._write_back(b))

    def _forward(self) -> list[StreamEvent]:
        """One forward over the batch: ``(B, 1)`` tokens at each row's own position, each row's
        token picked by its own sampler."""
        rows, device = self.members, self.model.device
        assert self._mask is not None and self._cache is not None
        ids = torch.tensor([[b.last_token] for b in rows], device=device)  # (B, 1)
        positions = torch.tensor([[b.decoder.position] for b in rows], device=device)  # (B, 1)
        mask = torch.cat([self._mask, self._mask.new_ones((len(rows), 1))], dim=1)  # (B, N + 1)
        with torch.inference_mode(), TimingWindow(device) as window:
            out = self.model(input_ids=ids, past_key_values=self._cache, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1].float()  # (B, V)
            plain = [b.choice.sampler.argmax_only for b in rows]
            tops = logits.argmax(dim=-1).tolist() if any(plain) else []  # (B,): the greedy rows' in one read
            for row, branch in enumerate(rows):
                branch.choice.pick(logits[row], tops[row] if plain[row] else None)
        self._mask = mask
        for branch in rows:
            branch.decoder.position += 1
        return [b.gen.accept(b, window.seconds) for b in rows]
