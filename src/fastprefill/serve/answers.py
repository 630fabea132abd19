"""A request's answers on their way from the engine to the client: what the worker hands the
request (:class:`Token`, :class:`Finished`, gathered by :class:`Collector`) and their OpenAI wire
shapes (:class:`Responder`: choices, chunks, log-probabilities, ``echo``).

Log-probabilities are the engine's (:mod:`fastprefill.sampling`: the log-softmax of the model's
unprocessed logits). Chat completions give them as OpenAI's ``logprobs.content`` list; text
completions as the legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``
lists, where ``top_logprobs`` also holds the chosen token (as vLLM's do) and, with ``echo``, the
prompt's tokens come first (the first with ``None``: nothing predicts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from fastprefill.engine import Answer, StreamEvent, Timing, collect
from fastprefill.sampling import SamplingParams, TokenLogprob
from fastprefill.serve.protocol import ResponseIds, usage_block

__all__ = ["Collector", "Finished", "Responder", "Token"]

#: What a log-probability of minus infinity is sent as (JSON has no infinity; OpenAI's value).
LOGPROB_FLOOR = -9999.0


@dataclass
class Token:
    """Text to stream for answer ``choice`` (already cut before any stop string), the
    log-probabilities of the token it comes with, the tokens generated so far (all answers), and
    on the first token the prompt's log-probabilities (if asked)."""

    text: str
    choice: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Finished:
    """Every answer (as :func:`fastprefill.engine.generate` would give it), the tokens generated
    by all of them, the engine's timing, the queue wait and the prompt's log-probabilities (if asked)."""

    answers: list[Answer]
    completion_tokens: int
    timing: Timing
    queue_wait_s: float
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Collector:
    """The worker's side: a job's engine events gathered into answers.

    Args:
        params: the job's sampling parameters.
        tokenizer: decodes each answer's whole text when it ends (``None``: no text).
    """

    def __init__(self, params: SamplingParams, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.events: list[list[StreamEvent]] = [[] for _ in range(params.n)]
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.count = 0

    def add(self, event: StreamEvent) -> Token | None:
        """Take one event; the :class:`Token` to stream, or ``None`` when it adds nothing to send
        (no text and no log-probability; an answer's first token is always sent: it marks TTFT)."""
        self.events[event.choice].append(event)
        self.count += 1
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.text or event.index == 0 or event.logprob is not None:
            return Token(event.text, event.choice, [event.logprob] if event.logprob is not None else [], self.count,
                         event.prompt_logprobs)
        return None

    def finished(self, timing: Timing, queue_wait_s: float) -> Finished:
        """Every answer, its text decoded, with the generation's timing and the queue wait."""
        return Finished(collect(self.events, self.tokenizer, self.params), self.count, timing, queue_wait_s,
                        self.prompt_logprobs)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class Responder:
    """The wire shapes of one request's answers.

    Args:
        ids: the response's id and names.
        tokenizer: gives each token's text (``decode([id])``).
        echo: the prompt's text and ids, sent before each answer (text completions' ``echo``).
    """

    def __init__(self, ids: ResponseIds, tokenizer: PreTrainedTokenizerBase,
                 echo: tuple[str, list[int]] | None = None) -> None:
        self.ids = ids
        self.tokenizer = tokenizer
        self.echo = echo
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}  # answer -> text_offset of its next token (streamed completions)
        self._prompt_logprobs: list[TokenLogprob | None] | None = None

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8", "surrogatepass"))}

    def chat_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
        return {"content": [{**self._chat_entry(e.token_id, e.logprob),
                             "top_logprobs": [self._chat_entry(t, lp) for t, lp in e.top]} for e in entries]}

    def completion_logprobs(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                            offset: int = 0) -> dict[str, Any]:
        """The legacy ``logprobs`` of ``token_ids`` (``entries[i]`` for ``token_ids[i]``; ``None``:
        no log-probability), ``text_offset`` counted from ``offset`` characters."""
        tokens = [self._token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = [None if e is None else {**{self._token(t): _lp(lp) for t, lp in e.top},
                                       self._token(e.token_id): _lp(e.logprob)} for e in entries]
        return {"tokens": tokens, "token_logprobs": [None if e is None else _lp(e.logprob) for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def _logprobs(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob], first: bool,
                  prompt: Sequence[TokenLogprob | None] | None, offset: int) -> dict[str, Any]:
        if self.ids.chat:
            return self.chat_logprobs(entries)
        out = self.completion_logprobs(token_ids, entries, offset)
        if first and self.echo is not None and prompt is not None:
            head = self.completion_logprobs(self.echo[1], prompt)
            out = {key: head[key] + out[key] for key in out}
        return out

    def body(self, fin: Finished, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole (non-streamed) response: one choice per answer."""
        choices = []
        prompt_text = self.echo[0] if self.echo is not None else ""
        for i, answer in enumerate(fin.answers):
            logprobs = None if answer.logprobs is None else self._logprobs(
                answer.token_ids, answer.logprobs, True, fin.prompt_logprobs, len(prompt_text))
            if self.ids.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": answer.text},
                                "logprobs": logprobs, "finish_reason": answer.finish_reason})
            else:
                choices.append({"index": i, "text": prompt_text + answer.text, "logprobs": logprobs,
                                "finish_reason": answer.finish_reason})
        return {**self.ids.head(chunk=False), "choices": choices, "usage": usage}

    def chunk(self, token: Token, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """One streamed chunk of ``token``'s answer: the role (chat) or the echoed prompt and its
        log-probabilities (completions) with an answer's first chunk; ``usage`` (continuous usage) if given."""
        first = token.choice not in self._started
        self._started.add(token.choice)
        if token.prompt_logprobs is not None:
            self._prompt_logprobs = token.prompt_logprobs
        prompt = self._prompt_logprobs
        text = token.text
        if not self.ids.chat and first and self.echo is not None:
            text = self.echo[0] + text
        logprobs = None
        if token.logprobs:
            offset = self._offsets.get(token.choice, len(self.echo[0]) if self.echo is not None else 0)
            logprobs = self._logprobs([e.token_id for e in token.logprobs], token.logprobs, first, prompt, offset)
            if not self.ids.chat:  # the next token's text starts after this one's
                self._offsets[token.choice] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        if self.ids.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": token.choice, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        else:
            choice = {"index": token.choice, "text": text, "logprobs": logprobs, "finish_reason": None}
        return {**self.ids.head(chunk=True), "choices": [choice], **({"usage": usage} if usage else {})}

    def finish_chunks(self, fin: Finished, usage: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The last chunk of each answer: its ``finish_reason`` (and ``usage`` if given)."""
        out = []
        for i, answer in enumerate(fin.answers):
            body: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": answer.finish_reason}
            body.update({"delta": {}} if self.ids.chat else {"text": ""})
            out.append({**self.ids.head(chunk=True), "choices": [body], **({"usage": usage} if usage else {})})
        return out

    def usage_chunk(self, fin: Finished) -> dict[str, Any]:
        """The final usage chunk (``stream_options.include_usage``): no choices."""
        return {**self.ids.head(chunk=True), "choices": [],
                "usage": usage_block(fin.timing, fin.completion_tokens, fin.queue_wait_s)}


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage so far (``stream_options.continuous_usage_stats``, vLLM's)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
