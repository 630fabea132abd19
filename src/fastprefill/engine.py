"""Generation engine: prefill through a method, decoding (greedy unless sampling is asked for), honest timings.

- Every prompt is validated first by :func:`fastprefill.prompt.prepare_generation`, the one
  validator (the ranks of a distributed generation call it too; the server's request processor
  checks the same, :mod:`fastprefill.serve.requests`).
- :class:`~fastprefill.events.TimingWindow` is the only clock (:func:`~fastprefill.host.device_clock`,
  which TTFT's span over several units of prefill reads too): on CUDA it synchronises the
  device before each read. TTFT runs from the start of prefill (the prompt ids already on the
  device) through the first token id (picked from the prefill logits); everything the method
  does for the first token is inside that window.
- Each token is picked by one call, :meth:`fastprefill.sampling.Choice.pick` on the step's
  ``(V,)`` logits row (``argmax`` when no sampling is asked for); ``n`` answers share one
  prefill, each decoding over its own copy of the prefill's cache (a :class:`Branch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.cache import fork_cache
from fastprefill.errors import UnsupportedModelError
from fastprefill.events import Answer, GenerationResult, StreamEvent, Timing, TimingWindow
from fastprefill.host import device_clock, dtype_name
from fastprefill.methods.base import ComputeStats, Decoder, Method, ModelDecoder, PrefillOutput
from fastprefill.prefix_cache import PrefixCache
from fastprefill.prompt import PromptInput, prepare_generation
from fastprefill.sampling import Choice, SamplingParams, TokenLogprob, prompt_logprobs
from fastprefill.units import Branch, LayeredUnit

__all__ = [
    "Answer",
    "Branch",
    "Generation",
    "GenerationResult",
    "LayeredUnit",
    "StreamEvent",
    "Timing",
    "TimingWindow",
    "collect",
    "decoder_for",
    "generate",
    "stream",
]


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
    """One generation of validated ids (``n`` answers from one prefill), driven one unit of work
    at a time.

    :func:`stream` runs it to the end at once (the whole prompt in one prefill); the server's
    scheduler (:mod:`fastprefill.serve.scheduler`) interleaves many: it calls :meth:`prefill`
    with a token budget, so a method that allows it (``Method.chunked_prefill``) prefills a long
    prompt chunk by chunk, each chunk a prefill over the K/V of the ones before (the prefix
    cache's hit path), and then :meth:`step` (or, for a token a batched decode step picked,
    :meth:`accept`) once per token of each answer. One path, so a chunked answer is the same
    computation as an unchunked one, and each answer picks its tokens with its own sampler
    whether it decodes alone or in a batch.

    Args:
        input_ids: ``(1, T)`` ids from :func:`prepare_generation` (or the server's request
            processor, which checks the same).
        method: the method that runs this prompt, as :func:`prepare_generation` resolved it.
        max_new_tokens, stop_at_eos, stop, prefix_cache, sampling: as :func:`generate`'s.
        name: how :attr:`Timing.method` names the method (``None``: its ``describe()``; the
            server gives ``Method.served_name()``).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, input_ids: torch.Tensor,
                 method: Method, max_new_tokens: int, *, stop_at_eos: bool = True,
                 stop: Callable[[str], bool] | None = None, prefix_cache: PrefixCache | None = None,
                 sampling: SamplingParams | None = None, name: str | None = None) -> None:
        self.model, self.tokenizer, self.input_ids, self.method = model, tokenizer, input_ids, method
        self.name = name if name is not None else method.describe()
        self.params = params = sampling if sampling is not None else SamplingParams()
        self.n_prompt = int(input_ids.shape[1])
        self.max_new_tokens = params.budget(max_new_tokens)
        self.prefix_cache = prefix_cache
        eos = _eos_ids(model, tokenizer) if stop_at_eos and not params.ignore_eos else set()
        self.choices = [Choice(params, i, input_ids, eos, self.max_new_tokens, tokenizer, stop)
                        for i in range(params.n)]
        self.uses_cache = prefix_cache is not None and method.takes_prefix
        self.cached_tokens = self.shared_tokens = 0  # prompt tokens the cache gave; of them, stored after admission
        self.lookup_s = 0.0
        self._seen: int | None = None  # the cache's stored-token count at the last lookup
        self.done_tokens = 0  # prompt tokens whose K/V is computed (or was cached)
        # tokens this generation put into the prefix cache, the seconds it took, the exact tokens offered so far
        self.stored_tokens, self.store_s, self._stored_upto = 0, 0.0, 0
        self.out: PrefillOutput | None = None
        self.branches: list[Branch] = []
        self.decode_s = 0.0
        self._cache: DynamicCache | None = None
        self._parts: list[ComputeStats] = []
        self._started: float | None = None
        self.ttft_s = 0.0
        self.first_logits: torch.Tensor | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    # --- prefill ---------------------------------------------------------------------------
    def lookup(self) -> int:
        """Look the prompt up in the prefix cache (inside TTFT); again before the first unit of prefill
        if blocks were stored since (by running requests: :attr:`shared_tokens`); returns :attr:`remaining`."""
        cache = self.prefix_cache if self.uses_cache and not self._parts else None
        if cache is not None and self._seen != (seen := cache.stats.stored_tokens):
            with torch.inference_mode(), TimingWindow(self.model.device) as lookup:
                hit = cache.lookup(self.model, self.input_ids, longer_than=self.cached_tokens)
            self.lookup_s += lookup.seconds
            self.shared_tokens += max(0, hit.tokens - self.cached_tokens) if self._seen is not None else 0
            self._seen = seen
            if hit.cache is not None:  # longer than the hit held (which is kept otherwise: no K/V copied again)
                self.cached_tokens = self.done_tokens = hit.tokens
                self._cache = hit.cache
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
        Once the last prompt token has run, every answer's first token is known
        (:meth:`first_events`). Returns the prompt tokens this call computed."""
        end = self._begin_unit(budget)
        with torch.inference_mode(), TimingWindow(self.model.device):  # synchronised: the clock below is honest
            ids = self.input_ids[:, :end]
            out = self.method.prefill(self.model, ids, self._cache) if self._cache is not None else (
                self.method.prefill(self.model, ids))
            if end == self.n_prompt:
                self.choices[0].pick(out.logits)
        return self._end_unit(out, end)

    def prefill_steps(self, budget: int | None = None) -> LayeredUnit:
        """The unit :meth:`prefill` would run, a layer at a time
        (:meth:`~fastprefill.methods.base.Method.prefill_steps`): whoever runs its steps (a
        :class:`~fastprefill.batch.DecodeBatch` step with other streams' rows beside it) then
        calls its ``finish`` with the ``(V,)`` logits of its last row, which does what the end of
        :meth:`prefill` does and returns the prompt tokens the unit computed.

        Raises:
            UnsupportedModelError: the method does not prefill a layer at a time.
        """
        started = self._started
        end = self._begin_unit(budget)
        try:
            layered = self.method.prefill_steps(self.model, self.input_ids[:, :end], self._cache)
        except UnsupportedModelError:
            self._started = started  # nothing ran: the TTFT clock starts with the first unit that does
            raise

        def finish(logits: torch.Tensor) -> int:
            out = layered.output(logits)
            if end == self.n_prompt:
                self.choices[0].pick(out.logits)
            return self._end_unit(out, end)

        return LayeredUnit(layered.steps, finish)

    def _begin_unit(self, budget: int | None) -> int:
        """Look up again, start the TTFT clock at the first unit; the prompt position the unit ends at."""
        self.lookup()
        if self._started is None:  # TTFT: the lookup, then every unit of prefill through the first token
            self._started = device_clock(self.model.device) - self.lookup_s
        todo = self.remaining if budget is None or not self.chunked else max(1, min(budget, self.remaining))
        return self.done_tokens + todo

    def _end_unit(self, out: PrefillOutput, end: int) -> int:
        """Keep a unit's output (the K/V so far, or the whole prefill's); the tokens it computed."""
        todo = end - self.done_tokens
        self._parts.append(out.stats)
        self.done_tokens = end
        if end < self.n_prompt:
            self._cache = out.cache  # the K/V so far: the next chunk's prefix, and visible to other requests
            self._store(self.input_ids[0, :end].tolist(), out.cache, min(out.exact_tokens, end))
            return todo
        self._cache = None
        self.out = dataclasses.replace(out, stats=_chunk_stats(self._parts))
        self.ttft_s = device_clock(self.model.device) - self._started
        self.first_logits = out.logits.detach().reshape(-1).to("cpu", torch.float32, copy=True)  # (V,)
        with torch.inference_mode():
            for choice in self.choices[1:]:  # the other answers' first tokens, from the same logits
                choice.pick(out.logits)
            self.branches = self._branches(self.out)
            if (top := self.params.prompt_logprobs) is not None:  # one more forward, outside TTFT
                self.prompt_logprobs = prompt_logprobs(self.model, self.input_ids, top)
        return todo

    def _branches(self, out: PrefillOutput) -> list[Branch]:
        """One :class:`Branch` per answer: the first decodes as :func:`decoder_for` says, each
        other with the model's forward over its own copy of the prefill's cache (made before any
        step appends to it)."""
        n = len(self.choices)
        assert n == 1 or out.decoder is None, "n > 1 with a method's own decode step (check_answers)"
        forks = [ModelDecoder(self.model, dataclasses.replace(out, cache=fork_cache(out.cache))) for _ in range(n - 1)]
        return [Branch(self, i, d, out.ragged) for i, d in enumerate([decoder_for(self.model, out), *forks])]

    @property
    def prefilled(self) -> bool:
        """Whether the prefill is done (the first tokens known)."""
        return self.out is not None

    # --- tokens ----------------------------------------------------------------------------
    @property
    def generated(self) -> list[int]:
        """The first answer's token ids so far."""
        return self.choices[0].ids

    @property
    def live(self) -> list[Branch]:
        """The answers still decoding."""
        return [b for b in self.branches if not b.finished]

    @property
    def finished(self) -> bool:
        """Whether every answer has ended (the last event carried the :class:`Timing`)."""
        return bool(self.branches) and not self.live

    def first_events(self) -> list[StreamEvent]:
        """Every answer's first token event (after the last unit of :meth:`prefill`)."""
        return [self.accept(b, 0.0) for b in self.branches]

    def step(self) -> list[StreamEvent]:
        """One decode step of every live answer, each alone: their next tokens' events."""
        assert self.prefilled and not self.finished
        self.publish()
        return [b.step() for b in self.live]

    def accept(self, branch: Branch, seconds: float) -> StreamEvent:
        """The event of the token ``branch`` has just picked (``seconds``: the decode step's time,
        0 for the first); the event that ends the last answer carries the :class:`Timing`."""
        choice = branch.choice
        self.decode_s += seconds
        index = len(choice.ids) - 1
        event = StreamEvent(choice.ids[-1], choice.push(choice.ids[-1]), index, choice=choice.index,
                            logprob=choice.logprobs[-1] if choice.logprobs else None,
                            finish_reason=choice.finish_reason,
                            prompt_logprobs=self.prompt_logprobs if choice.index == 0 and index == 0 else None)
        if branch.finished:
            if branch.on_finish is not None:
                branch.on_finish()
            if self.finished:
                event.timing, event.first_logits = self._finish(), self.first_logits
        return event

    def publish(self) -> None:
        """Store the prompt's exact whole blocks once the prefill is done, after the first tokens' events
        and before any decode step, so a request over the same prefix hits while this one decodes."""
        if self.out is not None:
            self._store(self.input_ids[0].tolist(), self.out.cache, self.out.exact_tokens)

    def _store(self, ids: list[int], cache: DynamicCache, exact_tokens: int) -> None:
        """Store the whole blocks of ``ids[:exact_tokens]`` from ``cache`` (counted in :attr:`stored_tokens`)."""
        if self.prefix_cache is None or exact_tokens <= max(self.cached_tokens, self._stored_upto):
            return
        with torch.inference_mode(), TimingWindow(self.model.device) as window:
            self.stored_tokens += self.prefix_cache.store(self.model, ids, cache, exact_tokens)
        self._stored_upto = exact_tokens
        self.store_s += window.seconds

    def _finish(self) -> Timing:
        """Store the exact K/V of the generated tokens (and the prompt's, if not yet) and time the whole."""
        out, n_prompt, first = self.out, self.n_prompt, self.choices[0].ids
        assert out is not None
        # the first answer's tokens fed through the model are exact too when the whole prompt was
        fed = first[:-1] if out.exact_tokens == n_prompt and out.decoder is None else []
        self._store(self.input_ids[0].tolist() + fed, out.cache, out.exact_tokens + len(fed))
        generated = sum(len(c.ids) for c in self.choices)
        steps = generated - len(self.choices)
        method = self.method
        return Timing(
            method=self.name, prompt_tokens=n_prompt, new_tokens=generated, ttft_s=self.ttft_s,
            decode_s_per_token=self.decode_s / steps if steps else None, total_s=self.ttft_s + self.decode_s,
            stats=out.stats, decode_extra=dict(self.branches[0].decoder.stats()), cached_tokens=self.cached_tokens,
            prefix_cache=("off" if self.prefix_cache is None else
                          f"not used: {method.name} takes no cached prefix" if not method.takes_prefix else
                          "hit" if self.cached_tokens else "miss"),
            stored_tokens=self.stored_tokens, prefix_lookup_s=self.lookup_s, prefix_store_s=self.store_s,
            shared_tokens=self.shared_tokens,
            dtype=dtype_name(self.model.dtype),
        )

    def close(self) -> None:
        """Stop early: drop the K/V. The whole blocks its finished units of prefill stored stay
        in the prefix cache; nothing of a unit that did not finish was stored."""
        self._cache, self.out, self.branches = None, None, []

    def run(self, chunk: int | None = None) -> Iterator[StreamEvent]:
        """The whole generation: the prompt in one prefill (or in units of ``chunk`` tokens,
        see :meth:`prefill`), then one decode step per token, the answers in turn."""
        while not self.prefilled:
            self.prefill(chunk)
        events = self.first_events()
        while True:
            yield from events
            if self.finished:
                return
            events = self.step()  # the first publishes the prompt's K/V


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
    (``stop`` is called with the text of the answer's events so far). TTFT runs from the
    prefix-cache lookup (or the prefill) through the first token's pick.
    """
    params = sampling if sampling is not None else SamplingParams()
    input_ids, method = prepare_generation(model, tokenizer, prompt, method, max_new_tokens, chat=chat,
                                           sampling=params)
    gen = Generation(model, tokenizer, input_ids, method, max_new_tokens, stop_at_eos=stop_at_eos, stop=stop,
                     prefix_cache=prefix_cache, sampling=params)
    try:
        yield from gen.run()
    finally:  # its K/V freed now, not at the next garbage collection (a generation and its branches form a cycle)
        gen.close()


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
        PromptError, ConfigError, UnsupportedModelError: as :func:`~fastprefill.prompt.prepare_request` says;
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
