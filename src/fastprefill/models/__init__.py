"""Models: the zoo of packaged real models (``zoo``), any transformers causal LM (``pretrained``),
seeded random test models (``random``), the family adapters (``adapters``), fastprefill's
attention function (``attention``) and prepacked linear layers (``packed``).

:func:`load` is the one loader every process calls with a model name (the CLI, rank-pool
workers, torchrun ranks, calibration): a zoo name, a local folder or Hugging Face id, or
``random:<family>``.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch

from fastprefill.errors import ConfigError
from fastprefill.host import cpu_info, resolve_dtype
from fastprefill.models import random as random_models
from fastprefill.models.adapters import compile_blocks, fuse_mlps
from fastprefill.models.attention import ATTENTION_BACKENDS, attention_backend, set_attention_backend
from fastprefill.models.fused import fuse_attention, fuse_layers, set_last_row_only
from fastprefill.models.packed import (
    can_pack,
    check_wide_rows,
    few_rows_used,
    linear_bytes,
    linears_packed,
    onednn_bf16,
    pack_linears,
    packable,
    set_wide_rows,
)
from fastprefill.models.pretrained import load_pretrained
from fastprefill.models.zoo import (
    DEFAULT_MODEL,
    ZOO,
    ZooEntry,
    default_cache_dir,
    is_prepared,
    list_models,
    prepare,
)

__all__ = [
    "DEFAULT_MODEL",
    "ZOO",
    "ZooEntry",
    "default_cache_dir",
    "is_prepared",
    "list_models",
    "load",
    "prepare",
]


def _default_pack(model: Any, device: str | torch.device, processes: int, warn: bool) -> bool:
    """``pack=None``: :func:`~fastprefill.models.packed.can_pack` with the packed copies of
    ``processes`` processes; a float32 model left unpacked for memory says so (``warn``)."""
    copies = linear_bytes(model) * max(1, processes)
    pack = can_pack(device, model.dtype, copies)
    if warn and not pack and model.dtype == torch.float32 and packable(device, model.dtype):
        warnings.warn(f"float32 model not packed: its packed copies ({copies / 2**30:.1f} GiB in {max(1, processes)} "
                      "process(es)) would take more than a third of this machine's memory, so prefix-cache hits and "
                      "decode steps run on MKL's slower few-row products; pass pack=True to pack it anyway",
                      stacklevel=3)
    return pack


def load(
    spec: str | os.PathLike[str] | ZooEntry,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    *,
    compile: bool | None = None,
    pack: bool | None = None,
    processes: int = 1,
    attention: str = "auto",
    wide_rows: int | None = None,
    last_row: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode on ``device``.

    Args:
        spec: ``"random:llama"`` / ``"random:qwen2"`` / ``"random:gpt2"`` (a seeded tiny model,
            tokenizer ``None``; see :mod:`fastprefill.models.random`), or anything
            :func:`fastprefill.models.pretrained.load_pretrained` accepts (zoo name, model folder, HF id).
        dtype: ``"auto"`` (bfloat16 where the device multiplies it natively, else float32: see
            :func:`fastprefill.host.resolve_dtype`), ``"bfloat16"``, ``"float32"``, ``"float16"``
            or the ``torch.dtype``.
        compile: compile each decoder layer's MLP and norms with ``torch.compile``
            (:func:`fastprefill.models.adapters.compile_blocks`; Llama and Qwen2 families).
            ``None`` (the default): on the CPU when a C++ compiler is on the PATH for inductor
            (without one, a warning says the model runs uncompiled), never for ``random:``
            test models.
        pack: prepack every linear layer's weight for oneDNN (:mod:`fastprefill.models.packed`:
            faster bfloat16 products, faster float32 ones of a few rows; the linear weights'
            memory once more), a bfloat16 SwiGLU's activation inside its products. ``None``: where
            :func:`~fastprefill.models.packed.can_pack` says (a float32 model's copies, one per
            of ``processes``, within a third of memory, else a warning), never for ``random:``
            models. ``True`` where it cannot apply raises ConfigError.
        processes: the processes on this machine holding the model (runahead's ranks, their driver).
        attention: where unmasked causal attention runs (:func:`~fastprefill.models.attention.set_attention_backend`):
            ``"auto"`` (fastprefill's C++ kernel where it runs, else SDPA and a warning saying
            why), ``"kernel"`` (refused where the kernel cannot run) or ``"sdpa"``.
        wide_rows: a packed float32 model's products of more than this many input rows run on the
            plain weight (MKL's sgemm in torch's CPU wheels) instead of oneDNN's packed copy
            (:func:`~fastprefill.models.packed.set_wide_rows`), for a CPU where MKL's prompt-sized
            products are faster (``packed_bench.py --against mkl-wide``). ``None``: packed copy.
        last_row: ``False``: a prefill's last layer computes every row, as transformers' forward
            does, not the last row only (:func:`~fastprefill.models.fused.last_row_only`).
        cache_dir, progress: for zoo models (see :func:`~fastprefill.models.pretrained.load_pretrained`).

    On the CPU, a Llama or Qwen2 model's attention and decoder layers run fastprefill's forwards
    (:mod:`fastprefill.models.fused`: rotary in one pass, one q/k/v product, few-row norms).

    Raises:
        ConfigError: an unknown ``dtype`` or ``attention``; ``wide_rows`` not a non-negative int,
            not float32 or with ``pack=False`` (before loading), or with no layer packed (after);
            ``"kernel"`` where it cannot run; ``pack=True`` off the CPU, for a model neither bfloat16 nor float32, or in
            bfloat16 where oneDNN has no bfloat16 path on this CPU.
        ModelNotFoundError, UnsupportedModelError, MissingPackageError, ChecksumError: see
            :func:`~fastprefill.models.pretrained.load_pretrained`.
    """
    if attention not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    torch_dtype = resolve_dtype(dtype, device)
    _check_wide_rows(wide_rows, torch_dtype, pack)
    if random_models.is_random_spec(spec):
        model, tokenizer = random_models.load(str(spec), device=device, dtype=torch_dtype)
        compile, pack = bool(compile), bool(pack)
    else:
        _warn_if_emulated(torch_dtype, device)
        model, tokenizer = load_pretrained(spec, device=device, dtype=torch_dtype, cache_dir=cache_dir,
                                           progress=progress)
    _pack(model, device, processes, pack, wide_rows, warn=not random_models.is_random_spec(spec))
    if torch.device(device).type == "cpu":
        _fuse(model, last_row)
    if compile is None:
        compile = torch.device(device).type == "cpu" and _inductor_can_compile()
    if compile:
        compile_blocks(model)
    if attention != "auto":
        set_attention_backend(model, attention)
    if not random_models.is_random_spec(spec):
        _warn_if_no_kernel(model)
    return model, tokenizer


def _fuse(model: Any, last_row: bool) -> None:
    """Give a CPU model fastprefill's attention and layer forwards, the last layer on the last
    row only unless ``last_row`` is False (:mod:`fastprefill.models.fused`)."""
    fuse_attention(model)
    fuse_layers(model)
    set_last_row_only(model, last_row)


def _check_wide_rows(wide_rows: int | None, dtype: torch.dtype, pack: bool | None) -> None:
    """Refuse a ``wide_rows`` that is not ``None`` or a non-negative int, or given for a model
    that does not load in float32 or is not to be packed (ConfigError)."""
    check_wide_rows(wide_rows)
    if wide_rows is not None and dtype != torch.float32:
        raise ConfigError(f"wide_rows applies to float32 products; this model loads in {dtype} "
                          "(pass dtype='float32', or drop wide_rows)")
    if wide_rows is not None and pack is False:
        raise ConfigError("wide_rows chooses between a packed layer's copies, and pack=False packs none "
                          "(pass pack=None or True, or drop wide_rows)")


def _pack(model: Any, device: str | torch.device, processes: int, pack: bool | None, wide_rows: int | None,
          warn: bool) -> None:
    """Pack ``model``'s linear layers as :func:`load` was asked (``pack``: ``None`` decides by
    :func:`_default_pack`), fuse a packed bfloat16 model's SwiGLUs, and set ``wide_rows``."""
    if pack is None:
        pack = _default_pack(model, device, processes, warn=warn)
    elif pack and not packable(device, model.dtype):
        cpu = ("; this CPU has no oneDNN bfloat16 path (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT)"
               if model.dtype == torch.bfloat16 and not onednn_bf16() else "")
        raise ConfigError(f"pack=True needs a bfloat16 or float32 model on the CPU with oneDNN (got {model.dtype} "
                          f"on {device}{cpu}); pass pack=None (auto) or False")
    if pack and pack_linears(model) and model.dtype == torch.bfloat16:  # float32: MLPs stay compiled
        fuse_mlps(model)
    if wide_rows is not None and set_wide_rows(model, wide_rows) == 0:
        why = "this device or dtype cannot pack" if not packable(device, model.dtype) else "the loader chose not to pack"
        raise ConfigError(f"wide_rows={wide_rows}: no linear layer was packed here ({why}), so there is no packed "
                          "copy to route around; drop wide_rows, or pass pack=True")


def _warn_if_no_kernel(model: Any) -> None:
    """Say once per process and reason when a CPU model's attention runs on SDPA instead of the
    C++ kernel (:mod:`fastprefill.kernels`) although the model did not choose SDPA, and when a
    packed bfloat16 model's decode products run on oneDNN because the few-row kernel cannot."""
    backend, why = attention_backend(model)
    if backend == "sdpa" and why and model.device.type == "cpu" and why not in _kernel_warnings:
        _kernel_warnings.add(why)
        warnings.warn(f"attention runs on SDPA, not fastprefill's C++ kernel: {why}", stacklevel=3)
    used, why = few_rows_used(model)
    if linears_packed(model) and model.dtype == torch.bfloat16 and not used and why not in _kernel_warnings:
        _kernel_warnings.add(why)
        warnings.warn(f"decode steps' matrix products run on oneDNN, not fastprefill's few-row kernel: {why}",
                      stacklevel=3)


_kernel_warnings: set[str] = set()


def _warn_if_emulated(dtype: torch.dtype, device: str | torch.device) -> None:
    """Warn when bfloat16 was asked for on a CPU without native bfloat16 matrix units (``auto``
    never picks it there): torch has no fast bfloat16 kernel there, and prefill runs several times
    slower than in float32."""
    info = cpu_info()
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not info.bf16_native:
        warnings.warn(f"bfloat16 on a CPU without native bfloat16 matrix units ({info.name}, {info.isa}): "
                      "prefill runs several times slower than in float32 here; dtype='auto' picks float32",
                      stacklevel=3)


def _inductor_can_compile() -> bool:
    """Whether inductor finds a C++ compiler (it builds its CPU kernels with one); warns once if not."""
    global _warned
    if any(shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if name):
        return True
    if not _warned:
        warnings.warn("no C++ compiler on the PATH (g++, c++, clang++ or $CXX): the model runs uncompiled, "
                      "with its norms and MLPs unfused (slower prefill); install one, or pass compile=False "
                      "to silence this", stacklevel=3)
        _warned = True
    return False


_warned = False
