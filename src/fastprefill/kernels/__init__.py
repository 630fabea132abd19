"""fastprefill's C++ kernels: built once by ``scripts/setup.sh`` with torch's ``cpp_extension``,
loaded at run time, never compiled on a request's path.

Two kernels (:data:`SOURCES`), each its own extension module; their headers say how they work:

- ``attention.cpp``: causal attention on the CPU for a whole prefill, a suffix over cached keys
  and a decode step, plus the one-pass rotary embedding. It is compiled in one variant per vector
  ISA (:data:`VARIANTS`: AVX-512 and AVX2 flags, for its softmax's and packing's vector code; the
  matrix products inside are oneDNN's, which picks its own ISA).
- ``rows.cpp``: matrix products of a few input rows (a decode step's linear layers), float32 in
  both variants, bfloat16 (AVX512-BF16) in the AVX-512 one, and a decode step's bfloat16 norms.

Each build goes into the kernel cache ``<cache>/kernels/<variant>-<key>/`` (the attention
kernel's) or ``<cache>/kernels/<kernel>-<variant>-<key>/`` (``<cache>`` is
``$FASTPREFILL_CACHE_DIR`` or ``~/.cache/fastprefill``), where ``<key>`` hashes the source, the
flags and torch's version: a changed source or another torch is a new build directory, never a
stale module.

- :func:`build` compiles every kernel's variants that this CPU runs (``python -m fastprefill.kernels
  build``; setup runs it).
- :func:`attention_kernel` returns the attention variant for this CPU and dtype, loaded once per
  process and checked once against SDPA on a small random input, or ``None``;
  :func:`kernel_status` says which, and why not (not built, no compiler, the CPU lacks the ISA,
  the check failed). Where it is ``None`` the library uses SDPA and says so once
  (:func:`fastprefill.models.attention.attention_backend`).
- :func:`row_products` returns the few-row products for a dtype, checked once against float64
  products, or ``None`` (:func:`rows_status` says why); where it is ``None`` oneDNN computes every
  product (:mod:`fastprefill.models.packed`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["SOURCES", "VARIANTS", "KernelStatus", "attention_kernel", "build", "compile_source", "kernel_dir",
           "kernel_status", "rotary_kernel", "row_products", "rows_status", "runnable_variants"]

#: The kernels: name -> (source, the variants it is built in).
SOURCES: dict[str, tuple[Path, tuple[str, ...]]] = {
    "attention": (Path(__file__).with_name("attention.cpp"), ("avx512", "avx2")),
    "rows": (Path(__file__).with_name("rows.cpp"), ("avx512", "avx2")),
}
#: The builds: variant -> the compiler flags that select ATen's vector code for it (torch's
#: ``CPU_CAPABILITY`` macros) and the instructions it may use.
VARIANTS: dict[str, list[str]] = {
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
#: ``-fopenmp`` compiles ATen's ``parallel_for`` (inline, OpenMP in torch's CPU builds) into OpenMP
#: regions; without it the pragma is ignored and the kernel runs on one thread whatever
#: ``torch.get_num_threads()`` says. Linked with it too: at run time the ``libgomp.so.1`` that torch
#: already loaded serves the extension (one thread pool, sized by ``torch.set_num_threads``).
#: ``-ffp-contract=off``: no multiply-add fused where the source rounds in between (the rotary
#: rounds every product as transformers' eager code does, for the same bits).
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_LINK_FLAGS = ["-fopenmp"]
#: torch's reading of the CPU (``torch.backends.cpu.get_cpu_capability()``) -> the variant it runs.
_VARIANT_OF_ISA = {"AVX512": "avx512", "AVX512_BF16": "avx512", "AMX": "avx512", "AVX2": "avx2"}
#: The variant a CPU runs -> every variant it can load (an AVX-512 CPU has AVX2 too).
_RUNS = {"avx512": ("avx512", "avx2"), "avx2": ("avx2",)}
#: Elementwise tolerance of the load-time check against SDPA, by dtype (SDPA's own rounding).
_CHECK_ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

#: ``kernel(q, k, v, scale, mask=None) -> out``: q ``(B, H_q, T, d)``, k and v ``(B, H_kv, N, d)``
#: (unit stride on ``d``), out ``(B, T, H_q, d)``. Without a mask query ``t`` sits at position
#: ``N - T + t`` and attends keys ``0 .. N - T + t``; with a boolean ``mask`` ``(B, 1, T, N)``
#: (``B``, ``T`` may be 1) it attends the keys its row allows, and a row allowing none gets zeros.
AttentionKernel = Callable[..., torch.Tensor]


def _key(variant: str, kernel: str = "attention") -> str:
    """What a build depends on: the source, the flags, torch's version (16 hex digits)."""
    h = hashlib.sha256(SOURCES[kernel][0].read_bytes())
    h.update(json.dumps([VARIANTS[variant], _COMMON_FLAGS, _LINK_FLAGS, torch.__version__]).encode())
    return h.hexdigest()[:16]


def kernel_dir(variant: str, kernel: str = "attention") -> Path:
    """The build directory of ``kernel``'s ``variant`` for its source and this torch:
    ``<cache>/kernels/<variant>-<key>`` for the attention kernel, ``<kernel>-<variant>-<key>`` for another."""
    from fastprefill.models.zoo import default_cache_dir

    prefix = "" if kernel == "attention" else f"{kernel}-"
    return default_cache_dir() / "kernels" / f"{prefix}{variant}-{_key(variant, kernel)}"


def _module_name(variant: str, kernel: str = "attention") -> str:
    return f"fastprefill_{kernel}_{variant}"


def runnable_variants() -> tuple[str, ...]:
    """The variants this CPU can load: an AVX-512 CPU runs both builds, an AVX2 CPU the AVX2 one,
    another CPU none. (``cpp_extension`` imports what it compiles, and a build for an ISA the CPU
    lacks dies on import with an illegal instruction, so only these are ever built here.)"""
    return _RUNS.get(_variant_for_cpu() or "", ())


def build(variants: list[str] | None = None, verbose: bool = False) -> dict[str, str]:
    """Compile every kernel of :data:`SOURCES` in each of its variants this CPU runs
    (:func:`runnable_variants`), or in those of ``variants`` it is built in.

    A build already made for its source and torch is left alone. Needs a C++ compiler and
    ninja (both on the PATH). Returns ``{"<kernel> <variant>": "built" | "up to date" | "failed: <reason>"}``.

    Raises:
        ValueError: ``variants`` names an unknown variant, or one this CPU cannot run.
    """
    runnable = runnable_variants()
    for variant in variants or []:
        if variant not in VARIANTS:
            raise ValueError(f"unknown kernel variant {variant!r}; choose from {sorted(VARIANTS)}")
        if variant not in runnable:
            raise ValueError(f"this CPU cannot run the {variant} kernels (torch reads its ISA as "
                             f"{torch.backends.cpu.get_cpu_capability()}); build them on a CPU that has it")
    results: dict[str, str] = {}
    for kernel, (source, built_in) in SOURCES.items():
        for variant in [v for v in built_in if v in (runnable if variants is None else variants)]:
            results[f"{kernel} {variant}"] = _build_one(kernel, source, variant, verbose)
    return results


def _build_one(kernel: str, source: Path, variant: str, verbose: bool) -> str:
    out = kernel_dir(variant, kernel)
    if (out / "built.json").exists():
        return "up to date"
    try:
        compile_source(source, _module_name(variant, kernel), out, variant, verbose=verbose)
    except (RuntimeError, OSError, ImportError, SystemExit) as exc:  # no compiler, no ninja, a compile error
        return f"failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
    (out / "built.json").write_text(json.dumps({"kernel": kernel, "variant": variant, "torch": torch.__version__,
                                                "flags": _COMMON_FLAGS + VARIANTS[variant]}))
    return "built"


def compile_source(source: Path, name: str, out: Path, variant: str, verbose: bool = False) -> Any:
    """Compile ``source`` as the extension module ``name`` for ``variant`` (its :data:`VARIANTS`
    flags, as :func:`build` compiles the kernel) in directory ``out``, and import it.

    :func:`build` compiles the package's own source with it; a benchmark compiles an older
    revision's source under another name, to time two versions of the kernel in one process.

    Raises:
        RuntimeError, OSError, ImportError: no compiler or ninja, or the source does not compile.
    """
    from torch.utils import cpp_extension

    _ninja_on_path()
    out.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name=name, sources=[str(source)], build_directory=str(out),
                              extra_cflags=_COMMON_FLAGS + VARIANTS[variant],
                              extra_ldflags=list(_LINK_FLAGS),  # a copy: load() appends to the list it is given
                              verbose=verbose)


def _ninja_on_path() -> None:
    """Put the ninja that the ``ninja`` package installed (a dependency) on this process's PATH:
    ``cpp_extension`` runs ``ninja`` by name, and a virtualenv that is not activated does not have
    its ``bin`` on the PATH. Called by :func:`compile_source` only, never at import."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(getattr(ninja, "BIN_DIR", ""))
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path


@dataclass(frozen=True)
class KernelStatus:
    """Whether the attention kernel runs in this process for one dtype, and why not.

    Attributes:
        dtype: the dtype asked about.
        variant: the build this CPU runs (``"avx512"``, ``"avx2"``), or ``None``.
        available: the kernel loaded and passed its check.
        reason: why not (empty when available).
    """

    dtype: torch.dtype
    variant: str | None
    available: bool
    reason: str = ""


def _variant_for_cpu() -> str | None:
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None
    return _VARIANT_OF_ISA.get(str(isa))


@functools.cache
def _load(variant: str, kernel: str = "attention") -> tuple[Any | None, str]:
    """The built module of ``kernel``'s ``variant`` imported (once per process), or ``None`` with the reason."""
    out = kernel_dir(variant, kernel)
    name = _module_name(variant, kernel)
    so = out / f"{name}.so"
    if not (out / "built.json").exists() or not so.exists():
        return None, (f"not built for this source and torch {torch.__version__} (run: bash scripts/setup.sh, "
                      "or python -m fastprefill.kernels build)")
    if name in sys.modules:
        return sys.modules[name], ""
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(so))
        spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        return None, f"the build in {out} does not load: {exc}"
    sys.modules[name] = module
    return module, ""


def _self_check(module: Any, dtype: torch.dtype) -> str:
    """Compare the build's attention with SDPA on a small random grouped-query input (a whole
    prefill, a suffix over cached keys, a decode step, masked rows), within :data:`_CHECK_ATOL`,
    and its rotary embedding with the eager formula, bit for bit; ``""`` if both agree, else what
    differed."""
    fn = module.causal_attention
    gen = torch.Generator().manual_seed(0)
    for t, n, masked in ((45, 45, False), (7, 300, False), (1, 260, False), (9, 300, True)):
        q = torch.randn(1, 4, t, 64, generator=gen).to(dtype)
        k, v = (torch.randn(1, 2, n, 64, generator=gen).to(dtype) for _ in range(2))
        allowed = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]  # (T, N)
        if masked:
            allowed = allowed & (torch.rand(t, n, generator=gen) < 0.7)
            allowed[:, 0] = True
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=allowed, enable_gqa=True).transpose(1, 2)
        out = fn(q, k, v, 1 / math.sqrt(64), mask=allowed[None, None] if masked else None)
        err = (out.float() - ref).abs().max().item()
        if not err <= _CHECK_ATOL[dtype]:
            kind = "masked " if masked else ""
            return f"its check against SDPA failed ({t} {kind}queries over {n} keys, {dtype}: max error {err:.3g})"
    x = torch.randn(2, 5, 4 * 64, generator=gen).to(dtype)
    angles = torch.randn(2, 5, 64, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    heads = x.view(2, 5, 4, 64).transpose(1, 2)  # (B, H, T, d)
    half = torch.cat((-heads[..., 32:], heads[..., :32]), dim=-1)
    if not torch.equal(module.rotary(x, cos, sin, 4), heads * cos[:, None] + half * sin[:, None]):
        return f"its rotary embedding differs from the eager formula's bits ({dtype})"
    return ""


@functools.cache
def kernel_status(dtype: torch.dtype) -> KernelStatus:
    """Whether :func:`attention_kernel` runs ``dtype`` on this CPU (decided once per process)."""
    variant = _variant_for_cpu()
    if variant is None:
        return KernelStatus(dtype, None, False, "this CPU has neither AVX-512 nor AVX2")
    if dtype not in _CHECK_ATOL:
        return KernelStatus(dtype, variant, False, f"{dtype} is not a kernel dtype (float32, bfloat16)")
    if dtype == torch.bfloat16:
        from fastprefill.host import cpu_info

        if not cpu_info().bf16_native:
            return KernelStatus(dtype, variant, False, "bfloat16 needs AVX512-BF16 or AMX-BF16, which this CPU lacks")
    module, reason = _load(variant)
    if module is None:
        return KernelStatus(dtype, variant, False, reason)
    reason = _self_check(module, dtype)
    return KernelStatus(dtype, variant, not reason, reason)


def _checked_module(dtype: torch.dtype) -> Any | None:
    """The build that runs ``dtype`` on this CPU, loaded and checked, or ``None`` (:func:`kernel_status` says why)."""
    status = kernel_status(dtype)
    return _load(status.variant)[0] if status.available else None


def attention_kernel(dtype: torch.dtype) -> AttentionKernel | None:
    """The causal attention kernel for ``dtype`` on this CPU (see :data:`AttentionKernel`), or
    ``None`` (:func:`kernel_status` says why)."""
    module = _checked_module(dtype)
    return None if module is None else module.causal_attention


#: ``rotary(x, cos, sin, heads) -> out``: x ``(B, T, H * d)`` (unit last stride), cos and sin
#: ``(B or 1, T, d)`` of x's dtype; out ``(B, H, T, d)`` contiguous, ``x * cos + rotate_half(x) * sin``
#: rounded as transformers' eager rotary rounds it (bit for bit).
RotaryKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def rotary_kernel(dtype: torch.dtype) -> RotaryKernel | None:
    """The one-pass rotary embedding for ``dtype`` (see :data:`RotaryKernel`), or ``None`` where the
    attention kernel's build does not run (:func:`kernel_status` says why): the two share a build."""
    module = _checked_module(dtype)
    return None if module is None else module.rotary


#: Relative tolerance of the few-row products' load-time check against float64, by dtype (the
#: dtype's rounding of the output, and float32 sums over K in another order).
_ROWS_RTOL = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}


def _rows_check(module: Any, dtype: torch.dtype) -> str:
    """Compare the few-row products in ``dtype`` with float64 products on small random inputs (1 to
    4 rows; in float32 up to 9 too, across the 4-row tiles; an odd ``K``, merged weights with
    biases; a SwiGLU in bfloat16), each output within the dtype's rounding of the float64 result,
    and each row's output bit for bit the same whatever the row count; ``""`` if all hold, else
    what did not."""
    gen = torch.Generator().manual_seed(0)
    k = 200  # not a multiple of 64 or 32: the masked step runs
    counts = (1, 2, 3, 4) if dtype == torch.bfloat16 else (1, 2, 3, 4, 5, 8, 9)
    x = torch.randn(max(counts), k, generator=gen).to(dtype)
    weights = [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype) for n in (37, 5)]
    biases = [torch.randn(37, generator=gen).to(dtype), None]
    ref = x.double() @ torch.cat(weights).double().T + torch.cat([biases[0].double(), torch.zeros(5, dtype=torch.float64)])
    gate, up = ((torch.randn(21, k, generator=gen) * k ** -0.5).to(dtype) for _ in range(2))
    g = x.double() @ gate.double().T
    swiglu_ref = (g * torch.sigmoid(g)).bfloat16().double() * (x.double() @ up.double().T)
    rtol = _ROWS_RTOL[dtype]
    for rows in counts:
        out = module.products(x[:rows], weights, biases)
        if not torch.allclose(out.double(), ref[:rows], rtol=rtol, atol=1e-3 if dtype == torch.bfloat16 else 1e-5):
            return f"its products differ from float64's beyond {dtype}'s rounding ({rows} rows)"
        if not torch.equal(out, torch.cat([module.products(x[i:i + 1], weights, biases) for i in range(rows)])):
            return f"a row's product depends on the row count ({rows} rows, {dtype})"
        if dtype == torch.bfloat16 and not torch.allclose(module.swiglu(x[:rows], gate, None, up, None).double(),
                                                         swiglu_ref[:rows], rtol=2 ** -6, atol=1e-3):
            return f"its SwiGLU differs from float64's beyond bfloat16 rounding ({rows} rows)"
    return ""


@functools.cache
def rows_status(dtype: torch.dtype = torch.bfloat16) -> KernelStatus:
    """Whether :func:`row_products` runs ``dtype`` on this CPU (decided once per process):
    float32 in either variant, bfloat16 in the AVX-512 one on a CPU with AVX512-BF16."""
    from fastprefill.host import cpu_info

    variant = _variant_for_cpu()
    if dtype not in _ROWS_RTOL:
        return KernelStatus(dtype, variant, False, f"the few-row products are float32 and bfloat16 only, not {dtype}")
    if dtype == torch.bfloat16 and (variant != "avx512" or not cpu_info().bf16_native):
        return KernelStatus(dtype, None, False, "the few-row bfloat16 products need AVX512-BF16, which this CPU lacks")
    if variant is None:
        return KernelStatus(dtype, None, False, "this CPU has neither AVX-512 nor AVX2")
    module, reason = _load(variant, "rows")
    if module is None:
        return KernelStatus(dtype, variant, False, reason)
    reason = _rows_check(module, dtype)
    return KernelStatus(dtype, variant, not reason, reason)


def row_products(dtype: torch.dtype = torch.bfloat16) -> Any | None:
    """The few-row products for ``dtype`` (``rows.cpp``: ``products(x, weights, biases)`` in
    float32 and bfloat16; ``swiglu(x, gate_w, gate_b, up_w, up_b)`` and the norms in bfloat16;
    1 to ``max_rows`` input rows, to ``max_float_rows`` in float32), loaded and checked, or ``None`` (:func:`rows_status` says why)."""
    status = rows_status(dtype)
    return _load(status.variant, "rows")[0] if status.available and status.variant else None


def _main(argv: list[str]) -> int:
    """``python -m fastprefill.kernels build [--verbose]`` / ``status``."""
    if not argv or argv[0] not in ("build", "status"):
        print("usage: python -m fastprefill.kernels {build [--verbose] | status}", file=sys.stderr)
        return 2
    if argv[0] == "build":
        results = build(verbose="--verbose" in argv)
        for name, result in results.items():
            kernel, variant = name.split()
            print(f"{kernel} kernel, {variant}: {result} ({kernel_dir(variant, kernel)})")
        mine = _variant_for_cpu()
        if mine is not None and not results.get(f"attention {mine}", "").startswith(("built", "up to date")):
            warnings.warn(f"the attention kernel for this CPU ({mine}) did not build: fastprefill will use SDPA",
                          stacklevel=1)
        if mine is not None and not results.get(f"rows {mine}", "").startswith(("built", "up to date")):
            warnings.warn("the few-row products did not build: oneDNN will compute decode steps' products",
                          stacklevel=1)
        return 0
    for dtype in (torch.float32, torch.bfloat16):
        s = kernel_status(dtype)
        print(f"attention, {dtype}: " + (f"kernel ({s.variant})" if s.available else f"SDPA ({s.reason})"))
    for dtype in (torch.float32, torch.bfloat16):
        r = rows_status(dtype)
        print(f"few-row products, {dtype}: " + (f"kernel ({r.variant})" if r.available else f"oneDNN ({r.reason})"))
    return 0
