"""What this process runs on, the precision that follows from it, and its process-wide settings.

- :func:`cpu_info` reads, through torch, whether the CPU multiplies bfloat16 matrices natively:
  AMX tiles with BF16 (``amx_bf16``) or AVX-512 BF16 dot products (``avx512_bf16``). Where it
  does, a bfloat16 matrix product runs several times faster than a float32 one; where it does
  not, torch emulates bfloat16 with conversions and float32 stays the fast path.
- :func:`resolve_dtype` turns a dtype choice (``"auto"``, a name, a ``torch.dtype``) into the
  ``torch.dtype`` a model is loaded in. ``"auto"``, the default everywhere, is bfloat16 on a CPU
  with native bfloat16 matrix units or a CUDA device that supports it, float32 elsewhere.
- :func:`precision_report` is what every timing is recorded with: the dtype, whether it was
  chosen automatically, and the CPU's capability; :func:`accelerator_report` adds the GPU, its
  driver and the CUDA versions for a timing on one.
- :func:`keep_freed_memory` sets the C allocator (glibc) to keep freed memory for reuse instead
  of returning it to the system, so a prefill's large temporary tensors do not fault fresh pages
  in on every call. The command line, the server and the benchmarks call it once per process;
  a library user may call it too (it affects the whole process).
- :func:`device_clock` is the one clock read of a timing: the device's queued work finished
  first (CUDA and other accelerators run asynchronously), then ``time.perf_counter()``.
  :class:`fastprefill.events.TimingWindow` and every timed span below it read it.
- :func:`lock_in_memory` pins the pages under some tensors (a model's weights) in memory
  (``mlock2``), so another process's demand cannot take them: the float32 weights of a zoo model
  are pages of the mapped checkpoint, which the kernel may otherwise drop and read again.
- :func:`set_threads` fixes torch's thread counts: every entry point that sets threads (the
  CLI, the benchmark harness, the rank pool's workers, torchrun ranks, partition calibration)
  calls it.

Nothing here runs at import; this module imports nothing from fastprefill but the errors, so any
layer may use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fastprefill.errors import ConfigError, is_int

__all__ = [
    "DTYPES",
    "CpuInfo",
    "LockedMemory",
    "accelerator_report",
    "auto_dtype",
    "cpu_info",
    "device_clock",
    "dtype_name",
    "keep_freed_memory",
    "lock_in_memory",
    "precision_line",
    "precision_report",
    "resolve_dtype",
    "set_threads",
    "synchronize",
]

#: The dtype names a user may give (``--dtype``, ``load_model(dtype=...)``), ``"auto"`` first.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
}


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's matrix capability, as torch reports it.

    Attributes:
        name: the CPU's name (torch's, or ``platform.processor()``).
        isa: the vector ISA torch's kernels were dispatched to (``"AVX512"``, ``"AVX2"``, ...).
        amx_bf16: AMX tiles with BF16 (Sapphire Rapids and later).
        avx512_bf16: AVX-512 BF16 dot-product instructions (Cooper Lake, Zen 4 and later).
    """

    name: str
    isa: str
    amx_bf16: bool
    avx512_bf16: bool

    @property
    def bf16_native(self) -> bool:
        """Whether bfloat16 matrix products run on native units (AMX-BF16 or AVX512-BF16)."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def bf16_units(self) -> str:
        """The units bfloat16 matrix products run on: ``"amx_bf16"``, ``"avx512_bf16"`` or ``"none"``."""
        return "amx_bf16" if self.amx_bf16 else "avx512_bf16" if self.avx512_bf16 else "none"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bf16_native": self.bf16_native}


def _cpu_flags() -> dict[str, Any]:
    """torch's own reading of the CPU (``torch._C._cpu._get_cpu_capability``), ``{}`` if unavailable."""
    reader = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    try:
        return dict(reader()) if callable(reader) else {}
    except (RuntimeError, TypeError):
        return {}


@functools.cache
def cpu_info() -> CpuInfo:
    """The CPU's bfloat16 capability (read once per process)."""
    import platform

    flags = _cpu_flags()
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        isa = "unknown"
    return CpuInfo(
        name=str(flags.get("cpu_name") or platform.processor() or "unknown"),
        isa=str(isa),
        amx_bf16=bool(flags.get("amx_bf16", False)),
        avx512_bf16=bool(flags.get("avx512_bf16", False)),
    )


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype ``"auto"`` means on ``device``: bfloat16 where matrix units run it natively.

    CPU: bfloat16 when :func:`cpu_info` reports AMX-BF16 or AVX512-BF16, else float32. CUDA:
    bfloat16 when the device supports it, else float32. Any other device: float32.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.bfloat16 if cpu_info().bf16_native else torch.float32
    if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """The ``torch.dtype`` to load a model in.

    Args:
        dtype: ``"auto"`` or ``None`` (see :func:`auto_dtype`), a name in :data:`DTYPES`, or a
            floating-point ``torch.dtype``.
        device: where the model will run.

    Raises:
        ConfigError: any other value, naming the allowed ones.
    """
    if dtype is None or dtype == "auto":
        return auto_dtype(device)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and DTYPES.get(dtype) is not None:
        return DTYPES[dtype]  # type: ignore[return-value]
    raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} or a floating-point torch dtype, got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def precision_report(dtype: torch.dtype, device: str | torch.device = "cpu", requested: str | None = None) -> dict[str, Any]:
    """What a timing ran in: the dtype (and what was asked for), the device, the CPU's bfloat16
    units and vector ISA, and whether :func:`keep_freed_memory` is in effect.

    Args:
        dtype: the model's dtype.
        device: its device (the CPU fields describe the host CPU either way).
        requested: what the user asked for (``"auto"``, a name); ``None`` when not known.
    """
    info = cpu_info()
    return {
        "dtype": dtype_name(dtype),
        "dtype_requested": requested,
        "device": str(torch.device(device)),
        "bf16_native": info.bf16_native,
        "bf16_units": info.bf16_units,
        "cpu_isa": info.isa,
        "freed_memory_kept": _kept,
    }


def accelerator_report(device: str | torch.device) -> dict[str, Any] | None:
    """What a timing on an accelerator ran on (``None`` on the CPU): for CUDA the GPU's name,
    memory and compute capability, the driver (``nvidia-smi``'s version, else the CUDA driver API
    version torch reports), torch's CUDA and cuDNN versions and the number of GPUs; for another
    device type only its type."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return {"device_type": dev.type}
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "compute_capability": f"{props.major}.{props.minor}", "driver": _cuda_driver(index),
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "gpus": torch.cuda.device_count(),
    }


def _cuda_driver(index: int) -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), else ``"CUDA driver API X.Y"``, else ``None``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={index}"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    reader = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        version = int(reader()) if callable(reader) else 0
    except (RuntimeError, TypeError, ValueError):
        version = 0
    return f"CUDA driver API {version // 1000}.{version % 1000 // 10}" if version else None


def precision_line(dtype: torch.dtype, device: str | torch.device, requested: str | torch.dtype | None) -> str:
    """One line for a user: the dtype a model runs in, why, and the CPU's bfloat16 units."""
    info = cpu_info()
    units = (f"bfloat16 matrix units: {info.bf16_units}" if info.bf16_native else
             "no native bfloat16 matrix units (float32 is the fast path)")
    why = "chosen by dtype auto" if requested in (None, "auto") else "as asked"
    return f"{dtype_name(dtype)} on {device} ({why}); CPU {info.name}, {info.isa}, {units}"


def synchronize(device: str | torch.device) -> None:
    """Wait until the work queued on ``device`` has run: ``torch.cuda.synchronize`` on CUDA, the
    backend's own on another accelerator (``torch.xpu``, ``torch.mps``), nothing on the CPU
    (its work is done when the call returns)."""
    dev = torch.device(device)
    if dev.type == "cpu" or dev.type == "meta":
        return
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return
    backend = getattr(torch, dev.type, None)
    sync = getattr(backend, "synchronize", None)
    if callable(sync):
        sync()


def device_clock(device: str | torch.device) -> float:
    """Seconds (``time.perf_counter``) once ``device``'s queued work has run (:func:`synchronize`):
    the difference of two reads holds all the work queued between them."""
    synchronize(device)
    return time.perf_counter()


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_kept = False


def keep_freed_memory() -> bool:
    """Make glibc's allocator keep freed memory for reuse (once per process; idempotent).

    By default glibc serves large blocks with fresh ``mmap`` pages and returns freed heap memory
    to the system, so each prefill's temporary tensors (tens of MB each) fault their pages in
    again on every call. With ``M_MMAP_MAX=0`` and an unbounded ``M_TRIM_THRESHOLD`` they come
    from the heap and stay there: the process keeps its peak memory, as an allocator that caches
    (PyTorch's CUDA one, jemalloc, tcmalloc) does.

    Returns:
        Whether the setting is in effect (``False`` where the C library is not glibc).
    """
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_MMAP_MAX, 0))
    return _kept


def set_threads(threads: int, *, interop: int | None = None) -> None:
    """Fix torch's intra-op thread count (and, once per process, the inter-op count).

    Args:
        threads: intra-op threads, >= 1.
        interop: inter-op threads; ``None`` leaves them. torch refuses to change them after
            parallel work has started, which is ignored here (the intra-op count is what counts).

    Raises:
        ConfigError: ``threads`` is not an integer >= 1.
    """
    if not is_int(threads, 1):
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(threads)
    if interop is not None:
        try:
            torch.set_num_interop_threads(interop)
        except RuntimeError:
            pass  # already set or parallel work has started: torch keeps the old value


_MLOCK_ONFAULT = 1


def _libc_memlock() -> tuple[Any, Any]:
    """``(address, length) -> 0 | -1`` (errno set) calls: glibc's ``mlock2`` with ``MLOCK_ONFAULT``
    and ``munlock``. Raises ConfigError where the C library has no ``mlock2`` (glibc < 2.27)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    try:
        mlock2 = libc.mlock2
    except AttributeError as e:
        raise ConfigError("locking weights in memory needs mlock2 (glibc 2.27 or later, Linux 4.4 or later), "
                          "which this C library lacks; run without locking") from e
    mlock2.argtypes, mlock2.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ctypes.c_int
    libc.munlock.argtypes, libc.munlock.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    return (lambda addr, length: mlock2(addr, length, _MLOCK_ONFAULT)), libc.munlock


def _with_storage(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``tensors`` on the CPU with a storage of their own bytes (not oneDNN's packed
    copies, which expose none, nor sparse ones), and not empty."""
    return [t for t in tensors if t.device.type == "cpu" and not (t.is_mkldnn or t.is_sparse)
            and t.untyped_storage().nbytes() > 0]


def _read_every_page(tensors: list[torch.Tensor]) -> None:
    """Read one element of each page of ``tensors`` (:func:`_with_storage`'s; read faults: a page
    of a private file mapping stays the file's page, where a write fault, or plain ``mlock``,
    would copy it)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with torch.no_grad():
        for t in tensors:
            if t.numel():
                t.detach().reshape(-1)[:: max(1, page // t.element_size())].sum()


@dataclass
class LockedMemory:
    """Page ranges :func:`lock_in_memory` locked: ``(start, end)`` addresses, page-aligned, disjoint."""

    ranges: list[tuple[int, int]]

    @property
    def bytes(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def unlock(self) -> None:
        """Let the kernel reclaim the pages again (``munlock``; idempotent)."""
        if self.ranges:
            munlock = _libc_memlock()[1]
            for start, end in self.ranges:
                munlock(start, end - start)
            self.ranges = []


def _page_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned, merged address ranges of ``tensors``' storages (:func:`_with_storage`'s;
    each storage once)."""
    page = os.sysconf("SC_PAGE_SIZE")
    spans = []
    for t in tensors:
        start, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        spans.append((start // page * page, -(-(start + size) // page) * page))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def lock_in_memory(tensors: Iterable[torch.Tensor]) -> LockedMemory:
    """Lock the pages under ``tensors``' CPU storages in memory: they are read in now if they are
    not already, and stay until :meth:`LockedMemory.unlock` or until they are freed.

    A model's weights loaded as views of a memory-mapped checkpoint (a float32 zoo model) are
    page-cache pages: under another process's demand the kernel may drop them and read them from
    disk again at their next use. Locked, they stay, and that memory is no longer the host's to
    reclaim. They are locked as they are (``mlock2`` with ``MLOCK_ONFAULT``, then a read of every
    page), so they stay the file's pages, shared with every process that maps the same file
    (runahead's ranks): plain ``mlock`` populates a private writable mapping with write faults,
    which would give this process its own copy of every page.

    Returns:
        The locked ranges (``.bytes``: how much).

    Raises:
        ConfigError: not Linux, no ``mlock2``, or the kernel refused (``RLIMIT_MEMLOCK``, ``ulimit -l``, below
            the size, or too little memory); nothing stays locked then.
    """
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"locking weights in memory needs Linux's mlock (this is {sys.platform}); run without it")
    held = _with_storage(tensors)
    ranges = _page_ranges(held)
    mlock = _libc_memlock()[0]
    done = LockedMemory([])
    for start, end in ranges:
        if mlock(start, end - start) != 0:
            err = ctypes.get_errno()
            want = sum(e - s for s, e in ranges)
            done.unlock()
            soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
            raise ConfigError(
                f"could not lock {want / 2**30:.2f} GiB of weights in memory: {os.strerror(err)} (the process may "
                f"lock {limit}: ulimit -l). Raise the limit (ulimit -l unlimited; docker run --ulimit memlock=-1; "
                "or the CAP_IPC_LOCK capability), free memory, or run without locking")
        done.ranges.append((start, end))
    _read_every_page(held)
    return done
