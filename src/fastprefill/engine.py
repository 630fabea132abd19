"""Generation engine: prefill through a method, greedy decoding, honest timings.

- Every prompt is validated first by :func:`fastprefill.prompt.prepare_request`, the one
  validator (the distributed pool's workers and the server call it too).
- :class:`TimingWindow` is the only clock: on CUDA it synchronises the device before each read.
  TTFT runs from the start of prefill (the prompt ids already on the device) through the first
  token id (the argmax of the prefill logits); everything the method does for the first token
  is inside that window.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.host import dtype_name
from fastprefill.methods.base import ComputeStats, Decoder, Method, ModelDecoder, PrefillOutput
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache
from fastprefill.prompt import PromptInput, prepare_request
from fastprefill.text import IncrementalDecoder

__all__ = [
    "Generation",
    "GenerationResult",
    "StreamEvent",
    "Timing",
    "TimingWindow",
    "decoder_for",
    "generate",
    "stream",
]

@dataclass
class Timing:
    """Timings of one generation and what its prefill computed.

    Attributes:
        method: the method's :meth:`~fastprefill.methods.base.Method.describe` string.
        prompt_tokens: prompt length ``T``.
        new_tokens: tokens generated (the first one included).
        ttft_s: seconds from the start of prefill (the prefix-cache lookup) through the first
            token; under the server's interleaved scheduler, the other requests' work between
            this prompt's chunks included (the wall time this request's prefill took).
        decode_s_per_token: mean seconds per token after the first (``None`` if only one).
        total_s: TTFT plus all decoding.
        stats: the prefill's :class:`~fastprefill.methods.base.ComputeStats` (token-layers,
            FLOPs, method counters), as the method reported it.
        decode_extra: counters the method's own decoder gathered (``Decoder.stats``).
        cached_tokens: prompt tokens whose K/V came from a prefix cache (not computed).
        prefix_cache: what the prefix cache did: ``"off"`` (none given), ``"hit"``, ``"miss"``,
            or ``"not used: <method> takes no cached prefix"`` (the whole prompt ran).
        stored_tokens: tokens this generation added to the prefix cache.
        prefix_lookup_s: of ``ttft_s``, the seconds spent looking the prompt up in the prefix cache
            (and assembling the hit's K/V).
        prefix_store_s: seconds spent storing into the prefix cache (after the last token,
            outside TTFT and decoding).
        dtype: the model's dtype (``"bfloat16"``, ``"float32"``, ...): every timing names it.
    """

    method: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_s_per_token: float | None
    total_s: float
    stats: ComputeStats
    decode_extra: dict[str, Any] = field(default_factory=dict)
    cached_tokens: int = 0
    prefix_cache: str = "off"
    stored_tokens: int = 0
    prefix_lookup_s: float = 0.0
    prefix_store_s: float = 0.0
    dtype: str = ""

    @property
    def extra(self) -> dict[str, Any]:
        """Prefill and decode counters in one dict (decode keys win on a clash)."""
        return {**self.stats.extra, **self.decode_extra}

    def to_dict(self) -> dict[str, Any]:
        """A flat, JSON-friendly dict (the keys benchmark records and the pool's replies use): the
        timings, :meth:`ComputeStats.to_dict`'s keys (with ``extra`` the prefill and decode
        counters of :attr:`extra`), and the prefix cache's fields."""
        return {
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ttft_s": self.ttft_s,
            "decode_s_per_token": self.decode_s_per_token,
            "total_s": self.total_s,
            **self.stats.to_dict(),
            "extra": self.extra,
            "cached_tokens": self.cached_tokens,
            "prefix_cache": self.prefix_cache,
            "stored_tokens": self.stored_tokens,
            "prefix_lookup_s": self.prefix_lookup_s,
            "prefix_store_s": self.prefix_store_s,
            "dtype": self.dtype,
        }


@dataclass
class StreamEvent:
    """One generated token. ``timing`` and ``first_logits`` are set on the last event only."""

    token_id: int
    text: str
    index: int
    timing: Timing | None = None
    first_logits: torch.Tensor | None = None


@dataclass
class GenerationResult:
    """The generated text, its token ids, the :class:`Timing` and ``first_logits``: the prefill's
    ``(V,)`` float32 logits for the first token, a copy on the CPU (taken outside the timing window)."""

    text: str
    token_ids: list[int]
    timing: Timing
    first_logits: torch.Tensor | None = None


class TimingWindow:
    """The engine's clock: ``with TimingWindow(device) as w: ...`` then ``w.seconds``.

    The device is synchronised before the start and the end reads (CUDA work is asynchronous),
    so the window holds all the work queued inside it.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.seconds = 0.0
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> Self:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self._t0


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for src in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, Sequence):
            ids.update(int(x) for x in src)
    return ids


def decoder_for(model: PreTrainedModel, out: PrefillOutput) -> Decoder:
    """The decode step the engine uses after ``out``: the method's own :class:`Decoder`, else
    :class:`ModelDecoder` (the model's forward over ``out.cache``)."""
    return out.decoder if out.decoder is not None else ModelDecoder(model, out)


def _chunk_stats(parts: list[ComputeStats]) -> ComputeStats:
    """One prefill's stats from its chunks': what they computed, added up; the full count is the
    last chunk's (the whole prompt); ``extra`` counts the chunks."""
    if len(parts) == 1:
        return parts[0]
    return ComputeStats(token_layers=sum(p.token_layers for p in parts),
                        total_token_layers=parts[-1].total_token_layers,
                        flops=sum(p.flops for p in parts), extra={**parts[-1].extra, "prefill_chunks": len(parts)})


class Generation:
    """One greedy generation of validated ids, driven one unit of work at a time.

    :func:`stream` runs it to the end at once (the whole prompt in one prefill); the server's
    scheduler (:mod:`fastprefill.serve.scheduler`) interleaves many: it calls :meth:`prefill`
    with a token budget, so a method that allows it (``Method.chunked_prefill``) prefills a long
    prompt chunk by chunk, each chunk a prefill over the K/V of the ones before (the prefix
    cache's hit path), and then :meth:`step` (or :meth:`accept`, for a token a batched decode
    step computed) once per token. One path, so a chunked answer is the same computation as an
    unchunked one.

    Args:
        input_ids: ``(1, T)`` ids from :func:`~fastprefill.prompt.prepare_prompt`.
        method: the method that runs this prompt (already :meth:`~Method.resolve` d).
        max_new_tokens, stop_at_eos, stop, prefix_cache: as :func:`generate`'s.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, input_ids: torch.Tensor,
                 method: Method, max_new_tokens: int, *, stop_at_eos: bool = True,
                 stop: Callable[[str], bool] | None = None, prefix_cache: PrefixCache | None = None) -> None:
        self.model, self.tokenizer, self.input_ids, self.method = model, tokenizer, input_ids, method
        self.n_prompt = int(input_ids.shape[1])
        self.max_new_tokens, self.stop, self.prefix_cache = max_new_tokens, stop, prefix_cache
        self.eos = _eos_ids(model, tokenizer) if stop_at_eos else set()
        self.uses_cache = prefix_cache is not None and method.takes_prefix
        self.cached_tokens = 0
        self.lookup_s = 0.0
        self.done_tokens = 0  # prompt tokens whose K/V is computed (or was cached)
        self.out: PrefillOutput | None = None
        self.decoder: Decoder | None = None
        self.generated: list[int] = []
        self.text = ""
        self.finished = False
        self.decode_s = 0.0
        self._cache: DynamicCache | None = None
        self._looked_up = False
        self._parts: list[ComputeStats] = []
        self._started: float | None = None
        self.ttft_s = 0.0
        self.first_logits: torch.Tensor | None = None
        #: called before the last token's prefix store (a decode batch writes this row's K/V back)
        self.on_finish: Callable[[], None] | None = None
        self._first = -1
        self._pending = IncrementalDecoder(tokenizer) if tokenizer is not None else None

    # --- prefill ---------------------------------------------------------------------------
    def lookup(self) -> int:
        """Look the prompt up in the prefix cache (once; inside TTFT); returns :attr:`remaining`."""
        if not self._looked_up:
            self._looked_up = True
            if self.uses_cache:
                assert self.prefix_cache is not None
                with torch.inference_mode(), TimingWindow(self.model.device) as lookup:
                    hit = self.prefix_cache.lookup(self.model, self.input_ids)
                self.lookup_s = lookup.seconds
                self.cached_tokens = self.done_tokens = hit.tokens
                self._cache = hit.cache if hit.tokens else None
        return self.remaining

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill."""
        return self.n_prompt - self.done_tokens

    @property
    def chunked(self) -> bool:
        """Whether :meth:`prefill` may run part of the prompt (``Method.chunked_prefill``)."""
        return self.method.chunked_prefill

    def prefill(self, budget: int | None = None) -> int:
        """Run one unit of prefill: the next ``min(budget, remaining)`` prompt tokens over the K/V
        so far if the method is :attr:`chunked`, else (or with ``budget=None``) the whole rest.
        Once the last prompt token has run, the first token is known (:meth:`first_event`).
        Returns the prompt tokens this call computed."""
        self.lookup()
        if self._started is None:  # TTFT: the lookup, then every unit of prefill through the first token
            self._started = time.perf_counter() - self.lookup_s
        todo = self.remaining if budget is None or not self.chunked else max(1, min(budget, self.remaining))
        end = self.done_tokens + todo
        with torch.inference_mode(), TimingWindow(self.model.device):  # synchronised: the clock below is honest
            ids = self.input_ids[:, :end]
            out = self.method.prefill(self.model, ids, self._cache) if self._cache is not None else (
                self.method.prefill(self.model, ids))
            if end == self.n_prompt:
                token = int(torch.argmax(out.logits))
        self._parts.append(out.stats)
        self.done_tokens = end
        if end < self.n_prompt:
            self._cache = out.cache  # the K/V so far: the next chunk's prefix
            return todo
        self._cache = None
        self.out = dataclasses.replace(out, stats=_chunk_stats(self._parts))
        self.ttft_s = time.perf_counter() - self._started
        self.decoder = decoder_for(self.model, self.out)
        self.first_logits = out.logits.detach().reshape(-1).to("cpu", torch.float32, copy=True)  # (V,)
        self._first = token
        return todo

    @property
    def prefilled(self) -> bool:
        """Whether the prefill is done (the first token known)."""
        return self.out is not None

    # --- tokens ----------------------------------------------------------------------------
    def first_event(self) -> StreamEvent:
        """The first token's event (after the last unit of :meth:`prefill`)."""
        return self.accept(self._first, 0.0)

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds."""
        return self.generated[-1]

    def step(self) -> StreamEvent:
        """One decode step through :attr:`decoder`: the next token's event."""
        assert self.decoder is not None and not self.finished
        with torch.inference_mode(), TimingWindow(self.model.device) as window:
            token = int(torch.argmax(self.decoder.step(self.last_token)))
        return self.accept(token, window.seconds)

    def accept(self, token: int, seconds: float) -> StreamEvent:
        """Take the next generated token (``seconds``: the decode step's time, 0 for the first);
        the last event (end-of-sequence, ``max_new_tokens`` or ``stop``) carries the :class:`Timing`."""
        self.generated.append(token)
        self.decode_s += seconds
        delta = self._pending.push(token) if self._pending is not None else ""
        self.text += delta
        index = len(self.generated) - 1
        if not (token in self.eos or len(self.generated) >= self.max_new_tokens
                or (self.stop is not None and self.stop(self.text))):
            return StreamEvent(token, delta, index)
        self.finished = True
        timing = self._finish()
        tail = self._pending.flush() if self._pending is not None else ""
        return StreamEvent(token, delta + tail, index, timing, self.first_logits)

    def _finish(self) -> Timing:
        """Store the exact K/V into the prefix cache (after the last token) and time the whole."""
        if self.on_finish is not None:
            self.on_finish()
        out, n_prompt, generated = self.out, self.n_prompt, self.generated
        assert out is not None and self.decoder is not None
        stored, store_s = 0, 0.0
        if self.prefix_cache is not None and out.exact_tokens > self.cached_tokens:
            # the generated tokens fed through the model are exact too when the whole prompt was
            with torch.inference_mode(), TimingWindow(self.model.device) as window:
                fed = generated[:-1] if out.exact_tokens == n_prompt and out.decoder is None else []
                ids = self.input_ids[0].tolist() + fed
                stored = self.prefix_cache.store(self.model, ids, out.cache, out.exact_tokens + len(fed))
            store_s = window.seconds
        steps = len(generated) - 1
        method = self.method
        return Timing(
            method=method.describe(), prompt_tokens=n_prompt, new_tokens=len(generated), ttft_s=self.ttft_s,
            decode_s_per_token=self.decode_s / steps if steps else None, total_s=self.ttft_s + self.decode_s,
            stats=out.stats, decode_extra=dict(self.decoder.stats()), cached_tokens=self.cached_tokens,
            prefix_cache=("off" if self.prefix_cache is None else
                          f"not used: {method.name} takes no cached prefix" if not method.takes_prefix else
                          "hit" if self.cached_tokens else "miss"),
            stored_tokens=stored, prefix_lookup_s=self.lookup_s, prefix_store_s=store_s,
            dtype=dtype_name(self.model.dtype),
        )

    def close(self) -> None:
        """Stop early: drop the K/V (nothing is stored into the prefix cache)."""
        self._cache, self.out, self.decoder = None, None, None

    def run(self, chunk: int | None = None) -> Iterator[StreamEvent]:
        """The whole generation: the prompt in one prefill (or in units of ``chunk`` tokens,
        see :meth:`prefill`), then one decode step per token."""
        while not self.prefilled:
            self.prefill(chunk)
        event = self.first_event()
        while True:
            yield event
            if event.timing is not None:
                return
            event = self.step()


def stream(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: PromptInput,
    method: Method | None = None,
    max_new_tokens: int = 64,
    *,
    chat: bool = False,
    stop_at_eos: bool = True,
    stop: Callable[[str], bool] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[StreamEvent]:
    """Greedy generation as an iterator of :class:`StreamEvent` (one per token).

    Each event's ``text`` is the text new since the last event, whole characters only (a
    character split over tokens comes with the token that completes it, see
    :class:`~fastprefill.text.IncrementalDecoder`, which decodes a short window per token); the
    texts add up to :func:`generate`'s. The last event carries the :class:`Timing`. See
    :func:`generate` for the arguments (``stop`` is called with the text of the events so far).
    TTFT runs from the prefix-cache lookup (or the prefill) through the first token's argmax.
    """
    method = method if method is not None else FullPrefill()
    input_ids, method = prepare_request(model, tokenizer, prompt, method, max_new_tokens=max_new_tokens, chat=chat)
    yield from Generation(model, tokenizer, input_ids, method, max_new_tokens, stop_at_eos=stop_at_eos, stop=stop,
                          prefix_cache=prefix_cache).run()


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: PromptInput,
    method: Method | None = None,
    max_new_tokens: int = 64,
    *,
    chat: bool = False,
    stop_at_eos: bool = True,
    stop: Callable[[str], bool] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> GenerationResult:
    """Generate greedily from ``prompt`` with ``method`` (full prefill when ``None``).

    Args:
        model: a decoder-only causal LM (``AutoModelForCausalLM``), in eval mode.
        tokenizer: its tokenizer (needed for text prompts and for the output text).
        prompt: text (``bytes`` must be UTF-8), or token ids as a list or a ``(T,)`` / ``(1, T)`` tensor.
        method: a :class:`~fastprefill.methods.base.Method`; ``None`` is full prefill.
        max_new_tokens: at most this many tokens, the first one included (>= 1).
        chat: wrap a text prompt in the tokenizer's chat template.
        stop_at_eos: stop after the model's end-of-sequence token (which is kept in the ids
            and dropped from the text).
        stop: called with the text generated so far after every token; generation ends (that
            token kept) once it returns True. Tasks use it to stop when the rest of the
            answer cannot change the score (e.g. HumanEval after the closing code fence).
        prefix_cache: a :class:`~fastprefill.prefix_cache.PrefixCache`: the longest cached
            prefix of the prompt is reused (for a method that takes one: full prefill, LazyLLM,
            kvp-prefix; the others run the whole prompt), and the exact K/V this generation
            computed is stored. ``Timing.cached_tokens`` says how many prompt tokens were reused.

    Returns:
        The text, the generated ids, the :class:`Timing` and the first token's logits.

    Raises:
        PromptError, ConfigError, UnsupportedModelError: as :func:`prepare_prompt` says.
    """
    ids: list[int] = []
    last: StreamEvent | None = None
    for last in stream(
        model, tokenizer, prompt, method, max_new_tokens, chat=chat, stop_at_eos=stop_at_eos, stop=stop,
        prefix_cache=prefix_cache,
    ):
        ids.append(last.token_id)
    assert last is not None and last.timing is not None
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
    return GenerationResult(text=text, token_ids=ids, timing=last.timing, first_logits=last.first_logits)
