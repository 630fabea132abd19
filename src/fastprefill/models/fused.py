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
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fastprefill.kernels import rotary_kernel
from fastprefill.models.adapters import decoder_layers, supports_layer_loop
from fastprefill.models.packed import MergedProduct, PackedLinear, few_row_kernel

__all__ = ["EAGER_ROWS", "FusedAttention", "FusedDecoderLayer", "attention_fused", "fuse_attention", "fuse_layers",
           "layers_fused"]

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
        b, t, _ = hidden_states.shape
        d = self.head_dim
        h_q, h_kv = self.config.num_attention_heads, self.config.num_key_value_heads
        q, k, v = self._projections(hidden_states)  # (B, T, H_q * d), (B, T, H_kv * d) twice
        cos, sin = position_embeddings
        rotate = rotary_kernel(q.dtype) if (
            q.device.type == "cpu" and cos.dtype == sin.dtype == q.dtype and cos.dim() == sin.dim() == 3
            and cos.stride(-1) == sin.stride(-1) == 1
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))) else None
        if rotate is not None:
            query, key = rotate(q, cos, sin, h_q), rotate(k, cos, sin, h_kv)  # (B, H, T, d)
        else:
            query, key = self._family.apply_rotary_pos_emb(q.view(b, t, h_q, d).transpose(1, 2),
                                                     k.view(b, t, h_kv, d).transpose(1, 2), cos, sin)
        value = v.view(b, t, h_kv, d).transpose(1, 2)  # (B, H_kv, T, d)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          self._family.eager_attention_forward)
        if hasattr(self, "sliding_window"):
            kwargs["sliding_window"] = self.sliding_window
        out, weights = interface(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(b, t, -1).contiguous()), weights

    def _projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``q, k, v`` projections of ``x`` ``(B, T, D)``: one merged product where they are packed."""
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


def layers_fused(model: Any) -> bool:
    """Whether :func:`fuse_layers` gave ``model``'s decoder layers the fused forward."""
    layers = decoder_layers(model)
    return bool(layers) and isinstance(layers[0], FusedDecoderLayer)
