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

1. **short prefills first**, unless a decode step is due (``--decode-interval`` since the last):
   the requests whose uncached rest is at most :data:`INTERLUDE_TOKENS` (a question, a
   follow-up over a cached document, sent while other answers stream) are prefilled to their
   first token, out of the iteration's budget, before the streams' next token;
2. **decode**: every admitted request past its first token gets its next token, in one step of
   the executor (one decode batch for the server's model, each multi-rank request apart);
3. **prefill**: what is left of up to ``prefill_chunk`` tokens of prefill, spent on the waiting prefills in the
   policy's order. An exact method (``Method.chunked_prefill``: full prefill, prefix-cache hits
   included) runs a chunk of its prompt over the K/V computed so far, the prefix cache's own hit
   path; any other method (LazyLLM, the KV Prediction methods, the multi-rank methods) runs its
   whole prefill as one unit, started only at the head of an iteration. A request that has not
   started waits while a running exact prefill computes blocks of its prompt (its backend's
   ``waits_for``), then prefills only its rest: a new document is computed once.

**Mixed batches** (``--mixed-chunk N``, off by default): where the policy's next prefill is an
exact local one, an iteration is one unit: a chunk of at most ``N`` of its tokens carrying every
decoding stream's next token (the executor's ``mixed``, never paused), or, while none decodes,
its unit alone, so requests that arrive together are prefilled one after the other.

**Pauses** (on by default; :mod:`fastprefill.serve.pauses`, put on the model by the executor).
A chunk runs on a thread of its own and stops before its next decoder layer when a request arrives, or when a decode step is
due (``--decode-interval``); the *interlude* then admits the new requests, prefills those of at
most :data:`INTERLUDE_TOKENS` uncached tokens to their first token and steps the decoding
streams, and the chunk resumes. The chunk (8192 tokens) bounds memory, not the others' wait.

Between two units the scheduler drops a request whose client has gone or whose deadline has
passed (its K/V is freed; on the ranks the last rank is told to stop). A multi-rank request
holds the rank pool from its prefill to its last token, so a second waits until it is done;
the ranks decode on their own, and the scheduler takes one of their tokens per iteration.

**Policies** (:mod:`fastprefill.serve.policies`). :class:`FifoPolicy` admits one request at a time and runs it whole, start to end,
in arrival order (``--scheduler fifo``: the server before this scheduler). :class:`ShortFirstPolicy`
(``--scheduler interleaved``, the default) orders prefills by the prompt tokens they still
need, fewest first (a one-line question or a follow-up over a cached document goes before the
next chunk of a long cold prompt), and ages them: a prefill passed over ``max_skips`` times in a
row goes first at the next iteration, so a long prompt always advances.

:meth:`Scheduler.close` starts a shutdown: waiting jobs fail with its error, later submissions
are refused with it, and the thread ends once the admitted requests are done.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.policies import FifoPolicy, Running, ShortFirstPolicy
from fastprefill.serve.protocol import APIError
from fastprefill.serve.worker import Decoded, Executor, Job, Pause, timeout_error

__all__ = ["INTERLUDE_TOKENS", "Scheduler"]

#: The most uncached prompt tokens a request may have to be prefilled in an interlude (and at
#: most one chunk): an interlude holds the paused chunk, so it takes only a short request's work.
INTERLUDE_TOKENS = 512

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        waiting = [r for r in self.running if not r.work.prefilled]
        served: set[int] = set()
        decoding = [r for r in self.running if r.work.prefilled]
        head = self._mixable(decoding)
        if head is not None and decoding:
            self._mixed(head, decoding, served)  # the streams' next token rides in a chunk of the head's prefill
        elif head is not None:  # nothing decodes: the head's unit alone, the others' chunks will carry its tokens
            served.add(id(head))
            self._unit(head, self.policy.budget)
        else:
            self._apart(waiting, served)
        for run in waiting:
            run.skips = 0 if id(run) in served else run.skips + 1

    def _apart(self, waiting: list[Running], served: set[int]) -> None:
        """An iteration of units apart: steps 1-3 of the module docstring."""
        left = self.policy.budget
        if not self._decode_due():  # short prompts' first tokens before the streams' next token
            short = {id(r) for r in self._short(waiting)}  # those the policy puts first (an aged prompt stops them)
            left = self._prefill(list(itertools.takewhile(lambda r: id(r) in short, self.policy.order(waiting))),
                                 left, served)
        decoding = [r for r in self.running if r.work.prefilled and id(r) not in served]  # just prefilled: next time
        if decoding:
            self._decode(decoding)
        if (left is None and not served) or (left is not None and left > 0):  # None: one unit an iteration
            self._prefill([r for r in self.running if not r.work.prefilled], left, served)

    def _short(self, runs: list[Running]) -> list[Running]:
        """Of ``runs``, the requests not started whose uncached rest is at most
        :data:`INTERLUDE_TOKENS` (and one chunk) on a backend that takes a chunk at a time and
        serves several requests: a question, a follow-up over a cached document."""
        budget = self.policy.budget
        limit = min(budget or INTERLUDE_TOKENS, INTERLUDE_TOKENS)
        return [r for r in runs if r.started is None and r.work.chunked and not r.job.backend.exclusive
                and not r.job.cancelled and r.work.remaining <= limit]

    def _decode(self, runs: list[Running]) -> None:
        """One decode step of every stream in ``runs`` (a group decoded together fails together)."""
        self._last_decode = time.monotonic()
        decoded = self._guard(runs, lambda: self.executor.decode([r.work for r in runs]))
        if decoded is not None:
            self._decoded(runs, decoded)

    def _mixable(self, decoding: list[Running]) -> Running | None:
        """With ``mixed_chunk`` set, the policy's next prefill if it can carry ``decoding``'s step."""
        if not getattr(self.policy, "mixed_chunk", 0):
            return None
        head = next((r for r in self.policy.order([r for r in self.running if not r.work.prefilled])
                     if not self._waits(r)), None)
        mixes = head is not None and head.work.chunked and self.executor.mixes(head.work, [r.work for r in decoding])
        return head if mixes else None

    def _mixed(self, run: Running, decoding: list[Running], served: set[int]) -> None:
        """A chunk of ``run``'s prefill carrying ``decoding``'s step; a failure fails all of them."""
        self._begin(run)
        self._last_decode = time.monotonic()
        served.add(id(run))
        budget = self.policy.mixed_chunk  # type: ignore[union-attr]  (_mixable checked it)
        result = self._guard([run, *decoding], lambda: self.executor.mixed(run.work, budget, [r.work for r in decoding]))
        if result is not None:
            self.metrics.mixed_steps.inc()
            self._decoded(decoding, result[1])
            if run in self.running:
                self._after_unit(run)

    def _decoded(self, runs: list[Running], decoded: Decoded) -> None:  # hand out a step's tokens; a failed group fails
        by_work = {id(r.work): r for r in runs}
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

    def _prefill(self, runs: list[Running], left: int | None, served: set[int]) -> int | None:
        """Up to ``left`` tokens of prefill (None: one unit, whole) of ``runs``, in the policy's
        order (see the module docstring); the ids of the runs given a unit join ``served``.
        Returns the budget left."""
        budget = self.policy.budget
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
        return left

    def _waits(self, run: Running) -> bool:
        """Whether ``run`` has not started and a started prefill will store blocks of its prompt it
        lacks: it waits for them, then prefills only its rest (one computation per new prefix)."""
        return run.started is None and any(o is not run and o.started is not None and not o.work.prefilled
                                           and run.job.backend.waits_for(run.work, o.work) > 0 for o in self.running)

    def _unit(self, run: Running, budget: int | None, pausable: bool = True) -> int | None:
        """One unit of ``run``'s prefill (at most ``budget`` tokens when chunked), pausable between
        layers for an interlude when it is a local chunked prefill; its first tokens once done.
        Returns the tokens it ran (None: it failed, and was dropped)."""
        self._begin(run)
        pause = None
        if pausable and self.pausing and run.work.chunked:
            pause = Pause(self._wants_pause, self._interlude)
            self._pausable = run
        try:
            ran = self._guard([run], lambda: self.executor.prefill(run.work, budget, pause))
        finally:
            self._pausable = None
        if ran is not None:
            self._after_unit(run)
        return ran

    def _begin(self, run: Running) -> None:  # its first unit of work: the end of its queue wait
        if run.started is None:
            run.started = time.monotonic()
            self.metrics.queue_wait.labels(run.job.label).observe(run.started - run.job.arrived)

    def _after_unit(self, run: Running) -> None:  # count the unit; once prefilled, its first tokens, then its blocks
        self.metrics.prefill_chunks.labels(run.job.label).inc()
        if run.work.prefilled:
            for event in run.work.first_events():
                self._emit(run, event)
            if run in self.running:  # its prompt's blocks, visible to the requests that follow
                self._guard([run], run.work.publish)

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
        for run in self.policy.order(self._short(self.running)):  # _short leaves cancelled runs out
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
