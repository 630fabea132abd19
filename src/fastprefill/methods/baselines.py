"""LazyLLM's baselines at matched token budgets: random token drop and static (GemFilter-style) pruning.

Both are policies over the pruning mechanism of :mod:`fastprefill.methods.pruning` (original
positions, gathered rows, one :class:`~fastprefill.cache.PositionKVCache`) and decode normally
from their shorter cache: each generated token at its true position attends every cached key of
every layer.

- :class:`RandomDrop`: a random subset of the prompt (the last token always kept) through every
  layer.
- :class:`StaticPruning`: layers ``0..select_layer`` on the full prompt; the last query's
  attention at ``select_layer`` (averaged over all query heads) picks the top-k (+ last); then
  *all* layers run from layer 0 on the kept tokens only. The selection pass is part of its cost
  (token-layers, FLOPs and TTFT).

:func:`equivalent_keep` turns a LazyLLM schedule into the uniform keep fraction with the same
prompt token-layer count, and :func:`matched_baselines` builds every baseline at a LazyLLM
setting's budget (the one place benchmarks and the demo get them from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from fastprefill.errors import ConfigError
from fastprefill.methods.base import Method, PrefillOutput
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.pruning import (
    Schedule,
    check_keep,
    check_layers,
    check_schedule,
    decode_step,
    keep_count,
    probe_scores,
    schedule_token_layers,
    subset_prefill,
    top_k_keep,
)
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.shape import ModelShape

__all__ = ["RandomDrop", "StaticPruning", "equivalent_keep", "matched_baselines"]


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


def _decode(state: Any, token_id: int) -> torch.Tensor:
    """Plain decoding over a static policy's cache (empty schedule: nothing is reselected)."""
    return decode_step(state, token_id, top_k_keep)


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
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    def choose(self, n: int) -> torch.Tensor:
        """Ascending kept positions ``(K,)`` of an ``n``-token prompt (``n - 1`` always included)."""
        k = keep_count(self.keep, n)
        gen = torch.Generator().manual_seed(self.seed)
        others = torch.randperm(n - 1, generator=gen)[: k - 1]
        return torch.cat([others.sort().values, torch.tensor([n - 1])])

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrefillOutput:
        ad = DecoderAdapter(model, method="RandomDrop")
        keep = self.choose(int(input_ids.shape[1])).to(ad.device)
        return subset_prefill(ad, input_ids, keep)

    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        return _decode(state, token_id)

    def describe(self) -> str:
        return f"random[keep={self.keep:g},seed={self.seed}]"


@dataclass
class StaticPruning(Method):
    """GemFilter-style static pruning: select once at ``select_layer``, then a full run on the kept tokens.

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
        if isinstance(self.select_layer, bool) or not isinstance(self.select_layer, int) or self.select_layer < 0:
            raise ConfigError(f"select_layer must be an integer >= 0, got {self.select_layer!r}")

    def check_prompt(self, model: PreTrainedModel, prompt_len: int) -> None:
        """``select_layer`` must be a layer of this model."""
        layers = ModelShape.from_config(model.config).num_layers
        if self.select_layer > layers - 1:
            raise ConfigError(
                f"select_layer {self.select_layer} out of range for a {layers}-layer model; allowed 0..{layers - 1}"
            )

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrefillOutput:
        self.check_prompt(model, int(input_ids.shape[1]))
        ad = DecoderAdapter(model, method="StaticPruning")
        row = probe_scores(ad, input_ids, self.select_layer)
        row[-1] = float("inf")
        keep = top_k_keep(row, keep_count(self.keep, int(input_ids.shape[1])))  # ascending positions
        return subset_prefill(ad, input_ids, keep, selection_layer=self.select_layer)

    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        return _decode(state, token_id)

    def describe(self) -> str:
        return f"static[keep={self.keep:g},select_layer={self.select_layer}]"


def matched_baselines(
    lazy: LazyLLM, num_layers: int, prompt_len: int, *, static_select_layer: int | None = None
) -> dict[str, Method]:
    """The baselines at ``lazy``'s prompt token-layer budget on an ``L``-layer model and a ``T``-token prompt.

    Args:
        lazy: the LazyLLM setting whose budget the baselines match.
        num_layers: ``L``.
        prompt_len: ``T``.
        static_select_layer: :class:`StaticPruning`'s selection layer (default ``L // 4``); its
            selection pass is paid out of the same budget.

    Returns:
        ``{"static": StaticPruning, "random": RandomDrop}`` (registry names as keys).

    Raises:
        ConfigError: ``lazy``'s schedule does not fit the model, or a selection pass alone
            exceeds the budget.
    """
    schedule = lazy.resolved(num_layers)
    select = num_layers // 4 if static_select_layer is None else static_select_layer
    return {
        "static": StaticPruning(keep=equivalent_keep(schedule, num_layers, prompt_len, select), select_layer=select),
        "random": RandomDrop(keep=equivalent_keep(schedule, num_layers, prompt_len), seed=0),
    }
