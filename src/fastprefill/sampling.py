"""Per-request sampling: what a request asks for (:class:`SamplingParams`), how one answer picks
its next token from a row of logits (:class:`Sampler`), and one answer's state while it is
generated (:class:`Choice`: its sampler, its streamed text, stop strings and why it ended).

- **Greedy is the default.** :class:`SamplingParams` with nothing set is greedy decoding, and
  :meth:`Sampler.pick` is then exactly ``argmax`` of the row, the engine's tokens of before.
- **Processing is transformers'.** The penalties and warpers are transformers' own logits
  processors (``LogitsProcessorList``), in the order transformers' ``generate`` applies them:
  logit bias, repetition penalty, presence/frequency penalties (OpenAI's definition, which
  transformers lacks: :class:`PresenceFrequencyPenalty`), ``min_tokens``, then, when sampling,
  temperature, top-k, top-p and min-p. Sampling draws with ``torch.multinomial`` from the
  softmax of the processed row, as ``generate(do_sample=True)`` does, but from the request's
  own ``torch.Generator``: a seeded request gives the same tokens whatever else runs.
- **Log-probabilities** are those of the model: the log-softmax of the *unprocessed* logits row
  (vLLM's default, ``logprobs_mode="raw_logprobs"``), not of the row after penalties and
  temperature. The first generated token's come from the method's prefill logits, so a request
  shows the method's first-token distribution; :func:`prompt_logprobs` gives full prefill's over
  the prompt.

Each :class:`Sampler` owns its request's token history (prompt and generated ids), so a batched
decode step can call one sampler per row, each with its own parameters and generator.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fastprefill.errors import ConfigError, check_fields, is_int, is_number
from fastprefill.text import IncrementalDecoder, StopStrings

__all__ = ["GREEDY_BELOW", "MAX_LOGPROBS", "MAX_N", "Choice", "PresenceFrequencyPenalty", "Sampler",
           "SamplingParams", "TokenLogprob", "prompt_logprobs"]

#: A temperature below this is greedy decoding (vLLM's threshold).
GREEDY_BELOW = 1e-5
#: The most alternatives ``logprobs`` / ``prompt_logprobs`` may ask for per token (OpenAI's 20).
MAX_LOGPROBS = 20
#: The most answers one request may ask for (``n``).
MAX_N = 16


def _finite(value: object, low: float, high: float) -> bool:
    return is_number(value) and math.isfinite(value) and low <= value <= high


@dataclass(frozen=True)
class SamplingParams:
    """How one request's answers are decoded. Nothing set: one greedy answer.

    Attributes:
        temperature: ``0`` (below :data:`GREEDY_BELOW`) is greedy; otherwise sampling, the
            logits divided by it (``<= 100``).
        top_p: keep the smallest set of tokens whose probability adds up to ``top_p`` (``(0, 1]``).
        top_k: keep the ``top_k`` most likely tokens (``0``: all).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (``[0, 1]``).
        seed: seeds this request's generator (``None``: a random seed); answer ``i`` of ``n``
            uses ``seed + i``, as vLLM does.
        presence_penalty, frequency_penalty: OpenAI's penalties (``[-2, 2]``) on tokens already
            generated: ``logit -= frequency * count + presence * (count > 0)``.
        repetition_penalty: transformers' (CTRL's) penalty on every token of the prompt and the
            answer (``> 0``; ``1``: none).
        logit_bias: ``(token_id, bias)`` pairs added to the logits (bias in ``[-100, 100]``);
            a mapping is accepted and stored as pairs.
        stop: strings that end the answer, cut from it (not included); a string is one stop.
        max_tokens: tokens to generate at most, the first included (``None``: the caller's
            limit, e.g. the engine's ``max_new_tokens``).
        min_tokens: the end-of-sequence token and the stop strings cannot end the answer before
            this many tokens (vLLM's extension).
        ignore_eos: generate past the end-of-sequence token (vLLM's extension; benchmarks).
        logprobs: return each generated token's log-probability and this many most likely
            alternatives (``0``: the token's only; ``None``: none).
        prompt_logprobs: the same for every prompt token but the first (``None``: none): full
            prefill's, from one more forward over the prompt in chunks (:func:`prompt_logprobs`),
            outside TTFT.
        n: answers to generate from one prefill (``[1, MAX_N]``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(p) for p in self.logit_bias))

        def count(v: object, low: int, high: int | None = None, none: bool = False) -> bool:
            return (none and v is None) or is_int(v, low, high)

        check_fields(self, (
            ("temperature", _finite(self.temperature, 0, 100), "a finite number in [0, 100] (0: greedy)"),
            ("top_p", _finite(self.top_p, 0, 1) and self.top_p > 0, "a number in (0, 1]"),
            ("top_k", count(self.top_k, 0), "an integer >= 0 (0: no top-k)"),
            ("min_p", _finite(self.min_p, 0, 1), "a number in [0, 1]"),
            ("seed", count(self.seed, -(2**63), 2**64 - 1, none=True), "a 64-bit integer, or None"),
            ("presence_penalty", _finite(self.presence_penalty, -2, 2), "a number in [-2, 2]"),
            ("frequency_penalty", _finite(self.frequency_penalty, -2, 2), "a number in [-2, 2]"),
            ("repetition_penalty", _finite(self.repetition_penalty, 0, 100) and self.repetition_penalty > 0,
             "a number in (0, 100] (1: none)"),
            ("logit_bias", isinstance(self.logit_bias, tuple) and all(
                isinstance(p, tuple) and len(p) == 2 and is_int(p[0], 0) and _finite(p[1], -100, 100)
                for p in self.logit_bias), "pairs of a token id >= 0 and a bias in [-100, 100]"),
            ("stop", isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
             "non-empty strings"),
            ("max_tokens", count(self.max_tokens, 1, none=True), "an integer >= 1, or None"),
            ("min_tokens", count(self.min_tokens, 0) and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "an integer >= 0, at most max_tokens"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("logprobs", count(self.logprobs, 0, MAX_LOGPROBS, none=True), f"an integer in [0, {MAX_LOGPROBS}], or None"),
            ("prompt_logprobs", count(self.prompt_logprobs, 0, MAX_LOGPROBS, none=True),
             f"an integer in [0, {MAX_LOGPROBS}], or None"),
            ("n", count(self.n, 1, MAX_N), f"an integer in [1, {MAX_N}]"),
        ))

    @property
    def greedy(self) -> bool:
        """Whether the next token is the most likely one after processing (no draw)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def budget(self, default: int) -> int:
        """Tokens to generate at most per answer: :attr:`max_tokens`, else the caller's ``default``."""
        return self.max_tokens if self.max_tokens is not None else default

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of answer ``index`` of ``n``: the seed ``seed + index`` (wrapped to 64 bits)."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % 2**64)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a ``logit_bias`` token id outside ``[0, vocab_size)``.

        Raises:
            ConfigError: naming the id.
        """
        bad = [tid for tid, _ in self.logit_bias if tid >= vocab_size]
        if bad:
            raise ConfigError(f"SamplingParams.logit_bias: token id {bad[0]} is not in the model's vocabulary "
                              f"(ids 0..{vocab_size - 1})")


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties, as a transformers logits processor.

    ``scores[j] -= frequency * c[j] + presence * (c[j] > 0)``, where ``c[j]`` counts token ``j``
    among the generated tokens: ``input_ids[:, prompt_len:]`` (the prompt is not counted).

    Args:
        presence: the presence penalty.
        frequency: the frequency penalty.
        prompt_len: leading ids of ``input_ids`` that are the prompt.
    """

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence = float(presence)
        self.frequency = float(frequency)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``(B, L)``, ``scores`` ``(B, V)`` -> penalised ``(B, V)`` (a new tensor)."""
        out = input_ids[:, self.prompt_len:]  # (B, L - T)
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def build_processors(params: SamplingParams, prompt_len: int, eos_ids: Iterable[int],
                     device: torch.device | str = "cpu") -> LogitsProcessorList | None:
    """The processors ``params`` asks for, in transformers' ``generate`` order (``None``: none:
    plain greedy, or sampling at temperature 1 from the raw distribution). ``eos_ids``: the tokens ``min_tokens`` holds back (empty: no end token);
    ``device``: where the logits will be."""
    p, procs = params, LogitsProcessorList()
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[tid], float(bias)] for tid, bias in p.logit_bias]))
    if p.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty)))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(PresenceFrequencyPenalty(p.presence_penalty, p.frequency_penalty, prompt_len))
    eos = sorted(set(eos_ids))
    if p.min_tokens and eos:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, eos, device=str(device)))
    if not p.greedy:
        if p.temperature != 1:
            procs.append(TemperatureLogitsWarper(float(p.temperature)))
        if p.top_k:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1:
            procs.append(TopPLogitsWarper(float(p.top_p)))
        if p.min_p:
            procs.append(MinPLogitsWarper(float(p.min_p)))
    return procs if procs else None


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the most likely tokens at its place.

    Attributes:
        token_id: the token.
        logprob: its log-probability (log-softmax of the unprocessed logits).
        top: ``(token_id, logprob)`` of the most likely tokens, best first (as many as asked).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _logprob_entry(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """From a ``(V,)`` log-softmax row: ``token_id``'s entry with its ``k`` best alternatives."""
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, idx = torch.topk(logprobs, k)
        top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


class Sampler:
    """One answer's next-token choice: a logits row in, a token id out.

    Holds the answer's token history (the prompt, then every token picked), its processors and
    its own ``torch.Generator`` (seeded by ``params.seed``, else randomly), created on the first
    pick on the logits' device.

    Args:
        params: the answer's parameters (for answer ``i`` of ``n``: ``params.for_choice(i)``).
        prompt_ids: the prompt's ids, ``(T,)`` or ``(1, T)`` (a tensor or a list).
        eos_ids: end-of-sequence ids that ``min_tokens`` holds back (empty with ``ignore_eos``).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] | torch.Tensor,
                 eos_ids: Iterable[int] = ()) -> None:
        self.params = params
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
        self.prompt_len = int(ids.numel())
        self.processors = build_processors(params, self.prompt_len, eos_ids, ids.device)
        self._ids = ids  # (capacity,) on the prompt's device: the first `length` are the history
        self.length = self.prompt_len
        self.generator: torch.Generator | None = None

    @property
    def history(self) -> torch.Tensor:
        """``(1, L)``: the prompt's ids and every token picked."""
        return self._ids[: self.length].unsqueeze(0)

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed % 2**64)
        return self.generator

    @property
    def argmax_only(self) -> bool:
        """Whether a pick is its row's ``argmax`` and nothing else (greedy, no processor)."""
        return self.params.greedy and self.processors is None

    def pick(self, logits: torch.Tensor, argmax: int | None = None) -> tuple[int, TokenLogprob | None]:
        """The next token from ``logits``, the ``(V,)`` (or ``(1, V)``) row of the model's logits
        for it, and its :class:`TokenLogprob` if ``params.logprobs`` asks for one.

        Greedy with no processor (:attr:`argmax_only`): ``argmax(logits)``, or ``argmax`` when the
        caller read it already (a decode batch reads every row's in one transfer). Otherwise the
        processors (if any) run over ``(1, V)`` float32 scores, then ``argmax`` (greedy) or one
        ``torch.multinomial`` draw from their softmax with this sampler's generator (also with no
        processor: temperature 1 and nothing else samples from the model's own distribution).
        The token joins the history.
        """
        row = logits.reshape(-1)  # (V,)
        if self.argmax_only:
            token = int(torch.argmax(row)) if argmax is None else argmax
        else:
            scores = row.float().reshape(1, -1).clone()  # (1, V)
            if self.processors is not None:
                scores = self.processors(self.history.to(row.device), scores)
            if self.params.greedy:
                token = int(torch.argmax(scores))
            else:
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self._generator(probs.device)))
        entry = None
        if self.params.logprobs is not None:
            entry = _logprob_entry(torch.log_softmax(row.float(), dim=-1), token, self.params.logprobs)
        self._append(token)
        return token, entry

    def _append(self, token: int) -> None:
        if self.length == self._ids.numel():  # grow by doubling: appends cost O(1) on average
            self._ids = torch.cat([self._ids, torch.empty_like(self._ids[: max(16, self.length)])])
        self._ids[self.length] = token
        self.length += 1


class Choice:
    """One answer while it is generated: its :class:`Sampler`, its text and why it ended.

    Feed it the logits of each step (:meth:`pick`) and then the token picked (:meth:`push`),
    which returns the token's text as a stream may send it: whole characters
    (:class:`~fastprefill.text.IncrementalDecoder`) and never a part of a stop string
    (:class:`~fastprefill.text.StopStrings`). :attr:`finish_reason` is set by the token that
    ends the answer: ``"stop"`` (an end-of-sequence token, a stop string, or ``until``), or
    ``"length"`` (``budget`` tokens).

    Args:
        params: the request's parameters (this answer's seed is derived from ``index``).
        index: which of the request's ``n`` answers.
        prompt_ids: the prompt's ``(T,)`` or ``(1, T)`` ids.
        eos_ids: tokens that end the answer (empty: none, as with ``ignore_eos``).
        budget: tokens to generate at most, the first included.
        tokenizer: decodes the text (``None``: no text).
        until: called with the answer's text so far (before stop strings are cut) after each
            token; True ends the answer (the engine's ``stop`` predicate).
    """

    def __init__(self, params: SamplingParams, index: int, prompt_ids: Sequence[int] | torch.Tensor,
                 eos_ids: Iterable[int], budget: int, tokenizer: Any = None,
                 until: Callable[[str], bool] | None = None) -> None:
        self.index = index
        self.eos = frozenset(eos_ids)
        self.sampler = Sampler(params.for_choice(index), prompt_ids, self.eos)
        self.min_tokens = params.min_tokens
        self.budget = budget
        self.until = until
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.detok = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.stops = StopStrings(params.stop)
        self.finish_reason: str | None = None

    def pick(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """The next token from the ``(V,)`` logits row (see :meth:`Sampler.pick`; ``argmax``: the
        row's, when the caller read it already)."""
        token, entry = self.sampler.pick(logits, argmax)
        self.ids.append(token)
        if entry is not None:
            self.logprobs.append(entry)
        return token

    def push(self, token: int) -> str:
        """The text ``token`` (the last one picked) adds, safe to stream; sets
        :attr:`finish_reason` if it ends the answer (the text then includes every held-back tail)."""
        armed = len(self.ids) > self.min_tokens
        raw = self.detok.push(token) if self.detok is not None else ""
        out = self.stops.feed(raw, armed)
        if self.stops.hit or token in self.eos or (self.until is not None and self.until(self.stops.text)):
            self.finish_reason = "stop"
        elif len(self.ids) >= self.budget:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            if self.detok is not None:
                out += self.stops.feed(self.detok.flush(), armed)
            out += self.stops.flush()
        return out

    def text(self, decoded: str) -> str:
        """The answer's text from ``decoded`` (a decode of :attr:`ids`), cut before its stop string."""
        return self.stops.cut(decoded)


def prompt_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, top: int,
                    chunk: int = 256) -> list[TokenLogprob | None]:
    """Full prefill's log-probability of each prompt token given the ones before it.

    One more forward of the model over the ``(1, T)`` prompt, ``chunk`` tokens at a time (so at
    most ``(chunk, V)`` logits exist at once), each chunk over the K/V of the ones before in a
    cache of its own. In float32 that equals one forward pass over the whole prompt to rounding;
    in bfloat16 the chunked forward rounds differently from one pass, so the values are close
    to a single pass's, not bit-for-bit equal.

    Returns:
        ``T`` entries: ``None`` for the first token (nothing predicts it, as in OpenAI's and
        vLLM's answers), then a :class:`TokenLogprob` with ``top`` alternatives for each other.
    """
    ids = input_ids.reshape(1, -1)
    n = int(ids.shape[1])
    entries: list[TokenLogprob | None] = [None]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for start in range(0, n - 1, chunk):
            part = ids[:, start: min(start + chunk, n - 1)]  # the last token predicts nothing asked
            logits = model(input_ids=part, past_key_values=cache, use_cache=True).logits[0].float()  # (c, V)
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = ids[0, start + 1: start + 1 + part.shape[1]].tolist()
            entries.extend(_logprob_entry(row, tid, top) for row, tid in zip(logprobs, targets, strict=True))
    return entries
