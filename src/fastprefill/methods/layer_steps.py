"""Decode steps run a layer at a time, the rows of several streams in one call of each decoder layer.

A decoder that can decode in a batch (a :class:`StepsDecoder`: the model's forward over an
ordinary or a pruned, ragged cache; LazyLLM's revival) describes one decode step as a *layer
steps* generator (:data:`LayerSteps`): for each decoder layer in order it yields the groups of
rows (:class:`Rows`) it needs computed there, each group over its own cache, with its own mask
(or none) and, if asked, its attention scores; it is sent back their outputs; after the last
layer it returns the token's hidden state ``(1, 1, D)``. Between two layers it may do what its
method does there (LazyLLM reselects its tokens and revives some from the Aux Cache).

:func:`run_layers` drives any number of such generators together: at layer ``l`` every
stream's rows are concatenated into one ``(1, R_1 + ... + R_B, D)`` call of the model's own
layer ``l`` (one matrix product per projection for all of them), and then one final norm and
LM head give each stream its ``(V,)`` logits. Attention is the only part that is not shared:
the layer's cache is a router (:class:`_Route`) that appends each group's keys and values to
the group's own cache, and the attention function selected for the call
(:data:`ROUTED_ATTENTION`) computes each group's attention apart, with fastprefill's attention
function over exactly the keys and the mask that group would have alone (the C++ kernel for an
unmasked decode row where it runs). So each stream's per-layer K/V length is its own (no
padding, nothing copied between steps), and a stream's rows see exactly the keys they see when
it decodes alone; only the shared matrix products run over more rows. Where every group is one
row (each stream's decode position), the layer call and the head run inside
:func:`fastprefill.models.packed.streams_as_rows`, so up to
:data:`~fastprefill.models.packed.FEW_ROWS` such rows (two in bfloat16, forty in float32) take the
few-row kernel, which computes each row alone: a stream's row then gets the bits it gets decoding alone.

Shapes: hidden ``(1, R, D)``; positions ``(R,)`` int64; rotary ``(cos, sin)`` each ``(1, R, d)``;
masks ``(1, 1, R, N)`` bool over the ``N`` keys the group's cache returns (its rows included).
"""

from __future__ import annotations

import contextvars
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.attention import (
    ATTENTION_NAME,
    SCORE_SINK_KWARG,
    SCORER_KWARG,
    ScoreFn,
    attention_as,
)
from fastprefill.models.packed import streams_as_rows

__all__ = ["ROUTED_ATTENTION", "LayerSteps", "Rows", "StepsDecoder", "run_layers"]

#: The attention function :func:`run_layers` selects on the model for its layer calls.
ROUTED_ATTENTION = "fastprefill_routed"


@dataclass
class Rows:
    """One stream's rows at one layer of a decode step.

    Attributes:
        cache: the stream's own cache (a transformers ``Cache`` or a
            :class:`~fastprefill.cache.PositionKVCache`): the rows' keys and values are appended
            to it and the rows attend what its ``update`` returns.
        hidden: ``(1, R, D)`` the rows' inputs to the layer.
        positions: ``(R,)`` int64 their original positions.
        rotary: ``(cos, sin)`` at those positions, each ``(1, R, d)``.
        mask: bool ``(1, 1, R, N)`` over the ``N`` keys the cache returns (``True``: attend), or
            ``None``: causal by position, the rows being the last ``R`` of the ``N`` keys (one
            row attends every key; a chunk of a prompt over its own cache, each row the keys up
            to its own).
        stage: the cache is position-indexed: ``positions`` are staged before its update.
        scores: if given, receives ``scores[layer] = (1, N)`` from ``scorer``.
        scorer: what a score is (with ``scores``).
    """

    cache: Any
    hidden: torch.Tensor
    positions: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None = None
    stage: bool = False
    scores: dict[int, torch.Tensor] | None = None
    scorer: ScoreFn | None = None
    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # what the cache returned at this layer

    @property
    def count(self) -> int:
        """``R``, the rows."""
        return int(self.hidden.shape[1])


#: One decode step of one stream: yields each layer's :class:`Rows` (at least one group), is sent
#: their outputs (one ``(1, R, D)`` per group, in order), returns the token's ``(1, 1, D)`` hidden
#: state after the last layer.
LayerSteps = Generator[list[Rows], list[torch.Tensor], torch.Tensor]


@runtime_checkable
class StepsDecoder(Protocol):
    """A decoder that can decode in a batch: its step as :data:`LayerSteps`."""

    def layer_steps(self, token_id: int) -> LayerSteps:
        """One decode step feeding ``token_id``, a layer at a time (see the module docstring)."""
        ...


class _Route:
    """The cache a routed layer call runs over: each group's rows into the group's own cache."""

    def __init__(self) -> None:
        self.groups: list[Rows] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each group's ``(1, H_kv, R_g, d)`` slice of the rows to its cache (in order);
        the keys and values each group attends are kept for :func:`_routed_attention`."""
        start = 0
        for group in self.groups:
            end = start + group.count
            if group.stage:
                group.cache.stage(layer_idx, group.positions)
            group.kv = group.cache.update(key_states[:, :, start:end], value_states[:, :, start:end], layer_idx)
            start = end
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Not one length: each group's cache has its own (this is never a model forward's cache)."""
        raise RuntimeError("a routed decode step has no single cache length; each stream's cache has its own")


_ROUTE: contextvars.ContextVar[_Route | None] = contextvars.ContextVar("fastprefill_route", default=None)


def _routed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Each group's attention apart: its query rows ``(1, H_q, R_g, d)`` over the keys and values
    its own cache returned, with its own mask and scores, by fastprefill's attention function.
    Returns ``(1, R, H_q, d)`` (the groups' outputs in order) and no weights."""
    del key, value, attention_mask  # the router's: each group has its own
    route = _ROUTE.get()
    if route is None:
        raise RuntimeError(f"the {ROUTED_ATTENTION!r} attention runs only inside run_layers")
    inner = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]
    outs, start = [], 0
    for group in route.groups:
        end = start + group.count
        assert group.kv is not None
        extra = dict(kwargs)
        if "position_ids" in extra:
            extra["position_ids"] = group.positions[None]
        if group.scores is not None:
            extra[SCORE_SINK_KWARG], extra[SCORER_KWARG] = group.scores, group.scorer
        out, _ = inner(module, query[:, :, start:end], *group.kv, group.mask, dropout=dropout, scaling=scaling,
                       **extra)
        outs.append(out)  # (1, R_g, H_q, d)
        start = end
    return _cat(outs), None


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=1)


def run_layers(adapter: DecoderAdapter, steps: Sequence[LayerSteps]) -> torch.Tensor:
    """One decode step of every stream in ``steps`` together: each decoder layer called once on
    all their rows, then one head (see the module docstring).

    Args:
        adapter: the model's :class:`~fastprefill.models.adapters.DecoderAdapter`.
        steps: one :data:`LayerSteps` per stream, not started.

    Returns:
        ``(B, V)`` float32 logits, row ``i`` the next token's of ``steps[i]``.

    Raises:
        RuntimeError: a stream's steps yield no rows at a layer, or do not last exactly one
            yield per layer.
    """
    AttentionInterface.register(ROUTED_ATTENTION, _routed_attention)  # a name in transformers' mapping, set again
    route = _Route()
    token = _ROUTE.set(route)
    try:
        with torch.inference_mode(), adapter.attention_scope(), attention_as(adapter.model, ROUTED_ATTENTION):
            wanted = [next(s) for s in steps]
            last: list[torch.Tensor] = []
            for layer in range(adapter.num_layers):
                if not all(wanted):
                    raise RuntimeError(f"a stream's decode step asked for no rows at layer {layer}")
                route.groups = groups = [g for want in wanted for g in want]
                with streams_as_rows(all(g.count == 1 for g in groups)):  # each row one stream's decode position
                    out = adapter.layer(layer, _cat([g.hidden for g in groups]),
                                        torch.cat([g.positions for g in groups])[None], route,
                                        rotary=(_cat([g.rotary[0] for g in groups]), _cat([g.rotary[1] for g in groups])))
                parts = iter(out.split([g.count for g in groups], dim=1))
                done = layer == adapter.num_layers - 1
                wanted = [_send(s, [next(parts) for _ in want], done, last) for s, want in zip(steps, wanted, strict=True)]
            with streams_as_rows():  # one final hidden state per stream
                return adapter.head(_cat(last))[0]  # (B, V)
    finally:
        route.groups = []
        _ROUTE.reset(token)


def _send(steps: LayerSteps, outputs: list[torch.Tensor], done: bool, last: list[torch.Tensor]) -> list[Rows]:
    """Send a stream its layer's outputs: the next layer's rows, or (after the last layer) its final
    hidden state ``(1, 1, D)`` appended to ``last``."""
    try:
        want = steps.send(outputs)
    except StopIteration as stop:
        if not done:
            raise RuntimeError("a stream's decode step ended before the model's last layer") from None
        last.append(stop.value)
        return []
    if done:
        raise RuntimeError("a stream's decode step asks for rows past the model's last layer")
    return want
