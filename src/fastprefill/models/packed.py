"""Linear layers whose weights are prepacked for oneDNN's matrix products on the CPU (by default:
bfloat16 where the CPU multiplies it natively; float32 where the copy fits in memory).

``torch.nn.functional.linear`` hands oneDNN a plain ``(out, in)`` weight on every call, which it
reads in that layout; a weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the same prepacking inductor's freezing pass and
IPEX apply) multiplies faster on CPUs with AMX or AVX512-BF16 units, for prompt-sized and
one-row inputs alike (measured in ``docs/results/native-precision.md``). oneDNN may pick another
kernel for a packed weight than for a plain one, so a result can differ in its last bits.
In float32 (on the AVX2 EPYC measured) oneDNN's packed products ran faster than MKL's plain
ones (``F.linear``) for a few rows (a decode step, a hit's suffix, the LM head's row) and for
prompt-sized inputs alike; :func:`set_wide_rows` sends a float32 layer's products of more than a
given number of rows to the plain weight instead, for a machine where MKL's are the faster ones.
A float32 model keeps its compiled MLPs (no :class:`PackedSwiGLU`; ``benchmarks/mlp_variants.py``).

:func:`pack_linears` turns every ``torch.nn.Linear`` of a model into a :class:`PackedLinear`
in place: the same module (its ``weight`` and ``bias`` parameters stay, so fingerprints,
``state_dict`` and the methods that read a projection's weight see nothing new), plus the packed
copy it multiplies with. The copy costs the linear weights' memory once more. It is re-made
when the weight changes in place (outside ``torch.inference_mode``), and the plain call is used wherever the packed one does not
apply (another device or dtype, autograd on the weight).

:class:`PackedSwiGLU` goes one step further for a SwiGLU MLP over packed layers: its product
(and in bfloat16 its activation) run inside the gate and up products (oneDNN post-ops) instead
of as passes over the ``(T, I)`` intermediate.

A row's result can depend on how many rows a product computes (oneDNN's few-row kernels round
unlike its wider ones): each :class:`PackedLinear` has a ``row_floor`` below which its rows are
padded with zero rows, set by :mod:`fastprefill.models.row_floor`.

A decode step's product, at most :data:`FEW_ROWS` rows of one position each (one stream, or a
small batch: :func:`decode_rows`), runs on fastprefill's few-row products instead
(:func:`fastprefill.kernels.row_products`), where they are built: in bfloat16 where the CPU has
AVX512-BF16, in float32 on any CPU with AVX2. In float32 (:data:`PROMPT_ROWS`) so does a
prompt's product of at most that many positions (a prefix-cache hit's suffix, a short prompt).
oneDNN's few-row products read the weights at about half (bfloat16) or two thirds (float32, as
MKL's) of the rate the cores can stream them, and its float32 products of a few dozen rows ran
below the kernel's tiles; these read the plain weight in order (``docs/results/attention.md`` and
``docs/results/native-precision.md`` have the measurements). They compute each row alone, so its
result is the same for any number of rows up to the limit, though not the same bits as the row
inside a prompt-sized product. A model given a row floor (:func:`fastprefill.models.row_floor.set_row_floor`, any but 1) keeps oneDNN for every
product, so the floor's promise holds; :func:`set_few_rows` turns them off (or on) for a model.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
from collections.abc import Iterator
from typing import Any

import torch

from fastprefill.errors import ConfigError
from fastprefill.kernels import row_products, rows_status

__all__ = ["FEW_ROWS", "FLOAT32_PACK_SHARE", "PROMPT_ROWS", "MergedProduct", "PackedLinear", "PackedSwiGLU",
           "can_pack", "check_wide_rows", "decode_rows", "few_row_kernel", "few_rows_used", "fits_in_memory", "kernel_rows",
           "linear_bytes", "linears_packed", "onednn_bf16", "pack_linears", "packable", "set_few_rows",
           "set_wide_rows", "streams_as_rows"]

#: Products of at most this many input rows, by dtype, run on the few-row kernel where it applies
#: (more run on oneDNN): in bfloat16, from three or four rows on, oneDNN's products were as fast or
#: faster on the AVX512-BF16 machine measured; in float32 the kernel's tiles were the faster ones
#: up to about 40 rows on the AVX2 EPYC measured (``docs/decisions.md``).
FEW_ROWS: dict[torch.dtype, int] = {torch.bfloat16: 2, torch.float32: 40}
#: The dtypes whose few-row products take a prompt's positions too (a hit's suffix, a short prompt
#: or chunk), not only a decode step's rows: float32, where a prompt's rows already get other bits
#: inside a longer prompt (more than :data:`FEW_ROWS` rows run on oneDNN). In bfloat16 a prompt's
#: positions stay on oneDNN, whose products give them the bits they get inside a longer prompt.
PROMPT_ROWS: frozenset[torch.dtype] = frozenset({torch.float32})
#: The dtypes whose fused SwiGLU (:class:`PackedSwiGLU`) applies SiLU inside the gate's product
#: (oneDNN's ``swish`` post-op). Elsewhere the gate's product is plain and torch's SiLU runs over
#: it in place (on an AVX2 CPU the float32 post-op cost more than that pass); float32 MLPs stay
#: unfused by default all the same (level with this, ``benchmarks/mlp_variants.py``).
SILU_IN_PRODUCT: frozenset[torch.dtype] = frozenset({torch.bfloat16})


def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 products on this CPU at all: torch built with it, and the CPU
    has AVX512BW/VL/DQ or AVX-NE-CONVERT (without them oneDNN refuses to pack a bfloat16 weight)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return torch.backends.mkldnn.is_available() and probe is not None and bool(probe())


def packable(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether packing applies at all: a model on the CPU with oneDNN, in float32, or in bfloat16
    where oneDNN runs bfloat16 (:func:`onednn_bf16`)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16())


def can_pack(device: str | torch.device, dtype: torch.dtype, copy_bytes: int = 0) -> bool:
    """Whether packing is on by default: it applies (:func:`packable`) and either the model is
    bfloat16 on a CPU whose cores multiply bfloat16 natively (:func:`fastprefill.host.cpu_info`),
    or it is float32 and the packed copy (``copy_bytes``: the linear weights once more) takes at
    most :data:`FLOAT32_PACK_SHARE` of the machine's memory (:func:`fits_in_memory`)."""
    from fastprefill.host import cpu_info

    if not packable(device, dtype):
        return False
    if dtype == torch.float32:
        return fits_in_memory(copy_bytes)
    return dtype == torch.bfloat16 and cpu_info().bf16_native


#: The largest share of the machine's memory a float32 model's packed copy may take by default.
FLOAT32_PACK_SHARE = 1 / 3


def fits_in_memory(copy_bytes: int) -> bool:
    """Whether ``copy_bytes`` is at most :data:`FLOAT32_PACK_SHARE` of this machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: do not pack by default
        return False
    return copy_bytes <= total * FLOAT32_PACK_SHARE


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights :func:`pack_linears` would copy (every ``torch.nn.Linear``'s, shared ones once each)."""
    weights = {id(m.weight): m.weight for m in model.modules() if type(m) in (torch.nn.Linear, PackedLinear)}
    return sum(w.numel() * w.element_size() for w in weights.values())


class PackedLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` that multiplies with a oneDNN-packed copy of its weight.

    ``forward`` maps ``(..., in_features)`` to ``(..., out_features)`` as ``Linear`` does; on the
    CPU, without autograd on the weight and in the weight's dtype it calls
    ``torch.ops.mkldnn._linear_pointwise`` on the packed copy, otherwise ``F.linear``.
    Make one with :func:`pack_linears`.
    """

    _packed: torch.Tensor | None = None  # made on first use by a layer built as PackedLinear directly
    _packed_for: tuple[int, int] = (0, -2)
    #: fewer input rows are padded with zero rows up to this many
    #: (:func:`fastprefill.models.row_floor.set_row_floor`; 1: never)
    row_floor: int = 1
    #: products of up to :data:`FEW_ROWS` rows may run on the few-row kernel (:func:`set_few_rows`)
    few_rows: bool = True
    #: float32 products of more input rows than this run on the plain weight (``F.linear``: MKL's
    #: sgemm in torch's CPU wheels) instead of the packed copy; ``None``: none do (:func:`set_wide_rows`)
    wide_rows: int | None = None

    def repack(self, rows: int = 2048) -> None:
        """(Re)make the packed copy of ``weight`` (oneDNN picks its layout for ``rows`` input rows;
        any row count works)."""
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)
        self._packed_for = _stamp(self.weight)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the packed product serves input ``x``: both on the CPU, ``x`` in the weight's
        dtype, and no autograd on the weight."""
        weight = self.weight
        return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
                and not (torch.is_grad_enabled() and weight.requires_grad))

    def plain(self, x: torch.Tensor) -> bool:
        """Whether a float32 product of ``x`` has more than ``wide_rows`` rows (no row floor): it
        runs on the plain weight (MKL's sgemm) instead of the packed copy."""
        return (self.wide_rows is not None and x.dtype == torch.float32 and self.row_floor == 1
                and x.numel() > self.wide_rows * x.shape[-1])

    def packed_weight(self) -> torch.Tensor:
        """The packed copy of ``weight``, re-made first if the weight changed since."""
        if self._packed is None or self._packed_for != _stamp(self.weight):
            self.repack()
        assert self._packed is not None
        return self._packed

    @torch.compiler.disable  # dynamo cannot trace oneDNN's opaque tensors; compiled blocks call out to it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.applies(x) or self.plain(x):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        kernel = few_row_kernel(x, [self])
        if kernel is not None:
            return kernel.products(x, [self.weight], [self.bias]).view(*x.shape[:-1], self.out_features)
        return _floored(x, self.row_floor, lambda t: torch.ops.mkldnn._linear_pointwise(
            t, self.packed_weight(), self.bias, "none", [None], ""))

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        """A deep copy packs its own weight (oneDNN's packed tensors have no storage to copy)."""
        packed, self._packed = self._packed, None
        try:
            clone = copy.copy(self)
            clone.__dict__ = copy.deepcopy(self.__dict__, memo)
        finally:
            self._packed = packed
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_packed": None}  # pickled without the packed copy; re-made on use


class PackedSwiGLU(torch.nn.Module):
    """A decoder layer's SwiGLU MLP, ``down(silu(gate(x)) * up(x))``, with the activation and the
    product inside oneDNN's matrix products.

    The same three :class:`PackedLinear` modules under the same names (``gate_proj``, ``up_proj``,
    ``down_proj``: parameters, ``state_dict`` and fingerprints unchanged). Where the packed
    products apply, the gate's product applies SiLU to its float32 accumulator before rounding
    (oneDNN's ``swish`` post-op; in a dtype outside :data:`SILU_IN_PRODUCT`, torch's SiLU in place
    over the gate's output instead) and the up product multiplies its accumulator by that (the
    ``mul`` binary post-op), so the ``(B, T, I)`` element-wise passes the MLP would make over
    memory are not made (in float32, one is); otherwise (another device, dtype or autograd, or a float32 product its
    layers' ``wide_rows`` sends to the plain weight) it computes the formula with the layers' own
    calls. Rounding once instead of three times, it can differ from the unfused MLP in the last
    bits. Rows for the few-row kernel take it: in bfloat16 its own SwiGLU, in float32 the gate's
    and the up products in one call and the activation after. Made by
    :func:`fastprefill.models.adapters.fuse_mlps`.

    Shapes: ``(..., D)`` -> ``(..., D)``, through ``(..., I)``.
    """

    def __init__(self, gate_proj: PackedLinear, up_proj: PackedLinear, down_proj: PackedLinear,
                 act_fn: torch.nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate_proj, up_proj, down_proj, act_fn

    @torch.compiler.disable  # opaque oneDNN tensors, as PackedLinear
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        if not (gate.applies(x) and up.applies(x)) or gate.plain(x) or up.plain(x):
            return self.down_proj(self.act_fn(gate(x)) * up(x))
        kernel = few_row_kernel(x, [gate, up])
        if kernel is not None and x.dtype == torch.bfloat16:
            act = kernel.swiglu(x, gate.weight, gate.bias, up.weight, up.bias)  # (R, I)
            return self.down_proj(act.view(*x.shape[:-1], gate.out_features))
        if kernel is not None:  # float32: both products in one call, each output as in its own layer's
            both = kernel.products(x, [gate.weight, up.weight], [gate.bias, up.bias])  # (R, 2 I)
            g, u = both.view(*x.shape[:-1], 2 * gate.out_features).split(gate.out_features, dim=-1)
            return self.down_proj(self.act_fn(g) * u)
        linear = torch.ops.mkldnn._linear_pointwise

        def product(t: torch.Tensor) -> torch.Tensor:
            if t.dtype in SILU_IN_PRODUCT:
                gated = linear(t, gate.packed_weight(), gate.bias, "swish", [None], "")  # silu(x Wg + bg)
            else:  # the gate's plain product, then torch's SiLU in place over it
                gated = torch.nn.functional.silu(linear(t, gate.packed_weight(), gate.bias, "none", [None], ""),
                                                 inplace=True)
            return linear.binary(t, gated, up.packed_weight(), up.bias, "mul")  # (x Wu + bu) * gated

        return self.down_proj(_floored(x, max(gate.row_floor, up.row_floor), product))


class MergedProduct:
    """Several :class:`PackedLinear` layers over one input as one oneDNN product: their weights
    stacked along the output dimension and packed once (a decoder layer's q, k and v projections,
    for example), so the input is read once and one product runs instead of several.

    The layers stay what they are (their parameters, ``state_dict`` and their own calls); the
    merged copy replaces their own packed copies (re-made on use if a layer is called alone) and
    is re-made when any weight changes. Each output column is the same dot product as the layer's
    own, though oneDNN may pick another kernel for the wider product, so results can differ from
    separate products in the last bits.

    Args:
        layers: the layers, in the order their outputs are wanted; one ``in_features``.
    """

    def __init__(self, layers: list[PackedLinear]) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._for: tuple[tuple[int, int], ...] = ()

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the merged product serves ``x``: every layer's packed product would."""
        return all(layer.applies(x) for layer in self.layers)

    def _weights(self) -> torch.Tensor:
        stamps = tuple(_stamp(layer.weight) for layer in self.layers)
        if self._packed is None or stamps != self._for:
            with torch.no_grad():
                weight = torch.cat([layer.weight.detach() for layer in self.layers])  # (sum out, in)
                biases = [layer.bias for layer in self.layers]
                self._bias = None if all(b is None for b in biases) else torch.cat([
                    b.detach() if b is not None else layer.weight.new_zeros(layer.out_features)
                    for b, layer in zip(biases, self.layers)])
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2048)
            for layer in self.layers:
                layer._packed = None  # the merged copy serves them; a lone call re-packs its own
            self._for = stamps
        return self._packed

    def __deepcopy__(self, memo: dict[int, Any]) -> MergedProduct:
        """A copy over the copied layers, packed again on first use (a packed tensor has no storage to copy)."""
        return MergedProduct([copy.deepcopy(layer, memo) for layer in self.layers])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_packed": None, "_for": ()}  # pickled without the packed copy

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``(..., in)`` -> one ``(..., out_i)`` view per layer (of one merged output)."""
        if all(layer.plain(x) for layer in self.layers):
            return [layer(x) for layer in self.layers]  # each on its plain weight
        kernel = few_row_kernel(x, self.layers)
        if kernel is not None:
            merged = kernel.products(x, [m.weight for m in self.layers], [m.bias for m in self.layers])
            return list(merged.view(*x.shape[:-1], sum(self.sizes)).split(self.sizes, dim=-1))
        packed = self._weights()
        floor = max(layer.row_floor for layer in self.layers)
        merged = _floored(x, floor, lambda t: torch.ops.mkldnn._linear_pointwise(t, packed, self._bias, "none", [None], ""))
        return list(merged.split(self.sizes, dim=-1))


#: Set by :func:`streams_as_rows`: the rows of a ``(1, R, D)`` input are R streams' decode positions.
_STREAM_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("fastprefill_stream_rows", default=False)


@contextlib.contextmanager
def streams_as_rows(enabled: bool = True) -> Iterator[None]:
    """Within, a ``(1, R, D)`` input holds ``R`` streams' decode rows, one position each (a batched
    decode step that concatenates its streams' rows, as :func:`fastprefill.methods.layer_steps.run_layers`
    does), so :func:`decode_rows` counts them as a decode step's rows, not a prompt's positions.
    Only for rows that are each a stream's one decode position: a stream's row then gets the bits
    it gets alone (the few-row kernel computes each row alone)."""
    token = _STREAM_ROWS.set(enabled)
    try:
        yield
    finally:
        _STREAM_ROWS.reset(token)


def decode_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is a decode step's input for the few-row kernel: at most :data:`FEW_ROWS`
    (of its dtype) rows of one position each (``(B, 1, D)``, or ``(R, D)``; inside :func:`streams_as_rows`, also
    ``(1, R, D)``). A prompt's few positions (``(1, T, D)``, ``T > 1``: a short partition, chunk
    or suffix) are not: oneDNN keeps their bits those of the same rows inside a longer prompt."""
    streams = _STREAM_ROWS.get() and x.dim() == 3 and x.shape[0] == 1
    if x.dim() == 0 or (x.dim() >= 3 and x.shape[-2] != 1 and not streams):
        return False
    return _few_rows(x)


def kernel_rows(x: torch.Tensor) -> bool:
    """Whether the few-row kernel takes ``x``'s rows: :func:`decode_rows`, or in a dtype of
    :data:`PROMPT_ROWS` any ``(..., D)`` input of at most :data:`FEW_ROWS` rows (a prompt's positions too)."""
    if x.dtype in PROMPT_ROWS and x.dim() >= 1:
        return _few_rows(x)
    return decode_rows(x)


def _few_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` ``(..., D)`` holds 1 to :data:`FEW_ROWS` (of its dtype; none without an entry) rows of ``D``."""
    return 1 <= x.numel() // max(x.shape[-1], 1) <= FEW_ROWS.get(x.dtype, 0)


def few_row_kernel(x: torch.Tensor, layers: list[PackedLinear]) -> Any | None:
    """The few-row kernel if it computes ``layers``' products of ``x`` (the caller checked that the
    packed product applies): :func:`kernel_rows`, every layer with ``few_rows`` on, no row floor
    and a contiguous weight, and the kernel built and checked here."""
    if not kernel_rows(x):  # a dtype without a FEW_ROWS entry never is
        return None
    if not all(m.few_rows and m.row_floor == 1 and m.weight.is_contiguous() for m in layers):
        return None
    return row_products(x.dtype)


def set_few_rows(model: torch.nn.Module, enabled: bool = True) -> int:
    """Let every :class:`PackedLinear` of ``model`` run its products of up to :data:`FEW_ROWS`
    rows on the few-row kernel (the default), or keep them on oneDNN's packed product
    (``enabled=False``). Returns the number of layers set."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for layer in layers:
        layer.few_rows = bool(enabled)
    return len(layers)


def check_wide_rows(rows: int | None) -> None:
    """Refuse a ``wide_rows`` that is neither ``None`` nor a non-negative int (ConfigError, a ValueError)."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise ConfigError(f"wide_rows={rows!r}: give a non-negative number of rows, or None to keep every "
                          "product on the packed weights")


def set_wide_rows(model: torch.nn.Module, rows: int | None) -> int:
    """Run every :class:`PackedLinear` of ``model``'s float32 products of more than ``rows`` input
    rows on the plain weight (``F.linear``: MKL's sgemm in torch's CPU wheels) instead of oneDNN's
    packed copy, for a CPU where MKL's prompt-sized products are the faster ones; ``None`` (the
    default): every product on the packed copy (or the few-row kernel). A row floor keeps every
    product packed. Returns the number of layers set.

    Raises:
        ConfigError: ``rows`` is not ``None`` or a non-negative int (:func:`check_wide_rows`).
    """
    check_wide_rows(rows)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for layer in layers:
        layer.wide_rows = rows
    return len(layers)


def few_rows_used(model: Any) -> tuple[bool, str]:
    """``(used, why not)``: whether ``model``'s one-row products run on the few-row kernel, and if
    not, why (not packed, another dtype, turned off, a row floor, or the kernel's own reason)."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)] if isinstance(model, torch.nn.Module) else []
    if not layers:
        return False, "its linear layers are not packed"
    if not all(m.few_rows for m in layers):
        return False, "turned off (set_few_rows, or a row floor: it keeps every product on oneDNN)"
    status = rows_status(layers[0].weight.dtype)  # another dtype: its reason names the ones it runs
    return status.available, status.reason


def _floored(x: torch.Tensor, floor: int, product: Any) -> torch.Tensor:
    """``product`` of ``x`` ``(..., in)`` computed over at least ``floor`` rows: fewer are padded with
    zero rows, whose outputs are dropped. ``product`` takes and returns contiguous tensors."""
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= floor or rows == 0:
        return product(x)
    flat = x.reshape(rows, x.shape[-1])
    out = product(torch.cat([flat, flat.new_zeros(floor - rows, x.shape[-1])]))[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What identifies a weight's values: its storage and in-place version (an inference tensor,
    made under ``torch.inference_mode``, keeps no version: -1)."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


def pack_linears(model: torch.nn.Module, rows: int = 2048) -> int:
    """Turn every ``torch.nn.Linear`` of ``model`` (exactly that class, not subclasses) into a
    :class:`PackedLinear` in place, packing each weight for ``rows`` input rows. A weight shared
    with another module (tied embeddings) is packed as a copy; the parameter stays shared.

    Returns:
        The number of layers packed.
    """
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
            module.repack(rows)  # type: ignore[attr-defined]
            count += 1
    return count


def linears_packed(model: Any) -> bool:
    """Whether :func:`pack_linears` packed ``model``'s linear layers."""
    return isinstance(model, torch.nn.Module) and any(isinstance(m, PackedLinear) for m in model.modules())
