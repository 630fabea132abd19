"""LazyLLM's baselines at matched token budgets: random token drop, static pruning and GemFilter.

All are policies over the pruning mechanism of :mod:`fastprefill.methods.pruning` (original
positions, gathered rows, one :class:`~fastprefill.cache.PositionKVCache`) and decode normally
from their shorter cache: each generated token at its true position attends every cached key of
every layer.

- :class:`RandomDrop`: a random subset of the prompt (the last token always kept) through every
  layer.
- :class:`StaticPruning`: layers ``0..select_layer`` on the full prompt; the last query's
  attention at ``select_layer`` (averaged over all query heads) picks the top-k (+ last); then
  *all* layers run from layer 0 on the kept tokens only. The selection pass is part of its cost
  (token-layers, FLOPs and TTFT).
- :class:`GemFilter`: the peer itself (arXiv 2409.17422): the same static shape, selected at
  layer ``floor(GEMFILTER_DEPTH * L)`` by the last query's *pre-softmax* logits summed over heads and average-pooled
  over positions, and the kept tokens renumbered ``0..K-1`` (they run, and decoding continues,
  as if the prompt were only them).

:func:`equivalent_keep` turns a LazyLLM schedule into the uniform keep fraction with the same
prompt token-layer count, and :func:`matched_baselines` builds every baseline at a LazyLLM
setting's budget (the one place benchmarks and the demo get them from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.errors import ConfigError, is_int, is_number
from fastprefill.methods.base import Method, PrefillOutput
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.pruning import (
    PrunedPrefill,
    Schedule,
    avg_pool_scores,
    check_keep,
    check_layers,
    check_schedule,
    keep_count,
    probe_scores,
    schedule_token_layers,
    subset_prefill,
    top_k_keep,
)
from fastprefill.methods.pruning.scorers import LogitScorer, RandomScorer
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.shape import ModelShape

__all__ = ["GEMFILTER_DEPTH", "GemFilter", "RandomDrop", "StaticPruning", "equivalent_keep", "matched_baselines"]

#: GemFilter's selection depth when neither ``select_layer`` nor ``select_depth`` is given: the
#: paper's layers (13 of 32 for Llama 3.1 8B) sit at about 40% of the depth.
GEMFILTER_DEPTH = 0.4


def equivalent_keep(
    schedule: Schedule, num_layers: int, prompt_len: int, select_layer: int | None = None
) -> float:
    """Uniform keep fraction whose prefill computes as many prompt token-layers as ``schedule``.

    Args:
        schedule: a LazyLLM absolute schedule ``((layer, keep), ...)``.
        num_layers: ``L``.
        prompt_len: ``T``.
        select_layer: ``None`` for :class:`RandomDrop` (``keep * T * L`` token-layers); a layer
            for :class:`StaticPruning`, whose selection pass over layers ``0..select_layer``
            costs ``T * (select_layer + 1)`` on top of ``keep * T * L``.

    Returns:
        the keep fraction in ``(0, 1]`` (``keep_count(keep, T)`` is within one token of the
        budget).

    Raises:
        ConfigError: if the selection pass alone exceeds the budget.
    """
    schedule = check_schedule(schedule)
    check_layers(schedule, num_layers)
    budget = schedule_token_layers(schedule, num_layers, prompt_len)
    if select_layer is not None:
        budget -= prompt_len * (select_layer + 1)
    if budget < num_layers:
        raise ConfigError(
            f"select_layer={select_layer}: the selection pass alone costs {prompt_len * (select_layer + 1)} "
            f"token-layers, leaving {budget} of the schedule's budget; choose an earlier select_layer"
        )
    return min(1.0, budget / (num_layers * prompt_len))


def _check_select_layer(layer: int, num_layers: int) -> None:
    if layer > num_layers - 1:
        raise ConfigError(
            f"select_layer {layer} out of range for a {num_layers}-layer model; allowed 0..{num_layers - 1}"
        )


@dataclass
class RandomDrop(Method):
    """Random token drop: ``ceil(keep * T)`` prompt tokens (the last always among them) through every layer.

    Args:
        keep: fraction of the prompt kept, in ``(0, 1]``.
        seed: seed of the choice (a CPU ``torch.Generator``; the same prompt length and seed give
            the same subset on any device).
    """

    name: ClassVar[str] = "random"
    layer_loop: ClassVar[bool] = True

    keep: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        self.keep = check_keep(self.keep)
        if not is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    def choose(self, n: int) -> torch.Tensor:
        """Ascending kept positions ``(K,)`` of an ``n``-token prompt (``n - 1`` always included):
        the top ``K - 1`` of :class:`RandomScorer`'s order over the others."""
        k = keep_count(self.keep, n)
        scores = torch.cat([RandomScorer(self.seed).rank(n - 1), torch.tensor([float("inf")])])
        return top_k_keep(scores, k)

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        self.refuse_prefix(prefix)
        return self.run(model, input_ids).output

    def run(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrunedPrefill:
        """The prefill with the pruning mechanism's state (KV by position, counters, the kept set)."""
        ad = DecoderAdapter(model, method="RandomDrop")
        keep = self.choose(int(input_ids.shape[1])).to(ad.device)
        return subset_prefill(ad, input_ids, keep)


    def describe(self) -> str:
        return f"random[keep={self.keep:g},seed={self.seed}]"


@dataclass
class StaticPruning(Method):
    """Static pruning: select once at ``select_layer``, then a full run on the kept tokens at their positions.

    GemFilter's shape with LazyLLM's score (attention probabilities averaged over heads, no
    pooling) and original positions; :class:`GemFilter` is the peer itself.

    Args:
        keep: fraction of the prompt kept, in ``(0, 1]``.
        select_layer: the layer whose last-query attention selects the tokens, in ``[0, L - 1]``
            (checked at prefill).
    """

    name: ClassVar[str] = "static"
    layer_loop: ClassVar[bool] = True

    keep: float = 0.5
    select_layer: int = 8

    def __post_init__(self) -> None:
        self.keep = check_keep(self.keep)
        if not is_int(self.select_layer, 0):
            raise ConfigError(f"select_layer must be an integer >= 0, got {self.select_layer!r}")

    def check_prompt(self, model: PreTrainedModel, prompt_len: int) -> None:
        """``select_layer`` must be a layer of this model."""
        _check_select_layer(self.select_layer, ModelShape.from_config(model.config).num_layers)

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        self.refuse_prefix(prefix)
        return self.run(model, input_ids).output

    def run(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrunedPrefill:
        """The prefill with the pruning mechanism's state (KV by position, counters, the kept set)."""
        self.check_prompt(model, int(input_ids.shape[1]))
        ad = DecoderAdapter(model, method="StaticPruning")
        row = probe_scores(ad, input_ids, self.select_layer)
        row[-1] = float("inf")
        keep = top_k_keep(row, keep_count(self.keep, int(input_ids.shape[1])))  # ascending positions
        return subset_prefill(ad, input_ids, keep, selection_layer=self.select_layer)


    def describe(self) -> str:
        return f"static[keep={self.keep:g},select_layer={self.select_layer}]"


@dataclass
class GemFilter(Method):
    """GemFilter (arXiv 2409.17422): early-layer selection, then a full run on the kept tokens, renumbered.

    Selection pass: layers ``0..s`` on the whole prompt. At layer ``s`` the last query's
    pre-softmax attention logits, summed over every query head
    (:class:`~fastprefill.methods.pruning.scorers.LogitScorer`), are average-pooled over ``kernel``
    positions and the top ``ceil(keep * T)`` tokens are kept in prompt order. Then every layer
    runs from layer 0 on those tokens at positions ``0..K-1`` (GemFilter's choice; LazyLLM and
    :class:`StaticPruning` keep original positions), and decoding continues at ``K``.

    *Choose* (last token): GemFilter's top-k may drop the last prompt token, and its first
    token is then predicted after some other token; here the last token is always kept (it
    costs at most one token of the budget), so the first token answers the prompt as every
    other method's does.

    Args:
        keep: fraction of the prompt kept, in ``(0, 1]``.
        select_layer: the selection layer ``s`` in ``[0, L - 1]`` (checked at prefill); ``-1``
            (default): from ``select_depth``.
        select_depth: ``s = floor(select_depth * L)``, in ``[0, 1)``; ``-1`` (default): from
            ``select_layer``, or :data:`GEMFILTER_DEPTH` if that is ``-1`` too. Give at most one.
        kernel: width of the average pooling over positions, odd, ``>= 1`` (GemFilter: 5; 1 = no
            pooling).
    """

    name: ClassVar[str] = "gemfilter"
    layer_loop: ClassVar[bool] = True

    keep: float = 0.5
    select_layer: int = -1
    select_depth: float = -1.0
    kernel: int = 5

    def __post_init__(self) -> None:
        self.keep = check_keep(self.keep)
        if not is_int(self.select_layer, -1):
            raise ConfigError(f"select_layer must be an integer >= 0 (or -1: from select_depth), got {self.select_layer!r}")
        depth = self.select_depth
        if not is_number(depth) or not (0.0 <= depth < 1.0 or depth == -1):
            raise ConfigError(f"select_depth must lie in [0, 1) (or -1: from select_layer), got {depth!r}")
        self.select_depth = float(depth)
        if self.select_layer >= 0 and self.select_depth >= 0:
            raise ConfigError("give select_layer or select_depth, not both")
        if not is_int(self.kernel, 1) or self.kernel % 2 == 0:
            raise ConfigError(f"kernel must be an odd integer >= 1 (1 = no pooling), got {self.kernel!r}")

    def selection_layer(self, num_layers: int) -> int:
        """The layer ``s`` that selects on an ``L``-layer model."""
        if self.select_layer >= 0:
            return self.select_layer
        depth = self.select_depth if self.select_depth >= 0 else GEMFILTER_DEPTH
        return math.floor(depth * num_layers)

    def check_prompt(self, model: PreTrainedModel, prompt_len: int) -> None:
        """The selection layer must be a layer of this model."""
        layers = ModelShape.from_config(model.config).num_layers
        _check_select_layer(self.selection_layer(layers), layers)

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        self.refuse_prefix(prefix)
        return self.run(model, input_ids).output

    def run(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrunedPrefill:
        """The prefill with the pruning mechanism's state (KV by position, counters, the kept set)."""
        self.check_prompt(model, int(input_ids.shape[1]))
        ad = DecoderAdapter(model, method="GemFilter")
        s = self.selection_layer(ad.num_layers)
        row = avg_pool_scores(probe_scores(ad, input_ids, s, scorer=LogitScorer()), self.kernel)  # (T,)
        row[-1] = float("inf")
        keep = top_k_keep(row, keep_count(self.keep, int(input_ids.shape[1])))  # ascending positions
        return subset_prefill(ad, input_ids, keep, selection_layer=s, renumber=True)


    def describe(self) -> str:
        where = f"select_layer={self.select_layer}" if self.select_layer >= 0 else (
            f"select_depth={self.select_depth if self.select_depth >= 0 else GEMFILTER_DEPTH:g}")
        return f"gemfilter[keep={self.keep:g},{where},kernel={self.kernel}]"


def matched_baselines(
    lazy: LazyLLM, num_layers: int, prompt_len: int, *, static_select_layer: int | None = None,
    gemfilter_select_layer: int | None = None,
) -> dict[str, Method]:
    """The baselines at ``lazy``'s prompt token-layer budget on an ``L``-layer model and a ``T``-token prompt.

    Args:
        lazy: the LazyLLM setting whose budget the baselines match.
        num_layers: ``L``.
        prompt_len: ``T``.
        static_select_layer: :class:`StaticPruning`'s selection layer (default ``L // 4``).
        gemfilter_select_layer: :class:`GemFilter`'s (default ``floor(GEMFILTER_DEPTH * L)``).
            Each selection pass is paid out of the same budget.

    Returns:
        ``{"static": StaticPruning, "random": RandomDrop, "gemfilter": GemFilter}`` (registry
        names as keys).

    Raises:
        ConfigError: ``lazy``'s schedule does not fit the model, or a selection pass alone
            exceeds the budget (the message names the baseline).
    """
    schedule = lazy.resolved(num_layers)
    static = num_layers // 4 if static_select_layer is None else static_select_layer
    gem = math.floor(GEMFILTER_DEPTH * num_layers) if gemfilter_select_layer is None else gemfilter_select_layer

    def keep(baseline: str, select_layer: int | None) -> float:
        try:
            return equivalent_keep(schedule, num_layers, prompt_len, select_layer)
        except ConfigError as exc:
            raise ConfigError(f"{baseline} at the budget of {lazy.describe()}: {exc}") from None

    return {
        "static": StaticPruning(keep=keep("static", static), select_layer=static),
        "random": RandomDrop(keep=keep("random", None), seed=0),
        "gemfilter": GemFilter(keep=keep("gemfilter", gem), select_layer=gem),
    }
