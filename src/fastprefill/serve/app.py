"""The FastAPI application: OpenAI-compatible routes over one model and one :class:`Worker`.

A completion request goes: body (at most ``--max-body-mb``) -> schema and greedy-only checks ->
method (the server's, or the request's ``"fastprefill": {"method": SPEC}``) -> the prompt's
length in characters against what the context can hold (:mod:`fastprefill.serve.limits`) ->
:func:`fastprefill.engine.prepare_prompt` (on one of :data:`CHECK_THREADS` checker threads, each
with its own tokenizer copy, so neither the worker's generation nor other requests wait for a
long tokenization) -> the bounded queue -> the worker. Every refusal is answered in OpenAI's
error shape: 400 (404 for an unknown model name or route, 405 for a wrong HTTP method, 413 for
a body over the limit, 429 when the queue is full, 503 while shutting down, 500 for an
unexpected failure, which the server log details); nothing a request does changes the server's
state for the next one.

Shutdown (SIGTERM or SIGINT under :func:`run`): the server stops taking requests (503), fails
the waiting ones with 503, lets the running generation finish for up to ``--drain-timeout``
seconds and then ends it with an error event, and exits once the answers are out: within
``--drain-timeout`` + :data:`EXIT_GRACE_S` seconds. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.engine import PromptInput, context_length, generate, prepare_prompt
from fastprefill.errors import ConfigError, FastprefillError, check_fields
from fastprefill.methods.base import DistributedMethod, Method
from fastprefill.methods.registry import METHODS, make_method, parse_spec
from fastprefill.serve.limits import prompt_char_limit, read_body
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ResponseIds,
    chunk_body,
    completion_body,
    describe_errors,
    parse_request,
    prompt_bytes,
    sse,
    usage_block,
)
from fastprefill.serve.worker import Failed, Finished, Job, Token, Worker, internal_error, timeout_error

__all__ = ["PER_REQUEST_METHODS", "ServeConfig", "background", "create_app", "run"]

log = logging.getLogger(__name__)

#: Methods a request may build by name: their settings are plain values. The others (``kvp``
#: reads a checkpoint from the server's disk) serve only if named when the server starts.
PER_REQUEST_METHODS = frozenset({"full", "lazyllm", "random", "static", "gemfilter"})
#: Methods that run over several processes (a rank pool or torchrun): this server cannot run them.
MULTI_RANK_METHODS = frozenset({"runahead", "tsp"})
#: Threads (each with its own tokenizer copy) that validate and tokenize prompts beside the worker.
CHECK_THREADS = 4
#: Seconds a shutdown gives the last answers to be sent once the drain timeout has passed.
DRAIN_GRACE_S = 2.0
#: Seconds uvicorn then gives open connections to close.
CLOSE_GRACE_S = 3.0
#: Seconds the worker thread then gets to stop (it is a daemon: a prefill cannot hold the process).
WORKER_JOIN_S = 2.0
#: What a shutdown may take past ``--drain-timeout``: the three grace periods above.
EXIT_GRACE_S = DRAIN_GRACE_S + CLOSE_GRACE_S + WORKER_JOIN_S
#: What routes exist, for the message of a 404.
ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
          "GET /health", "GET /metrics")


@dataclass(frozen=True)
class ServeConfig:
    """Settings of one server.

    Attributes:
        model_name: the name requests give as ``model`` (and ``/v1/models`` lists).
        method: the default method spec (``"full"``, ``"lazyllm:preset=default"``, ...).
        allow_methods: more specs built at start that requests may name (e.g. ``kvp:predictor=DIR``).
        queue_size: requests that may wait while one generates (>= 1); more get 429.
        timeout_s: seconds a request may take from arrival, queue wait included (> 0).
        max_tokens: tokens to generate when a request gives no ``max_tokens`` (>= 1).
        max_body_mb: the largest request body in MiB (> 0); a larger one gets 413 before it is read.
        drain_timeout_s: on SIGTERM/SIGINT, seconds the running generation may go on (>= 0)
            before it is ended with an error (see the module docstring).
    """

    model_name: str
    method: str = "full"
    allow_methods: tuple[str, ...] = field(default_factory=tuple)
    queue_size: int = 16
    timeout_s: float = 300.0
    max_tokens: int = 256
    max_body_mb: float = 8.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        def seconds(v: object, low: float) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low

        check_fields(self, (
            ("queue_size", count(self.queue_size), "an integer >= 1"),
            ("max_tokens", count(self.max_tokens), "an integer >= 1"),
            ("timeout_s", seconds(self.timeout_s, 0) and self.timeout_s > 0, "a finite number of seconds > 0"),
            ("max_body_mb", seconds(self.max_body_mb, 0) and self.max_body_mb > 0, "a finite number > 0"),
            ("drain_timeout_s", seconds(self.drain_timeout_s, 0), "a finite number of seconds >= 0"),
        ))

    @property
    def max_body_bytes(self) -> int:
        """``max_body_mb`` in bytes."""
        return int(self.max_body_mb * 2**20)


class MethodTable:
    """The default method, the ones built at start, and per-request ones built by name."""

    def __init__(self, model: PreTrainedModel, default: str, allowed: Sequence[str]) -> None:
        self.default = default.strip()
        self.built: dict[str, tuple[str, Method]] = {}
        for spec in (self.default, *(s.strip() for s in allowed)):
            name, _ = parse_spec(spec)
            method = make_method(spec)
            if isinstance(method, DistributedMethod):
                raise ConfigError(
                    f"{spec!r} runs over several ranks; the server runs one model in one process. Serve a "
                    "single-process method, and run KV-Runahead/TSP with `python -m fastprefill.launch` (or torchrun)"
                )
            method.check_model(model)
            self.built[spec] = (name, method)

    def get(self, spec: str | None) -> tuple[str, Method]:
        """``(registry name, method)`` for a request's spec (``None``: the default).

        Raises:
            APIError: 400 for an unknown or badly formed spec, or one not allowed per request.
        """
        spec = self.default if spec is None else spec.strip()
        if spec in self.built:
            return self.built[spec]
        try:
            name, _ = parse_spec(spec)
            if name in MULTI_RANK_METHODS:
                raise APIError(400, f"fastprefill.method: {name} runs over several processes and is not "
                                    "available in this server; run it with `python -m fastprefill.launch` "
                                    "(or torchrun)", param="fastprefill.method")
            if name in METHODS and name not in PER_REQUEST_METHODS:
                raise APIError(400, f"fastprefill.method: a request may name {sorted(PER_REQUEST_METHODS)} "
                                    f"or a spec the server was started with ({sorted(self.built)}), not "
                                    f"{spec!r}; start the server with --allow-method {spec!r} to offer it",
                               param="fastprefill.method")
            return name, make_method(spec)
        except FastprefillError as exc:
            raise APIError(400, f"fastprefill.method: {exc}", param="fastprefill.method") from None


class _JobStream(StreamingResponse):
    """Server-sent events of one job; when the response ends (done, or the client gone) the
    job is cancelled, so a disconnected client's generation stops at its next token, and
    ``on_end`` is called."""

    def __init__(self, job: Job, content: AsyncIterator[bytes], on_end: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            self.job.resolve("cancelled")  # a no-op unless the client left before the end
            self.on_end()


def _error(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    if exc.status in (429, 503):
        headers = {**(headers or {}), "Retry-After": "1"}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _shutting_down() -> APIError:
    """The 503 of a request that arrives, or waits, while the server shuts down."""
    return APIError(503, "the server is shutting down; retry on another server or once it is back",
                    kind="server_error")


def _cut_short() -> APIError:
    return APIError(503, "the server shut down before this answer was complete (its drain timeout "
                         "passed); retry on another server or once it is back", kind="server_error")


class Server:
    """One model behind the OpenAI routes (see :func:`create_app`)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ServeConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = ServeMetrics()
        self.methods = MethodTable(model, config.method, config.allow_methods)
        self.worker = Worker(model, tokenizer, self.metrics, config.queue_size)
        self.context = context_length(model)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        #: characters over which a prompt cannot fit the context (None: the tokenizer gives no safe bound)
        self.max_prompt_chars = prompt_char_limit(tokenizer, self.context)
        # prepare_prompt runs beside the worker's generation on the checker threads, each call
        # with a tokenizer copy of its own (a fast tokenizer is not safe to share between threads)
        self._check_tokenizers: queue.SimpleQueue[PreTrainedTokenizerBase] = queue.SimpleQueue()
        for _ in range(CHECK_THREADS):
            self._check_tokenizers.put(copy.deepcopy(tokenizer))
        self._checker = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="fastprefill-check")
        self.created = int(time.time())
        self.draining = False
        self.active = 0  # completion requests being answered (a stream until its last event)

    # --- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        """Fail what is waiting or running with 503 and stop the worker (the app's shutdown)."""
        self.draining = True
        self.worker.stop(_shutting_down(), timeout=WORKER_JOIN_S)
        self._checker.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests (503), fail the waiting ones with 503, give the running
        generation up to ``timeout_s`` seconds and then end it with a 503 error, and wait up to
        :data:`DRAIN_GRACE_S` more seconds for the last answers to be sent."""
        self.draining = True
        self.worker.close(_shutting_down())
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if (job := self.worker.current) is not None:
            job.fail(_cut_short())
        deadline = time.monotonic() + DRAIN_GRACE_S
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def warm_up(self) -> None:
        """One short generation per method built at start (first calls are slow; a method that
        cannot run on this model fails here, not on the first request)."""
        ids = [(1000 + i) % self.vocab_size for i in range(64)]
        for _, method in self.methods.built.values():
            generate(self.model, self.tokenizer, ids, method, max_new_tokens=2)

    # --- validation ----------------------------------------------------------------------------
    def check_length(self, text: str, param: str) -> None:
        """Refuse ``text`` (what will be tokenized, or a part of it that the tokenizer keeps)
        if it has more characters than the model's context can hold: no tokenization needed.

        Raises:
            APIError: 400.
        """
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"the prompt has {len(text)} characters, more than the model's context of "
                                f"{self.context} tokens can hold (at most {limit} characters); shorten it",
                           param=param)

    def check_lengths(self, req: ChatRequest | CompletionRequest) -> None:
        """:meth:`check_length` on what can be counted before the chat template runs: a text
        prompt, or the one user message (stripped: a template may trim it)."""
        if isinstance(req, CompletionRequest):
            prompt = req.single_prompt(self.vocab_size)
            if isinstance(prompt, str):
                self.check_length(prompt, "prompt")
        elif len(req.messages) == 1 and req.messages[0].role == "user":
            self.check_length(req.messages[0].text().strip(), "messages")

    def _prepare(self, tok: PreTrainedTokenizerBase, prompt: PromptInput, method: Method, max_tokens: int,
                 chat: bool) -> torch.Tensor:
        try:
            return prepare_prompt(self.model, tok, prompt, method, max_new_tokens=max_tokens, chat=chat)
        except FastprefillError as exc:
            raise APIError(400, str(exc)) from None

    def prompt_ids(self, req: ChatRequest | CompletionRequest, method: Method, max_tokens: int) -> torch.Tensor:
        """The request's ``(1, T)`` prompt ids, validated by :func:`~fastprefill.engine.prepare_prompt`
        (a checker thread runs this)."""
        tok = self._check_tokenizers.get()
        try:
            return self._prompt_ids(tok, req, method, max_tokens)
        finally:
            self._check_tokenizers.put(tok)

    def _prompt_ids(self, tok: PreTrainedTokenizerBase, req: ChatRequest | CompletionRequest, method: Method,
                    max_tokens: int) -> torch.Tensor:
        if isinstance(req, CompletionRequest):
            prompt = req.single_prompt(self.vocab_size)
            return self._prepare(tok, prompt_bytes(prompt) if isinstance(prompt, str) else prompt, method,
                                 max_tokens, chat=False)
        msgs = req.messages
        if len(msgs) == 1 and msgs[0].role == "user":  # exactly `generate(..., chat=True)`
            return self._prepare(tok, prompt_bytes(msgs[0].text()), method, max_tokens, chat=True)
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template, so a conversation must be one user "
                                "message; send raw text to /v1/completions", param="messages")
        from jinja2 import TemplateError

        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in msgs]
        try:
            text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise APIError(400, f"messages: the model's chat template refuses them: {exc}", param="messages") from None
        self.check_length(text, "messages")
        # The rendered conversation is checked as text (UTF-8, NUL characters, limits: with a BOS
        # the tokenizer may add, one token stricter), then as the ids the template itself gives
        # (the template holds the special tokens, so none are added).
        self._prepare(tok, prompt_bytes(text), method, max_tokens, chat=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return self._prepare(tok, ids, method, max_tokens, chat=False)

    # --- requests ------------------------------------------------------------------------------
    async def complete(self, request: Request, chat: bool) -> Response:
        """Answer one completion request (counted in :attr:`active` until its answer is out)."""
        self.active += 1
        response: Response | None = None
        try:
            response = await self._complete(request, chat)
            return response
        finally:
            if not isinstance(response, _JobStream):  # a stream counts until its end (see _ended)
                self.active -= 1

    def _ended(self) -> None:
        self.active -= 1

    async def _complete(self, request: Request, chat: bool) -> Response:
        arrived = time.monotonic()
        label = "invalid"
        try:
            if self.draining:
                raise _shutting_down()
            req = parse_request(await read_body(request, self.config.max_body_bytes),
                                ChatRequest if chat else CompletionRequest)
            self.check_model(req.model)
            req.check_greedy()
            stops = req.stops()
            label, method = self.methods.get(req.fastprefill.method)
            max_tokens = req.budget() or self.config.max_tokens
            self.check_lengths(req)
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._checker, self.prompt_ids, req, method, max_tokens)
            job = Job(ids, method, label, max_tokens, stops, req.fastprefill.ignore_eos, req.stream,
                      arrived, arrived + self.config.timeout_s, self.metrics, loop)
            self.worker.submit(job)
        except APIError as exc:
            self.metrics.requests.labels(label, exc.outcome).inc()
            return _error(exc)
        except ClientDisconnect:  # gone while sending its body: nobody reads an answer
            self.metrics.requests.labels(label, "cancelled").inc()
            return Response(status_code=499)
        except Exception as exc:  # a bug, not the request's fault: answered and counted all the same
            log.exception("request failed before generation")
            error = internal_error(exc)
            self.metrics.requests.labels(label, error.outcome).inc()
            return _error(error)
        ids_ = ResponseIds(chat, self.config.model_name)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _JobStream(job, self._stream(job, ids_, usage), self._ended)
        while True:
            event = await self._next(job, request)
            if event is None:  # the client has gone: nobody reads this
                return Response(status_code=499)
            if isinstance(event, Failed):
                return _error(event.error)
            if isinstance(event, Finished):
                usage_ = usage_block(event.timing, event.completion_tokens, event.queue_wait_s)
                return JSONResponse(completion_body(ids_, event.text, event.finish_reason, usage_))

    async def _next(self, job: Job, request: Request | None) -> Token | Finished | Failed | None:
        """The job's next event; a timeout error at its deadline; ``None`` if ``request``'s
        client disconnects (polled twice a second; a stream's disconnect cancels it instead)."""
        while True:
            left = job.deadline - time.monotonic()
            try:
                return await asyncio.wait_for(job.events.get(), timeout=max(0.0, min(0.5, left)))
            except TimeoutError:
                pass
            if time.monotonic() >= job.deadline and job.resolve("timeout"):
                job.cancel()
                return Failed(timeout_error(self.config.timeout_s))
            if request is not None and await request.is_disconnected():
                job.cancel()
                job.resolve("cancelled")
                return None

    async def _stream(self, job: Job, ids: ResponseIds, include_usage: bool) -> AsyncIterator[bytes]:
        first = True
        while True:
            event = await self._next(job, None)
            if isinstance(event, Token):  # the first one comes with the first token (clients time TTFT by it)
                yield sse(chunk_body(ids, event.text, role=first))
                first = False
                continue
            if isinstance(event, Failed):
                yield sse(event.error.body())
            elif isinstance(event, Finished):
                yield sse(chunk_body(ids, "", event.finish_reason))
                if include_usage:
                    yield sse(chunk_body(ids, None, usage=usage_block(event.timing, event.completion_tokens,
                                                                      event.queue_wait_s)))
            yield sse("[DONE]")
            return

    def health(self) -> dict[str, Any]:
        return {
            "status": "draining" if self.draining else "ok",
            "model": self.config.model_name,
            "method": self.methods.built[self.methods.default][1].describe(),
            "busy": self.worker.current is not None,
            "queue": {"waiting": self.worker.waiting, "capacity": self.config.queue_size},
            "timeout_s": self.config.timeout_s,
        }

    def model_card(self) -> dict[str, Any]:
        """The served model as OpenAI's model object (plus ``context_length``)."""
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "fastprefill",
                "context_length": self.context}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def check_model(self, model_id: str) -> None:
        """Refuse any model id but the served one.

        Raises:
            APIError: 404.
        """
        if model_id != self.config.model_name:
            raise APIError(404, f"model {model_id!r} is not served here; this server serves "
                                f"{self.config.model_name!r}", kind="not_found_error", param="model")

    def model_info(self, model_id: str) -> dict[str, Any]:
        """:meth:`model_card` if ``model_id`` names the served model (else a 404 :class:`APIError`)."""
        self.check_model(model_id)
        return self.model_card()


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``model`` (the worker starts and stops with the app's lifespan).

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed with
    ``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health`` (503
    while shutting down), ``GET /metrics`` (Prometheus). Every error, an unknown route or a
    wrong HTTP method included, is answered in OpenAI's error shape.

    Raises:
        ConfigError: a method spec that does not parse; UnsupportedModelError: a method that
            does not support the model.
    """
    server = Server(model, tokenizer, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="fastprefill", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.complete(request, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model_(model_id: str) -> dict[str, Any]:
        return server.model_info(model_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(server.health(), status_code=503 if server.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def refused(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"{where}: no such route; this server serves {', '.join(ROUTES)}"
        elif exc.status_code == 405:
            message = f"{where}: method not allowed here; use {(exc.headers or {}).get('Allow', 'another method')}"
        else:
            message = f"{where}: {exc.detail}"
        return _error(APIError(exc.status_code, message), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(APIError(400, describe_errors(exc.errors())))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s: %s", type(exc).__name__, exc)
        error = internal_error(exc)
        server.metrics.requests.labels("invalid", error.outcome).inc()
        return _error(error)

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn's server; the first SIGTERM or SIGINT drains the app's :class:`Server`
    (:meth:`Server.drain` with its ``drain_timeout_s``) before uvicorn shuts down, a second one
    is uvicorn's own handling (shut down now)."""

    def __init__(self, config: uvicorn.Config, app_server: Server) -> None:
        super().__init__(config)
        self.app_server = app_server
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.warning("shutting down: draining for at most %g s (a second signal stops at once)",
                    self.app_server.config.drain_timeout_s)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.app_server.drain(self.app_server.config.drain_timeout_s)
        finally:
            self.should_exit = True


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Serve ``app`` (made by :func:`create_app`) with uvicorn until SIGTERM or SIGINT, then
    shut down as the module docstring says (one process: the model is loaded once)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=CLOSE_GRACE_S)
    _DrainingServer(config, app.state.server).run()


@contextmanager
def background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a thread of this process (tests, notebooks); yields the base URL
    ``http://host:port`` once the server accepts connections, and stops it on exit (without a
    drain: what is waiting or running is answered 503)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="fastprefill-uvicorn",
                              daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread ended before it started (see the log above)")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
