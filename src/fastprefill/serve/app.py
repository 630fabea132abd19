"""The FastAPI application: OpenAI-compatible routes over one model and one :class:`Worker`.

A completion request goes: body -> schema and greedy-only checks -> method (the server's, or
the request's ``"fastprefill": {"method": SPEC}``) -> :func:`fastprefill.engine.prepare_prompt`
(on a checker thread with its own tokenizer copy, so the worker's generation is never touched)
-> the bounded queue -> the worker. Every refusal before the queue is a 400 (404 for an unknown
model name, 429 when the queue is full) in OpenAI's error shape; nothing a request does changes
the server's state for the next one.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.engine import PromptInput, context_length, generate, prepare_prompt
from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.methods.base import DistributedMethod, Method
from fastprefill.methods.registry import METHODS, make_method, parse_spec
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ResponseIds,
    chunk_body,
    completion_body,
    parse_request,
    prompt_bytes,
    sse,
    usage_block,
)
from fastprefill.serve.worker import Failed, Finished, Job, Token, Worker, timeout_error

__all__ = ["PER_REQUEST_METHODS", "ServeConfig", "background", "create_app", "run"]

log = logging.getLogger(__name__)

#: Methods a request may build by name: their settings are plain values. The others (``kvp``
#: reads a checkpoint from the server's disk) serve only if named when the server starts.
PER_REQUEST_METHODS = frozenset({"full", "lazyllm", "random", "static", "gemfilter"})


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
    """

    model_name: str
    method: str = "full"
    allow_methods: tuple[str, ...] = field(default_factory=tuple)
    queue_size: int = 16
    timeout_s: float = 300.0
    max_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("queue_size", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")


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
    job is cancelled, so a disconnected client's generation stops at its next token."""

    def __init__(self, job: Job, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            self.job.resolve("cancelled")  # a no-op unless the client left before the end


def _error(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class Server:
    """One model behind the OpenAI routes (see :func:`create_app`)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ServeConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = ServeMetrics()
        self.methods = MethodTable(model, config.method, config.allow_methods)
        self.worker = Worker(model, tokenizer, self.metrics, config.queue_size)
        # prepare_prompt runs here, beside the worker's generation: on its own thread with its
        # own tokenizer (a fast tokenizer is not safe to share between threads)
        self._check_tokenizer = copy.deepcopy(tokenizer)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="fastprefill-check")
        self.created = int(time.time())

    # --- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self._checker.shutdown(wait=False, cancel_futures=True)

    def warm_up(self) -> None:
        """One short generation per method built at start (first calls are slow; a method that
        cannot run on this model fails here, not on the first request)."""
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = [(1000 + i) % vocab for i in range(64)]
        for _, method in self.methods.built.values():
            generate(self.model, self.tokenizer, ids, method, max_new_tokens=2)

    # --- validation (checker thread) -----------------------------------------------------------
    def _prepare(self, prompt: PromptInput, method: Method, max_tokens: int, chat: bool) -> torch.Tensor:
        try:
            return prepare_prompt(self.model, self._check_tokenizer, prompt, method,
                                  max_new_tokens=max_tokens, chat=chat)
        except FastprefillError as exc:
            raise APIError(400, str(exc)) from None

    def prompt_ids(self, req: ChatRequest | CompletionRequest, method: Method, max_tokens: int) -> torch.Tensor:
        """The request's ``(1, T)`` prompt ids, validated by :func:`~fastprefill.engine.prepare_prompt`."""
        if isinstance(req, CompletionRequest):
            prompt = req.single_prompt()
            return self._prepare(prompt_bytes(prompt) if isinstance(prompt, str) else prompt, method, max_tokens,
                                 chat=False)
        msgs = req.messages
        if len(msgs) == 1 and msgs[0].role == "user":  # exactly `generate(..., chat=True)`
            return self._prepare(prompt_bytes(msgs[0].text()), method, max_tokens, chat=True)
        tok = self._check_tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template, so a conversation must be one user "
                                "message; send raw text to /v1/completions", param="messages")
        from jinja2 import TemplateError

        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in msgs]
        try:
            text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise APIError(400, f"messages: the model's chat template refuses them: {exc}", param="messages") from None
        # The rendered conversation is checked as text (UTF-8, NUL characters, limits: with a BOS
        # the tokenizer may add, one token stricter), then as the ids the template itself gives
        # (the template holds the special tokens, so none are added).
        self._prepare(prompt_bytes(text), method, max_tokens, chat=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return self._prepare(ids, method, max_tokens, chat=False)

    # --- requests ------------------------------------------------------------------------------
    async def complete(self, request: Request, chat: bool) -> Response:
        arrived = time.monotonic()
        label = "invalid"
        try:
            req = parse_request(await request.body(), ChatRequest if chat else CompletionRequest)
            if req.model != self.config.model_name:
                raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                                    f"{self.config.model_name!r}", kind="not_found_error", param="model")
            req.check_greedy()
            stops = req.stops()
            label, method = self.methods.get(req.fastprefill.method)
            max_tokens = req.budget() or self.config.max_tokens
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._checker, self.prompt_ids, req, method, max_tokens)
            job = Job(ids, method, label, max_tokens, stops, req.fastprefill.ignore_eos, req.stream,
                      arrived, arrived + self.config.timeout_s, self.metrics, loop)
            self.worker.submit(job)
        except APIError as exc:
            self.metrics.requests.labels(label, exc.outcome).inc()
            return _error(exc)
        ids_ = ResponseIds(chat, self.config.model_name)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _JobStream(job, self._stream(job, ids_, usage))
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
            "status": "ok",
            "model": self.config.model_name,
            "method": self.methods.built[self.methods.default][1].describe(),
            "busy": self.worker.current is not None,
            "queue": {"waiting": self.worker.waiting, "capacity": self.config.queue_size},
            "timeout_s": self.config.timeout_s,
        }

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "fastprefill",
            "context_length": context_length(self.model),
        }]}


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``model`` (the worker starts and stops with the app's lifespan).

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed with
    ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s: %s", type(exc).__name__, exc)
        return _error(APIError(500, f"internal error ({type(exc).__name__}); the server log has the details",
                               kind="server_error"))

    return app


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted (one process: the model is loaded once)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)


@contextmanager
def background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a thread of this process (tests, notebooks); yields the base URL
    ``http://host:port`` once the server accepts connections, and stops it on exit."""
    import uvicorn

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
