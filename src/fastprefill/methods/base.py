"""The method contract: what the engine asks of every prefill method.

A method is a small typed dataclass whose fields are its settings, checked in ``__post_init__``
(a :class:`~fastprefill.errors.ConfigError` names the field and its allowed range). The engine
asks it for two things:

- :meth:`Method.prefill`: prompt ids in, first-token logits and a decode state out;
- :meth:`Method.decode`: one token in, next-token logits out.

Each prefill reports what it computed in a :class:`ComputeStats`: the prompt (token, layer)
pairs computed against the full count, and a FLOPs estimate. Everything a method does to get
the first token (scoring, gathering, an auxiliary model, communication) happens inside
``prefill``, so the engine's TTFT timer includes it.

A method that splits the prefill over several processes also meets :class:`DistributedMethod`:
the last rank runs the engine, the others :meth:`DistributedMethod.contribute`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from fastprefill.errors import UnsupportedModelError
from fastprefill.models.adapters import LAYER_LOOP_FAMILIES, supports_layer_loop


@dataclass
class ComputeStats:
    """What a prefill computed.

    Attributes:
        token_layers: prompt (token, layer) pairs computed by the base model.
        total_token_layers: ``prompt_length * num_layers``, the full-prefill count.
        flops: estimated FLOPs to the first token (all models involved, LM head included).
        extra: method-specific counters (for example LazyLLM's kept tokens per layer).
    """

    token_layers: int
    total_token_layers: int
    flops: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        """``token_layers / total_token_layers`` (1.0 for full prefill)."""
        return self.token_layers / self.total_token_layers if self.total_token_layers else 1.0


@dataclass
class PrefillOutput:
    """Result of a method's prefill.

    Attributes:
        logits: ``(V,)`` float32 logits for the token after the prompt.
        state: the method's decode state, handed back to :meth:`Method.decode`.
        stats: what was computed.
    """

    logits: torch.Tensor
    state: Any
    stats: ComputeStats


class Method(ABC):
    """Base class of prefill methods (subclasses are dataclasses)."""

    #: Short name used by the CLI and in benchmark records.
    name: ClassVar[str] = "method"
    #: True when the method runs the model's decoder layers itself (through a family adapter),
    #: so it supports only :data:`~fastprefill.models.adapters.LAYER_LOOP_FAMILIES`.
    layer_loop: ClassVar[bool] = False

    # --- capability queries (static: nothing is built) ---------------------------------------
    @classmethod
    def supports(cls, config: Any) -> bool:
        """Whether this method can run a model with this transformers ``config``."""
        return supports_layer_loop(config) if cls.layer_loop else True

    @classmethod
    def check_model(cls, model: PreTrainedModel) -> None:
        """Raise :class:`UnsupportedModelError` unless :meth:`supports` the model's config."""
        if not cls.supports(model.config):
            model_type = getattr(model.config, "model_type", "?")
            raise UnsupportedModelError(
                f"{cls.name} runs the model layer by layer and supports the families "
                f"{sorted(LAYER_LOOP_FAMILIES)}, not {model_type!r}; use full prefill (method=None) for this model."
            )

    def check_prompt(self, model: PreTrainedModel, prompt_len: int) -> None:
        """Raise :class:`~fastprefill.errors.ConfigError` if this method's settings cannot serve a
        ``prompt_len``-token prompt on ``model`` (called by the engine before any work)."""
        del model, prompt_len

    @abstractmethod
    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor) -> PrefillOutput:
        """Process the prompt.

        Args:
            model: a causal LM in eval mode.
            input_ids: ``(1, T)`` int64 prompt ids on the model's device, ``T >= 1``, already
                validated by :func:`fastprefill.engine.prepare_prompt` (this method's
                :meth:`check_model` and :meth:`check_prompt` included).
        """

    @abstractmethod
    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        """Feed one generated token; return ``(V,)`` float32 logits for the next one."""

    def decode_stats(self, state: Any) -> dict[str, Any]:
        """Counters gathered while decoding (for example LazyLLM's revivals per step)."""
        del state
        return {}

    def describe(self) -> str:
        """One line naming the method and its settings, for tables and logs."""
        return self.name


#: Called after every layer of a rank's share of a distributed prefill as ``hook(rank, layer)``
#: (fault-injection tests use it).
LayerHook = Callable[[int, int], None]


class DistributedMethod(Method):
    """The contract of a prefill split over ``procs`` ranks of one torch.distributed process group.

    Every rank holds the model and gets the same prompt ids. The last rank (``procs - 1``) runs
    the engine: :meth:`prefill` gives it the first-token logits and it decodes alone. Ranks
    ``0..procs-2`` call :meth:`contribute` with the same ids and are then free. Drivers (the
    local rank pool in ``fastprefill.distributed.pool``, torchrun ranks in ``fastprefill.launch``)
    talk to distributed methods only through this contract. With ``procs == 1`` no process group
    is needed and the method is an ordinary one-process :class:`Method`.

    Attributes:
        procs: number of ranks; when > 1 it must equal the process group's world size.
        timeout_s: bound in seconds on every communication wait (a dead or hung rank raises
            instead of blocking); drivers bound a whole request by a small multiple of it.
    """

    procs: int
    timeout_s: float

    @abstractmethod
    def contribute(
        self, model: PreTrainedModel, input_ids: torch.Tensor, layer_hook: LayerHook | None = None
    ) -> ComputeStats:
        """Run this helper rank's share of the prefill (ranks ``0..procs-2``) and send what the
        later ranks need.

        Args:
            model: the same model as on every other rank.
            input_ids: ``(1, T)`` int64, the whole prompt, validated by
                :func:`fastprefill.engine.prepare_prompt` as on the last rank.
            layer_hook: called as ``hook(rank, layer)`` after every layer, or ``None``.

        Returns:
            What this rank computed (its counters in ``extra``).
        """
