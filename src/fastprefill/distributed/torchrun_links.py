"""torchrun's ranks as the ranks of a :class:`~fastprefill.distributed.pool.RankPool`, on one
machine or several.

Under torchrun every process is a rank of the default process group (joined with
:func:`~fastprefill.runtime.init_group`). Rank 0 drives: it builds a ``RankPool``
from :func:`driver_links`, and every other rank answers it with :func:`serve_driver` (the loop
of :mod:`fastprefill.distributed.rank`, the same protocol as a local pool's workers). Rank 0's
own share of each prefill runs in a thread of its process, over a pipe (:class:`ThreadLink`).

The control channel of rank ``r > 0`` is one ``multiprocessing`` connection over TCP: rank 0
listens on ``port`` (0: a free one) and sends every rank that port and a fresh random key with
one ``broadcast_object_list`` over the process group; each rank connects to ``MASTER_ADDR``
(127.0.0.1 when every rank runs on this machine, where rank 0 then listens on loopback only),
both sides prove they hold the key (``multiprocessing.connection``'s HMAC challenge, so a
connection from anything else that reaches the port is dropped before a message is read), and
the rank says which rank it is. A rank's end is the end of its connection (its process died, it
left, or its machine is unreachable): no sentinel is needed. Every wait here is bounded by
``timeout_s``.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection, Pipe, answer_challenge, deliver_challenge
from typing import Any

from fastprefill.distributed.links import RankLink
from fastprefill.distributed.pool import RankPoolError
from fastprefill.distributed.rank import send_error, serve_rank

__all__ = ["ThreadLink", "driver_links", "join_driver", "local_ranks", "on_one_machine", "serve_driver"]


def local_ranks() -> int:
    """How many torchrun ranks run on this machine (``LOCAL_WORLD_SIZE``; without it ``WORLD_SIZE``, else 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def on_one_machine() -> bool:
    """Whether every torchrun rank runs on this machine (``LOCAL_WORLD_SIZE == WORLD_SIZE``)."""
    return local_ranks() == int(os.environ.get("WORLD_SIZE", "1"))


class ThreadLink(RankLink):
    """Rank 0's own share, served by a thread of the driver's process over a pipe."""

    def __init__(self, thread: threading.Thread, conn: Connection) -> None:
        super().__init__(conn, os.getpid(), socket.gethostname())
        self.thread = thread

    def alive(self) -> bool:
        return self.thread.is_alive() and super().alive()

    def gone(self) -> str:
        return "(its thread in the server's process) ended"

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def _rank_zero(conn: Connection, model: Any, tokenizer: Any, world: int) -> None:
    try:
        serve_rank(conn, model, tokenizer, 0, world)
    except Exception as exc:  # noqa: BLE001 - report it; the driver shuts the pool down
        send_error(conn, 0, exc)
    finally:
        conn.close()


def _bounded(sock: socket.socket, timeout_s: float | None) -> Connection:
    """``sock`` as a blocking Connection whose reads fail after ``timeout_s`` (``None``: never)."""
    sock.settimeout(None)
    secs = 0.0 if timeout_s is None else max(timeout_s, 0.001)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(secs), int(secs % 1 * 1e6)))
    return Connection(sock.detach())


def _unbound(conn: Connection) -> None:
    """Lift :func:`_bounded`'s read timeout (the handshake is over)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    finally:
        sock.close()


def driver_links(model: Any, tokenizer: Any, world: int, *, port: int = 0, timeout_s: float = 120.0) -> list[RankLink]:
    """Rank 0: one link per rank, in rank order (rank 0's own thread first; see the module docstring).

    Call it on rank 0 while every other rank calls :func:`join_driver`. ``model`` and
    ``tokenizer`` serve rank 0's own share (a thread; they may be shared with the server, which
    never runs beside a multi-rank request).

    Raises:
        RankPoolError: a rank did not connect within ``timeout_s``.
    """
    import torch.distributed as dist

    near, far = Pipe(duplex=True)
    thread = threading.Thread(target=_rank_zero, args=(far, model, tokenizer, world), daemon=True,
                              name="fastprefill-rank0")
    server = socket.create_server(("127.0.0.1" if on_one_machine() else "", port))
    key = os.urandom(32)
    dist.broadcast_object_list([(server.getsockname()[1], key)], src=0)
    links: dict[int, RankLink] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(links) < world - 1:
            left = deadline - time.monotonic()
            server.settimeout(max(left, 0.001))
            try:
                sock, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, world)) - set(links))
                raise RankPoolError(f"ranks {missing} did not connect to rank 0's control port "
                                    f"{server.getsockname()[1]} within {timeout_s:g} s") from None
            conn = _bounded(sock, left)
            try:
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
                kind, (rank, pid, host) = conn.recv()
            except Exception:  # noqa: BLE001 - not one of our ranks (no key, or garbage): drop it
                conn.close()
                continue
            if kind != "hello" or not 0 < rank < world or rank in links:
                conn.close()
                continue
            _unbound(conn)
            links[rank] = RankLink(conn, pid, host)
    except BaseException:
        for link in links.values():
            link.conn.close()
        raise
    finally:
        server.close()
    thread.start()
    return [ThreadLink(thread, near), *(links[r] for r in range(1, world))]


def join_driver(rank: int, *, timeout_s: float = 120.0) -> Connection:
    """Rank ``rank > 0``: connect to rank 0's control port (see the module docstring).

    Raises:
        OSError: rank 0 cannot be reached or refuses the key within ``timeout_s``.
    """
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    port, key = box[0]
    host = "127.0.0.1" if on_one_machine() else os.environ.get("MASTER_ADDR", "127.0.0.1")
    conn = _bounded(socket.create_connection((host, port), timeout=timeout_s), timeout_s)
    answer_challenge(conn, key)
    deliver_challenge(conn, key)
    _unbound(conn)
    conn.send(("hello", (rank, os.getpid(), socket.gethostname())))
    return conn


def serve_driver(conn: Connection, model: Any, tokenizer: Any, rank: int, world: int) -> int:
    """Rank ``rank > 0``: answer rank 0 until it stops this rank; the exit status: 0 after a
    stop, 1 when rank 0 has gone or a run failed (reported to rank 0 first)."""
    try:
        return 0 if serve_rank(conn, model, tokenizer, rank, world) else 1
    except Exception as exc:  # noqa: BLE001 - report any failure; rank 0 shuts the pool down
        send_error(conn, rank, exc)
        return 1
    finally:
        conn.close()
