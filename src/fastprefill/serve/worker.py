"""A prepared request (:class:`Job`), what runs it (the :class:`Backend` and :class:`Work`
contracts), the events it sends back, and the errors that end one.

A :class:`Job` is a request prepared once (:meth:`fastprefill.serve.requests.RequestProcessor.process`:
its prompt ids validated and tokenized, its method resolved for the prompt, then its backend
chosen); the scheduler (:mod:`fastprefill.serve.scheduler`) and the backends
(:mod:`fastprefill.serve.backends`, which implement the contracts) consume it without checking
it again. Events go back to the request's event loop with ``call_soon_threadsafe``.

Each job ends with exactly one outcome (:meth:`Job.settle`: the first caller wins, the HTTP
side for a timeout, a disconnect or a shutdown, the scheduler otherwise), counted once in the
metrics.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fastprefill.events import StreamEvent
from fastprefill.methods.base import Method
from fastprefill.sampling import SamplingParams
from fastprefill.serve.answers import Finished, Token
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.protocol import APIError, StreamOptions

__all__ = ["Answers", "Backend", "Decoded", "Executor", "Failed", "Job", "Pause", "Stepped", "Work", "internal_error",
           "ranks_down", "timeout_error"]


class Work(Protocol):
    """One running request as the scheduler drives it (:class:`~fastprefill.engine.Generation`
    is the reference implementation)."""

    n_prompt: int
    finished: bool

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill (after :meth:`lookup`)."""
        ...

    @property
    def chunked(self) -> bool:
        """Whether :meth:`prefill` may run part of the prompt."""
        ...

    @property
    def prefilled(self) -> bool:
        """Whether the first token is known."""
        ...

    def lookup(self) -> int:
        """Find what is already computed (the prefix cache); returns :attr:`remaining`."""
        ...

    def prefill(self, budget: int | None = None) -> int:
        """One unit of prefill (at most ``budget`` tokens when :attr:`chunked`); the tokens run."""
        ...

    def first_events(self) -> list[StreamEvent]:
        """The first tokens' events (one per answer it holds), once :attr:`prefilled`."""
        ...

    def step(self) -> list[StreamEvent]:
        """One decode step: the next tokens' events (the generation's last carries the timing)."""
        ...

    def publish(self) -> None:
        """Once its first tokens are out: make what its prefill computed visible to other
        requests (the prefix cache's blocks)."""
        ...

    def close(self) -> None:
        """Stop early and free what the work holds (its K/V, the ranks)."""
        ...


class Backend(Protocol):
    """What a job runs on: the server's own model, or its rank pool (:mod:`fastprefill.serve.backends`)."""

    #: at most one of its works may run at a time (a rank pool runs one request at a time)
    exclusive: bool
    #: a failure of it ends the server (torchrun's ranks)
    fatal: bool

    def check(self) -> None:
        """Raise :class:`~fastprefill.serve.protocol.APIError` if it cannot take a request now."""
        ...

    def unavailable(self) -> str | None:
        """Why it cannot take a request now (``None``: it can); never waits."""
        ...

    def begin(self, job: Job) -> Work:
        """The job's work."""
        ...

    def waits_for(self, work: Work, other: Work) -> int:
        """Prompt tokens of ``work`` that ``other`` (running) will store and ``work`` lacks: worth
        waiting for rather than computing twice (0: none)."""
        ...

    def warm_up(self, method: Method, vocab_size: int) -> None:
        """One short generation with ``method`` (first calls are slow)."""
        ...


class Answers(Protocol):
    """A running request's answers as the scheduler hands them on
    (:class:`~fastprefill.serve.answers.Collector` is the implementation)."""

    count: int

    def add(self, event: StreamEvent) -> Token | None:
        """Take one event; the :class:`Token` to stream, or ``None`` when there is nothing to send."""
        ...

    def finished(self, timing: Any, queue_wait_s: float) -> Finished:
        """Every answer, its text decoded."""
        ...


@dataclass(frozen=True)
class Pause:
    """What a pausable unit of prefill asks the scheduler: whether to stop at the next decoder
    layer (``wants``, asked under the scheduler's lock), and what to run meanwhile (``interlude``)."""

    wants: Callable[[], bool]
    interlude: Callable[[], None]


@dataclass
class Stepped:
    """The outcome of one decode step for ``works``: each one's events (``events[i]`` for
    ``works[i]``), or the ``error`` that failed all of them."""

    works: list[Work]
    events: list[list[StreamEvent]] | None
    error: Exception | None = None


@dataclass
class Decoded:
    """One decode step of every stream: the outcome of each group decoded together, and the
    step's seconds on the engine's clock."""

    steps: list[Stepped]
    seconds: float


class Executor(Protocol):
    """What runs the scheduler's units on the model (:class:`~fastprefill.serve.executor.ModelExecutor`):
    the scheduler decides, the executor touches the model, the tokenizer and the rank pool."""

    def enable_pauses(self, cv: threading.Condition) -> bool:
        """Make prefill units pausable between layers under ``cv``; whether they can be."""
        ...

    def release(self) -> None:
        """Undo :meth:`enable_pauses` (the scheduler's thread has ended)."""
        ...

    def begin(self, job: Job) -> tuple[Work, Answers]:
        """The job's work on its backend, and the collector of its answers."""
        ...

    def prefill(self, work: Work, budget: int | None, pause: Pause | None) -> int:
        """One unit of ``work``'s prefill (pausable when ``pause`` is given); the tokens it ran."""
        ...

    def decode(self, works: Sequence[Work]) -> Decoded:
        """One decode step for every answer of ``works``."""
        ...

    def mixes(self, work: Work, works: Sequence[Work]) -> bool:
        """Whether a unit of ``work``'s prefill can carry the decode step of ``works`` in its
        layer calls (:meth:`mixed`)."""
        ...

    def mixed(self, work: Work, budget: int, works: Sequence[Work]) -> tuple[int, Decoded]:
        """One unit of ``work``'s prefill (at most ``budget`` tokens) with one decode step of every
        answer of ``works`` in the same forward (a failure fails all of them); the tokens it
        ran, and the step."""
        ...

    def error(self, exc: Exception, fatal: bool) -> APIError:
        """The answer to a unit that raised ``exc`` (``fatal``: the server ends with it)."""
        ...


@dataclass
class Failed:
    error: APIError


@dataclass(eq=False)
class Job:
    """A request prepared once, waiting for or running on the scheduler.

    Attributes:
        input_ids: ``(1, T)`` ids, validated (:func:`~fastprefill.prompt.prepare_request`).
        method: the prefill method, resolved for this prompt (``auto``'s choice);
            ``label`` the metrics label of the spec the request named
            (:meth:`~fastprefill.methods.base.Method.metric_label`); ``name`` how the answer
            names the method (:meth:`~fastprefill.methods.base.Method.served_name`).
        backend: what runs it (the server's model, or its rank pool), chosen once the method was resolved.
        max_tokens: tokens to generate at most per answer (the first included).
        sampling: how the answers are decoded (stop strings, ``ignore_eos``, ``n``, log-probabilities...).
        streaming: send :class:`Token` events as tokens come.
        arrived: ``time.monotonic()`` when the request arrived.
        deadline: ``time.monotonic()`` after which the job times out (queue wait included).
        echo: the prompt as text, for a completion that asks for it back (``None``: not asked).
        stream_options: what a streamed answer adds (usage chunks).
    """

    input_ids: torch.Tensor
    method: Method
    backend: Backend
    label: str
    name: str
    max_tokens: int
    sampling: SamplingParams
    streaming: bool
    arrived: float
    deadline: float
    metrics: ServeMetrics
    loop: asyncio.AbstractEventLoop
    echo: str | None = None
    stream_options: StreamOptions | None = None
    events: asyncio.Queue[Any] = field(init=False, default_factory=asyncio.Queue)
    outcome: str | None = field(init=False, default=None)
    _cancelled: threading.Event = field(init=False, default_factory=threading.Event)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def cancel(self) -> None:
        """Stop at the next chunk or token (or skip the job if it has not started)."""
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
        stop its generation at the next chunk or token. Safe from any thread."""
        if self.settle(error.outcome):
            self.post(Failed(error))
        self.cancel()

    async def next_event(self, gone: Callable[[], Awaitable[bool]] | None = None,
                         poll_s: float = 0.5) -> Token | Finished | Failed | None:
        """The job's next event (on its event loop); a timeout error at its deadline; ``None``
        once ``gone()`` says the client has disconnected (asked every ``poll_s`` seconds).

        Past the deadline the job times out here unless another caller settled it first (the
        scheduler's own timeout, an error, its last token): that caller has posted the job's
        last event, which is then awaited like any other.
        """
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0 and self.settle("timeout"):
                self.cancel()
                return Failed(timeout_error(self.deadline - self.arrived))
            try:
                return await asyncio.wait_for(self.events.get(), timeout=min(poll_s, left) if left > 0 else poll_s)
            except TimeoutError:
                pass
            if gone is not None and await gone():
                self.cancel()
                self.settle("cancelled")
                return None

    def post(self, event: Token | Finished | Failed) -> None:
        """Hand an event to the request's event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel()


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
