"""Host round-trips inside a model's layer loop, caught on any device (the CPU included).

On an accelerator, reading a tensor's value on the host (``.item()``, ``int(t)``, ``bool(t)``,
``.tolist()``, a copy to the CPU) or an operation whose output size depends on the values
(``nonzero``, a boolean index) makes the host wait for every queued kernel: between two
decoder layers that stalls the device. ``torch.cuda.set_sync_debug_mode`` reports them on CUDA
only; :func:`host_syncs_in_layers` reports them on any device, by the operators the dispatcher
sees (a ``TorchDispatchMode``) and by the tensor methods that read values without one
(``tolist``, ``numpy``; ``cpu``, a copy to the host on an accelerator), and only while the decoder layers run: from the first layer's start to
the last layer's end (forward hooks, removed on exit), so what a method does before its first
layer (the prompt's embedding, a prefix lookup) or after its last (the first token's pick) is
not counted.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSync", "SyncLog", "host_syncs", "host_syncs_in_layers"]

_aten = torch.ops.aten
#: Operators that read a value back to the host (``item`` and friends) or size their output by
#: the values (the host waits for the count).
_READS = {_aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default, _aten.equal.default}
_VALUE_SIZED = {_aten.nonzero, _aten.masked_select, _aten._unique2, _aten.unique_consecutive, _aten.unique_dim,
                _aten.nonzero_numpy}
_INDEXING = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
_TO_HOST = {_aten._to_copy, _aten.to, _aten._to_cpu}


@dataclass(frozen=True)
class HostSync:
    """One host round-trip: what it was and where in fastprefill it happened (``file:line function``)."""

    what: str
    where: str


@dataclass
class SyncLog:
    """The round-trips seen while the layers ran, in order."""

    syncs: list[HostSync] = field(default_factory=list)
    armed: bool = False

    def record(self, what: str) -> None:
        if self.armed:
            frames = [f for f in traceback.extract_stack() if "/fastprefill/" in f.filename or "/transformers/" in f.filename]
            where = "; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-3:])
            self.syncs.append(HostSync(what, where))


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy to the CPU of a tensor on another device, or one asked for by name on the CPU."""
    device = kwargs.get("device")
    if device is None and len(args) > 1 and isinstance(args[1], (torch.device, str)):
        device = args[1]
    return device is not None and torch.device(device).type == "cpu" and isinstance(args[0], torch.Tensor) \
        and args[0].device.type != "cpu"


class _Watch(TorchDispatchMode):
    def __init__(self, log: SyncLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if func in _READS or packet in _VALUE_SIZED:
            self.log.record(str(func))
        elif packet in _INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()) if i is not None):
            self.log.record(f"{func} with a boolean index")
        elif packet in _TO_HOST and _to_host(func, args, kwargs):
            self.log.record(f"{func} to the CPU")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _watching(log: SyncLog) -> Iterator[SyncLog]:
    """The dispatcher mode and the patched tensor readers, for the block (undone on exit)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def reading(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            log.record(f"Tensor.{name}")
            return originals[name](self, *args, **kwargs)
        return read

    try:
        for name in originals:
            setattr(torch.Tensor, name, reading(name))
        with _Watch(log):
            yield log
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def host_syncs() -> Iterator[SyncLog]:
    """``with host_syncs() as log: ...``: every host round-trip inside the block."""
    with _watching(SyncLog(armed=True)) as log:
        yield log


@contextlib.contextmanager
def host_syncs_in_layers(model: torch.nn.Module) -> Iterator[SyncLog]:
    """``with host_syncs_in_layers(model) as log: method.prefill(model, ids)``, then ``log.syncs``.

    Records every host round-trip from the start of ``model.model.layers[0]``'s forward to the
    end of the last layer's (each decoder-layer call of a forward or of a method's own layer loop).
    """
    layers = model.model.layers
    log = SyncLog()

    def arm(*_: Any) -> None:
        log.armed = True

    def disarm(*_: Any) -> None:
        log.armed = False

    hooks = [layers[0].register_forward_pre_hook(arm), layers[-1].register_forward_hook(disarm)]
    try:
        with _watching(log):
            yield log
    finally:
        for hook in hooks:
            hook.remove()
