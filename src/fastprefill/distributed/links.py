"""How a rank pool's driver reaches its ranks: :class:`RankLink` (a rank known by its connection,
such as a torchrun rank), :class:`ProcessLink` (a worker process of this machine) and
:func:`worker_main`, the entry point of such a worker (it loads the model once and answers the
driver with :func:`fastprefill.distributed.rank.serve_rank`)."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

from fastprefill.distributed.rank import send_error, serve_rank
from fastprefill.host import set_threads
from fastprefill.runtime import init_group, use_loopback

__all__ = ["ProcessLink", "RankLink", "worker_main"]


class RankLink:
    """One rank as the driver sees it: the connection it answers on, and how it tells it has gone.

    This base class is a rank known only by its connection (a torchrun rank, here or on another
    machine): the connection's end is the rank's end. :class:`ProcessLink` is a local worker.

    Attributes:
        conn: the duplex connection (:mod:`fastprefill.distributed.rank`'s protocol).
        pid: the rank's process id (on its own machine), for logs and ``/health``.
        host: where the rank runs, for messages.
        sentinel: an object :func:`multiprocessing.connection.wait` reports once the rank has
            gone; ``None``: the end of ``conn`` reports it.
    """

    sentinel: Any = None

    def __init__(self, conn: Connection, pid: int | None = None, host: str = "") -> None:
        self.conn, self.pid, self.host = conn, pid, host
        self.ended = False  # the rank's end of the connection has closed

    def alive(self) -> bool:
        return not (self.ended or self.conn.closed)

    def gone(self) -> str:
        """What happened to the rank, for a message after ``"rank N "``."""
        return (f"closed its connection (pid {self.pid} on {self.host}: its process ended or its machine is "
                "unreachable)")

    def kill(self) -> None:
        """Make the rank leave: it ends its loop when its connection closes."""
        self.conn.close()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the rank to close its end (its messages are dropped)."""
        deadline = time.monotonic() + timeout
        try:
            while not self.conn.closed and (left := deadline - time.monotonic()) > 0:
                if self.conn.poll(left):
                    self.conn.recv()
        except (EOFError, OSError):
            self.ended = True


class ProcessLink(RankLink):
    """A worker process of this machine (a :class:`RankPool`'s own): its sentinel tells its death."""

    def __init__(self, proc: Any, conn: Connection) -> None:
        super().__init__(conn, proc.pid, "this machine")
        self.proc = proc
        self.sentinel = proc.sentinel

    def alive(self) -> bool:
        return bool(self.proc.is_alive())

    def gone(self) -> str:
        return f"died (exit code {self.proc.exitcode})"

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()

    def join(self, timeout: float) -> None:
        self.proc.join(timeout=timeout)


def worker_main(
    rank: int, world: int, port: int, model_spec: str, dtype: str, threads: int, core: int | None,
    conn: Connection, parent_pid: int, timeout_s: float,
) -> None:
    """Entry point of one spawned rank of a :class:`~fastprefill.distributed.pool.RankPool`
    (module-level so ``spawn`` can import it)."""
    import torch.distributed as dist

    from fastprefill.host import keep_freed_memory
    from fastprefill.models import load

    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        set_threads(threads, interop=1)
        use_loopback()
        keep_freed_memory()
        model, tokenizer = load(model_spec, dtype=dtype, processes=world + 1)  # the ranks and the driver's model
        if world > 1:
            init_group(rank, world, port=port, timeout_s=timeout_s)
        if not serve_rank(conn, model, tokenizer, rank, world, driver_alive=lambda: os.getppid() == parent_pid):
            os._exit(1)  # the driver is gone: do not linger
        if world > 1:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - report any failure, then exit non-zero: the driver tears the pool down
        send_error(conn, rank, exc)
        os._exit(1)
