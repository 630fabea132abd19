"""Row floors: a row's result independent of the rows computed with it.

A row's result can depend on how many rows a product computes: oneDNN runs a one-row product
(and, for some shapes, a two-row one) with another kernel, whose sums round differently, than a
product of more rows. So a stream's decode step gives other bits alone than in a decode batch,
and a prefix-cache hit's one-row suffix others than the same row inside a whole prefill.
:func:`set_row_floor` gives every packed product of a model a *row floor*: fewer input rows are
padded with zero rows up to it (their outputs dropped), so every product at or above the floor
runs the kernels that compute each row the same whatever other rows come with it
(:func:`row_floor_for` finds the floor for this CPU's kernels by checking the products' shapes;
``set_row_floor(model, "auto")`` keeps what it found on disk, :func:`row_floor_cache_path`, so
a product's shape is checked once per CPU, torch, dtype and thread count).

A model given a floor other than 1 keeps its few-row products on oneDNN too
(:func:`fastprefill.models.packed.set_few_rows`): the few-row kernel computes a row alone, with
other bits than oneDNN's products of more rows, so with it a stream's step would still change
when its batch grows past two rows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from fastprefill.models.packed import PackedLinear, packable, set_few_rows

__all__ = ["ROW_FLOORS", "chunked", "row_floor_cache_path", "row_floor_for", "set_row_floor"]

#: The row floors :func:`row_floor_for` tries, smallest first (a CPU with AMX tiles may pick its
#: kernels by blocks of 16 rows).
ROW_FLOORS = (1, 2, 4, 8, 16)
#: The row counts :func:`row_floor_for` computes its rows by (those at or above the floor tried).
_PROBE_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 48)


def chunked(product: Any, x: torch.Tensor, m: int) -> torch.Tensor:
    """``product`` of ``x`` ``(R, in)`` computed ``m`` rows at a time (``R`` a multiple of ``m``)."""
    return torch.cat([product(x[i:i + m].contiguous()) for i in range(0, x.shape[0], m)])


def row_floor_for(shapes: Any, dtype: torch.dtype, *, rows: int = 48, whole: int = 256, seed: int = 0) -> int | None:
    """The smallest floor of :data:`ROW_FLOORS` at which this CPU's packed products of every
    ``(in_features, out_features)`` of ``shapes`` compute each row the same whatever the row count.
    For each shape, the first ``rows`` rows of random inputs (32 for an output wider than 8192)
    are computed ``M`` rows at a time, for each ``M`` at or above the floor that divides them
    (up to 48), and compared bit for bit with the same rows inside one ``whole``-row product.
    Many rows are compared because two kernels' float32 sums that differ in order mostly round
    to the same bfloat16 output. ``None``: no floor does (or oneDNN does not pack ``dtype``
    here)."""
    if not packable("cpu", dtype):
        return None
    gen = torch.Generator().manual_seed(seed)
    cases = []
    with torch.inference_mode():
        for d_in, d_out in dict.fromkeys(tuple(s) for s in shapes):
            weight = (torch.randn(d_out, d_in, generator=gen) * d_in ** -0.5).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2048)
            product = functools.partial(_packed_product, packed)
            x = torch.randn(max(rows, whole), d_in, generator=gen).to(dtype)
            n = rows if d_out <= 8192 else 32  # a wide product (an LM head): fewer rows hold as many outputs
            cases.append((product, x[:n], product(x)[:n]))
        for floor in ROW_FLOORS:
            if all(torch.equal(chunked(product, x, m), ref) for product, x, ref in cases
                   for m in _PROBE_COUNTS if m >= floor and x.shape[0] % m == 0):
                return floor
    return None


def _packed_product(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def row_floor_cache_path() -> Path:
    """The file where ``set_row_floor(model, "auto")`` keeps the floors it found: ``row_floors.json``
    in the cache folder (``$FASTPREFILL_CACHE_DIR`` or ``~/.cache/fastprefill``).
    The floors are filed under a key of everything the kernels' choice may depend on (the CPU's
    name and flags as torch reads them, torch's version (and so its oneDNN's), the thread count,
    the check's own settings), so another CPU, torch or thread count is checked again; deleting the
    file costs only the checks again."""
    from fastprefill.models.zoo import default_cache_dir

    return default_cache_dir() / "row_floors.json"


def _floor_machine_key() -> str:
    """What a found floor depends on besides its product's dtype and shape (16 hex digits)."""
    from fastprefill.host import _cpu_flags

    what = {"cpu": _cpu_flags(), "isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "floors": ROW_FLOORS, "counts": _PROBE_COUNTS}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_floors(path: Path, warn: bool = True) -> dict[str, Any]:
    """The floor file's contents, ``{}`` where there is none; an unreadable or malformed file is
    warned about (where ``warn``) and later rewritten, never trusted or raised from."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # none yet (or no folder for one: the write says so)
        return {}
    except (OSError, ValueError) as exc:
        if warn:
            warnings.warn(f"ignoring the row floor cache {path} ({exc}); its floors are checked again and the "
                          "file rewritten", RuntimeWarning, stacklevel=4)
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) and isinstance(v.get("floors"), dict)
                                             for v in data.values()):
        if warn:
            warnings.warn(f"ignoring the row floor cache {path} (not a mapping of machines to floors); its "
                          "floors are checked again and the file rewritten", RuntimeWarning, stacklevel=4)
        return {}
    return data


def _write_floors(path: Path, data: dict[str, Any]) -> None:
    """Write the floor file whole (a temporary file renamed over it, so no reader sees half of
    one); a file that cannot be written is warned about, never raised from."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        warnings.warn(f"could not write the row floor cache {path} ({exc}); the floors will be checked again "
                      "at the next load", RuntimeWarning, stacklevel=4)


def _found_floors(shapes: list[tuple[int, int]], dtype: torch.dtype,
                  cache: bool) -> dict[tuple[int, int], int | None]:
    """:func:`row_floor_for` of each ``(in_features, out_features)`` of ``shapes`` alone; with
    ``cache``, those already in the floor file (:func:`row_floor_cache_path`) are read from it and
    the others added to it."""
    from fastprefill.host import cpu_info, dtype_name

    name = dtype_name(dtype)
    path = row_floor_cache_path() if cache else None
    key = _floor_machine_key() if cache else ""
    known = dict(_read_floors(path).get(key, {}).get("floors", {})) if path else {}
    found: dict[tuple[int, int], int | None] = {}
    added = False
    for shape in dict.fromkeys(shapes):
        entry = f"{name} {shape[0]}x{shape[1]}"
        if entry in known and (known[entry] is None or known[entry] in ROW_FLOORS):
            found[shape] = known[entry]
        else:
            found[shape] = known[entry] = row_floor_for([shape], dtype)
            added = True
    if path and added:
        data = _read_floors(path, warn=False)  # again: another process may have added floors meanwhile
        machine = data.setdefault(key, {"cpu": cpu_info().name, "torch": torch.__version__,
                                        "threads": torch.get_num_threads(), "floors": {}})
        machine["floors"].update(known)
        _write_floors(path, data)
    return found


def set_row_floor(model: torch.nn.Module, rows: int | str = "auto", *, cache: bool = True) -> int:
    """Give every :class:`PackedLinear` of ``model`` a row floor (see the module docstring; its
    merged and fused products follow their layers): ``rows`` for all (>= 1; 1 turns it off), or
    ``"auto"``: each layer the floor :func:`row_floor_for` finds for its own product's shape and,
    for a q/k/v projection, the merged product's, so that only the products whose few-row kernels
    round differently pay for padding. Any floor but 1 also keeps the model's few-row products on
    oneDNN (:func:`set_few_rows`: off; a floor of 1 turns them on again). Returns the largest floor set.
    With ``cache`` (the default) ``"auto"`` reads the floors already found for this machine from
    :func:`row_floor_cache_path` and adds the ones it checks, so only a model's first load on a
    machine pays for the checks (a few seconds of products per shape).

    Raises:
        ConfigError: ``rows`` is neither an integer >= 1 nor ``"auto"``, or ``"auto"`` finds no
            floor (a model without packed layers, or a product that depends on its row count at
            every floor of :data:`ROW_FLOORS`).
    """
    from fastprefill.errors import ConfigError

    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if rows != "auto":
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ConfigError(f"row floor must be an integer >= 1 or 'auto', got {rows!r}")
        for layer in layers:
            layer.row_floor = rows
        set_few_rows(model, rows == 1)
        return rows
    if not layers:
        raise ConfigError("a row floor needs packed linear layers (load the model with pack=True)")
    dtype = layers[0].weight.dtype
    products: dict[int, list[list[PackedLinear]]] = {id(m): [[m]] for m in layers}  # its own, a merged q/k/v
    for module in model.modules():
        qkv = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if all(isinstance(m, PackedLinear) for m in qkv):
            for m in qkv:
                products[id(m)].append(qkv)  # type: ignore[arg-type]
    shapes = {id(m): [(group[0].in_features, sum(x.out_features for x in group)) for group in products[id(m)]]
              for m in layers}
    floors = _found_floors([shape for own in shapes.values() for shape in own], dtype, cache)

    def floor_of(shape: tuple[int, int]) -> int:
        if floors[shape] is None:
            raise ConfigError(f"no row floor of {ROW_FLOORS} makes this CPU's {dtype} {shape[0]}x{shape[1]} "
                              "product independent of its row count")
        return floors[shape]  # type: ignore[return-value]

    for layer in layers:
        layer.row_floor = max(floor_of(shape) for shape in shapes[id(layer)])
    set_few_rows(model, False)  # a layer whose floor is 1 must compute its few rows as oneDNN does too
    return max(layer.row_floor for layer in layers)
