"""A persistent pool of ranks that serves prompts with a distributed method.

:class:`RankPool` spawns ``procs`` worker processes on this machine, joins them in a gloo
process group on a free 127.0.0.1 port (:mod:`fastprefill.runtime`), fixes each
rank's torch thread count and optionally pins rank ``r`` to one CPU core
(``os.sched_setaffinity``). Every worker loads the model *once* (:func:`fastprefill.models.load`);
the pool then stays alive and the driver sends it prompts. That keeps model loading out of TTFT,
and TTFT is measured **on the driver** from dispatching the prompt through receiving the first
token id from the last rank (pipes, every rank's work and all communication included);
``fastprefill generate --method runahead`` and ``python -m fastprefill.launch`` drive one. A pool
may also drive ranks started elsewhere (torchrun's, on several machines:
:mod:`fastprefill.distributed.torchrun_links`), given as links (:mod:`fastprefill.distributed.links`).

Roles and the protocol every rank answers are :mod:`fastprefill.distributed.rank`'s: every rank
validates the request before any communication (``check_request``); then the last rank runs the
engine's :class:`~fastprefill.engine.Generation` of those ids (prefill, first token, decode) and ranks ``0..P-2`` call the
method's :meth:`~fastprefill.methods.base.DistributedMethod.contribute` (``run_rank``). The
driver sees each rank as a :class:`~fastprefill.distributed.links.RankLink`: its connection, and
how it tells that the rank has gone (a local worker: its process sentinel; a rank known only by
its connection: the connection's end).

Faults: a request a rank refuses (a :class:`~fastprefill.errors.FastprefillError` from
validation: bad prompt, bad method setting, a model family the method does not support) is
raised on the driver as that same error and the pool stays usable, since every rank refuses
alike before any communication. Every communication wait is bounded by the method's
``timeout_s``; the driver watches every rank, and the first one that dies or fails mid-request
makes it stop all of them and raise :class:`RankPoolError` (a failed process group is not
reused). Local workers are daemonic children and also exit when the driver's pid goes away: no
orphans.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, NoReturn, Self, cast

import torch

from fastprefill.distributed.links import ProcessLink, RankLink, worker_main
from fastprefill.distributed.rank import Request
from fastprefill.errors import ConfigError, FastprefillError, is_int
from fastprefill.host import DTYPES, resolve_dtype
from fastprefill.methods.base import DistributedMethod, Method
from fastprefill.runtime import free_port

if TYPE_CHECKING:
    from fastprefill.sampling import SamplingParams

__all__ = ["PoolResult", "RankPool", "RankPoolError"]


class RankPoolError(FastprefillError, RuntimeError):
    """A worker died, hung or failed; the pool has been shut down."""


@dataclass
class PoolResult:
    """One generation on a pool.

    Attributes:
        text, token_ids: the greedy output.
        ttft_s: driver-measured seconds from dispatching the prompt to receiving the first token.
        timing: the last rank's engine :class:`~fastprefill.engine.Timing` as a dict (its own TTFT
            excludes dispatch).
        ranks: per-rank prefill counters (chunks, bytes sent/received, ...), index = rank.
        logits: ``(V,)`` float32 first-token logits from the last rank (sent after generation,
            outside the TTFT window).
    """

    text: str
    token_ids: list[int]
    ttft_s: float
    timing: dict[str, Any]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    logits: torch.Tensor | None = None


# --- driver side ---------------------------------------------------------------------------------
class RankPool:
    """A persistent group of ranks, each holding the model (see the module docstring).

    Args:
        model: a name :func:`fastprefill.models.load` accepts (zoo name, model folder,
            ``"random:llama"``, ...).
        procs: number of ranks (>= 1).
        dtype: what every rank loads the model in (``"auto"``, ``"bfloat16"``, ``"float32"``,
            ``"float16"``; see :func:`fastprefill.host.resolve_dtype`): the same on every rank.
        threads_per_rank: torch threads in each rank (:func:`~fastprefill.host.set_threads`).
        pin: pin rank ``r`` to the ``r``-th CPU of this process's affinity set (one core per rank).
        timeout_s: process-group timeout and the bound on each communication wait.
        start_timeout_s: bound on starting all workers (model loading included).
        start_method: ``"spawn"`` (default: a fresh interpreter per rank; scripts need the
            ``if __name__ == "__main__":`` guard) or ``"fork"`` (starts in well under a second
            because torch is already imported; used by the tests; only with
            ``threads_per_rank=1`` and before this process has initialised CUDA or a process
            group, as forked OpenMP/CUDA state is not safe to reuse).
        links: ranks that already run elsewhere (torchrun's), one per rank in rank order, each
            running :func:`~fastprefill.distributed.rank.serve_rank`: the pool starts no process
            and only waits for their ``"ready"`` (``threads_per_rank``, ``pin`` and
            ``start_method`` are then not used).

    Raises:
        ConfigError: a bad argument.
        FastprefillError: the model cannot be loaded (for example ModelNotFoundError), raised as
            the workers' own error.
        RankPoolError: a worker failed to start otherwise.

    Use as a context manager; :meth:`close` stops the workers.
    """

    def __init__(
        self,
        model: str,
        procs: int,
        *,
        dtype: str = "auto",
        threads_per_rank: int = 1,
        pin: bool = False,
        timeout_s: float = 120.0,
        start_timeout_s: float = 900.0,
        start_method: str = "spawn",
        links: Sequence[RankLink] | None = None,
    ) -> None:
        if not is_int(procs, 1):
            raise ConfigError(f"procs must be an integer >= 1, got {procs!r}")
        if not is_int(threads_per_rank, 1):
            raise ConfigError(f"threads_per_rank must be an integer >= 1, got {threads_per_rank!r}")
        cores = sorted(os.sched_getaffinity(0))
        if pin and procs > len(cores):
            raise ConfigError(f"pin=True needs one core per rank: {procs} ranks, {len(cores)} cores available")
        if start_method not in ("spawn", "fork"):
            raise ConfigError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
        if start_method == "fork" and threads_per_rank != 1:
            raise ConfigError("start_method='fork' needs threads_per_rank=1 (forked OpenMP pools are unsafe)")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if links is not None and len(links) != procs:
            raise ConfigError(f"links: one per rank, {procs} expected, got {len(links)}")
        self.model_spec, self.procs, self.timeout_s = model, procs, timeout_s
        self.dtype = resolve_dtype(dtype)  #: what every rank's model runs in (resolved here, on the same host)
        self._links: list[RankLink] = []
        self._closed = False
        self._links = list(links) if links is not None else self._spawn(model, dtype, procs, threads_per_rank,
                                                                         cores if pin else None, timeout_s,
                                                                         start_method)
        self._conns = [link.conn for link in self._links]
        replies = self._collect("starting", start_timeout_s)
        assert len(replies) == procs

    @staticmethod
    def _spawn(model: str, dtype: str, procs: int, threads: int, cores: list[int] | None, timeout_s: float,
               start_method: str) -> list[RankLink]:
        import torch.multiprocessing as mp

        ctx = mp.get_context(start_method)
        port = free_port()
        links: list[RankLink] = []
        for rank in range(procs):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=worker_main,
                args=(rank, procs, port, model, dtype, threads, None if cores is None else cores[rank], child, os.getpid(),
                      timeout_s),
                daemon=True, name=f"fastprefill-rank{rank}",
            )
            p.start()
            child.close()
            links.append(ProcessLink(p, parent))
        return links

    # --- plumbing -----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int | None]:
        return [link.pid for link in self._links]

    def _kill_all(self) -> None:
        for link in self._links:
            link.kill()
        for link in self._links:
            link.join(10)
        for c in self._conns:
            c.close()
        self._closed = True

    def _fail(self, msg: str, user_error: FastprefillError | None = None) -> NoReturn:
        """Kill every worker; raise ``user_error`` (a worker's own error at start) or RankPoolError."""
        self._kill_all()
        if user_error is not None:
            raise user_error
        raise RankPoolError(msg)

    def _on_error(self, what: str, payload: tuple[str, FastprefillError | None]) -> None:
        message, exc = payload
        self._fail(f"{what} failed on {message}; pool shut down", exc if what == "starting" else None)

    def _collect(
        self, what: str, timeout_s: float, first_cb: Callable[[int], None] | None = None
    ) -> dict[int, tuple[str, Any]]:
        """One reply per rank (anything but "first" and "error"); watch sentinels and the deadline."""
        replies: dict[int, tuple[str, Any]] = {}
        pending, deadline = set(range(self.procs)), time.monotonic() + timeout_s
        while pending:
            rank, kind, payload = self._next(what, pending, deadline, timeout_s)
            if kind == "first":
                if first_cb is not None:
                    first_cb(payload)
                continue
            replies[rank] = (kind, payload)
            pending.discard(rank)
        return replies

    def _next(self, what: str, pending: set[int], deadline: float, timeout_s: float) -> tuple[int, str, Any]:
        """The next message ``(rank, kind, payload)`` from one of the ``pending`` ranks; a worker's
        ``"error"``, any rank's death or the deadline passing shuts the pool down (RankPoolError)."""
        by_conn = {self._conns[r]: r for r in pending}
        by_sentinel = {link.sentinel: r for r, link in enumerate(self._links) if link.sentinel is not None}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"{what}: ranks {sorted(pending)} did not answer within {timeout_s:.0f} s; pool shut down")
            for obj in wait(list(by_conn) + list(by_sentinel), timeout=min(left, 1.0)):
                if obj in by_conn:
                    try:
                        kind, payload = obj.recv()
                    except (EOFError, OSError):
                        link = self._links[by_conn[obj]]
                        if link.sentinel is not None:
                            continue  # the sentinel reports the death
                        link.ended = True
                        self._fail(f"{what}: rank {by_conn[obj]} {link.gone()}; pool shut down")
                    if kind == "error":
                        self._on_error(what, payload)
                    return by_conn[obj], kind, payload
                rank = by_sentinel[obj]
                conn = self._conns[rank]  # give its error message (if any) a moment to arrive
                if conn.poll(0.5):
                    try:
                        kind, payload = conn.recv()
                        if kind == "error":
                            self._on_error(what, payload)
                    except (EOFError, OSError):
                        pass
                self._links[rank].join(1.0)
                self._fail(f"{what}: rank {rank} {self._links[rank].gone()}; pool shut down")

    def _check_open(self) -> None:
        if self._closed:
            raise RankPoolError("this RankPool is closed (a worker failed or close() was called); start a new one")

    # --- public -------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | bytes | Sequence[int],
        method: Method | None = None,
        max_new_tokens: int = 64,
        *,
        chat: bool = False,
        stop_at_eos: bool = True,
        fault: tuple[int, int, str] | None = None,
        sampling: SamplingParams | None = None,
    ) -> PoolResult:
        """Generation with ``method`` on every rank, greedy unless ``sampling`` says otherwise
        (the last rank decodes; the result holds the first answer).

        Args:
            prompt: text (bytes must be UTF-8) or token ids (the same on every rank).
            method: a :class:`DistributedMethod` whose ``procs`` equals the pool's, or any
                Method on a one-rank pool (default: ``KVRunahead(procs)``, or full prefill on
                a one-rank pool).
            fault: test hook ``(rank, layer, "exit"|"hang")``: that helper rank exits (or hangs)
                after the given layer.

        Raises:
            FastprefillError: the request was refused by every rank before any communication,
                as the ranks' own error (ConfigError, PromptError, UnsupportedModelError, ...);
                the pool stays usable.
            RankPoolError: a worker failed, died or hung (the pool is shut down).
        """
        self._check_open()
        if method is None:
            from fastprefill.methods.full import FullPrefill
            from fastprefill.methods.runahead.method import KVRunahead

            method = KVRunahead(procs=self.procs) if self.procs > 1 else FullPrefill()
        if not is_int(max_new_tokens, 1):
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        req = Request(prompt if isinstance(prompt, (str, bytes)) else list(prompt), method, max_new_tokens, chat, stop_at_eos,
                      fault, sampling=sampling)
        first: list[float] = []
        t0 = time.perf_counter()
        for c in self._conns:
            c.send(("run", req))
        timeout = cast(DistributedMethod, method).timeout_s if method.on_ranks else self.timeout_s
        replies = self._collect("generate", 4 * float(timeout) + 60.0,
                                first_cb=lambda _tok: first.append(time.perf_counter() - t0))
        invalid = [payload for kind, payload in replies.values() if kind == "invalid"]
        if invalid:
            message, exc = invalid[0]
            raise exc if exc is not None else FastprefillError(message)
        last = replies[self.procs - 1][1]
        return PoolResult(
            text=last["text"], token_ids=last["token_ids"], ttft_s=first[0], timing=last["timing"],
            ranks=[replies[r][1]["stats"] for r in range(self.procs)], logits=last["logits"],
        )

    def close(self) -> None:
        """Stop the ranks (kills local workers that do not exit within 10 s; closes the
        connection of other ranks, which then leave)."""
        if self._closed:
            return
        for c in self._conns:
            try:
                c.send(("stop", None))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for link in self._links:
            link.join(max(0.1, deadline - time.monotonic()))
        self._kill_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._kill_all()
