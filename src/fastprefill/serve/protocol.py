"""The OpenAI-compatible wire format: request schemas, their sampling parameters, response bodies.

Requests are parsed from the raw body here (not by FastAPI) so that every refusal is a 400 in
OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) and so that prompt
text carries any byte that is not UTF-8 through to :func:`fastprefill.prompt.prepare_request`,
which refuses it with its own message (see :func:`prompt_bytes`).

A request's decoding fields become one :class:`~fastprefill.sampling.SamplingParams`
(:meth:`ChatRequest.sampling`, :meth:`CompletionRequest.sampling`), whose checks give the 400
that names the field. A field the schema does not know (``tools``, ``functions``, ...) is
refused with a 400 that names it; ``response_format`` is accepted only as ``{"type": "text"}``.
docs/serving.md has the table of every field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastprefill.engine import Timing
from fastprefill.errors import ConfigError
from fastprefill.host import cpu_info
from fastprefill.sampling import MAX_LOGPROBS, MAX_N, SamplingParams

__all__ = [
    "APIError",
    "ChatRequest",
    "CompletionRequest",
    "FastprefillOptions",
    "describe_errors",
    "parse_request",
    "prompt_bytes",
    "sse",
    "usage_block",
]

#: HTTP status -> the ``outcome`` label of ``fastprefill_requests_total`` (any other: ``error``).
OUTCOMES = {400: "bad_request", 404: "bad_request", 413: "too_large", 429: "queue_full", 503: "shutting_down",
            504: "timeout"}


class APIError(Exception):
    """A refusal with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, outcome: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self._outcome = outcome

    @property
    def outcome(self) -> str:
        """The ``outcome`` label: the one given, else by status (:data:`OUTCOMES`)."""
        return self._outcome or OUTCOMES.get(self.status, "error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def prompt_bytes(text: str) -> bytes:
    """The UTF-8 bytes of request text, keeping what was not valid UTF-8 invalid.

    The body is decoded with ``surrogateescape``, so a raw byte that is not UTF-8 arrives as a
    lone surrogate and goes back to that same byte here; a JSON ``\\ud800``-style escape (a
    lone surrogate, not text) becomes bytes that are not UTF-8 either. Either way
    :func:`fastprefill.prompt.prepare_request` refuses them.
    """
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


# --- requests ----------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FastprefillOptions(_Strict):
    """The extra body field ``"fastprefill"``: the prefill method, and ``ignore_eos`` to generate
    exactly ``max_tokens`` tokens (benchmarks; the same as the top-level ``ignore_eos``)."""

    method: str | None = None
    ignore_eos: bool = False


class StreamOptions(_Strict):
    """``include_usage``: a last chunk with the usage; ``continuous_usage_stats`` (vLLM's): the
    usage so far on every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str

    def check(self) -> None:
        if self.type != "text":
            raise APIError(400, f"response_format: type {self.type!r} is not supported (no constrained decoding); "
                                "give {\"type\": \"text\"} or leave it out", param="response_format")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # name, tool_call_id, ... are not used

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


_FINITE = {"allow_inf_nan": False}


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # None: greedy. OpenAI's default is 1; this server keeps greedy unless a request asks (docs/serving.md)
    temperature: float | None = Field(None, ge=0, **_FINITE)
    top_p: float | None = Field(None, gt=0, le=1, **_FINITE)
    top_k: int | None = None  # vLLM's: -1 or 0 is off
    min_p: float | None = Field(None, ge=0, le=1, **_FINITE)
    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: int | None = None
    presence_penalty: float | None = Field(None, **_FINITE)
    frequency_penalty: float | None = Field(None, **_FINITE)
    repetition_penalty: float | None = Field(None, **_FINITE)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's
    min_tokens: int = Field(0, ge=0)  # vLLM's
    fastprefill: FastprefillOptions = Field(default_factory=FastprefillOptions)
    # accepted, no effect on the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def budget(self) -> int | None:
        return self.max_tokens

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop: give at most 4 non-empty strings", param="stop")
        return stops

    def _logprobs(self) -> tuple[int | None, int | None]:
        """``(logprobs, prompt_logprobs)`` of :class:`SamplingParams`."""
        return None, None

    def sampling(self, vocab_size: int, max_tokens: int | None = None) -> SamplingParams:
        """The request's :class:`SamplingParams`, with ``max_tokens`` the server's budget for it.

        Raises:
            APIError: 400 naming the field of a value out of range (``min_tokens`` over
                ``max_tokens`` included), or a ``logit_bias`` key that is not a token id of the vocabulary.
        """
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab_size - 1})",
                               param="logit_bias")
            bias[int(key)] = value
        logprobs, prompt_logprobs = self._logprobs()
        fields = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "repetition_penalty": self.repetition_penalty, "n": self.n}
        try:
            return SamplingParams(
                **{k: v for k, v in fields.items() if v is not None},
                top_k=0 if self.top_k in (None, -1) else self.top_k, logit_bias=bias, stop=self.stops(),
                max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos or self.fastprefill.ignore_eos,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ConfigError as exc:
            field = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(exc).replace("SamplingParams.", "", 1), param=self._param(field)) from None

    def _param(self, field: str) -> str:
        return field


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: give logprobs: true with it", param="top_logprobs")
        if self.response_format is not None:
            self.response_format.check()
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def _param(self, field: str) -> str:
        return "top_logprobs" if field == "logprobs" else field


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def _logprobs(self) -> tuple[int | None, int | None]:
        if self.suffix:
            raise APIError(400, "suffix: not supported (no fill-in-the-middle)", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of: not supported; ask for n answers and choose among them", param="best_of")
        return self.logprobs, self.logprobs if self.echo and self.logprobs is not None else None

    def single_prompt(self, vocab_size: int = 2**63) -> str | list[int]:
        """The one prompt of the request: text, or token ids each in ``[0, vocab_size)`` (by
        default the int64 range: no larger integer can be a token id).

        Raises:
            APIError: 400 for a list of several prompts, or an id out of range.
        """
        p = self.prompt
        if not (isinstance(p, str) or (p and isinstance(p[0], int)) or not p):
            if len(p) != 1:
                raise APIError(400, f"prompt: one prompt per request, got a list of {len(p)}", param="prompt")
            p = p[0]
        if not isinstance(p, str) and p and not 0 <= min(p) <= max(p) < vocab_size:
            raise APIError(400, f"prompt: prompt ids must lie in [0, {vocab_size}); got {min(p)}..{max(p)}",
                           param="prompt")
        return p  # type: ignore[return-value]


def describe_errors(errors: Sequence[Any]) -> str:
    """Up to three of pydantic's (or FastAPI's) validation errors as ``"field: problem"`` text."""
    problems = []
    for err in errors[:3]:
        where = ".".join(str(x) for x in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            problems.append(f"{where}: unsupported field (this server does not implement it)")
        else:
            problems.append(f"{where}: {err['msg']}")
    return "; ".join(problems)


def parse_request(raw: bytes, schema: type[_Common]) -> _Common:
    """Parse a JSON body into ``schema``.

    Raises:
        APIError: 400 when the body is not a JSON object, is nested too deeply for the parser,
            holds a number too long to convert, or does not fit the schema.
    """
    try:
        data = json.loads(raw.decode("utf-8", "surrogateescape"))
    except RecursionError:
        raise APIError(400, "the body is nested too deeply to parse; a request needs only a few levels") from None
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
        raise APIError(400, f"the body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]["loc"]
        raise APIError(400, describe_errors(exc.errors()), param=str(first[0]) if first else None) from None


# --- responses ---------------------------------------------------------------------------------
def usage_block(timing: Timing, completion_tokens: int, queue_wait_s: float) -> dict[str, Any]:
    """OpenAI's usage counts (``prompt_tokens_details.cached_tokens``: prompt tokens the prefix
    cache served) plus ``fastprefill``: the method, what its prefill took, and what the prefix
    cache did (``off``, ``hit``, ``miss`` or ``not used: ...``; ``shared_tokens``: of the cached
    tokens, those a request running beside this one computed after it arrived), the dtype the
    model ran in and whether this CPU multiplies bfloat16 on native units."""
    return {
        "prompt_tokens": timing.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": timing.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": timing.cached_tokens},
        "fastprefill": {
            "method": timing.method,
            "prefix_cache": timing.prefix_cache,
            "shared_tokens": timing.shared_tokens,
            "ttft_s": timing.ttft_s,
            "queue_wait_s": queue_wait_s,
            "decode_s_per_token": timing.decode_s_per_token,
            "token_layer_fraction": timing.stats.fraction,
            "prefill_flops": timing.stats.flops,
            "dtype": timing.dtype,
            "bf16_native": cpu_info().bf16_native,
        },
    }


class ResponseIds:
    """The id, object names and creation time shared by a response and all its chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
