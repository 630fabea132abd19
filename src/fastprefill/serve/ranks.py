"""The server's rank pool: KV-Runahead (and TSP) prefills over worker processes kept warm between requests.

``fastprefill serve --method runahead:procs=2`` (or ``--allow-method runahead:procs=2``) starts a
:class:`ServedPool` of that many ranks on this machine before the first request
(:func:`fastprefill.serve.backends.start_ranks`); each holds the model. A request whose method runs over several ranks goes
to the pool (one at a time); every other method runs in the server process, on the scheduler's
thread (:mod:`fastprefill.serve.scheduler`), between the pool's units: a multi-rank prefill runs
to its first token as one unit, then the last rank decodes on its own.

Roles (those of :class:`~fastprefill.distributed.pool.RankPool`): every rank validates the
request and joins the prefill; the last rank ends the prefill holding the whole K/V and decodes
there, sending each token (id and text) to the server as it comes, so no K/V crosses a pipe.
A request cancelled by its client, its timeout or a shutdown sends the last rank a cancel, and
it stops at its next token (a prefill already running on the ranks finishes first); the pool
stays warm. A rank that dies, hangs past the method's ``timeout_s`` (per message) or fails ends
the request with a 503 naming it, and the pool is shut down: the server then answers
multi-rank requests 503 until it is restarted, and single-process ones as before.

Under torchrun (:mod:`fastprefill.serve.torchrun`) the pool's ranks are torchrun's, possibly on
other machines (``links``); a failure is then ``fatal``: it also sets :attr:`ServedPool.failed`,
which drains and ends the server, and :meth:`ServedPool.watch` checks the ranks between
requests, so a rank lost while the server is idle ends it too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any, NoReturn, cast

import torch

from fastprefill.distributed.pool import RankPool, RankPoolError
from fastprefill.distributed.rank import Request
from fastprefill.engine import StreamEvent
from fastprefill.errors import FastprefillError
from fastprefill.methods.base import DistributedMethod, Method
from fastprefill.sampling import SamplingParams

__all__ = ["ServedPool"]

log = logging.getLogger(__name__)


class ServedPool(RankPool):
    """A :class:`~fastprefill.distributed.pool.RankPool` whose generations stream token by token
    and stop when asked (see the module docstring). Arguments as :class:`RankPool`'s, and
    ``fatal``: a failed pool ends the server (torchrun's ranks)."""

    def __init__(self, model: str, procs: int, *, fatal: bool = False, **kwargs: Any) -> None:
        #: why the pool was shut down (a dead, hung or failed rank), once it has been
        self.failure: str | None = None
        #: set when :attr:`failure` is
        self.failed = threading.Event()
        self.fatal = fatal
        #: generations the last rank stopped before their end because they were cancelled
        self.stopped_early = 0
        self._busy = threading.Lock()  # held by a generation; the watcher checks only without it
        self._watcher: threading.Thread | None = None
        super().__init__(model, procs, **kwargs)

    @property
    def closed(self) -> bool:
        return self._closed

    def lost(self) -> str | None:
        """Why the pool cannot run a request now (``None``: it can), without waiting and without
        touching a connection, so any thread may ask (``/health`` does, on the event loop): the
        pool's failure once it has been shut down; before that, a rank that has gone since its
        last request (a local worker's process sentinel, a remote rank's closed connection),
        which the next request, or :meth:`watch`, would fail on."""
        if self._closed:
            return self.failure or "the rank pool was closed"
        for rank, link in enumerate(list(self._links)):
            try:
                if link.sentinel is not None:
                    gone = bool(wait([link.sentinel], 0))
                else:
                    gone = not link.alive()
            except (OSError, ValueError):  # closed meanwhile
                return self.failure or "the rank pool was closed"
            if gone:
                return f"rank {rank} (pid {link.pid}) has gone"
        return None

    def _fail(self, msg: str, user_error: FastprefillError | None = None) -> NoReturn:
        if user_error is None:
            self.failure = msg
            self.failed.set()
        super()._fail(msg, user_error)

    def _send_all(self, message: tuple[str, Any]) -> None:
        for rank, link in enumerate(self._links):
            try:
                if not link.alive():
                    raise BrokenPipeError
                link.conn.send(message)
            except OSError:
                link.join(1.0)
                self._fail(f"generate: rank {rank} {link.gone()}; pool shut down")

    def watch(self, period_s: float = 1.0) -> threading.Thread:
        """Check every ``period_s`` seconds, while no generation runs, that every rank is still
        there (an idle rank sends nothing, so a message is its failure and the end of its
        connection its death); a lost rank shuts the pool down as during a request. Returns
        the daemon thread, which ends with the pool; a second call returns the running one."""
        if self._watcher is not None and self._watcher.is_alive():
            return self._watcher

        def loop() -> None:
            while not self._closed:
                time.sleep(period_s)
                if not self._busy.acquire(blocking=False):
                    continue
                try:
                    self._check_idle()
                except RankPoolError as exc:
                    log.error("rank pool: %s", exc)
                    return
                except (OSError, ValueError):  # closed meanwhile
                    return
                finally:
                    self._busy.release()

        self._watcher = threading.Thread(target=loop, name="fastprefill-rank-watch", daemon=True)
        self._watcher.start()
        return self._watcher

    def _check_idle(self) -> None:
        for rank, link in enumerate(self._links):
            if self._closed:
                return
            if link.alive() and link.conn.poll(0):
                try:
                    kind, payload = link.conn.recv()
                except (EOFError, OSError):
                    link.ended = True
                else:
                    if kind == "error":
                        self._on_error("idle", payload)
            if not link.alive():
                link.join(1.0)
                self._fail(f"idle: rank {rank} {link.gone()}; pool shut down")

    def stream(self, input_ids: torch.Tensor, method: Method, max_new_tokens: int, *, stop_at_eos: bool = True,
               sampling: SamplingParams | None = None, name: str | None = None) -> Iterator[StreamEvent]:
        """Generation of validated ``(1, T)`` ids over every rank, ``method`` as resolved for them
        (the ranks take both as they are; the last rank decodes with ``sampling`` and names the
        method ``name`` in its timing), as
        :func:`fastprefill.engine.stream`'s events (text deltas included). The last event carries
        the last rank's :class:`~fastprefill.engine.Timing`, its ``ttft_s`` (and ``total_s``) on
        this process's clock: from sending the request to the ranks through the first token's
        arrival. Closing the generator early cancels: the last rank stops at its next token.

        Raises:
            FastprefillError: every rank refused the request (the pool stays usable).
            RankPoolError: a rank died, failed, or sent nothing for ``method.timeout_s``; the
                pool is shut down.
        """
        request = Request(input_ids.reshape(-1).tolist(), method, max_new_tokens, stop_at_eos=stop_at_eos, stream=True,
                          sampling=sampling, prepared=True, name=name)
        with self._busy:
            yield from self._stream(request)

    def _stream(self, request: Request) -> Iterator[StreamEvent]:
        self._check_open()
        method = request.method
        timeout = float(cast(DistributedMethod, method).timeout_s if method.on_ranks else self.timeout_s)
        pending = set(range(self.procs))
        t0 = time.perf_counter()
        self._send_all(("run", request))
        ttft: float | None = None
        last: StreamEvent | None = None
        invalid: tuple[str, FastprefillError | None] | None = None
        try:
            while pending:
                rank, kind, payload = self._next("generate", pending, time.monotonic() + timeout, timeout)
                if kind != "token":
                    pending.discard(rank)
                    invalid = payload if kind == "invalid" else invalid
                    continue
                ttft = time.perf_counter() - t0 if ttft is None else ttft
                token_id, text, index, timing, choice, logprob, finish_reason, prompt_lp = payload
                event = StreamEvent(token_id, text, index, timing, choice=choice, logprob=logprob,
                                    finish_reason=finish_reason, prompt_logprobs=prompt_lp)
                if timing is None:
                    yield event
                else:  # the last: once every rank is done, so the pool is idle when the caller sees it
                    last = event
        finally:
            if pending and not self._closed:  # closed early: stop the last rank, wait for every rank
                self._conns[-1].send(("cancel", None))
                deadline = time.monotonic() + timeout
                while pending:
                    rank, kind, payload = self._next("cancel", pending, deadline, timeout)
                    if kind != "token":
                        pending.discard(rank)
                        self.stopped_early += kind == "done" and bool(payload.get("cancelled"))
        if invalid is not None:
            message, exc = invalid
            raise exc if exc is not None else FastprefillError(message)
        if last is None or last.timing is None or ttft is None:
            self._fail("generate: the last rank finished without its last token; pool shut down")
        last.timing.total_s += ttft - last.timing.ttft_s
        last.timing.ttft_s = ttft
        yield last

    def warm_up(self, method: Method, vocab_size: int) -> None:
        """One short generation with ``method`` (the first run on the ranks is slow)."""
        ids = torch.tensor([[(1000 + i) % vocab_size for i in range(64)]])
        for _ in self.stream(ids, method, 2):
            pass
