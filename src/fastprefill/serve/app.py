"""The FastAPI application: OpenAI-compatible routes over one model and one
:class:`~fastprefill.serve.scheduler.Scheduler`.

A completion request goes: body (at most ``--max-body-mb``) -> one prepared
:class:`~fastprefill.serve.worker.Job` (:meth:`fastprefill.serve.requests.RequestProcessor.process`:
schema, model, sampling, method, prompt tokenized and validated, method resolved, then its
backend) -> the scheduler's bounded queue. Every refusal is answered in OpenAI's error shape: 400
(404 for an unknown model name or route, 405 for a wrong HTTP method, 413 for a body over the
limit, 429 when the queue is full, 503 while shutting down, 500 for an unexpected failure, which
the server log details); nothing a request does changes the server's state for the next one.

Shutdown (SIGTERM or SIGINT under :func:`run`): the server stops taking requests (503), fails
the waiting ones with 503, lets the running generations finish for up to ``--drain-timeout``
seconds and then ends them with an error event, and exits once the answers are out: within
``--drain-timeout`` + :data:`EXIT_GRACE_S` seconds. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.host import dtype_name, precision_report
from fastprefill.prefix_cache import PrefixCache, PrefixCacheError
from fastprefill.serve.answers import Finished, Responder, Token, running_usage
from fastprefill.serve.backends import Backends
from fastprefill.serve.config import ServeConfig
from fastprefill.serve.executor import ModelExecutor
from fastprefill.serve.health import http_status, method_states, ranks_health, server_status
from fastprefill.serve.limits import read_body
from fastprefill.serve.method_table import MethodTable
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.policies import make_policy
from fastprefill.serve.protocol import APIError, ResponseIds, StreamOptions, describe_errors, sse, usage_block
from fastprefill.serve.ranks import ServedPool
from fastprefill.serve.requests import Refused, RequestProcessor
from fastprefill.serve.scheduler import Scheduler
from fastprefill.serve.worker import Failed, Job, internal_error, ranks_down

__all__ = ["Server", "create_app"]

log = logging.getLogger(__name__)

#: Seconds a shutdown gives the last answers to be sent once the drain timeout has passed.
DRAIN_GRACE_S = 2.0
#: Seconds uvicorn then gives open connections to close.
CLOSE_GRACE_S = 3.0
#: Seconds the scheduler thread then gets to stop (a daemon: a prefill cannot hold the process).
WORKER_JOIN_S = 2.0
#: What a shutdown may take past ``--drain-timeout``: the three grace periods above.
EXIT_GRACE_S = DRAIN_GRACE_S + CLOSE_GRACE_S + WORKER_JOIN_S
#: Seconds between two checks of an idle rank pool (``/health`` sees a dead local rank at once).
RANK_WATCH_S = 0.5
#: What routes exist, for the message of a 404.
ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
          "GET /health", "GET /metrics")


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
            self.job.settle("cancelled")  # a no-op unless the client left before the end
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

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ServeConfig,
                 ranks: ServedPool | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = ServeMetrics()
        self.metrics.set_precision(precision_report(model.dtype, model.device))
        if ranks is not None and ranks.dtype != model.dtype:
            raise ConfigError(f"the rank pool runs the model in {dtype_name(ranks.dtype)} and the server's own model is "
                              f"{dtype_name(model.dtype)}: start both in one dtype")
        self.ranks = ranks
        self.prefix_cache = self._open_prefix_cache()
        self.backends = Backends(model, tokenizer, self.prefix_cache, ranks)
        self.methods = MethodTable(model, config.method, config.allow_methods, self.backends)
        policy = make_policy(config)
        self.scheduler = Scheduler(ModelExecutor(model, tokenizer, policy.max_running), self.metrics, config.queue_size,
                                   policy)
        self.processor = RequestProcessor(model, tokenizer, config, self.methods, self.backends, self.metrics)
        self.wire_tokenizer = copy.deepcopy(tokenizer)  # the event loop's own (token texts): not thread-safe
        self.created = int(time.time())
        self.draining = False
        self.active = 0  # completion requests being answered (a stream until its last event)

    # --- life ----------------------------------------------------------------------------------
    def _open_prefix_cache(self) -> PrefixCache | None:
        """The shared prefix cache (``None`` when ``prefix_cache_mb`` is 0), loaded from
        ``prefix_cache_dir`` if a saved one is there; a file that is corrupt or was saved for
        another model, dtype or block size is refused with a log message and ignored.

        Raises:
            ConfigError: a bound too small for one block, or a model the cache cannot serve.
        """
        cfg = self.config
        if cfg.prefix_cache_mb == 0:
            return None
        cache = PrefixCache(max(1, int(cfg.prefix_cache_mb * 2**20)))
        try:
            cache.bind(self.model)
        except ConfigError as exc:
            raise ConfigError(f"--prefix-cache-mb: {exc}; start with --prefix-cache-mb 0 to serve without it") from None
        self.metrics.watch_prefix_cache(lambda: cache.nbytes, lambda: cache.num_blocks)
        if cfg.prefix_cache_dir is not None:
            try:
                loaded = cache.load(cfg.prefix_cache_dir, self.model)
            except PrefixCacheError as exc:
                log.warning("prefix cache not loaded: %s", exc)
            else:
                if loaded:
                    log.info("prefix cache: %d tokens loaded from %s", loaded, cfg.prefix_cache_dir)
        return cache

    def start(self) -> None:
        self.scheduler.start()
        if self.ranks is not None:  # a rank lost while idle shuts the pool down, as during a request
            self.ranks.watch(RANK_WATCH_S)

    def stop(self) -> None:
        """Fail what is waiting or running with 503, stop the scheduler (the app's shutdown), and
        save the prefix cache to ``prefix_cache_dir`` if one is set."""
        self.draining = True
        self.scheduler.stop(_shutting_down(), timeout=WORKER_JOIN_S)
        self.processor.close()
        self.save_prefix_cache()
        if self.ranks is not None:
            self.ranks.close()

    def save_prefix_cache(self) -> Path | None:
        """Write the prefix cache to ``prefix_cache_dir`` (``None``: no folder, no cache, nothing
        cached yet, or the scheduler still running, which the log says)."""
        cache, folder = self.prefix_cache, self.config.prefix_cache_dir
        if cache is None or folder is None or not cache.num_blocks:
            return None
        if self.scheduler.alive:
            log.warning("prefix cache not saved: the scheduler is still generating")
            return None
        try:
            path = cache.save(folder)
        except (OSError, FastprefillError) as exc:
            log.warning("prefix cache not saved to %s: %s", folder, exc)
            return None
        log.info("prefix cache: %d tokens saved to %s", cache.held_tokens, path)
        return path

    def _refusal(self) -> APIError:
        """The 503 of a request that arrives, or waits, while the server shuts down: why it does,
        when its ranks' failure ends it (under torchrun)."""
        ranks = self.ranks
        if ranks is not None and ranks.fatal and ranks.failure is not None:
            return ranks_down(ranks.failure, fatal=True)
        return _shutting_down()

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests (503), fail the waiting ones with 503, give the running
        generations up to ``timeout_s`` seconds and then end them with a 503 error, and wait up
        to :data:`DRAIN_GRACE_S` more seconds for the last answers to be sent."""
        self.draining = True
        self.scheduler.close(self._refusal())
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in self.scheduler.jobs:
            job.fail(_cut_short())
        deadline = time.monotonic() + DRAIN_GRACE_S
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def warm_up(self) -> None:
        """One short generation per method built at start (first calls are slow; a method that
        cannot run on this model fails here, not on the first request)."""
        self.backends.warm_up([method for _, method in self.methods.built.values()], self.processor.vocab_size,
                              batched=self.scheduler.policy.max_running > 1)

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
        label = "invalid"
        try:
            if self.draining:
                raise self._refusal()
            job = await self.processor.process(await read_body(request, self.config.max_body_bytes), chat,
                                               time.monotonic())
            label = job.label
            self.scheduler.submit(job)
        except Refused as refused:  # the processor's: counted under the method the request named
            self.metrics.requests.labels(refused.label, refused.error.outcome).inc()
            return _error(refused.error)
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
        echo = None if job.echo is None else (job.echo, job.input_ids[0].tolist())
        out = Responder(ResponseIds(chat, self.config.model_name), self.wire_tokenizer, echo)
        if job.streaming:
            return _JobStream(job, self._stream(job, out, job.stream_options), self._ended)
        while True:
            event = await job.next_event(request.is_disconnected)
            if event is None:  # the client has gone: nobody reads this
                return Response(status_code=499)
            if isinstance(event, Failed):
                return _error(event.error)
            if isinstance(event, Finished):
                return JSONResponse(out.body(event, usage_block(event.timing, event.completion_tokens,
                                                                event.queue_wait_s)))

    async def _stream(self, job: Job, out: Responder, options: StreamOptions | None) -> AsyncIterator[bytes]:
        running = options is not None and options.continuous_usage_stats
        prompt_tokens = int(job.input_ids.shape[1])
        while True:
            event = await job.next_event()
            if isinstance(event, Token):  # the first one comes with the first token (clients time TTFT by it)
                yield sse(out.chunk(event, running_usage(prompt_tokens, event.completion_tokens) if running else None))
                continue
            if isinstance(event, Failed):
                yield sse(event.error.body())
            elif isinstance(event, Finished):
                for chunk in out.finish_chunks(event, running_usage(prompt_tokens, event.completion_tokens)
                                               if running else None):
                    yield sse(chunk)
                if options is not None and options.include_usage:
                    yield sse(out.usage_chunk(event))
            yield sse("[DONE]")
            return

    def health(self) -> dict[str, Any]:
        """``/health``'s body: ``status`` (``ok``, ``degraded``, ``unavailable`` or ``draining``,
        :func:`~fastprefill.serve.health.server_status`; :func:`~fastprefill.serve.health.http_status`
        its HTTP status), ``reason`` why it is not ``ok``, ``methods`` each served method's state,
        and the model, queue and ranks."""
        states = method_states(self.methods, self.backends)
        status = server_status(states, draining=self.draining)
        return {
            "status": status.status,
            "reason": status.reason,
            "methods": {s.spec: s.body() for s in states},
            "model": self.config.model_name,
            "method": self.methods.built[self.methods.default][1].served_name(),
            "busy": self.scheduler.busy,
            "queue": {"waiting": self.scheduler.waiting, "capacity": self.config.queue_size,
                      "running": len(self.scheduler.running), "scheduler": self.config.scheduler},
            "timeout_s": self.config.timeout_s,
            "dtype": dtype_name(self.model.dtype),
            "ranks": None if self.ranks is None else ranks_health(self.ranks),
        }

    def model_card(self) -> dict[str, Any]:
        """The served model as OpenAI's model object (plus ``context_length``)."""
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "fastprefill",
                "context_length": self.processor.context}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_info(self, model_id: str) -> dict[str, Any]:
        """:meth:`model_card` if ``model_id`` names the served model (else a 404 :class:`APIError`)."""
        self.processor.check_model(model_id)
        return self.model_card()


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ServeConfig,
               ranks: ServedPool | None = None) -> FastAPI:
    """The FastAPI app serving ``model`` (the scheduler starts and stops with the app's lifespan).

    ``ranks``: the rank pool for the config's multi-rank methods (made by
    :func:`~fastprefill.serve.ranks.start_ranks`, closed at shutdown); ``None``: none.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed with
    ``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``
    (:mod:`fastprefill.serve.health`), ``GET /metrics`` (Prometheus). Every error, an unknown route or a
    wrong HTTP method included, is answered in OpenAI's error shape.

    Raises:
        ConfigError: a method spec that does not parse; UnsupportedModelError: a method that
            does not support the model.
    """
    server = Server(model, tokenizer, config, ranks)

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
        return JSONResponse(body := server.health(), status_code=http_status(body["status"]))

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
