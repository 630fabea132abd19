"""Blending: reuse each passage's K/V wherever it appears, and recompute a few tokens (CacheBlend, EPIC).

A retrieval prompt is a *lead* (the chat template's system turn, the instructions), passages
and a question. The prefix cache serves only an exact prefix; the same passages in another
order are a full prefill. ``blend`` reuses each passage's K/V from a
:class:`~fastprefill.chunk_store.ChunkStore` (computed once, on the first prompt that had it),
placed at its new position, and recomputes a chosen share of the passages' tokens so that they
attend across the passages again. The caller names the passages (:meth:`Blend.with_chunks`, or
a :class:`~fastprefill.prompt.ChunkedPrompt`): boundaries are never guessed.

**Prefill, in order** (everything inside TTFT):

1. The lead (the tokens before the first passage) is prefilled exactly, by the model's own
   forward (over a cached prefix, when the engine's prefix cache gave one).
2. Each passage's K/V comes from the store, or is computed and stored: alone from position 0
   (``anchor=zero``) or after the lead (``anchor=lead``, the default; the tokens before the
   first passage the request declared, whatever a prefix cache served: the passage then never
   becomes a spurious attention sink, and the first passage sits exactly where it was
   computed, so it is exact). Its keys are rotated by the position delta
   (:meth:`~fastprefill.models.adapters.DecoderAdapter.shift_keys`; exact for the supported
   rotary types) into one dense cache of the whole prompt (:class:`~fastprefill.cache.DenseKVCache`).
3. A policy scores the reusable passage tokens (those not exact) and the top ``budget`` share
   is selected:

   - ``deviation`` (CacheBlend): every token runs the layers below ``check_layer`` (default 1),
     then its K/V at ``check_layer`` is projected and compared with the reused K/V
     (squared distance, keys and values each over their mean squared norm); the tokens that
     differ most are selected, and every token's K/V at ``check_layer`` is refreshed.
   - ``head`` (EPIC): the first tokens of every passage, where a passage computed alone forms
     its own attention sink (a round robin over offsets: offset 0 of each passage first).
   - ``attention``: the glue and the question run layers ``0..check_layer`` (default a quarter
     of the depth) over the reused K/V, and the question's last ``window`` queries' attention
     to each passage token is its score (as LazyLLM scores). This probe is thrown away.

4. The glue between passages, the question after the last one and the selected tokens run
   every remaining layer over the dense cache (a mask by position); the question's last token
   gives the first token's logits. The other passage tokens keep their reused K/V.

``budget=0`` is plain reuse without recompute (the floor; no probe runs); ``budget=1`` recomputes
every token and equals full prefill to float rounding. Token-layers count every row run
through a layer: the lead, the passages computed on a store miss, the probe and the recompute
(``extra`` splits them, with the selection's own seconds).

Chosen beyond the papers: CacheBlend narrows its selection over several layers; here one
selection at one check layer. EPIC recomputes a fixed count per passage; here ``budget`` sets it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.cache import DenseKVCache, layer_kv, wrap_dynamic_cache
from fastprefill.chunk_store import ChunkEntry, ChunkStore, anchor_digest
from fastprefill.errors import ConfigError, UnsupportedModelError, check_fields, is_int, is_number
from fastprefill.host import device_clock
from fastprefill.methods.base import ComputeStats, Method, PrefillOutput, prefix_length
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.pruning.scorers import AttentionScorer
from fastprefill.models.adapters import DecoderAdapter, rope_type, supports_key_shift, supports_layer_loop
from fastprefill.models.attention import causal_mask, fastprefill_attention
from fastprefill.models.kv import rotate_keys
from fastprefill.models.shape import ModelShape, causal_pairs

__all__ = ["ANCHORS", "POLICIES", "Blend"]

POLICIES: tuple[str, ...] = ("deviation", "head", "attention")
ANCHORS: tuple[str, ...] = ("lead", "zero")


@dataclass
class _Chunk:
    """One reused passage: its span ``[start, end)`` in the prompt and its placed K/V."""

    start: int
    end: int
    entry: ChunkEntry
    hit: bool

    @property
    def exact(self) -> bool:
        """Placed where it was computed, after the same anchor: its K/V is full prefill's."""
        return self.entry.start == self.start


@dataclass
class _Count:
    """Rows run through layers, and their FLOPs, as the prefill goes."""

    shape: ModelShape
    token_layers: int = 0
    flops: float = 0.0

    def add(self, rows: int, layers: int, pairs_per_layer: int) -> None:
        self.token_layers += rows * layers
        self.flops += layers * self.shape.layer_flops(rows, pairs_per_layer)


@dataclass
class Blend(Method):
    """Reuse cached passages at new positions, recomputing a ``budget`` share of their tokens.

    Args:
        policy: which tokens to recompute: ``deviation``, ``head`` or ``attention`` (module docstring).
        budget: the share of the reused passage tokens recomputed, in ``[0, 1]``.
        check_layer: the layer a ``deviation`` or ``attention`` selection reads (``None``: 1 for
            ``deviation``, a quarter of the depth for ``attention``); below the model's depth.
        anchor: what a passage's K/V is computed after: ``lead`` or ``zero`` (nothing).
        window: the question's last query rows the ``attention`` policy reads (>= 1).
        store_mb: the bound in MiB of the store made when none is given (>= 1).
        store: the :class:`~fastprefill.chunk_store.ChunkStore` to reuse passages from and fill
            (not a spec option: share one across methods and requests).
        chunks: the passages' ``[start, end)`` spans (set by :meth:`with_chunks`; none: the whole
            prompt is prefilled as full prefill does).
    """

    name: ClassVar[str] = "blend"
    layer_loop: ClassVar[bool] = True
    takes_prefix: ClassVar[bool] = True

    policy: str = "deviation"
    budget: float = 0.15
    check_layer: int | None = None
    anchor: str = "lead"
    window: int = 32
    store_mb: int = 1024
    store: ChunkStore | None = field(default=None, repr=False, compare=False, metadata={"spec": False})
    chunks: tuple[tuple[int, int], ...] = field(default=(), metadata={"spec": False})

    def __post_init__(self) -> None:
        check_fields(self, [
            ("policy", self.policy in POLICIES, f"one of {list(POLICIES)}"),
            ("budget", is_number(self.budget) and 0.0 <= self.budget <= 1.0, "a number in [0, 1]"),
            ("check_layer", self.check_layer is None or is_int(self.check_layer, 1), "an integer >= 1 (or None)"),
            ("anchor", self.anchor in ANCHORS, f"one of {list(ANCHORS)}"),
            ("window", is_int(self.window, 1), "an integer >= 1"),
            ("store_mb", is_int(self.store_mb, 1), "an integer number of MiB >= 1"),
            ("store", self.store is None or isinstance(self.store, ChunkStore), "a ChunkStore (or None)"),
        ])
        self.chunks = _checked_spans(self.chunks)
        if self.store is None:
            self.store = ChunkStore(self.store_mb << 20)

    # --- capability and validation -----------------------------------------------------------
    @classmethod
    def supports(cls, config: Any) -> bool:
        return supports_key_shift(config)

    @classmethod
    def check_model(cls, model: PreTrainedModel) -> None:  # type: ignore[override]
        if not supports_layer_loop(model.config):
            super().check_model(model)  # the families' message
        if not cls.supports(model.config):
            raise UnsupportedModelError(
                f"blend moves cached keys to new positions, exact only for rotary types without length-dependent "
                f"scaling; this model's is {rope_type(model.config)!r}: use full prefill or the prefix cache")

    def check_prompt(self, model: PreTrainedModel, prompt_len: int) -> None:
        if self.chunks and self.chunks[-1][1] >= prompt_len:
            raise ConfigError(f"blend: the last passage ends at token {self.chunks[-1][1]} of a {prompt_len}-token "
                              "prompt; the question after the last passage must hold at least one token")
        layers = ModelShape.from_config(model.config).num_layers
        if self.check_layer is not None and self.check_layer >= layers:
            raise ConfigError(f"Blend.check_layer must be below the model's {layers} layers, got {self.check_layer}")

    def with_chunks(self, chunks: Sequence[tuple[int, int]]) -> Blend:
        """A copy bound to a prompt's passages (``[start, end)`` spans, increasing, not overlapping).

        Raises:
            ConfigError: no passage, or spans that are not increasing non-empty ranges.
        """
        if not len(chunks):
            raise ConfigError("blend needs at least one passage: give the prompt's passages as a non-empty list")
        return dataclasses.replace(self, chunks=tuple((int(s), int(e)) for s, e in chunks))

    def describe(self) -> str:
        check = "" if self.check_layer is None else f",check_layer={self.check_layer}"
        return f"blend:policy={self.policy},budget={self.budget:g},anchor={self.anchor}{check}"

    # --- prefill -------------------------------------------------------------------------------
    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        n, p = int(input_ids.shape[1]), prefix_length(prefix)
        self.check_prompt(model, n)
        spans = [(s, e) for s, e in self.chunks if s >= p]  # a passage the prefix reaches is computed as it is
        if not spans:
            out = FullPrefill().prefill(model, input_ids, prefix)
            out.stats.extra.update({"policy": self.policy, "chunks": 0})
            return out
        ad = DecoderAdapter(model, self.name)
        count = _Count(ad.shape)
        started = device_clock(ad.device)
        lead = _lead(model, input_ids, spans[0][0], prefix, count)
        chunks = self._fetch(model, input_ids, spans, lead, count)
        cache = _assemble(ad, n, lead, chunks)
        assembled = device_clock(ad.device)
        exact = chunks[0].exact  # only the first passage can sit where it was computed
        reused = chunks[1:] if exact else chunks
        dev = ad.device  # every index on the model's device
        held = torch.zeros(n, dtype=torch.bool, device=dev)
        held[: chunks[0].end if exact else chunks[0].start] = True
        candidates = torch.cat([torch.arange(c.start, c.end, device=dev) for c in reused]
                               or [torch.empty(0, dtype=torch.long, device=dev)])
        held[candidates] = True
        fresh = torch.nonzero(~held).reshape(-1)  # the glue and the question: computed at every layer
        k = round(self.budget * candidates.numel())
        with ad.attention_scope():
            selected, start_layer, probe, select_s = self._select(ad, input_ids, cache, fresh, candidates, reused, k,
                                                                  count)
            rows = torch.sort(torch.cat([fresh, selected])).values
            logits = _run_rows(ad, input_ids, cache, rows, start_layer, probe, count)
        done = device_clock(ad.device)
        return PrefillOutput(
            logits=logits, cache=cache.to_dynamic_cache(model.config),
            stats=ComputeStats(
                token_layers=count.token_layers, total_token_layers=n * ad.num_layers,
                flops=count.flops + ad.shape.head_flops(1),
                extra={"policy": self.policy, "budget": self.budget, "anchor": self.anchor,
                       "chunks": len(chunks), "chunk_hits": sum(c.hit for c in chunks),
                       "chunk_misses": sum(not c.hit for c in chunks), "reused_tokens": int(candidates.numel()),
                       "exact_chunk_tokens": chunks[0].end - chunks[0].start if exact else 0, "selected_tokens": k,
                       "fresh_tokens": int(fresh.numel()), "assemble_s": assembled - started,
                       "select_s": select_s, "recompute_s": done - assembled - select_s}),
            next_position=n, exact_tokens=chunks[0].end if exact else chunks[0].start)

    def _fetch(self, model: PreTrainedModel, ids: torch.Tensor, spans: list[tuple[int, int]],
               lead: DynamicCache | None, count: _Count) -> list[_Chunk]:
        """Each passage's K/V from the store, or computed (after the anchor) and stored."""
        assert self.store is not None
        size = self.chunks[0][0] if self.anchor == "lead" else 0  # the lead: before the first declared passage
        anchor = anchor_digest(ids[0, :size].tolist())
        out = []
        for s, e in spans:
            tokens = ids[0, s:e].tolist()
            entry = self.store.get_chunk(model, tokens, anchor)
            hit = entry is not None
            if entry is None:
                entry = _compute_chunk(model, ids[:, s:e], lead, size, count)
                self.store.put_chunk(model, tokens, anchor, entry)
            out.append(_Chunk(s, e, entry, hit))
        return out

    def _select(self, ad: DecoderAdapter, ids: torch.Tensor, cache: DenseKVCache, fresh: torch.Tensor,
                candidates: torch.Tensor, chunks: list[_Chunk], k: int, count: _Count,
                ) -> tuple[torch.Tensor, int, torch.Tensor | None, float]:
        """The ``k`` selected positions, the layer the recompute starts at, the hidden states the
        probe left for it (``None``: start from the embeddings) and the selection's seconds."""
        t0 = device_clock(ad.device)
        if k == 0 or k >= candidates.numel():  # the floor, or everything: nothing to score
            return (candidates if k else candidates[:0]), 0, None, 0.0
        probe: torch.Tensor | None = None
        start = 0
        if self.policy == "head":  # a round robin over offsets: offset 0 of every passage first
            offsets = torch.cat([torch.arange(c.end - c.start, device=ad.device) for c in chunks])
            chunk_of = torch.cat([torch.full((c.end - c.start,), i, device=ad.device) for i, c in enumerate(chunks)])
            scores = -(offsets * len(chunks) + chunk_of).double()
        elif self.policy == "deviation":
            layer = self.check_layer or 1
            scores, probe = _deviation(ad, ids, cache, fresh, candidates, layer, count)
            start = layer
        else:
            layer = self.check_layer or max(1, ad.num_layers // 4)
            scores = _attention(ad, ids, cache, fresh, candidates, layer, self.window, count)
        selected = torch.sort(candidates[torch.topk(scores, k).indices]).values
        if probe is not None:  # the probe ran fresh and candidate rows: keep those the recompute runs
            rows = torch.sort(torch.cat([fresh, candidates])).values
            keep = torch.isin(rows, torch.cat([fresh, selected]))
            probe = probe[:, keep]
        return selected, start, probe, device_clock(ad.device) - t0


def _checked_spans(chunks: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out = []
    last = 0
    for item in chunks:
        if len(item) != 2 or not (is_int(item[0], 0) and is_int(item[1], 1)) or item[0] >= item[1] or item[0] < last:
            raise ConfigError(f"Blend.chunks must be increasing, non-overlapping [start, end) spans with start < end, "
                              f"got {item!r} in {tuple(chunks)!r}")
        last = item[1]
        out.append((int(item[0]), int(item[1])))
    return tuple(out)


def _lead(model: PreTrainedModel, ids: torch.Tensor, s0: int, prefix: DynamicCache | None,
          count: _Count) -> DynamicCache | None:
    """The exact K/V of positions ``0..s0-1`` (the model's own forward over the cached prefix), or
    ``None`` when the first passage starts the prompt."""
    p = prefix_length(prefix)
    if s0 == p:
        return prefix
    cache = prefix if prefix is not None else DynamicCache(config=model.config)
    with fastprefill_attention(model) if p else contextlib.nullcontext():
        model.model(input_ids=ids[:, p:s0], past_key_values=cache, use_cache=True)
    count.add(s0 - p, count.shape.num_layers, (s0 - p) * p + causal_pairs(s0 - p))
    return cache


def _compute_chunk(model: PreTrainedModel, chunk_ids: torch.Tensor, lead: DynamicCache | None, s: int,
                   count: _Count) -> ChunkEntry:
    """A passage's K/V ``(2, L, H_kv, m, d)`` computed after the first ``s`` positions of ``lead``
    (``s = 0``: alone from position 0)."""
    layers = count.shape.num_layers
    m = int(chunk_ids.shape[1])
    if lead is None or s == 0:
        cache = DynamicCache(config=model.config)
    else:  # views of the lead's tensors, which the forward's concatenation leaves as they are
        cache = wrap_dynamic_cache(model.config, [(k[:, :, :s], v[:, :, :s])
                                                  for k, v in (layer_kv(lead, i) for i in range(layers))])
    with fastprefill_attention(model) if s else contextlib.nullcontext():
        model.model(input_ids=chunk_ids, past_key_values=cache, use_cache=True)
    kv = [layer_kv(cache, i) for i in range(layers)]
    keys = torch.stack([k[0, :, s:] for k, _ in kv])  # (L, H_kv, m, d)
    values = torch.stack([v[0, :, s:] for _, v in kv])
    count.add(m, layers, m * s + causal_pairs(m))
    return ChunkEntry(torch.stack([keys, values]), s)


def _assemble(ad: DecoderAdapter, n: int, lead: DynamicCache | None, chunks: list[_Chunk]) -> DenseKVCache:
    """One dense cache of the prompt: the lead's K/V, each passage's K/V moved to its position
    (keys rotated by the delta); the other positions are written by the layers that compute them."""
    shape = ad.shape
    size = (1, shape.num_kv_heads, n, shape.head_dim)
    cache = DenseKVCache([torch.zeros(size, dtype=ad.dtype, device=ad.device) for _ in range(shape.num_layers)],
                         [torch.zeros(size, dtype=ad.dtype, device=ad.device) for _ in range(shape.num_layers)])
    s0 = prefix_length(lead)
    for i in range(shape.num_layers if s0 else 0):
        k, v = layer_kv(lead, i)
        cache.write(i, slice(0, s0), k, v)
    for c in chunks:
        kv = c.entry.kv
        keys = ad.shift_keys(kv[0], c.start - c.entry.start)  # (L, H_kv, m, d)
        for i in range(shape.num_layers):
            cache.write(i, slice(c.start, c.end), keys[i][None], kv[1, i][None])
    return cache


def _run_layers(ad: DecoderAdapter, cache: DenseKVCache, hidden: torch.Tensor, positions: torch.Tensor,
                layers: range, count: _Count, scores: dict[int, torch.Tensor] | None = None,
                scorer: AttentionScorer | None = None) -> torch.Tensor:
    """Run the rows ``hidden`` ``(1, R, D)`` at ``positions`` ``(R,)`` through ``layers`` over the
    dense cache (each row attends every position up to its own)."""
    n = cache.get_seq_length()
    positions = positions.to(ad.device)
    mask = causal_mask(positions, torch.arange(n, device=ad.device))  # (1, 1, R, n)
    rotary = ad.rotary(hidden, positions[None])
    for idx in layers:
        cache.stage(idx, positions)
        hidden = ad.layer(idx, hidden, positions[None], cache, mask=mask, rotary=rotary,
                          scores=scores if scorer is not None else None, scorer=scorer)
    count.add(int(positions.numel()), len(layers), int(positions.numel()) * n)
    return hidden


def _deviation(ad: DecoderAdapter, ids: torch.Tensor, cache: DenseKVCache, fresh: torch.Tensor,
               candidates: torch.Tensor, layer: int, count: _Count) -> tuple[torch.Tensor, torch.Tensor]:
    """CacheBlend's score: every row runs the layers below ``layer``; each candidate's K/V at
    ``layer``, projected from there, against the reused one. Returns the ``(C,)`` scores and the
    probe's hidden states ``(1, R, D)`` (rows: fresh and candidates, in position order); every
    probed row's K/V at ``layer`` is written into the cache."""
    rows = torch.sort(torch.cat([fresh, candidates])).values
    hidden = _run_layers(ad, cache, ad.embed(ids[:, rows]), rows, range(layer), count)
    keys, values = ad.project_kv(layer, hidden)  # (1, H_kv, R, d), keys before rotation
    cos, sin = ad.rotary(hidden, rows[None].to(ad.device))
    keys = rotate_keys(keys, cos, sin)
    is_candidate = torch.isin(rows, candidates)
    dev = torch.zeros(candidates.numel(), dtype=torch.float32, device=ad.device)
    for new, old in ((keys, cache.keys[layer]), (values, cache.values[layer])):
        old = old[:, :, candidates].float()  # (1, H_kv, C, d)
        dev += (new[:, :, is_candidate].float() - old).pow(2).sum(dim=(0, 1, 3)) / old.pow(2).sum(dim=(0, 1, 3)).mean()
    cache.write(layer, rows, keys, values)
    count.flops += 4.0 * ad.shape.hidden_size * ad.shape.num_kv_heads * ad.shape.head_dim * rows.numel()
    return dev, hidden


def _attention(ad: DecoderAdapter, ids: torch.Tensor, cache: DenseKVCache, fresh: torch.Tensor,
               candidates: torch.Tensor, layer: int, window: int, count: _Count) -> torch.Tensor:
    """The question's attention to each candidate at ``layer``: the glue and the question run
    layers ``0..layer`` over the reused K/V (a probe, recomputed after), the last ``window``
    question rows scored beside the fused attention. Returns ``(C,)`` scores."""
    tail = int((fresh > candidates.max()).sum())
    scorer = AttentionScorer(window=max(1, min(window, tail)))
    hidden = _run_layers(ad, cache, ad.embed(ids[:, fresh]), fresh, range(layer), count)
    sink: dict[int, torch.Tensor] = {}
    _run_layers(ad, cache, hidden, fresh, range(layer, layer + 1), count, scores=sink, scorer=scorer)
    count.flops += ad.shape.scoring_flops(cache.get_seq_length()) * scorer.window
    return sink[layer][0, candidates.to(ad.device)].float()


def _run_rows(ad: DecoderAdapter, ids: torch.Tensor, cache: DenseKVCache, rows: torch.Tensor, start: int,
              hidden: torch.Tensor | None, count: _Count) -> torch.Tensor:
    """The recompute: ``rows`` (position order, the prompt's last token last) from layer ``start``
    (their hidden states given, or their embeddings from layer 0) to the last layer; the ``(V,)``
    float32 logits of the last row."""
    if hidden is None:
        hidden = ad.embed(ids[:, rows])
    hidden = _run_layers(ad, cache, hidden, rows, range(start, ad.num_layers), count)
    return ad.head(hidden[:, -1:])[0, -1]
