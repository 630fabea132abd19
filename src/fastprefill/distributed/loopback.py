"""The communication coefficients of this machine's loopback, for the KV-Runahead cost model.

:func:`measure_loopback` starts two local processes, joins them in a gloo process group on
127.0.0.1 (:mod:`fastprefill.runtime`) and fits ``t = latency + bytes / bandwidth`` on a
ping-pong of CPU tensors (``fastprefill calibrate-runahead`` gives the result to
:func:`fastprefill.methods.runahead.calibrate.calibrate`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from fastprefill.host import set_threads
from fastprefill.runtime import free_port, init_group, use_loopback

__all__ = ["measure_loopback"]


def _pingpong_worker(rank: int, port: int, sizes: list[int], repeats: int, out: Any) -> None:
    import torch.distributed as dist

    set_threads(1)
    use_loopback()
    init_group(rank, 2, port=port, timeout_s=60.0)
    try:
        result = []
        for n in sizes:
            buf = torch.zeros(n // 4, dtype=torch.float32)
            ts = []
            for k in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if k:
                    ts.append((time.perf_counter() - t0) / 2)
            result.append(statistics.median(ts))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def measure_loopback(sizes: Sequence[int] = (4096, 1 << 20, 8 << 20), repeats: int = 5) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of gloo point-to-point between two local processes,
    fitted as ``t = latency + bytes / bandwidth`` on a ping-pong (127.0.0.1 only)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_pingpong_worker, args=(r, port, list(sizes), repeats, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        ts = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    a = torch.tensor([[1.0, float(n)] for n in sizes], dtype=torch.float64)
    coef = torch.linalg.lstsq(a, torch.tensor(ts, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    lat = max(coef[0], 1e-6)
    per_byte = max(coef[1], 1e-12)
    return 1.0 / per_byte, lat
