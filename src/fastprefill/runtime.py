"""Process groups in one place: the loopback port, the backend, process-group init.

Every process group is made by :func:`init_group`. This module imports nothing from
fastprefill, so any layer may use it (torch threads are set by :func:`fastprefill.host.set_threads`).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch

__all__ = ["backend_for", "free_port", "init_group", "use_loopback"]


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
