"""Generation engine: prefill through a method, decoding (greedy unless sampling is asked for), honest timings.

- Every prompt is validated first by :func:`fastprefill.prompt.prepare_prompt`, the one
  validator (the distributed pool's workers and the server call it too).
- :class:`TimingWindow` is the only clock: on CUDA it synchronises the device before each read.
  TTFT runs from the start of prefill (the prompt ids already on the device) through the first
  token id (picked from the prefill logits); everything the method does for the first token
  is inside that window.
- Each token is picked by one call, :meth:`fastprefill.sampling.Choice.pick` on the step's
  ``(V,)`` logits row (``argmax`` when no sampling is asked for); ``n`` answers share one prefill,
  each decoding over its own copy of the prefill's cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Self

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.cache import fork_cache
from fastprefill.errors import ConfigError
from fastprefill.host import dtype_name
from fastprefill.methods.base import ComputeStats, Decoder, Method, ModelDecoder, PrefillOutput
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache
from fastprefill.prompt import PromptInput, prepare_prompt
from fastprefill.sampling import Choice, SamplingParams, TokenLogprob, prompt_logprobs

__all__ = [
    "Answer",
    "GenerationResult",
    "StreamEvent",
    "TimedPrefill",
    "Timing",
    "TimingWindow",
    "check_answers",
    "collect",
    "decoder_for",
    "generate",
    "stream",
    "timed_prefill",
]

@dataclass
class Timing:
    """Timings of one generation and what its prefill computed.

    Attributes:
        method: the method's :meth:`~fastprefill.methods.base.Method.describe` string.
        prompt_tokens: prompt length ``T``.
        new_tokens: tokens generated (the first one included).
        ttft_s: seconds from the start of prefill through the first token.
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
    """One generated token of answer ``choice`` (its ``index``-th). ``timing`` and
    ``first_logits`` are set on the last event of the generation only, ``finish_reason``
    (``"stop"`` or ``"length"``) on the last event of each answer, ``logprob`` when the sampling
    parameters ask for log-probabilities, ``prompt_logprobs`` on the very first event when they
    ask for the prompt's (see :func:`fastprefill.sampling.prompt_logprobs`)."""

    token_id: int
    text: str
    index: int
    timing: Timing | None = None
    first_logits: torch.Tensor | None = None
    choice: int = 0
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Answer:
    """One of a generation's ``n`` answers: its text (cut before a stop string), token ids,
    why it ended (``"stop"``: end-of-sequence token, stop string or ``stop`` predicate;
    ``"length"``: the token budget) and each token's log-probability if asked for."""

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    """The generated text, its token ids, the :class:`Timing` and ``first_logits``: the prefill's
    ``(V,)`` float32 logits for the first token, a copy on the CPU (taken outside the timing window).

    ``text`` and ``token_ids`` are the first answer's; ``answers`` holds all ``n``, and
    ``prompt_logprobs`` the prompt's log-probabilities when the sampling parameters ask for them."""

    text: str
    token_ids: list[int]
    timing: Timing
    first_logits: torch.Tensor | None = None
    answers: list[Answer] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


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


@dataclass
class TimedPrefill:
    """A prefill inside the engine's timing window.

    Attributes:
        output: the method's :class:`~fastprefill.methods.base.PrefillOutput`.
        first_token: the token picked from its logits (their argmax unless a ``pick`` was given).
        ttft_s: seconds of the window: prefix lookup, prefill and argmax.
        cached_tokens: prompt tokens taken from the prefix cache.
        lookup_s: of ``ttft_s``, the seconds of the prefix-cache lookup (0 without one).
    """

    output: PrefillOutput
    first_token: int
    ttft_s: float
    cached_tokens: int = 0
    lookup_s: float = 0.0


def timed_prefill(
    model: PreTrainedModel, input_ids: torch.Tensor, method: Method, prefix_cache: PrefixCache | None = None,
    pick: Callable[[torch.Tensor], int] | None = None,
) -> TimedPrefill:
    """Prefill ``(1, T)`` prepared ids with ``method`` inside the engine's timing window.

    With a ``prefix_cache`` and a method that :attr:`~fastprefill.methods.base.Method.takes_prefix`,
    the longest cached prefix is looked up (inside the window) and only the rest is prefilled.
    ``pick`` turns the ``(V,)`` logits into the first token (``None``: their argmax), inside the window.
    """
    hit, lookup_s = None, 0.0
    with torch.inference_mode(), TimingWindow(model.device) as window:
        if prefix_cache is not None and method.takes_prefix:
            with TimingWindow(model.device) as lookup:
                hit = prefix_cache.lookup(model, input_ids)
            lookup_s = lookup.seconds
        out = method.prefill(model, input_ids, hit.cache) if hit is not None and hit.tokens else (
            method.prefill(model, input_ids))
        token = pick(out.logits) if pick is not None else int(torch.argmax(out.logits))
    return TimedPrefill(out, token, window.seconds, hit.tokens if hit is not None else 0, lookup_s)


def decoder_for(model: PreTrainedModel, out: PrefillOutput) -> Decoder:
    """The decode step the engine uses after ``out``: the method's own :class:`Decoder`, else
    :class:`ModelDecoder` (the model's forward over ``out.cache``)."""
    return out.decoder if out.decoder is not None else ModelDecoder(model, out)


def check_answers(model: PreTrainedModel, method: Method, n: int) -> None:
    """Refuse ``n > 1`` answers with a ``method`` (as resolved for the prompt) that decodes with
    its own step (:meth:`~fastprefill.methods.base.Method.own_decoder`: LazyLLM's revival), whose
    state a copy of the cache does not carry.

    Raises:
        ConfigError: naming ``n`` and the way out.
    """
    if n > 1 and method.own_decoder(model):
        raise ConfigError(f"n={n}: several answers from one prefill need a method that decodes with the model's "
                          f"forward; {method.describe()} decodes with its own step (LazyLLM: give revival=none)")


def _decoders(model: PreTrainedModel, out: PrefillOutput, n: int) -> list[Decoder]:
    """One decode step per answer: :func:`decoder_for` ``out`` for the first, and for each of the
    ``n - 1`` others the model's forward over its own copy of the prefill's cache (made before
    any step appends to it). :func:`check_answers` has refused ``n > 1`` with a method's own step."""
    assert n == 1 or out.decoder is None, "n > 1 with a method's own decode step (check_answers)"
    forks = [ModelDecoder(model, replace(out, cache=fork_cache(out.cache))) for _ in range(n - 1)]
    return [decoder_for(model, out), *forks]


def _store(model: PreTrainedModel, prefix_cache: PrefixCache | None, timed: TimedPrefill, input_ids: torch.Tensor,
           generated: list[int]) -> tuple[int, float]:
    """Store the exact K/V of the prompt (and of the first answer's fed tokens when the whole
    prompt was exact) into ``prefix_cache``; ``(tokens stored, seconds)``."""
    out = timed.output
    if prefix_cache is None or out.exact_tokens <= timed.cached_tokens:
        return 0, 0.0
    n_prompt = int(input_ids.shape[1])
    # the generated tokens fed through the model are exact too when the whole prompt was
    with TimingWindow(model.device) as window:
        fed = generated[:-1] if out.exact_tokens == n_prompt and out.decoder is None else []
        stored = prefix_cache.store(model, input_ids[0].tolist() + fed, out.cache, out.exact_tokens + len(fed))
    return stored, window.seconds


def _timing(model: PreTrainedModel, method: Method, timed: TimedPrefill, n_prompt: int, generated: int, steps: int,
            decode_time: float, decoder: Decoder, prefix_cache: PrefixCache | None, store: tuple[int, float]) -> Timing:
    """The :class:`Timing` of a generation: ``generated`` tokens of which ``steps`` were decode steps."""
    cached = timed.cached_tokens
    state = ("off" if prefix_cache is None else f"not used: {method.name} takes no cached prefix"
             if not method.takes_prefix else "hit" if cached else "miss")
    return Timing(method=method.describe(), prompt_tokens=n_prompt, new_tokens=generated, ttft_s=timed.ttft_s,
                  decode_s_per_token=decode_time / steps if steps else None, total_s=timed.ttft_s + decode_time,
                  stats=timed.output.stats, decode_extra=dict(decoder.stats()), cached_tokens=cached,
                  prefix_cache=state, stored_tokens=store[0], prefix_lookup_s=timed.lookup_s, prefix_store_s=store[1],
                  dtype=dtype_name(model.dtype))


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
    sampling: SamplingParams | None = None,
) -> Iterator[StreamEvent]:
    """Generation as an iterator of :class:`StreamEvent` (one per token).

    Each event's ``text`` is the text new since the last event of its answer, whole characters
    only (a character split over tokens comes with the token that completes it, see
    :class:`~fastprefill.text.IncrementalDecoder`, which decodes a short window per token) and
    never a part of a stop string (:class:`~fastprefill.text.StopStrings`); an answer's texts add
    up to :func:`generate`'s. With ``n`` answers their events alternate, one token of each in
    turn. The last event carries the :class:`Timing`. See :func:`generate` for the arguments
    (``stop`` is called with the text of the answer's events so far).
    """
    params = sampling if sampling is not None else SamplingParams()
    budget = params.max_tokens if params.max_tokens is not None else max_new_tokens
    method = method if method is not None else FullPrefill()
    input_ids = prepare_prompt(model, tokenizer, prompt, method, max_new_tokens=budget, chat=chat)
    params.check_vocab(model.get_input_embeddings().num_embeddings)
    n_prompt = int(input_ids.shape[1])
    method = method.resolve(model, n_prompt)
    check_answers(model, method, params.n)
    device = model.device
    eos = _eos_ids(model, tokenizer) if stop_at_eos and not params.ignore_eos else set()
    choices = [Choice(params, i, input_ids, eos, budget, tokenizer, stop) for i in range(params.n)]

    timed = timed_prefill(model, input_ids, method, prefix_cache, pick=choices[0].pick)
    out = timed.output
    first_logits = out.logits.detach().reshape(-1).to("cpu", torch.float32, copy=True)  # (V,)
    prompt_lp = prompt_logprobs(model, input_ids, params.prompt_logprobs) if params.prompt_logprobs is not None else None
    decode_time = 0.0
    with torch.inference_mode():
        decoders = _decoders(model, out, params.n)
        tokens = [timed.first_token] + [c.pick(out.logits) for c in choices[1:]]  # every answer's first token
        live = list(range(params.n))
        while live:
            for i in tuple(live):
                choice = choices[i]
                event = StreamEvent(tokens[i], choice.push(tokens[i]), len(choice.ids) - 1, choice=i,
                                    logprob=choice.logprobs[-1] if choice.logprobs else None,
                                    finish_reason=choice.finish_reason,
                                    prompt_logprobs=prompt_lp if i == 0 and len(choice.ids) == 1 else None)
                if choice.finish_reason is not None:
                    live.remove(i)
                    if not live:  # the generation's last event: with its timing
                        break
                    yield event
                    continue
                yield event
                with TimingWindow(device) as window:
                    tokens[i] = choice.pick(decoders[i].step(tokens[i]))  # (V,) logits -> the next token
                decode_time += window.seconds

        store = _store(model, prefix_cache, timed, input_ids, choices[0].ids)
        generated = sum(len(c.ids) for c in choices)
        event.timing = _timing(model, method, timed, n_prompt, generated, generated - params.n, decode_time,
                               decoders[0], prefix_cache, store)
        event.first_logits = first_logits
        yield event


def collect(events: Sequence[Sequence[StreamEvent]], tokenizer: PreTrainedTokenizerBase | None,
            params: SamplingParams) -> list[Answer]:
    """The :class:`Answer` of each answer's events (``events[i]``: answer ``i``'s, in order). The
    text is the decode of its ids, or, with stop strings, what its events streamed (the same
    text, cut before the stop string)."""
    answers = []
    for evs in events:
        ids = [e.token_id for e in evs]
        text = "".join(e.text for e in evs) if params.stop else (
            tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else "")
        logprobs = [e.logprob for e in evs if e.logprob is not None] if params.logprobs is not None else None
        answers.append(Answer(text, ids, evs[-1].finish_reason or "length" if evs else "length", logprobs))
    return answers


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
    sampling: SamplingParams | None = None,
) -> GenerationResult:
    """Generate from ``prompt`` with ``method`` (full prefill when ``None``), greedily unless
    ``sampling`` says otherwise.

    Args:
        model: a decoder-only causal LM (``AutoModelForCausalLM``), in eval mode.
        tokenizer: its tokenizer (needed for text prompts and for the output text).
        prompt: text (``bytes`` must be UTF-8), or token ids as a list or a ``(T,)`` / ``(1, T)`` tensor.
        method: a :class:`~fastprefill.methods.base.Method`; ``None`` is full prefill.
        max_new_tokens: at most this many tokens, the first one included (>= 1); a
            ``sampling.max_tokens`` takes its place.
        chat: wrap a text prompt in the tokenizer's chat template.
        stop_at_eos: stop after the model's end-of-sequence token (which is kept in the ids
            and dropped from the text); ``sampling.ignore_eos`` turns it off too.
        stop: called with the text generated so far after every token; generation ends (that
            token kept) once it returns True. Tasks use it to stop when the rest of the
            answer cannot change the score (e.g. HumanEval after the closing code fence).
        prefix_cache: a :class:`~fastprefill.prefix_cache.PrefixCache`: the longest cached
            prefix of the prompt is reused (for a method that takes one: full prefill, LazyLLM,
            kvp-prefix; the others run the whole prompt), and the exact K/V this generation
            computed is stored. ``Timing.cached_tokens`` says how many prompt tokens were reused.
        sampling: :class:`~fastprefill.sampling.SamplingParams` (``None``: one greedy answer):
            temperature, top-p/k, min-p, seed, penalties, stop strings (cut from the text),
            ``min_tokens``, log-probabilities, ``n`` answers from one prefill.

    Returns:
        The text, the generated ids, the :class:`Timing` and the first token's logits; every
        answer in ``answers``.

    Raises:
        PromptError, ConfigError, UnsupportedModelError: as :func:`prepare_prompt` says;
            ConfigError for a ``logit_bias`` id outside the vocabulary, or ``n > 1`` with a
            method that decodes with its own step.
    """
    params = sampling if sampling is not None else SamplingParams()
    events: list[list[StreamEvent]] = [[] for _ in range(params.n)]
    last: StreamEvent | None = None
    for last in stream(
        model, tokenizer, prompt, method, max_new_tokens, chat=chat, stop_at_eos=stop_at_eos, stop=stop,
        prefix_cache=prefix_cache, sampling=params,
    ):
        events[last.choice].append(last)
    assert last is not None and last.timing is not None
    answers = collect(events, tokenizer, params)
    return GenerationResult(text=answers[0].text, token_ids=answers[0].token_ids, timing=last.timing,
                            first_logits=last.first_logits, answers=answers,
                            prompt_logprobs=events[0][0].prompt_logprobs)
