"""A persistent pool of ranks on this machine that serves prompts with a distributed method.

:class:`RankPool` spawns ``procs`` worker processes, joins them in a gloo process group on a
free 127.0.0.1 port (:mod:`fastprefill.distributed.runtime`), fixes each rank's torch thread
count and optionally pins rank ``r`` to one CPU core (``os.sched_setaffinity``). Every worker
loads the model *once* (:func:`fastprefill.models.load`); the pool then stays alive and the
driver sends it prompts. That keeps model loading out of TTFT, and TTFT is measured **on the
driver** from dispatching the prompt through receiving the first token id from the last rank
(pipes, every rank's work and all communication included). :func:`generate_distributed` is the
one-shot wrapper (``fastprefill generate --method runahead --procs 2``).

Roles: every rank validates the request with :func:`fastprefill.engine.prepare_prompt` before
any communication (:func:`check_request`); then the last rank runs
:func:`fastprefill.engine.stream` (prefill, first token, decode) and ranks ``0..P-2`` call the
method's :meth:`~fastprefill.methods.base.DistributedMethod.contribute` (:func:`run_rank`,
shared with the torchrun entry point ``python -m fastprefill.launch``).

Worker protocol (one duplex pipe per rank; the driver sends, the worker answers):

- ``("run", Request)`` -> ``("first", token_id)`` (last rank, as soon as it has it), then
  ``("done", payload)``; or ``("invalid", error)`` when validation refused the request. With
  ``Request.stream`` the last rank sends ``("token", (token_id, text, index, timing))`` for every
  token instead of ``"first"`` (``timing`` on the last one only), and stops at the next token
  when ``("cancel", None)`` arrives (a stray one, after the run, is ignored);
- ``("tokenize", {"prompt", "chat"})`` -> ``("tokens", ids)`` (sent to the last rank only);
- ``("stop", None)`` -> the worker leaves its group and exits;
- at start the worker answers ``("ready", rank)``; any failure is ``("error", (message, user
  error or None))`` and the worker exits.

Faults: a request a rank refuses (a :class:`~fastprefill.errors.FastprefillError` from
validation: bad prompt, bad method setting, a model family the method does not support) is
raised on the driver as that same error and the pool stays usable, since every rank refuses
alike before any communication. Every communication wait is bounded by the method's
``timeout_s``; the driver watches every worker's process sentinel, and the first worker that
dies or fails mid-request makes it kill all workers and raise :class:`RankPoolError` (a failed
process group is not reused). Workers are daemonic children and also exit when the driver's
pid goes away: no orphans.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, Self

import torch

from fastprefill.distributed.runtime import free_port, init_group, set_threads, use_loopback
from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.methods.base import DistributedMethod, LayerHook, Method

__all__ = [
    "FAULT_EXIT_CODE",
    "PoolResult",
    "RankPool",
    "RankPoolError",
    "Request",
    "check_ranks",
    "check_request",
    "generate_distributed",
    "required_ranks",
    "run_rank",
]

#: Worker exit code used by the fault-injection hook.
FAULT_EXIT_CODE = 17


class RankPoolError(FastprefillError, RuntimeError):
    """A worker died, hung or failed; the pool has been shut down."""


@dataclass(frozen=True)
class Request:
    """One generation request, identical on every rank.

    Attributes:
        prompt: text (needs the model's tokenizer) or token ids.
        method: the method every rank runs; see :func:`required_ranks`.
        max_new_tokens: tokens to generate, the first included.
        chat: wrap text in the chat template.
        stop_at_eos: stop at the model's end-of-sequence token.
        fault: test hook ``(rank, layer, "exit"|"hang")``: that helper rank exits (or hangs)
            after the given layer.
        stream: the last rank sends every token as it comes (see the module docstring).
        stops: generation ends once the text contains one of these strings.
    """

    prompt: str | list[int]
    method: Method
    max_new_tokens: int = 64
    chat: bool = False
    stop_at_eos: bool = True
    fault: tuple[int, int, str] | None = None
    stream: bool = False
    stops: tuple[str, ...] = ()


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


# --- one rank's work (the pool's workers and torchrun ranks) -------------------------------------
def required_ranks(method: Method) -> int:
    """Ranks ``method`` runs on: ``procs`` of a :class:`DistributedMethod`, else 1."""
    return method.procs if isinstance(method, DistributedMethod) else 1


def check_ranks(method: Method, world: int, group: str) -> None:
    """Refuse ``method`` unless it runs on ``world`` ranks; ``group`` says what has ``world``
    ranks, for the message (``"this group has 2"``).

    Raises:
        ConfigError: ``required_ranks(method) != world``.
    """
    need = required_ranks(method)
    if need != world:
        what = f"needs procs={need} ranks" if isinstance(method, DistributedMethod) else "runs on one process"
        raise ConfigError(f"{method.describe()} {what}, but {group}")


def check_request(model: Any, tokenizer: Any, request: Request, world: int) -> torch.Tensor:
    """Validate ``request`` for a group of ``world`` ranks; return its ``(1, T)`` ids.

    Every rank runs the same checks on the same input before any communication, so all ranks
    refuse alike.

    Raises:
        ConfigError: not a Method, or a method for another number of ranks; see also
            :func:`fastprefill.engine.prepare_prompt` (PromptError, UnsupportedModelError, ...).
    """
    from fastprefill.engine import prepare_prompt

    method = request.method
    if not isinstance(method, Method):
        raise ConfigError(f"method must be a fastprefill Method, got {type(method).__name__}")
    check_ranks(method, world, f"this group has {world}")
    return prepare_prompt(model, tokenizer, request.prompt, method, max_new_tokens=request.max_new_tokens,
                          chat=request.chat)


def _layer_hook(fault: tuple[int, int, str] | None) -> LayerHook | None:
    if fault is None:
        return None
    f_rank, f_layer, kind = fault

    def hook(rank: int, layer: int) -> None:
        if rank == f_rank and layer == f_layer:
            if kind == "exit":
                os._exit(FAULT_EXIT_CODE)
            time.sleep(10_000)  # "hang"

    return hook


def run_rank(
    model: Any,
    tokenizer: Any,
    rank: int,
    world: int,
    request: Request,
    input_ids: torch.Tensor,
    on_first: Callable[[int], None] | None = None,
    on_token: Callable[[Any], bool] | None = None,
) -> dict[str, Any]:
    """This rank's part of a request validated by :func:`check_request`.

    The last rank generates: the result has ``text``, ``token_ids``, ``timing`` (the engine's
    :class:`~fastprefill.engine.Timing` as a dict), ``stats`` (its prefill counters) and
    ``logits`` (``(V,)`` first-token logits on the CPU); ``on_first(token_id)`` is called as soon
    as the first token is known, ``on_token(event)`` with every
    :class:`~fastprefill.engine.StreamEvent` (True: stop now; the result is then
    ``{"cancelled": True, "stats": {}}``). Other ranks contribute and return ``{"stats": counters}``.
    """
    from fastprefill.engine import stream

    method = request.method
    if rank == world - 1:
        events = []
        stops = request.stops
        gen = stream(model, tokenizer, input_ids, method, request.max_new_tokens, stop_at_eos=request.stop_at_eos,
                     stop=(lambda text: any(s in text for s in stops)) if stops else None)
        with contextlib.closing(gen):
            for ev in gen:
                if ev.index == 0 and on_first is not None:
                    on_first(ev.token_id)
                events.append(ev)
                if on_token is not None and on_token(ev) and ev.timing is None:
                    return {"cancelled": True, "stats": {}}
        timing = events[-1].timing
        assert timing is not None
        ids_out = [e.token_id for e in events]
        text = tokenizer.decode(ids_out, skip_special_tokens=True) if tokenizer is not None else ""
        return {"text": text, "token_ids": ids_out, "timing": timing.to_dict(), "stats": timing.extra,
                "logits": None if request.stream else events[-1].first_logits}
    assert isinstance(method, DistributedMethod)  # check_request: world > 1 needs one
    with torch.inference_mode():
        stats = method.contribute(model, input_ids, layer_hook=_layer_hook(request.fault))
    return {"stats": stats.extra}


# --- worker side ---------------------------------------------------------------------------------
def _send_user_error(conn: Connection, kind: str, exc: FastprefillError, message: str) -> None:
    try:
        conn.send((kind, (message, exc)))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: send the text only
        conn.send((kind, (message, None)))


def _token_sender(conn: Connection) -> Callable[[Any], bool]:
    """``on_token`` of a streamed request: send the event, then say whether a cancel has come."""

    def send(ev: Any) -> bool:
        conn.send(("token", (ev.token_id, ev.text, ev.index, ev.timing)))
        cancelled = False
        while conn.poll(0):  # only a cancel is sent to a rank while it runs
            cancelled |= conn.recv()[0] == "cancel"
        return cancelled

    return send


def _worker_main(
    rank: int, world: int, port: int, model_spec: str, threads: int, core: int | None,
    conn: Connection, parent_pid: int, timeout_s: float,
) -> None:
    """Entry point of one spawned rank (module-level so ``spawn`` can import it)."""
    import torch.distributed as dist

    from fastprefill.models import load

    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        set_threads(threads, interop=1)
        use_loopback()
        model, tokenizer = load(model_spec)
        if world > 1:
            init_group(rank, world, port=port, timeout_s=timeout_s)
        conn.send(("ready", rank))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    os._exit(1)  # the driver is gone: do not linger
                continue
            kind, payload = conn.recv()
            if kind == "stop":
                break
            if kind == "cancel":  # for a run that had already ended
                continue
            if kind == "tokenize":
                from fastprefill.engine import encode_prompt

                conn.send(("tokens", encode_prompt(tokenizer, payload["prompt"], chat=payload["chat"])[0].tolist()))
                continue
            try:
                ids = check_request(model, tokenizer, payload, world)
            except FastprefillError as exc:
                _send_user_error(conn, "invalid", exc, f"rank {rank}: {type(exc).__name__}: {exc}")
                continue
            streams = payload.stream and rank == world - 1
            result = run_rank(model, tokenizer, rank, world, payload, ids,
                              on_first=None if streams else lambda tok: conn.send(("first", tok)),
                              on_token=_token_sender(conn) if streams else None)
            conn.send(("done", result))
        if world > 1:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - report any failure, then exit non-zero: the driver tears the pool down
        msg = f"rank {rank}: {type(exc).__name__}: {exc}"
        if not isinstance(exc, FastprefillError):
            msg += "\n" + traceback.format_exc(limit=3)
        try:
            if isinstance(exc, FastprefillError):
                _send_user_error(conn, "error", exc, msg)
            else:
                conn.send(("error", (msg, None)))
        except OSError:
            pass
        os._exit(1)


# --- driver side ---------------------------------------------------------------------------------
class RankPool:
    """A persistent group of ranks on this machine, each holding the model (see the module docstring).

    Args:
        model: a name :func:`fastprefill.models.load` accepts (zoo name, model folder,
            ``"random:llama"``, ...).
        procs: number of ranks (>= 1).
        threads_per_rank: torch threads in each rank (:func:`~fastprefill.distributed.runtime.set_threads`).
        pin: pin rank ``r`` to the ``r``-th CPU of this process's affinity set (one core per rank).
        timeout_s: process-group timeout and the bound on each communication wait.
        start_timeout_s: bound on starting all workers (model loading included).
        start_method: ``"spawn"`` (default: a fresh interpreter per rank; scripts need the
            ``if __name__ == "__main__":`` guard) or ``"fork"`` (starts in well under a second
            because torch is already imported; used by the tests; only with
            ``threads_per_rank=1`` and before this process has initialised CUDA or a process
            group, as forked OpenMP/CUDA state is not safe to reuse).

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
        threads_per_rank: int = 1,
        pin: bool = False,
        timeout_s: float = 120.0,
        start_timeout_s: float = 900.0,
        start_method: str = "spawn",
    ) -> None:
        if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
            raise ConfigError(f"procs must be an integer >= 1, got {procs!r}")
        if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
            raise ConfigError(f"threads_per_rank must be an integer >= 1, got {threads_per_rank!r}")
        cores = sorted(os.sched_getaffinity(0))
        if pin and procs > len(cores):
            raise ConfigError(f"pin=True needs one core per rank: {procs} ranks, {len(cores)} cores available")
        if start_method not in ("spawn", "fork"):
            raise ConfigError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
        if start_method == "fork" and threads_per_rank != 1:
            raise ConfigError("start_method='fork' needs threads_per_rank=1 (forked OpenMP pools are unsafe)")
        import torch.multiprocessing as mp

        self.model_spec, self.procs, self.timeout_s = model, procs, timeout_s
        ctx = mp.get_context(start_method)
        port = free_port()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._closed = False
        for rank in range(procs):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, procs, port, model, threads_per_rank, cores[rank] if pin else None, child,
                      os.getpid(), timeout_s),
                daemon=True, name=f"fastprefill-rank{rank}",
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        replies = self._collect("starting", start_timeout_s)
        assert len(replies) == procs

    # --- plumbing -----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
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
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"{what}: ranks {sorted(pending)} did not answer within {timeout_s:.0f} s; pool shut down")
            for obj in wait(list(by_conn) + list(by_sentinel), timeout=min(left, 1.0)):
                if obj in by_conn:
                    try:
                        kind, payload = obj.recv()
                    except (EOFError, OSError):
                        continue  # the sentinel reports the death
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
                self._procs[rank].join(timeout=1.0)
                self._fail(f"{what}: rank {rank} died (exit code {self._procs[rank].exitcode}); pool shut down")

    def _check_open(self) -> None:
        if self._closed:
            raise RankPoolError("this RankPool is closed (a worker failed or close() was called); start a new one")

    # --- public -------------------------------------------------------------------------------
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt`` from the last rank's tokenizer (the driver loads no model)."""
        self._check_open()
        self._conns[-1].send(("tokenize", {"prompt": prompt, "chat": chat}))
        if not self._conns[-1].poll(self.timeout_s):
            self._fail("tokenize: no answer")
        kind, payload = self._conns[-1].recv()
        if kind == "error":
            self._on_error("tokenize", payload)
        return list(payload)

    def generate(
        self,
        prompt: str | bytes | Sequence[int],
        method: Method | None = None,
        max_new_tokens: int = 64,
        *,
        chat: bool = False,
        stop_at_eos: bool = True,
        fault: tuple[int, int, str] | None = None,
    ) -> PoolResult:
        """Greedy generation with ``method`` on every rank.

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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        req = Request(prompt if isinstance(prompt, (str, bytes)) else list(prompt), method, max_new_tokens, chat, stop_at_eos,
                      fault)
        first: list[float] = []
        t0 = time.perf_counter()
        for c in self._conns:
            c.send(("run", req))
        timeout = method.timeout_s if isinstance(method, DistributedMethod) else self.timeout_s
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
        """Stop the workers (kills any that do not exit within 10 s)."""
        if self._closed:
            return
        for c in self._conns:
            try:
                c.send(("stop", None))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._kill_all()


def generate_distributed(
    model: str,
    prompt: str | bytes | Sequence[int],
    method: Method,
    *,
    procs: int | None = None,
    max_new_tokens: int = 64,
    chat: bool = False,
    stop_at_eos: bool = True,
    threads_per_rank: int = 1,
    pin: bool = False,
    start_method: str = "spawn",
) -> PoolResult:
    """One generation on a fresh local pool of :func:`required_ranks` ``(method)`` ranks, closed after.

    Args:
        procs: the number of ranks the caller asked for (``None``: the method's); it must equal
            the method's, so a mismatch is refused before any process starts.

    Raises:
        ConfigError: ``procs`` differs from what the method needs; see :class:`RankPool` and
            :meth:`RankPool.generate`.
    """
    need = required_ranks(method)
    if procs is not None and procs != need:
        raise ConfigError(f"{method.describe()} runs on {need} rank(s), but procs={procs} was asked for")
    timeout = method.timeout_s if isinstance(method, DistributedMethod) else 120.0
    with RankPool(model, need, threads_per_rank=threads_per_rank, pin=pin, timeout_s=timeout,
                  start_method=start_method) as pool:
        return pool.generate(prompt, method, max_new_tokens, chat=chat, stop_at_eos=stop_at_eos)
