"""One model, one generation at a time: the worker thread, its bounded queue and the jobs.

A :class:`Job` is a validated request (its prompt ids already made by
:func:`fastprefill.prompt.prepare_prompt`). The :class:`Worker` thread takes jobs in arrival
order and runs :func:`fastprefill.engine.stream` on each; between two tokens it stops a job
whose client has gone (:meth:`Job.cancel`) or whose deadline has passed. Events go back to the
request's event loop with ``call_soon_threadsafe``.

Each job ends with exactly one outcome (:meth:`Job.settle`: the first caller wins, the HTTP
side for a timeout, a disconnect or a shutdown, the worker otherwise), counted once in the metrics.

:meth:`Worker.close` starts a shutdown: the jobs still waiting fail with its error, later
submissions are refused with it, and the worker thread ends after the job it is running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.distributed.pool import RankPoolError
from fastprefill.engine import Timing, stream
from fastprefill.errors import FastprefillError
from fastprefill.methods.base import DistributedMethod, Method
from fastprefill.prefix_cache import PrefixCache
from fastprefill.sampling import SamplingParams
from fastprefill.serve.answers import Collector, Finished, Token
from fastprefill.serve.config import served_name
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.protocol import APIError

if TYPE_CHECKING:
    from fastprefill.serve.ranks import ServedPool

__all__ = ["Failed", "Job", "Worker", "internal_error", "ranks_down", "timeout_error"]

log = logging.getLogger(__name__)


@dataclass
class Failed:
    error: APIError


@dataclass(eq=False)
class Job:
    """A validated request waiting for, or running on, the worker.

    Attributes:
        input_ids: ``(1, T)`` ids from :func:`~fastprefill.prompt.prepare_prompt`.
        method: the prefill method; ``label`` its metrics label (:func:`~fastprefill.serve.config.metric_label`).
        max_tokens: tokens to generate at most per answer (the first included).
        sampling: how the answers are decoded (stop strings, ``ignore_eos``, ``n``, log-probabilities...).
        streaming: send :class:`Token` events as tokens come.
        arrived: ``time.monotonic()`` when the request arrived.
        deadline: ``time.monotonic()`` after which the job times out (queue wait included).
    """

    input_ids: torch.Tensor
    method: Method
    label: str
    max_tokens: int
    sampling: SamplingParams
    streaming: bool
    arrived: float
    deadline: float
    metrics: ServeMetrics
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Any] = field(init=False, default_factory=asyncio.Queue)
    outcome: str | None = field(init=False, default=None)
    _cancelled: threading.Event = field(init=False, default_factory=threading.Event)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def cancel(self) -> None:
        """Stop at the next token (or skip the job if it has not started)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def settle(self, outcome: str) -> bool:
        """Record the job's outcome; True for the first caller only (who then answers the client)."""
        with self._lock:
            if self.outcome is not None:
                return False
            self.outcome = outcome
        self.metrics.requests.labels(self.label, outcome).inc()
        return True

    def fail(self, error: APIError) -> None:
        """End the job with ``error`` (its outcome label), unless it has an outcome already, and
        stop its generation at the next token. Safe from any thread."""
        if self.settle(error.outcome):
            self.post(Failed(error))
        self.cancel()

    def post(self, event: Token | Finished | Failed) -> None:
        """Hand an event to the request's event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()


class Worker:
    """The thread that owns the model: one generation at a time, ``capacity`` jobs waiting."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, metrics: ServeMetrics,
                 capacity: int, prefix_cache: PrefixCache | None = None, ranks: ServedPool | None = None) -> None:
        self.model = model
        self.ranks = ranks  # multi-rank methods run there (this thread drives it: one job at a time)
        # Only this thread generates, so only it looks up and stores; the cache's own lock also
        # keeps a save (at shutdown) from reading a block while it is written.
        self.prefix_cache = prefix_cache
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.capacity = capacity
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=capacity)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # submit against close
        self.closed: APIError | None = None
        self.current: Job | None = None
        metrics.watch(lambda: self.waiting, lambda: float(self.current is not None))

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fastprefill-worker", daemon=True)
        self._thread.start()

    def close(self, error: APIError) -> None:
        """Refuse new jobs with ``error``, fail the waiting ones with it, and let the thread end
        after the job it is running (which goes on: see :meth:`Job.fail` to end it)."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = error
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.fail(error)
            self._queue.put_nowait(None)  # the queue is empty and closed: there is room

    def stop(self, error: APIError, timeout: float = 2.0) -> None:
        """:meth:`close` with ``error``, fail the running job with it too, and wait up to
        ``timeout`` seconds for the thread to end (it is a daemon: a prefill that cannot be
        interrupted does not hold the process)."""
        self.close(error)
        if (job := self.current) is not None:
            job.fail(error)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            APIError: 429 when ``capacity`` jobs are already waiting; the :meth:`close` error
                once the worker is closed.
        """
        with self._lock:
            if (closed := self.closed) is not None:
                raise APIError(closed.status, closed.message, kind=closed.kind, param=closed.param)
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise APIError(429, f"the server is busy: its queue of {self.capacity} is full (one request "
                                    "generates at a time); retry later", kind="rate_limit_error") from None

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running (it may still be, after :meth:`stop`'s timeout)."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self.current = job
            try:
                self._execute(job)
            except RankPoolError as exc:  # a rank died, hung or failed: the pool is down
                log.error("rank pool: %s", exc)
                job.fail(ranks_down(str(exc), fatal=self.ranks is not None and self.ranks.fatal))
            except FastprefillError as exc:  # refused by the engine: the request's fault
                job.fail(APIError(400, str(exc)))
            except Exception as exc:  # a failed request must not stop the worker
                log.exception("generation failed")
                job.fail(internal_error(exc))
            finally:
                self.current = None

    def _execute(self, job: Job) -> None:
        m, label = self.metrics, job.label
        started = time.monotonic()
        queue_wait = started - job.arrived
        m.queue_wait.labels(label).observe(queue_wait)
        if job.cancelled:
            job.settle("cancelled")
            return
        if started > job.deadline:
            job.fail(timeout_error(job.deadline - job.arrived))
            return
        collected = Collector(job.sampling)  # the answers, cut before stop strings by the engine
        timing: Timing | None = None
        multi_rank = isinstance(job.method, DistributedMethod)
        if multi_rank:
            assert self.ranks is not None  # the method table offers no multi-rank method without a pool
            events = self.ranks.stream(job.input_ids, job.method, job.max_tokens, sampling=job.sampling)
        else:
            events = stream(self.model, self.tokenizer, job.input_ids, job.method, job.max_tokens,
                            sampling=job.sampling,
                            prefix_cache=self.prefix_cache)  # stores only once the generation is complete
        try:
            for event in events:
                timing = event.timing
                token = collected.add(event)
                if job.streaming and token is not None:
                    job.post(token)
                if timing is None and job.cancelled:
                    break
                if timing is None and time.monotonic() > job.deadline:
                    job.fail(timeout_error(job.deadline - job.arrived))
                    break
        finally:
            events.close()
            m.completion_tokens.labels(label).inc(collected.count)
        if timing is None:  # stopped early: by a timeout (resolved above) or a disconnect
            job.settle("cancelled")
            return
        timing.method = served_name(job.method.resolve(self.model, timing.prompt_tokens))  # LazyLLM: with its revival
        if multi_rank and self.prefix_cache is not None:  # the ranks ran the whole prompt, with no cache
            timing.prefix_cache = f"not used: {job.method.name} takes no cached prefix"
        m.ttft.labels(label).observe(timing.ttft_s)
        if timing.decode_s_per_token is not None:
            m.decode.labels(label).observe(timing.decode_s_per_token)
        m.prompt_tokens.labels(label).observe(timing.prompt_tokens)
        m.token_layers.labels(label).inc(timing.stats.token_layers)
        m.token_layers_full.labels(label).inc(timing.stats.total_token_layers)
        if label == "auto":  # the profile's choice for this prompt's length
            m.auto_choices.labels(timing.method).inc()
        m.cached_prompt_tokens.labels(label).inc(timing.cached_tokens)
        m.computed_prompt_tokens.labels(label).inc(timing.prompt_tokens - timing.cached_tokens)
        if job.settle("ok"):
            job.post(collected.finished(self.tokenizer, timing, queue_wait))


def internal_error(exc: BaseException) -> APIError:
    """The 500 of an unexpected exception (its details go to the server log, not to the client)."""
    return APIError(500, f"internal error ({type(exc).__name__}); the server log has the details",
                    kind="server_error")


def ranks_down(reason: str, fatal: bool = False) -> APIError:
    """The 503 of a multi-rank request once the rank pool has failed (``reason`` names the rank);
    ``fatal``: the failure ends the server (torchrun's ranks), so every request gets it."""
    after = ("the server is shutting down (its torchrun job has lost a rank; torchrun --max-restarts starts it "
             "again)") if fatal else ("multi-rank methods are refused until the server is restarted; "
                                      "single-process methods still answer")
    return APIError(503, f"the server's rank pool failed ({reason}); {after}", kind="server_error", outcome="error")


def timeout_error(limit_s: float) -> APIError:
    return APIError(504, f"the request took longer than the server's timeout of {limit_s:g} s "
                         "(queue wait included); ask for fewer tokens or retry later", kind="timeout")
