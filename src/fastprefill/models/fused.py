"""fastprefill's forwards for a Llama / Qwen2 model's attention modules and decoder layers on the
CPU: the same computation as transformers' own, in fewer passes and calls.

Each is mixed into the module's own class (the module keeps its parameters, names, attributes and
hooks; only ``forward`` is fastprefill's, and the family's own stays reachable as ``_own``), as
:class:`~fastprefill.models.packed.PackedLinear` does for ``nn.Linear``; the loader applies both
on the CPU (:func:`fuse_attention`, :func:`fuse_layers`), and each can be taken back.

- :class:`FusedAttention`: the rotary embedding in one pass, the q, k and v projections as one
  product.
- :class:`FusedDecoderLayer`: for a call of a few rows (a decode step, a hit's suffix), the
  layer's RMSNorms and MLP by their own ``forward`` instead of their compiled graphs, whose guards,
  wrappers and graph breaks cost more than a few rows compute; for a decode step's one or two rows
  in bfloat16, the two RMSNorms and the residual add before the second one as calls of the
  few-row kernel (:func:`fastprefill.kernels.row_products`).
- :func:`last_row_only`: inside it, the model's last decoder layer computes every row's keys and
  values but the rest of the layer (query, attention, output projection, MLP) for the last row
  only, the one row the LM head reads when a prefill keeps one position's logits (as llama.cpp
  selects the rows it outputs before the last layer's products). On a 28-layer model that is
  nearly a layer's work fewer in every prefill.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fastprefill.kernels import rotary_kernel
from fastprefill.models.adapters import decoder_layers, supports_layer_loop
from fastprefill.models.packed import MergedProduct, PackedLinear, few_row_kernel

__all__ = ["EAGER_ROWS", "FusedAttention", "FusedDecoderLayer", "attention_fused", "fuse_attention", "fuse_layers",
           "last_row_only", "layers_fused", "set_last_row_only", "trims_last_row"]

#: A decoder layer's call of at most this many rows (batch times positions) runs its norms and MLP
#: by their own ``forward``, not through their compiled graphs (:func:`~fastprefill.models.adapters.compile_blocks`):
#: on the AVX2 EPYC measured, a compiled norm's or MLP's call cost more in dynamo's guards, wrappers
#: and graph breaks (the MLP breaks at each packed product) than inductor's fusion saved, up to
#: a few hundred rows (``docs/decisions.md``). Prompt-sized calls keep the compiled graphs.
EAGER_ROWS = 128


class FusedAttention(torch.nn.Module):
    """A Llama / Qwen2 attention module's forward, with its element-wise work in fewer passes.

    Mixed into the model's own attention class by :func:`fuse_attention` (the module keeps its
    parameters, names and attributes; only ``forward`` is this one). It computes what
    transformers' forward computes, in the same order, through the same attention function
    (``config._attn_implementation``, fastprefill's or SDPA), with two differences in how:

    - the rotary embedding of the queries and keys is one pass of the C++ build
      (:func:`fastprefill.kernels.rotary_kernel`) instead of eager's element-wise passes and
      concatenation per tensor, rounded as eager rounds it, so its bits are eager's; where the
      build does not run (another device or dtype, a gradient, not built, cos and sin not
      ``(B, T, d)`` with a unit last stride) eager's formula runs;
    - where the q, k and v projections are packed (:class:`~fastprefill.models.packed.PackedLinear`),
      they run as one product (:class:`~fastprefill.models.packed.MergedProduct`), the input read
      once; oneDNN may round that product's columns differently in the last bits.

    Shapes: hidden states ``(B, T, D)``; ``position_embeddings`` ``(cos, sin)``, each ``(B, T, d)``;
    returns ``((B, T, D), None)`` as the module's own forward does.
    """

    #: the model's own attention class, and the module that defines it (its eager rotary and attention)
    _own: type | None = None
    _family: Any = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._attend(hidden_states, position_embeddings, attention_mask, past_key_values, False, kwargs)

    def last_row(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` with every row's keys and values cached but the query, attention and
        output projection of the last row only: returns ``((B, 1, D), weights)``, the last row of
        what :meth:`forward` returns (to float rounding: its products run on one row)."""
        return self._attend(hidden_states, position_embeddings, attention_mask, past_key_values, True, kwargs)

    def _attend(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, past_key_values: Any, last: bool,
                kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` (``last`` False) or :meth:`last_row` (``last`` True)."""
        b, t, _ = hidden_states.shape
        d = self.head_dim
        h_q, h_kv = self.config.num_attention_heads, self.config.num_key_value_heads
        q, k, v = self._projections(hidden_states, last)  # (B, T_q, H_q * d), (B, T, H_kv * d) twice
        t_q = q.shape[1]
        cos, sin = position_embeddings
        cos_q, sin_q = (cos[:, -t_q:], sin[:, -t_q:]) if t_q < t else (cos, sin)
        rotate = rotary_kernel(q.dtype) if (
            q.device.type == "cpu" and cos.dtype == sin.dtype == q.dtype and cos.dim() == sin.dim() == 3
            and cos.stride(-1) == sin.stride(-1) == 1
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))) else None
        if rotate is not None:
            query, key = rotate(q, cos_q, sin_q, h_q), rotate(k, cos, sin, h_kv)  # (B, H, T_q or T, d)
        else:
            own = self._family.apply_rotary_pos_emb
            q_heads, k_heads = q.view(b, t_q, h_q, d).transpose(1, 2), k.view(b, t, h_kv, d).transpose(1, 2)
            query, key = own(q_heads, k_heads, cos, sin) if t_q == t else (
                own(q_heads, q_heads, cos_q, sin_q)[0], own(k_heads, k_heads, cos, sin)[1])
        value = v.view(b, t, h_kv, d).transpose(1, 2)  # (B, H_kv, T, d)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        if t_q < t and attention_mask is not None:
            attention_mask = attention_mask[..., -t_q:, :]  # the last query's row of (B, 1, T, N)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          self._family.eager_attention_forward)
        if hasattr(self, "sliding_window"):
            kwargs["sliding_window"] = self.sliding_window
        out, weights = interface(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(b, t_q, -1).contiguous()), weights

    def _projections(self, x: torch.Tensor, last: bool = False) -> list[torch.Tensor]:
        """``q, k, v`` projections of ``x`` ``(B, T, D)``: one merged product where they are packed;
        with ``last``, ``q`` of the last row only (``(B, 1, H_q * d)``) and ``k, v`` of every row."""
        if last:
            return [self.q_proj(x[:, -1:]), self.k_proj(x), self.v_proj(x)]
        layers = [self.q_proj, self.k_proj, self.v_proj]
        if all(isinstance(m, PackedLinear) for m in layers):
            merged = self.__dict__.get("_fastprefill_qkv")
            if merged is None or any(a is not b for a, b in zip(merged.layers, layers)):
                merged = self.__dict__["_fastprefill_qkv"] = MergedProduct(layers)
            if merged.applies(x):
                return merged(x)
        return [m(x) for m in layers]


@functools.cache
def _fused_class(cls: type) -> type:
    """``cls`` (a family's attention class) with :class:`FusedAttention`'s forward."""
    return type(f"Fused{cls.__name__}", (FusedAttention, cls), {"__module__": __name__, "_own": cls,
                                                                 "_family": sys.modules[cls.__module__]})


def fuse_attention(model: Any, fused: bool = True) -> int:
    """Give every decoder layer's attention of a :data:`LAYER_LOOP_FAMILIES` model
    :class:`FusedAttention`'s forward (in place: the module's class becomes a subclass of its own
    with that forward; parameters, names and ``state_dict`` unchanged), or with ``fused=False``
    its own class's forward again. Returns how many modules changed (0 for other families, or
    when they are as asked already)."""
    modules = [layer.self_attn for layer in decoder_layers(model)]
    count = _swap_classes(model, modules, FusedAttention, _fused_class, fused)
    if not fused:
        for attn in modules:
            attn.__dict__.pop("_fastprefill_qkv", None)
    return count


def _swap_classes(model: Any, modules: list[torch.nn.Module], mixin: type, make: Any, fused: bool) -> int:
    """Give each of ``modules`` the class ``make(its class)`` (mixing ``mixin``'s forward in), or
    with ``fused=False`` its own class again (``_own``); nothing for a family outside
    :data:`~fastprefill.models.adapters.LAYER_LOOP_FAMILIES`. Returns how many changed."""
    if not supports_layer_loop(getattr(model, "config", None)):
        return 0
    count = 0
    for module in modules:
        if fused and not isinstance(module, mixin):
            module.__class__ = make(type(module))
        elif not fused and isinstance(module, mixin):
            module.__class__ = module._own
        else:
            continue
        count += 1
    return count


def attention_fused(model: Any) -> bool:
    """Whether :func:`fuse_attention` gave ``model``'s attention modules the fused forward."""
    layers = decoder_layers(model)
    return bool(layers) and isinstance(layers[0].self_attn, FusedAttention)


class FusedDecoderLayer(torch.nn.Module):
    """A Llama / Qwen2 decoder layer's forward, with a few rows' norms and MLP outside their compiled graphs.

    Mixed into the layer's own class by :func:`fuse_layers`. A call of more than :data:`EAGER_ROWS`
    rows (or with positional arguments) is the family's own forward. A call of fewer computes what
    the family's forward computes (``h + attn(norm1(h))``, then that plus ``mlp(norm2(.))``), with
    the norms and the MLP called by their own ``forward`` (eager: the compiled graphs' guards and
    wrappers cost more than a few rows compute; their module hooks are not run) and the attention
    module called as the family calls it. Where the rows are a decode step's bfloat16 rows
    (:func:`~fastprefill.models.packed.decode_rows`) on the CPU, without a gradient, and the
    layer's products run on the few-row kernel (its output projection's ``few_rows`` on and no
    row floor: :func:`~fastprefill.models.packed.set_few_rows`), the kernel's ``rms_norm``
    computes the input norm and ``add_rms_norm`` the residual add and the post-attention norm.
    Eager and inductor take a norm's float32 statistics in other orders than each other and than
    the kernel, so a row's output can differ in the last bit between a few-row call and a
    prompt-sized one; each row's is the same whatever the number of rows up to :data:`EAGER_ROWS`.

    Shapes: hidden states ``(B, T, D)`` in and out; the keyword arguments are the family's.
    """

    _own: type | None = None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = hidden_states.numel() // max(hidden_states.shape[-1], 1)
        if (_LAST_ROW.get() or (None,))[0] is self and not args and self._takes_last_row(hidden_states, kwargs):
            return self._last_row(hidden_states, **kwargs)
        if args or rows > EAGER_ROWS:  # the family's arguments by name only
            assert self._own is not None
            return self._own.forward(self, hidden_states, *args, **kwargs)
        first, second = self.input_layernorm, self.post_attention_layernorm
        kernel = self._few_row_kernel(hidden_states)
        if kernel is None:
            residual = hidden_states
            attended, _ = self.self_attn(hidden_states=first.forward(hidden_states), **kwargs)
            residual = residual + attended
            normed = second.forward(residual)
        else:
            normed = kernel.rms_norm(hidden_states, first.weight, first.variance_epsilon)
            attended, _ = self.self_attn(hidden_states=normed, **kwargs)
            residual, normed = kernel.add_rms_norm(hidden_states, attended, second.weight, second.variance_epsilon)
        return residual + self.mlp.forward(normed)

    def _takes_last_row(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether :meth:`_last_row` computes this call: the prefill's own call (over the cache
        :func:`last_row_only` names, not a decode step run in one of its pauses), one sequence of
        more than one row, the fused attention, and no mask or a tensor one (whose last query row
        it slices)."""
        mask = kwargs.get("attention_mask")
        return (kwargs.get("past_key_values") is _LAST_ROW.get()[1] and hidden.dim() == 3
                and hidden.shape[0] == 1 and hidden.shape[1] > 1 and isinstance(self.self_attn, FusedAttention)
                and (mask is None or isinstance(mask, torch.Tensor)))

    def _last_row(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The layer's output for the last row only, ``(1, 1, D)`` from ``(1, T, D)``: every row's
        input norm, keys and values (cached as the family's forward caches them), the rest on
        the last row, its norm and MLP by their own ``forward`` (one row: see :data:`EAGER_ROWS`)."""
        attended, _ = self.self_attn.last_row(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        residual = hidden_states[:, -1:] + attended  # (1, 1, D)
        return residual + self.mlp.forward(self.post_attention_layernorm.forward(residual))

    def _few_row_kernel(self, hidden: torch.Tensor) -> Any | None:
        """The few-row kernel if this call's norms run on it (see the class docstring), else ``None``:
        where the layer's output projection would run its rows on it, and the norms can."""
        o_proj = getattr(self.self_attn, "o_proj", None)
        if not isinstance(o_proj, PackedLinear) or hidden.device.type != "cpu":
            return None
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if torch.is_grad_enabled() and any(n.weight.requires_grad for n in norms):
            return None
        if not all(hasattr(n, "variance_epsilon") and n.weight.dtype == torch.bfloat16 and n.weight.is_contiguous()
                   for n in norms):
            return None
        return few_row_kernel(hidden, [o_proj])


@functools.cache
def _layer_class(cls: type) -> type:
    """``cls`` (a family's decoder layer class) with :class:`FusedDecoderLayer`'s forward."""
    return type(f"Fused{cls.__name__}", (FusedDecoderLayer, cls), {"__module__": __name__, "_own": cls})


def fuse_layers(model: Any, fused: bool = True) -> int:
    """Give every decoder layer of a :data:`~fastprefill.models.adapters.LAYER_LOOP_FAMILIES` model
    :class:`FusedDecoderLayer`'s forward (in place, as :func:`fuse_attention` does), or with
    ``fused=False`` its own class's forward again. Returns how many layers changed."""
    return _swap_classes(model, decoder_layers(model), FusedDecoderLayer, _layer_class, fused)


#: The model attribute :func:`set_last_row_only` sets (``True``: every row, as the family computes it).
_EVERY_ROW = "_fastprefill_every_row"

#: The decoder layer that computes only its last row's output (:func:`last_row_only`), if any.
_LAST_ROW: contextvars.ContextVar[tuple[torch.nn.Module, Any] | None] = contextvars.ContextVar(
    "fastprefill_last_row", default=None)


@contextlib.contextmanager
def last_row_only(model: Any, cache: Any) -> Iterator[bool]:
    """Inside, ``model``'s last decoder layer, called over ``cache`` (the prefill's own forward;
    not a decode step that runs over its own cache in one of the prefill's pauses), computes
    every row's keys and values and the rest of the layer for the last row only: a forward over
    ``(1, T)`` ids returns that layer's ``(1, 1, D)`` output, so the final norm and the LM head
    see the last position alone, which is all a prefill that keeps one position's logits
    (``logits_to_keep=1``) reads. The cache
    ends as the full forward leaves it; the last row's logits are the full forward's to float
    rounding (its products run on one row). Only for callers that read no other row's output
    (not ``output_hidden_states``). Yields whether it applies: the layers have
    :class:`FusedDecoderLayer`'s forward (:func:`fuse_layers`) and the attention
    :class:`FusedAttention`'s; elsewhere the forward is the model's own, every row computed.
    """
    last = decoder_layers(model)[-1] if trims_last_row(model) else None
    token = _LAST_ROW.set(None if last is None else (last, cache))
    try:
        yield last is not None
    finally:
        _LAST_ROW.reset(token)


def trims_last_row(model: Any) -> bool:
    """Whether :func:`last_row_only` applies to ``model``: its last decoder layer and attention
    have fastprefill's forwards and :func:`set_last_row_only` did not switch it off."""
    layers = decoder_layers(model)
    return bool(layers) and isinstance(layers[-1], FusedDecoderLayer) \
        and isinstance(layers[-1].self_attn, FusedAttention) and not getattr(model, _EVERY_ROW, False)


def set_last_row_only(model: Any, on: bool = True) -> None:
    """Whether :func:`last_row_only` applies to ``model`` (on by default; off, its last layer
    computes every row as the family's forward does, for bit-for-bit comparisons and to time
    what the switch saves)."""
    setattr(model, _EVERY_ROW, not on)


def layers_fused(model: Any) -> bool:
    """Whether :func:`fuse_layers` gave ``model``'s decoder layers the fused forward."""
    layers = decoder_layers(model)
    return bool(layers) and isinstance(layers[0], FusedDecoderLayer)
