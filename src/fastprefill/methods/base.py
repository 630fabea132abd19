"""The method contract: what the engine asks of every prefill method.

A method is a small typed dataclass whose fields are its settings, checked in ``__post_init__``
(a :class:`~fastprefill.errors.ConfigError` names the field and its allowed range), and
registered as itself in :mod:`fastprefill.methods.registry`. The engine asks it for one thing,
:meth:`Method.prefill`: prompt ids (and, optionally, the exact K/V of a cached prefix of them)
in; a :class:`PrefillOutput` out:

- the first-token logits;
- a transformers ``Cache`` the model's own forward decodes from;
- :class:`ComputeStats`: the prompt (token, layer) pairs computed against the full count, and a
  FLOPs estimate;
- how many leading positions of that cache are *exact* (equal to full prefill's K/V at every
  layer): only those may be kept by a prefix cache;
- a :class:`Decoder` only when the method needs its own decode step (LazyLLM's revival of
  deferred tokens); every other method decodes with the model's own forward.

Everything a method does to get the first token (scoring, gathering, an auxiliary model,
communication) happens inside ``prefill``, so the engine's TTFT timer includes it.

A method that splits the prefill over several processes also meets :class:`DistributedMethod`:
the last rank runs the engine, the others :meth:`DistributedMethod.contribute`;
:attr:`Method.on_ranks` says so from the class, and :attr:`Method.ranks` how many ranks it needs.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from fastprefill.cache import make_roomy
from fastprefill.errors import ConfigError, UnsupportedModelError
from fastprefill.methods.layer_steps import LayerSteps, Rows
from fastprefill.models.adapters import LAYER_LOOP_FAMILIES, DecoderAdapter, supports_layer_loop
from fastprefill.models.attention import attention_backend


@dataclass
class ComputeStats:
    """What a prefill computed.

    Attributes:
        token_layers: prompt (token, layer) pairs computed by the base model.
        total_token_layers: ``prompt_length * num_layers``, the full-prefill count (a cached
            prefix included: its pairs count as not computed).
        flops: estimated FLOPs to the first token (all models involved, LM head included).
        extra: method-specific counters (for example LazyLLM's kept tokens per layer).
    """

    token_layers: int
    total_token_layers: int
    flops: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        """``token_layers / total_token_layers`` (1.0 for full prefill without a cached prefix)."""
        return self.token_layers / self.total_token_layers if self.total_token_layers else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The keys a benchmark record uses: ``token_layers``, ``total_token_layers``,
        ``prefill_flops`` (:attr:`flops`), ``extra`` and ``token_layer_fraction`` (:attr:`fraction`)."""
        return {"token_layers": self.token_layers, "total_token_layers": self.total_token_layers,
                "prefill_flops": self.flops, "extra": self.extra, "token_layer_fraction": self.fraction}


@runtime_checkable
class Decoder(Protocol):
    """A method's own decode step, for a cache the model's forward cannot decode by itself."""

    def step(self, token_id: int) -> torch.Tensor:
        """Feed one generated token; return ``(V,)`` float32 logits for the next one."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters gathered while decoding (for example revivals per step)."""
        ...


@dataclass
class PrefillOutput:
    """Result of a method's prefill.

    Attributes:
        logits: ``(V,)`` float32 logits for the token after the prompt.
        cache: a transformers ``Cache``; layer ``l`` holds the keys and values ``(1, H_kv, N_l, d)``
            (rotated at their original positions) that a generated token attends at ``l``.
        stats: what was computed.
        next_position: the position of the first generated token (``T``; the kept count when
            a method renumbers the kept tokens).
        exact_tokens: positions ``0..E-1`` are held at every layer of ``cache``, in order, with
            exactly full prefill's keys and values (``T`` for an exact method; the cached
            prefix's length for an approximate one). A prefix cache keeps only these.
        ragged: layers hold different key sets (pruned tokens are missing from some layers):
            the engine decodes such a cache with one query attending every key of each layer,
            inside :meth:`~fastprefill.models.adapters.DecoderAdapter.attention_scope`.
        decoder: the method's own decode step, or ``None``: the model's forward decodes ``cache``
            (:class:`ModelDecoder`).
    """

    logits: torch.Tensor
    cache: Cache
    stats: ComputeStats
    next_position: int
    exact_tokens: int
    ragged: bool = False
    decoder: Decoder | None = None


@dataclass
class LayeredPrefill:
    """One unit of prefill a layer at a time, so that other streams' rows can share its layer
    calls (:meth:`Method.prefill_steps`; :meth:`fastprefill.batch.DecodeBatch.mixed` runs it).

    Attributes:
        steps: the prompt's rows as :data:`~fastprefill.methods.layer_steps.LayerSteps`: one
            group per layer over the unit's own cache; after the last layer it returns the last
            prompt row's hidden state ``(1, 1, D)``.
        output: the unit's :class:`PrefillOutput` from the ``(V,)`` float32 logits of that row
            (the final norm and head, run by whoever ran ``steps``).
    """

    steps: LayerSteps
    output: Callable[[torch.Tensor], PrefillOutput]


class ModelDecoder:
    """The model's own forward, one token at a time, over a prefill's cache (every method without
    its own :class:`~fastprefill.methods.base.Decoder`).

    On a layer-loop family it is also a :class:`~fastprefill.methods.layer_steps.StepsDecoder`:
    :meth:`layer_steps` is the same step a layer at a time, so a decode batch runs it with other
    streams' (:func:`~fastprefill.methods.layer_steps.run_layers`).

    Args:
        model: the model the prefill ran on.
        out: the prefill; decoding continues at ``out.next_position`` and appends to ``out.cache``.
    """

    def __init__(self, model: PreTrainedModel, out: PrefillOutput) -> None:
        self.model = model
        self.cache = make_roomy(out.cache)  # each step's K/V written in place, not the cache copied
        self.position = out.next_position
        #: the model's layers one at a time (None: not a layer-loop family, no batched steps)
        self.adapter = DecoderAdapter(model) if supports_layer_loop(model.config) else None
        # a ragged cache: one query attending every key of each layer, with no mask built from
        # layer 0's length (the adapter's attention function takes mask=None); the same function
        # for a plain cache where the model's attention backend is the C++ kernel
        kernel = self.adapter is not None and attention_backend(model)[0] == "kernel"
        self.scope = DecoderAdapter(model).attention_scope if out.ragged or kernel else contextlib.nullcontext

    def step(self, token_id: int) -> torch.Tensor:
        """Feed one token; ``(V,)`` float32 logits for the next one."""
        device = self.model.device
        ids = torch.tensor([[token_id]], device=device)
        positions = torch.tensor([[self.position]], device=device)
        with self.scope():
            out = self.model(input_ids=ids, past_key_values=self.cache, position_ids=positions, use_cache=True,
                             logits_to_keep=1)
        self.position += 1
        return out.logits[0, -1].float()  # (V,)

    def layer_steps(self, token_id: int) -> LayerSteps:
        """:meth:`step` a layer at a time (:data:`~fastprefill.methods.layer_steps.LayerSteps`):
        the token's one row over this cache at every layer, attending every key there.

        Raises:
            UnsupportedModelError: the model is not a layer-loop family (:attr:`adapter` is None).
        """
        ad = self.adapter
        if ad is None:
            raise UnsupportedModelError(f"{type(self.model).__name__} runs no layer loop: it decodes with its own forward")
        hidden = ad.embed(torch.tensor([[token_id]], device=ad.device))  # (1, 1, D)
        positions = torch.tensor([self.position], device=ad.device)  # (1,)
        rotary = ad.rotary(hidden, positions[None])
        for _ in range(ad.num_layers):
            (hidden,) = yield [Rows(self.cache, hidden, positions, rotary)]
        self.position += 1
        return hidden

    def stats(self) -> dict[str, Any]:
        """No counters: plain decoding."""
        return {}


def prefix_length(prefix: Cache | None) -> int:
    """Positions held by a cached prefix (``0`` for ``None``)."""
    return 0 if prefix is None else int(prefix.get_seq_length())


class Method(ABC):
    """Base class of prefill methods (subclasses are dataclasses)."""

    #: Short name used by the CLI and in benchmark records.
    name: ClassVar[str] = "method"
    #: True when the method runs the model's decoder layers itself (through a family adapter),
    #: so it supports only :data:`~fastprefill.models.adapters.LAYER_LOOP_FAMILIES`.
    layer_loop: ClassVar[bool] = False
    #: True when :meth:`prefill` accepts ``prefix``: the exact K/V of the prompt's first
    #: positions, from a prefix cache; the method computes only the rest of the prompt.
    takes_prefix: ClassVar[bool] = False
    #: True when the method is exact and prefilling ``ids[:, :e]`` over the exact K/V of
    #: ``ids[:, :p]`` (the prefix path) is the same computation as prefilling it whole: a
    #: scheduler may then split a long prompt into chunks, each a prefill over the K/V so far.
    chunked_prefill: ClassVar[bool] = False
    #: True when the method runs on a rank pool (several processes of one process group, a
    #: :class:`DistributedMethod`) rather than on the caller's own model: the one fact behind the
    #: choice of backend (``fastprefill.serve.backends.Backends``, which the CLI, the server and
    #: torchrun ask). Known from the class, so a spec's name says it before anything is built.
    on_ranks: ClassVar[bool] = False

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

    def resolve(self, model: PreTrainedModel, prompt_len: int) -> Method:
        """The method that runs a ``prompt_len``-token prompt on ``model``: itself, except for a
        method that chooses per prompt (``auto``). Called by the engine before validation."""
        del model, prompt_len
        return self

    @abstractmethod
    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        """Process the prompt.

        Args:
            model: a causal LM in eval mode.
            input_ids: ``(1, T)`` int64 prompt ids on the model's device, ``T >= 1``, already
                validated by :func:`fastprefill.prompt.prepare_request` (this method's
                :meth:`check_model` and :meth:`check_prompt` included).
            prefix: only for a method that :attr:`takes_prefix`: a cache holding the exact
                keys and values of positions ``0..P-1`` (``P < T``) at every layer, owned by
                this call (the method may append to it); ``None``: nothing cached.
        """

    def prefill_steps(self, model: PreTrainedModel, input_ids: torch.Tensor,
                      prefix: DynamicCache | None = None) -> LayeredPrefill:
        """:meth:`prefill` a layer at a time (the same computation, so a decode step's rows may
        ride in its layer calls); only a :attr:`chunked_prefill` method has it.

        Raises:
            UnsupportedModelError: this method (or this model's family) does not prefill a layer at a time.
        """
        del model, input_ids, prefix
        raise UnsupportedModelError(f"{self.name} does not prefill a layer at a time beside decode rows")

    def own_decoder(self, model: PreTrainedModel) -> bool:
        """Whether :meth:`prefill` on ``model`` returns its own :class:`Decoder` (a decode step
        with state that a copy of the cache does not carry), known before any work. The engine
        asks it to refuse several answers from one prefill (``n > 1``) up front."""
        del model
        return False

    @property
    def ranks(self) -> int:
        """Ranks the method runs on: 1 (the caller's own process), or a multi-rank method's ``procs``."""
        return 1

    def describe(self) -> str:
        """One line naming the method and its settings, for tables and logs."""
        return self.name

    def served_name(self) -> str:
        """How a server's responses and ``/health`` name the method: :meth:`describe`, with the
        settings that say how an answer was decoded even where they are the defaults (LazyLLM's
        revival policy)."""
        return self.describe()

    def metric_label(self) -> str:
        """The method's label in a server's metrics: its :attr:`name`, with the settings that change
        how it decodes (LazyLLM: ``lazyllm[revival=none]``); a bounded set whatever requests send."""
        return self.name

    def with_chunks(self, chunks: Sequence[tuple[int, int]]) -> Method:
        """This method for a prompt made of passages: ``chunks`` are their ``[start, end)`` token
        spans, as the request declared them (:class:`~fastprefill.prompt.ChunkedPrompt`). A
        method that reuses passages' K/V (``blend``) returns a copy bound to them; every other
        method prefills the ids as they are and returns itself."""
        del chunks
        return self

    def refuse_prefix(self, prefix: Cache | None) -> None:
        """Raise :class:`~fastprefill.errors.ConfigError` for a cached prefix unless :attr:`takes_prefix`."""
        if prefix is not None and not self.takes_prefix:
            raise ConfigError(f"{self.name} does not take a cached prefix; prefill the whole prompt (prefix=None)")


#: Called after every layer of a rank's share of a distributed prefill as ``hook(rank, layer)``
#: (fault-injection tests use it).
LayerHook = Callable[[int, int], None]


class DistributedMethod(Method):
    """The contract of a prefill split over ``procs`` ranks of one torch.distributed process group.

    Every rank holds the model and gets the same prompt ids. The last rank (``procs - 1``) runs
    the engine: :meth:`prefill` gives it the first-token logits and the whole cache, and it
    decodes alone. Ranks ``0..procs-2`` call :meth:`contribute` with the same ids and are then
    free. Drivers (the local rank pool in ``fastprefill.distributed.pool``, torchrun ranks in
    ``fastprefill.launch``) talk to distributed methods only through this contract. With
    ``procs == 1`` no process group is needed and the method is an ordinary one-process
    :class:`Method`.

    Attributes:
        procs: number of ranks; when > 1 it must equal the process group's world size.
        timeout_s: bound in seconds on every communication wait (a dead or hung rank raises
            instead of blocking); drivers bound a whole request by a small multiple of it.
    """

    on_ranks: ClassVar[bool] = True

    procs: int
    timeout_s: float

    @property
    def ranks(self) -> int:
        """``procs``."""
        return self.procs

    @abstractmethod
    def contribute(
        self, model: PreTrainedModel, input_ids: torch.Tensor, layer_hook: LayerHook | None = None
    ) -> ComputeStats:
        """Run this helper rank's share of the prefill (ranks ``0..procs-2``) and send what the
        later ranks need.

        Args:
            model: the same model as on every other rank.
            input_ids: ``(1, T)`` int64, the whole prompt, validated by
                :func:`fastprefill.prompt.prepare_request` as on the last rank.
            layer_hook: called as ``hook(rank, layer)`` after every layer, or ``None``.

        Returns:
            What this rank computed (its counters in ``extra``).
        """
