"""Calibrate the KV-Runahead cost model on this machine and write a partition table.

:func:`calibrate` times one decoder layer for a grid of (chunk, prefix) sizes and fits the
compute coefficients of a :class:`~fastprefill.methods.runahead.search.CostModel`;
:func:`measure_loopback` fits the communication coefficients from a gloo ping-pong between two
local processes (127.0.0.1). The CLI searches every (ranks, length) on the fitted model and
writes a :class:`~fastprefill.methods.runahead.tables.PartitionTable`::

    python -m fastprefill.methods.runahead.calibrate --model NAME --out PATH
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastprefill.distributed.runtime import free_port, init_group, use_loopback
from fastprefill.errors import ConfigError, FastprefillError, is_int
from fastprefill.host import device_clock, set_threads
from fastprefill.methods.runahead.search import CostModel
from fastprefill.methods.runahead.tables import TABLE_LENGTHS, TABLE_RANKS, PartitionTable
from fastprefill.models.shape import ModelShape

__all__ = ["calibrate", "main", "measure_loopback"]


def _median_time(fn: Any, repeats: int, device: torch.device) -> float:
    fn()  # warm-up, discarded
    times = []
    for _ in range(repeats):
        t0 = device_clock(device)
        fn()
        times.append(device_clock(device) - t0)
    return statistics.median(times)


def calibrate(
    model: Any,
    chunks: Sequence[int] = (32, 128, 512),
    prefixes: Sequence[int] = (0, 1024, 3072),
    repeats: int = 3,
    bandwidth_bytes_s: float | None = None,
    latency_s: float | None = None,
    progress: bool = True,
) -> CostModel:
    """Fit a :class:`CostModel` by timing decoder layer 0 of ``model`` on this machine.

    For every ``(c, s)`` in ``chunks x prefixes`` it times one layer call on ``c`` rows whose
    cache holds ``s`` prefix rows, exactly as a chain rank runs it (explicit mask when
    ``s > 0``, plain causal when ``s = 0``), and fits
    ``t = a0 + a_lin * c + a_attn * pairs`` by least squares, with ``pairs = c*(s+c)`` for the
    masked calls and ``c*(c+1)/2`` for the plain causal ones. The LM head is timed on one row.
    Communication coefficients come from :func:`measure_loopback` unless given.

    Raises:
        ConfigError: ``repeats`` is not an integer >= 1.
    """
    if not is_int(repeats, 1):
        raise ConfigError(f"repeats must be an integer >= 1, got {repeats!r}")
    from tqdm import tqdm

    from fastprefill.cache import PositionKVCache
    from fastprefill.models.adapters import DecoderAdapter
    from fastprefill.models.attention import causal_mask

    ad = DecoderAdapter(model, method="runahead calibration")
    shape = ad.shape
    dev, dt = ad.device, ad.dtype
    rows, times = [], []
    grid = [(c, s) for c in chunks for s in prefixes]
    with torch.inference_mode(), ad.attention_scope():
        for c, s in tqdm(grid, desc="calibrate layer", disable=not progress):
            hidden = torch.randn(1, c, shape.hidden_size, device=dev, dtype=dt)
            pos = torch.arange(s, s + c, device=dev)[None]
            pk = torch.randn(1, shape.num_kv_heads, s, shape.head_dim, device=dev, dtype=dt)
            rot = ad.rotary(hidden, pos)
            mask = causal_mask(pos[0], torch.arange(s + c, device=dev)) if s else None

            def run(s=s, pk=pk, pos=pos, hidden=hidden, mask=mask, rot=rot) -> None:
                cache = PositionKVCache(shape.num_layers)
                if s:
                    cache.stage(0, torch.arange(s, device=dev))
                    cache.update(pk, pk, 0)
                cache.stage(0, pos[0])
                ad.layer(0, hidden, pos, cache, mask=mask, rotary=rot)

            times.append(_median_time(run, repeats, dev))
            rows.append([1.0, float(c), float(c * (s + c) if s else c * (c + 1) / 2)])
        h1 = torch.randn(1, 1, shape.hidden_size, device=dev, dtype=dt)
        head_s = _median_time(lambda: ad.head(h1), repeats, dev)
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(a, b).solution[:, 0].clamp(min=0.0).tolist()
    if bandwidth_bytes_s is None or latency_s is None:
        bw, lat = measure_loopback()
        bandwidth_bytes_s = bandwidth_bytes_s if bandwidth_bytes_s is not None else bw
        latency_s = latency_s if latency_s is not None else lat
    flop = CostModel.from_flops(shape, 1.0, 1.0)
    itemsize = torch.empty((), dtype=dt).element_size()
    return CostModel(
        num_layers=shape.num_layers,
        layer_overhead_s=coef[0],
        linear_s_per_token=coef[1],
        attn_s_per_pair=coef[2],
        qkv_fraction=flop.qkv_fraction,
        kv_bytes_per_token=2 * shape.num_kv_heads * shape.head_dim * itemsize,
        bandwidth_bytes_s=bandwidth_bytes_s,
        latency_s=latency_s,
        head_s=head_s,
        causal_kernel_pairs="half",
        notes={"samples": [[c, s, t] for (c, s), t in zip(grid, times, strict=True)], "threads": torch.get_num_threads()},
    )


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


def main(argv: Sequence[str] | None = None) -> int:
    """Calibrate on this machine and write a partition table (see the module docstring)."""
    import platform
    import sys

    from fastprefill.models import load

    parser = argparse.ArgumentParser(prog="python -m fastprefill.methods.runahead.calibrate", description=main.__doc__)
    parser.add_argument("--model", required=True, help="zoo name, local model folder or random:llama")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing (one rank's setting)")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(TABLE_RANKS))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(TABLE_LENGTHS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        set_threads(args.threads)
        model, _ = load(args.model)
        cost = calibrate(model, repeats=args.repeats)
    except FastprefillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = "python -m fastprefill.methods.runahead.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
               "threads": args.threads, "built": time.strftime("%Y-%m-%d %H:%M:%S")}
    table = PartitionTable.build(args.model, ModelShape.from_config(model.config), cost, args.ranks, args.lengths,
                                 command=command, machine=machine)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(table.to_json(), indent=1) + "\n")
    print(f"wrote {args.out}: {json.dumps({p: table.entries[p] for p in table.entries if p == 2})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
