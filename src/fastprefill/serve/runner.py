"""Running the app: under uvicorn with a draining shutdown (:func:`run`), or from a thread of
this process (:func:`background`, for tests and notebooks)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

from fastprefill.serve.app import CLOSE_GRACE_S, Server

__all__ = ["background", "run"]

log = logging.getLogger("fastprefill.serve.app")

#: Seconds an idle keep-alive connection stays open. Above the idle time of common client pools
#: (httpx, under the ``openai`` client, keeps one for 5 s; uvicorn's own default is also 5 s), so
#: a client never sends a request on a connection the server is closing at that moment.
KEEP_ALIVE_S = 30


class _DrainingServer(uvicorn.Server):
    """uvicorn's server; the first SIGTERM or SIGINT, or ``until`` being set, drains the app's
    :class:`Server` (:meth:`Server.drain` with its ``drain_timeout_s``) before uvicorn shuts
    down; a second signal is uvicorn's own handling (shut down now)."""

    def __init__(self, config: uvicorn.Config, app_server: Server, until: threading.Event | None = None) -> None:
        super().__init__(config)
        self.app_server = app_server
        self.until = until
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.warning("shutting down: draining for at most %g s (a second signal stops at once)",
                    self.app_server.config.drain_timeout_s)
        self._loop.call_soon_threadsafe(self._start_drain)

    async def on_tick(self, counter: int) -> bool:
        if self.until is not None and self.until.is_set() and not self._draining:
            self._draining = True
            log.warning("shutting down: the server's ranks failed; draining for at most %g s",
                        self.app_server.config.drain_timeout_s)
            self._start_drain()
        return await super().on_tick(counter)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.app_server.drain(self.app_server.config.drain_timeout_s)
        finally:
            self.should_exit = True


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
        until: threading.Event | None = None) -> None:
    """Serve ``app`` (made by :func:`create_app`) with uvicorn until SIGTERM or SIGINT (or
    ``until`` is set, checked every 0.1 s: a torchrun server's ranks failed), then shut down
    as the module docstring says (one process: the model is loaded once)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=CLOSE_GRACE_S,
                            timeout_keep_alive=KEEP_ALIVE_S)
    _DrainingServer(config, app.state.server, until).run()


@contextmanager
def background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a thread of this process (tests, notebooks); yields the base URL
    ``http://host:port`` once the server accepts connections, and stops it on exit (without a
    drain: what is waiting or running is answered 503)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                            timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="fastprefill-uvicorn",
                              daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread ended before it started (see the log above)")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
