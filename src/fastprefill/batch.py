"""Batched decode: running generations decode together, each decoder layer called once per step.

The answers of several :class:`~fastprefill.engine.Generation` s (their
:class:`~fastprefill.engine.Branch` es) decode together whatever their method, on a model of a
layer-loop family (:data:`~fastprefill.models.adapters.LAYER_LOOP_FAMILIES`): full prefill's
and every other method's that decodes with the model's forward (kvp-prefix, GemFilter), over a
pruned, ragged cache whose layers hold different key sets (static pruning, random drop,
LazyLLM with ``revival=none``) or with the method's own step (LazyLLM's revival: ``all``,
``budget:R``, ``catch-up``). Each answer's decoder gives its step a layer at a time
(:class:`~fastprefill.methods.layer_steps.StepsDecoder`) and
:func:`~fastprefill.methods.layer_steps.run_layers` runs every answer's rows of a layer in one
call of that layer: the projections and MLP over all the rows at once, attention apart for each
stream over its own cache, with that stream's own per-layer K/V length, mask and scores (a
LazyLLM step's revived rows and selection included), so each stream's keys are exactly those it
attends alone, nothing is padded and nothing is copied when a stream joins or leaves. Each
answer picks its token from its own ``(V,)`` logits row with its own sampler
(:meth:`fastprefill.sampling.Choice.pick`: its parameters, its seeded generator).

On a model of another family (only full prefill and methods without their own layer loop run
there) the answers that decode with the model's forward over an ordinary cache are stacked as
rows into one batch of **padded** K/V (:func:`fastprefill.cache.pad_caches`): layer ``l`` holds
``(B, H_kv, N_max + s, d)``, row ``i`` left-padded by ``N_max - N_i`` zero keys; each step feeds
``(B, 1)`` tokens at per-row positions with a ``(B, N_max + s + 1)`` attention mask that hides
the pads. That batch is kept across steps while its members stay the same; when one joins or
leaves, every row's K/V is written back into its own cache (:func:`fastprefill.cache.unpad_row`)
and the batch is stacked again; an answer that finishes writes its row back (before its
generation's prefix-cache store).

A chunk of a prompt's prefill (full prefill's, a layer at a time) can carry one decode step in
its layer calls (:meth:`DecodeBatch.mixed`): its rows are one more group over its own cache.

Exactness: a stream's attention is its own computation in either path, and every other
operation is row by row, so in float32 the tokens equal decoding each stream alone (the tests
assert it for a batch mixing every method); in bfloat16 a matrix product over more rows may
round differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from fastprefill.cache import pad_caches, unpad_row
from fastprefill.engine import Branch, Generation, StreamEvent, TimingWindow
from fastprefill.errors import UnsupportedModelError
from fastprefill.methods.base import ModelDecoder
from fastprefill.methods.layer_steps import StepsDecoder, run_layers
from fastprefill.models.adapters import DecoderAdapter, supports_layer_loop

__all__ = ["DecodeBatch"]


class DecodeBatch:
    """One decode step for many answers at once (see the module docstring).

    Args:
        model: the model every member runs on.
        max_batch: rows in one step at most (>= 1; 1 decodes every answer alone).

    Attributes:
        members: the answers of the last batched step that are still decoding (``[]`` when the
            last step decoded every answer alone).
    """

    def __init__(self, model: PreTrainedModel, max_batch: int = 8) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        #: the layer loop every answer's rows run through (None: another family, padded K/V)
        self.adapter = DecoderAdapter(model) if supports_layer_loop(model.config) else None
        self.members: list[Branch] = []
        self._pads: list[int] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # (B, N) long: 1 for a row's keys, 0 for its pads

    def batchable(self, branch: Branch) -> bool:
        """Whether ``branch`` may decode in this batch: on a layer-loop family, any answer of this
        model whose decoder gives its step a layer at a time (every method's); elsewhere one that
        decodes with the model's forward over an ordinary cache."""
        if branch.gen.model is not self.model:
            return False
        if self.adapter is not None:
            return isinstance(branch.decoder, StepsDecoder)
        return isinstance(branch.decoder, ModelDecoder) and not branch.ragged

    def step(self, gens: Sequence[Generation]) -> list[list[StreamEvent]]:
        """One decode step of every live answer of ``gens`` (prefilled, not finished): batchable
        ones in steps of at most :attr:`max_batch` rows, the others alone. Returns each
        generation's events (one per answer that stepped), in the order of ``gens``."""
        rows = [b for g in gens for b in g.live]
        together = [b for b in rows if self.batchable(b)][: self.max_batch]
        if len(together) < 2:
            together = []
        events: dict[int, StreamEvent] = {}
        if self.adapter is not None:
            if together:
                events.update(zip(map(id, together), self._routed(together), strict=True))
            self.members = [b for b in together if not b.finished]
        else:
            if [id(b) for b in together] != [id(b) for b in self.members]:
                self._regroup(together, keep=rows)
            if together:
                events.update(zip(map(id, together), self._forward(), strict=True))
        out = self._rest_alone(gens, rows, events)
        if self.adapter is None and any(b.finished for b in self.members):
            left = [b for b in self.members if not b.finished]
            self._regroup(left, keep=left)
        return out

    def mixed(self, gens: Sequence[Generation], prefill: Generation,
              budget: int | None) -> tuple[int, list[list[StreamEvent]]]:
        """One unit of ``prefill``'s prompt (at most ``budget`` tokens:
        :meth:`~fastprefill.engine.Generation.prefill_steps`) with one decode step of every live
        answer of ``gens`` riding in its layer calls (a mixed batch, as vLLM's chunked prefill and
        Sarathi-Serve run one): each decoder layer is called once on the prompt's rows and every
        answer's row, attention apart for each over its own cache, so the decode step costs the
        chunk only its extra rows, not a pass over the weights of its own. Answers that are not
        :meth:`batchable`, or past :attr:`max_batch`, step alone after it.

        Returns:
            The prompt tokens the unit computed, and each generation's events in the order of
            ``gens`` (the step's seconds, the chunk's included, on each).

        Raises:
            UnsupportedModelError: the model runs no layer loop, or the prefill's method does not
                prefill a layer at a time (nothing has run).
        """
        if self.adapter is None:
            raise UnsupportedModelError(f"{type(self.model).__name__} runs no layer loop: no mixed batches")
        rows = [b for g in gens for b in g.live]
        together = [b for b in rows if self.batchable(b)][: self.max_batch]
        unit = prefill.prefill_steps(budget)
        steps = [unit.steps, *(b.decoder.layer_steps(b.last_token) for b in together)]  # type: ignore[attr-defined]
        with torch.inference_mode(), TimingWindow(self.model.device) as window:
            logits = run_layers(self.adapter, steps).float()  # (1 + B, V): the prompt's last row, then the answers'
            self._pick(together, logits[1:])
        events = {id(b): b.gen.accept(b, window.seconds) for b in together}
        with torch.inference_mode():
            ran = unit.finish(logits[0])
        self.members = [b for b in together if not b.finished]
        return ran, self._rest_alone(gens, rows, events)

    @staticmethod
    def _rest_alone(gens: Sequence[Generation], rows: list[Branch],
                    events: dict[int, StreamEvent]) -> list[list[StreamEvent]]:
        """Step alone each of ``rows`` (the live answers of ``gens``) that has no event in
        ``events`` yet; then each generation's events, in the order of ``gens``."""
        for branch in rows:
            if id(branch) not in events:
                events[id(branch)] = branch.step()
        return [[events[id(b)] for b in rows if b.gen is g] for g in gens]

    def _routed(self, rows: list[Branch]) -> list[StreamEvent]:
        """One step of ``rows`` (two or more) on the layer loop: each decoder layer called once on
        every row's rows, each answer's token picked from its own logits row."""
        assert self.adapter is not None
        steps = [b.decoder.layer_steps(b.last_token) for b in rows]  # type: ignore[attr-defined]
        with torch.inference_mode(), TimingWindow(self.model.device) as window:
            logits = run_layers(self.adapter, steps).float()  # (B, V)
            self._pick(rows, logits)
        return [b.gen.accept(b, window.seconds) for b in rows]

    @staticmethod
    def _pick(rows: Sequence[Branch], logits: torch.Tensor) -> None:
        """Each row's token from its ``(V,)`` row of ``logits`` ``(B, V)`` by its own sampler; the
        greedy rows' read from the device at once."""
        plain = [b.choice.sampler.argmax_only for b in rows]
        tops = logits.argmax(dim=-1).tolist() if any(plain) else []  # (B,): the greedy rows' in one read
        for row, branch in enumerate(rows):
            branch.choice.pick(logits[row], tops[row] if plain[row] else None)

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
            self._pick(rows, out.logits[:, -1].float())  # (B, V)
        self._mask = mask
        for branch in rows:
            branch.decoder.position += 1
        return [b.gen.accept(b, window.seconds) for b in rows]
