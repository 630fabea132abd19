"""The server's scheduler: which request's work runs next, one unit at a time, on one thread.

The scheduler is policy: it queues, admits, orders, budgets, pauses and cancels, and never
touches the model. What runs a unit (a job's work from its backend, the decode batch, the pause
points on the decoder layers, the answers' text, what a failure answers) is its
:class:`~fastprefill.serve.worker.Executor` (:class:`~fastprefill.serve.executor.ModelExecutor`
on a server); this module imports nothing of torch, transformers, the engine, the models or the
methods (``tests/unit/test_scheduler_policy.py`` checks it and drives it with a fake executor).

**Mechanism** (:class:`Scheduler`). Prepared requests (:class:`~fastprefill.serve.worker.Job`)
wait in a bounded queue (``queue_size``; a full queue is a 429). The scheduler thread admits up
to ``max_running`` of them, each as a unit of :class:`~fastprefill.serve.worker.Work` from its
backend (the prefix-cache lookup happens at admission, so the uncached rest is known), and then
repeats one *iteration*:

1. **decode**: every admitted request past its first token gets its next token, in one step of
   the executor (one decode batch for the server's model, each multi-rank request apart);
2. **prefill**: up to ``prefill_chunk`` tokens of prefill, spent on the waiting prefills in the
   policy's order. An exact method (``Method.chunked_prefill``: full prefill, prefix-cache hits
   included) runs a chunk of its prompt over the K/V computed so far, the prefix cache's own hit
   path; any other method (LazyLLM, the KV Prediction methods, the multi-rank methods) runs its
   whole prefill as one unit, started only at the head of an iteration. A request that has not
   started waits while a running exact prefill computes blocks of its prompt (its backend's
   ``waits_for``), then prefills only its rest: a new document is computed once.

**Pauses** (on by default; :mod:`fastprefill.serve.pauses`, put on the model by the executor).
A chunk runs on a thread of its own and stops before its next decoder layer when a request arrives, or when a decode step is
due (``--decode-interval``); the *interlude* then admits the new requests, prefills those of at
most :data:`INTERLUDE_TOKENS` uncached tokens to their first token and steps the decoding
streams, and the chunk resumes. The chunk (8192 tokens) bounds memory, not the others' wait.

Between two units the scheduler drops a request whose client has gone or whose deadline has
passed (its K/V is freed; on the ranks the last rank is told to stop). A multi-rank request
holds the rank pool from its prefill to its last token, so a second waits until it is done;
the ranks decode on their own, and the scheduler takes one of their tokens per iteration.

**Policies.** :class:`FifoPolicy` admits one request at a time and runs it whole, start to end,
in arrival order (``--scheduler fifo``: the server before this scheduler). :class:`ShortFirstPolicy`
(``--scheduler interleaved``, the default) orders prefills by the prompt tokens they still
need, fewest first (a one-line question or a follow-up over a cached document goes before the
next chunk of a long cold prompt), and ages them: a prefill passed over ``max_skips`` times in a
row goes first at the next iteration, so a long prompt always advances.

:meth:`Scheduler.close` starts a shutdown: waiting jobs fail with its error, later submissions
are refused with it, and the thread ends once the admitted requests are done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastprefill.serve.config import ServeConfig
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.protocol import APIError
from fastprefill.serve.worker import Answers, Executor, Job, Pause, Work, timeout_error

__all__ = ["INTERLUDE_TOKENS", "FifoPolicy", "Running", "Scheduler", "ShortFirstPolicy", "make_policy"]

#: The most uncached prompt tokens a request may have to be prefilled in an interlude (and at
#: most one chunk): an interlude holds the paused chunk, so it takes only a short request's work.
INTERLUDE_TOKENS = 512

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class Running:
    """An admitted request: job, work, answers so far, prefills passed over in a row (``skips``)."""

    job: Job
    work: Work
    collected: Answers
    skips: int = 0
    started: float | None = None  # the first unit of work (the end of its queue wait)


@dataclass(frozen=True)
class FifoPolicy:
    """One request at a time, its whole prompt at once, in arrival order."""

    max_running: int = 1
    budget: int | None = None

    def order(self, prefilling: Sequence[Running]) -> list[Running]:
        """Arrival order."""
        return list(prefilling)


@dataclass(frozen=True)
class ShortFirstPolicy:
    """Fewest remaining prompt tokens first, with aging (see the module docstring).

    Attributes:
        max_running: requests admitted at once.
        budget: prompt tokens of prefill per iteration (``--prefill-chunk``).
        max_skips: iterations a prefill may be passed over in a row before it goes first.
        pause: pause a running chunk between two layers for a request that has just arrived,
            and for a decode step ``decode_interval_s`` after the last (``--prefill-pauses``,
            ``--decode-interval``; see the module docstring).
    """

    max_running: int = 8
    budget: int | None = 8192
    max_skips: int = 4
    pause: bool = True
    decode_interval_s: float = 2.0

    def order(self, prefilling: Sequence[Running]) -> list[Running]:
        """The aged prefills (oldest first), then the rest by remaining tokens (ties: arrival)."""
        aged = sorted((r for r in prefilling if r.skips >= self.max_skips), key=lambda r: r.job.arrived)
        rest = sorted((r for r in prefilling if r.skips < self.max_skips),
                      key=lambda r: (r.work.remaining, r.job.arrived))
        return aged + rest


def make_policy(config: ServeConfig) -> FifoPolicy | ShortFirstPolicy:
    """The policy ``config.scheduler`` names."""
    if config.scheduler == "fifo":
        return FifoPolicy()
    return ShortFirstPolicy(max_running=config.max_running, budget=config.prefill_chunk, pause=config.prefill_pauses,
                            decode_interval_s=config.decode_interval_s)


class Scheduler:
    """The thread that decides what the executor runs (see the module docstring).

    Args:
        executor: runs the units (the server's :class:`~fastprefill.serve.executor.ModelExecutor`).
        capacity: jobs that may wait to be admitted (more get 429).
        policy: :class:`FifoPolicy` or :class:`ShortFirstPolicy`.
    """

    def __init__(self, executor: Executor, metrics: ServeMetrics, capacity: int,
                 policy: FifoPolicy | ShortFirstPolicy) -> None:
        self.executor = executor
        self.metrics = metrics
        self.capacity = capacity
        self.policy = policy
        self.running: list[Running] = []
        self.closed: APIError | None = None
        self._waiting: deque[Job] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._submitted = self._seen = 0  # submissions, and those an interlude has looked at
        self._last_decode = time.monotonic()
        self._pausable: Running | None = None  # whose unit may pause: its interludes do not decode it
        #: whether a unit of prefill may pause for an interlude (the executor could put pause points)
        self.pausing = isinstance(policy, ShortFirstPolicy) and policy.pause and executor.enable_pauses(self._cv)
        metrics.watch(lambda: self.waiting, lambda: len(self.running))

    # --- the queue (any thread) -----------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether a request is admitted (prefilling or decoding)."""
        return bool(self.running)

    @property
    def jobs(self) -> list[Job]:
        """The admitted jobs."""
        return [r.job for r in list(self.running)]

    @property
    def alive(self) -> bool:
        """Whether the thread is running (it may still be, after :meth:`stop`'s timeout)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fastprefill-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            APIError: 429 when ``capacity`` jobs are already waiting; the :meth:`close` error
                once the scheduler is closed.
        """
        with self._cv:
            if (closed := self.closed) is not None:
                raise APIError(closed.status, closed.message, kind=closed.kind, param=closed.param)
            if len(self._waiting) >= self.capacity:
                raise APIError(429, f"the server is busy: its queue of {self.capacity} is full ("
                                    f"{self.policy.max_running} run at a time); retry later", kind="rate_limit_error")
            self._waiting.append(job)
            self._submitted += 1
            self._cv.notify_all()

    def close(self, error: APIError) -> None:
        """Refuse new jobs with ``error``, fail the waiting ones with it, and let the thread end
        once the admitted ones are done (they go on: see :meth:`Job.fail` to end them)."""
        with self._cv:
            if self.closed is not None:
                return
            self.closed = error
            while self._waiting:
                self._waiting.popleft().fail(error)
            self._cv.notify()

    def stop(self, error: APIError, timeout: float = 2.0) -> None:
        """:meth:`close` with ``error``, fail the admitted jobs with it too, and wait up to
        ``timeout`` seconds for the thread (a daemon: a prefill unit cannot hold the process)."""
        self.close(error)
        for job in self.jobs:
            job.fail(error)
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self.running and self.closed is None:
                    self._cv.wait()
                if not self._waiting and not self.running:
                    self.executor.release()
                    return  # closed, and nothing left
            self.run_once()

    def run_once(self) -> None:
        """Admit what may start, drop what was cancelled, and run one iteration (the thread's
        loop; tests drive the scheduler with it, without a thread)."""
        self._admit_waiting()
        self._reap()
        if self.running:
            self._iteration()

    def _admit_waiting(self) -> None:
        """Admit the waiting jobs that may start now (the submissions so far are then looked at)."""
        with self._cv:
            self._seen = self._submitted
            admitted = self._admissible()
        for job in admitted:
            self._admit(job)

    def _admissible(self) -> list[Job]:
        """Take the waiting jobs that may start now, in arrival order, up to ``max_running``: a
        job whose backend runs one request at a time (the rank pool) stays in the queue while
        another of its requests runs, without holding up the jobs behind it."""
        taken = [id(r.job.backend) for r in self.running if r.job.backend.exclusive]
        admitted, kept = [], deque()
        while self._waiting:
            job = self._waiting.popleft()
            if len(self.running) + len(admitted) >= self.policy.max_running or id(job.backend) in taken:
                kept.append(job)
                continue
            admitted.append(job)
            if job.backend.exclusive:
                taken.append(id(job.backend))
        self._waiting = kept
        return admitted

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            job.settle("cancelled")
            return
        if time.monotonic() > job.deadline:
            job.fail(timeout_error(job.deadline - job.arrived))
            return
        run = self._guard([], lambda: Running(job, *self.executor.begin(job)), job)
        if run is not None and self._guard([run], run.work.lookup) is not None:
            self.running.append(run)

    def _guard(self, runs: list[Running], call: Callable[[], T], job: Job | None = None) -> T | None:
        """``call()``; on an exception, fail ``runs`` (or ``job``, not yet running) with its
        error (the executor's answer to it) and drop them. Returns None on failure."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001  (a failed request must not stop the scheduler; the executor logs it)
            self._fail(runs, exc, job)
            return None

    def _fail(self, runs: list[Running], exc: Exception, job: Job | None = None) -> None:
        """Fail ``runs`` (and ``job``, not yet running) with the executor's answer to ``exc``; drop ``runs``."""
        jobs = [r.job for r in runs] + ([job] if job is not None else [])
        error = self.executor.error(exc, any(j.backend.fatal for j in jobs))
        for failed in jobs:
            failed.fail(error)
        for run in runs:
            self._drop(run)

    def _drop(self, run: Running) -> None:
        """Close ``run``'s work (its K/V freed; on the ranks, once the last rank has stopped), then
        remove it and count its tokens. It stays in :attr:`running` (``/health`` busy) until its
        work is closed, so an idle server has no cancel still in flight."""
        try:
            run.work.close()
        except Exception:  # the pool logs its own failures
            log.exception("closing a request's work failed")
        if run in self.running:
            self.running.remove(run)
        self.metrics.completion_tokens.labels(run.job.label).inc(run.collected.count)

    def _reap(self) -> None:
        """Drop the requests cancelled (client gone, shutdown) or past their deadline."""
        now = time.monotonic()
        for run in list(self.running):
            job = run.job
            if not job.cancelled and now > job.deadline:
                job.fail(timeout_error(job.deadline - job.arrived))
            if job.cancelled:
                job.settle("cancelled")  # a no-op when it failed
                self._drop(run)

    def _iteration(self) -> None:
        decoding = [r for r in self.running if r.work.prefilled]
        if decoding:
            self._decode(decoding)
        self._prefill([r for r in self.running if not r.work.prefilled])

    def _decode(self, runs: list[Running]) -> None:
        """One decode step for every answer of every stream in ``runs`` (the executor's step; a
        group it decoded together fails together)."""
        self._last_decode = time.monotonic()
        by_work = {id(r.work): r for r in runs}
        decoded = self._guard(runs, lambda: self.executor.decode([r.work for r in runs]))
        if decoded is None:
            return
        self.metrics.decode_batch.observe(len(runs))
        self.metrics.decode_step.observe(decoded.seconds)
        emitted = []
        for step in decoded.steps:
            group = [by_work[id(w)] for w in step.works]
            if step.error is not None or step.events is None:
                self._fail(group, step.error or RuntimeError("a decode step gave no events"))
                continue
            emitted += list(zip(group, step.events, strict=True))
        for run, events in emitted:
            for event in events:
                self._emit(run, event)

    def _prefill(self, runs: list[Running]) -> None:
        """Up to the policy's budget of prefill, in its order (see the module docstring)."""
        budget = self.policy.budget
        left, served = budget, set()
        busy = {id(r.job.backend) for r in self.running if r.job.backend.exclusive and r.work.prefilled}
        for run in self.policy.order(runs):
            if id(run.job.backend) in busy or run not in self.running or run.work.prefilled or self._waits(run):
                continue  # its backend runs one request at a time; dropped, prefilled in an interlude; or waits
            if budget is not None and not run.work.chunked and left != budget:
                continue  # a whole prefill starts an iteration
            ran = self._unit(run, left)
            served.add(id(run))
            if ran is None:
                continue
            if run.work.prefilled and run.job.backend.exclusive:
                busy.add(id(run.job.backend))
            if left is None:
                break
            left -= ran
            if left <= 0:
                break
        for run in runs:
            run.skips = 0 if id(run) in served else run.skips + 1

    def _waits(self, run: Running) -> bool:
        """Whether ``run`` has not started and a started prefill will store blocks of its prompt it
        lacks: it waits for them, then prefills only its rest (one computation per new prefix)."""
        return run.started is None and any(o is not run and o.started is not None and not o.work.prefilled
                                           and run.job.backend.waits_for(run.work, o.work) > 0 for o in self.running)

    def _unit(self, run: Running, budget: int | None, pausable: bool = True) -> int | None:
        """One unit of ``run``'s prefill (at most ``budget`` tokens when chunked), pausable between
        layers for an interlude when it is a local chunked prefill; its first tokens once done.
        Returns the tokens it ran (None: it failed, and was dropped)."""
        if run.started is None:
            run.started = time.monotonic()
            self.metrics.queue_wait.labels(run.job.label).observe(run.started - run.job.arrived)
        pause = None
        if pausable and self.pausing and run.work.chunked:
            pause = Pause(self._wants_pause, self._interlude)
            self._pausable = run
        try:
            ran = self._guard([run], lambda: self.executor.prefill(run.work, budget, pause))
        finally:
            self._pausable = None
        if ran is None:
            return None
        self.metrics.prefill_chunks.labels(run.job.label).inc()
        if run.work.prefilled:
            for event in run.work.first_events():
                self._emit(run, event)
            if run in self.running:  # its prompt's blocks, visible to the requests that follow
                self._guard([run], run.work.publish)
        return ran

    def _wants_pause(self) -> bool:
        """Whether a request came since the last interlude, or a decode step is due (under the lock)."""
        return self._submitted != self._seen or self._decode_due()

    def _decode_due(self) -> bool:
        interval = getattr(self.policy, "decode_interval_s", None)
        return (interval is not None and time.monotonic() - self._last_decode >= interval
                and bool(self._decodable()))

    def _decodable(self) -> list[Running]:
        """The prefilled runs but the one whose unit runs (``prefilled`` before its first tokens)."""
        return [r for r in self.running if r.work.prefilled and r is not self._pausable and not r.job.cancelled]

    def _interlude(self) -> None:
        """While a chunk is paused: admit the new requests, prefill whole (policy order) those of at
        most :data:`INTERLUDE_TOKENS` uncached tokens and one chunk, then a decode step if due."""
        self.metrics.prefill_pauses.inc()
        self._admit_waiting()
        budget = self.policy.budget
        short = [r for r in self.running if r.started is None and r.work.chunked and not r.job.backend.exclusive and r.work.remaining <= min(budget or INTERLUDE_TOKENS, INTERLUDE_TOKENS)]
        for run in self.policy.order(short):
            if not run.job.cancelled:
                self._unit(run, None, pausable=False)
        if self._decode_due():
            self._decode(self._decodable())

    def _emit(self, run: Running, event: Any) -> None:
        """Send one token's text (an answer's first always: it marks TTFT); finish on the last."""
        job = run.job
        token = run.collected.add(event)
        if job.streaming and token is not None:
            job.post(token)
        if event.timing is not None:
            self._finish(run, event.timing)

    def _finish(self, run: Running, timing: Any) -> None:
        job, m, label = run.job, self.metrics, run.job.label
        try:
            run.work.close()  # done: the ranks' pool is free again
        finally:
            if run in self.running:
                self.running.remove(run)
        m.finished(label, timing, run.collected.count)
        if job.settle("ok"):
            wait = (run.started or job.arrived) - job.arrived
            job.post(run.collected.finished(timing, wait))
