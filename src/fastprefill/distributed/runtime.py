"""Process-level settings in one place: torch threads, the loopback port, process-group init.

Every entry point that sets threads (the CLI, the benchmark harness, the rank pool's workers,
torchrun ranks, partition calibration) calls :func:`set_threads`; every process group is made
by :func:`init_group`. This module imports nothing from fastprefill but the errors, so any layer
may use it.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch

from fastprefill.errors import ConfigError

__all__ = ["backend_for", "free_port", "init_group", "set_threads", "use_loopback"]


def set_threads(threads: int, *, interop: int | None = None) -> None:
    """Fix torch's intra-op thread count (and, once per process, the inter-op count).

    Args:
        threads: intra-op threads, >= 1.
        interop: inter-op threads; ``None`` leaves them. torch refuses to change them after
            parallel work has started, which is ignored here (the intra-op count is what counts).

    Raises:
        ConfigError: ``threads`` is not an integer >= 1.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(threads)
    if interop is not None:
        try:
            torch.set_num_interop_threads(interop)
        except RuntimeError:
            pass  # already set or parallel work has started: torch keeps the old value


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (loopback only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def use_loopback() -> None:
    """Make gloo use the loopback interface (call in the rank process, before :func:`init_group`)."""
    names = {name for _, name in socket.if_nameindex()}
    if "lo" in names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(
    rank: int | None = None,
    world: int | None = None,
    *,
    port: int | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float = 120.0,
) -> None:
    """Join the default torch.distributed process group.

    Args:
        rank, world: this process's rank and the group size; ``None`` reads ``RANK`` /
            ``WORLD_SIZE`` from the environment (torchrun sets them, with ``MASTER_ADDR`` /
            ``MASTER_PORT``).
        port: a 127.0.0.1 port for a local group (the rank pool); ``None`` uses the environment's
            rendezvous (``env://``).
        device: picks the backend (:func:`backend_for`).
        timeout_s: the group's timeout for collectives.
    """
    import torch.distributed as dist

    init_method = f"tcp://127.0.0.1:{port}" if port is not None else "env://"
    where = {} if rank is None else {"rank": rank, "world_size": world}
    dist.init_process_group(
        backend_for(torch.device(device)), init_method=init_method,
        timeout=datetime.timedelta(seconds=timeout_s), **where,
    )
