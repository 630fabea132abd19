"""Calibrate the KV-Runahead cost model on this machine.

:func:`calibrate` times one decoder layer for a grid of (chunk, prefix) sizes and fits the
compute coefficients of a :class:`~fastprefill.methods.runahead.search.CostModel`; the
communication coefficients are measured by the caller
(:func:`fastprefill.distributed.loopback.measure_loopback`: a gloo ping-pong between two local
processes). ``fastprefill calibrate-runahead`` (:mod:`fastprefill.cli.calibrate`) does both,
searches every (ranks, length) on the fitted model and writes a
:class:`~fastprefill.methods.runahead.tables.PartitionTable`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from fastprefill.errors import ConfigError, is_int
from fastprefill.host import device_clock
from fastprefill.methods.runahead.search import CostModel

__all__ = ["calibrate"]


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
    *,
    bandwidth_bytes_s: float,
    latency_s: float,
    chunks: Sequence[int] = (32, 128, 512),
    prefixes: Sequence[int] = (0, 1024, 3072),
    repeats: int = 3,
    progress: bool = True,
) -> CostModel:
    """Fit a :class:`CostModel` by timing decoder layer 0 of ``model`` on this machine.

    For every ``(c, s)`` in ``chunks x prefixes`` it times one layer call on ``c`` rows whose
    cache holds ``s`` prefix rows, exactly as a chain rank runs it (explicit mask when
    ``s > 0``, plain causal when ``s = 0``), and fits
    ``t = a0 + a_lin * c + a_attn * pairs`` by least squares, with ``pairs = c*(s+c)`` for the
    masked calls and ``c*(c+1)/2`` for the plain causal ones. The LM head is timed on one row.
    ``bandwidth_bytes_s`` and ``latency_s`` are the communication coefficients, as measured
    between two ranks (:func:`fastprefill.distributed.loopback.measure_loopback` on one machine).

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
