"""Model-family adapters: the only module that knows a decoder family's internals.

The methods (LazyLLM, KV-Runahead, KV Prediction) run the model layer by layer with their own
positions, masks and caches. They do that through :class:`DecoderAdapter`, which calls the
model's *own* decoder layers (``model.model.layers[i]``), its own rotary embedding and its own
final norm and head. Nothing is monkey-patched: the extension point used is transformers'
``AttentionInterface``, where fastprefill's attention function (:mod:`fastprefill.models.attention`)
is selected on a model only inside :meth:`DecoderAdapter.attention_scope`, which restores the
previous choice in ``finally``. On the CPU the loader also gives each attention module and
decoder layer fastprefill's forward (:mod:`fastprefill.models.fused`: the module's own class with
that one method, as :class:`~fastprefill.models.packed.PackedLinear` does for ``nn.Linear``).

Tensor shapes used throughout (batch ``B`` is always 1 in fastprefill's engine):

- hidden states ``(B, T, D)``; positions ``(B, T)`` int64 (original prompt positions)
- keys / values ``(B, H_kv, N, d)``; queries ``(B, H_q, T, d)``
- boolean attention masks ``(B, 1, T, N)``, ``True`` where a query may attend a key

Scores computed beside the fused attention (for pruning) are requested per call with a sink dict
and a :data:`~fastprefill.models.attention.ScoreFn`; what a score *is* lives with the pruning policies
(:mod:`fastprefill.methods.pruning.scorers`), not here.

Supported families for the layer-loop methods: ``llama`` (SmolLM2) and ``qwen2``
(Qwen2.5-Coder). Others (for example Gemma3 with its sliding-window layers) are refused with
:class:`~fastprefill.errors.UnsupportedModelError`; plain full prefill works on any causal LM.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import PreTrainedModel

from fastprefill.errors import UnsupportedModelError
from fastprefill.models.attention import SCORE_SINK_KWARG, SCORER_KWARG, ScoreFn, fastprefill_attention
from fastprefill.models.packed import PackedLinear, PackedSwiGLU
from fastprefill.models.shape import ModelShape

#: Families whose decoder layers have the Llama calling convention
#: ``layer(hidden, attention_mask, position_ids, past_key_values, position_embeddings)``.
LAYER_LOOP_FAMILIES: frozenset[str] = frozenset({"llama", "qwen2"})


#: Rotary types whose frequencies do not depend on the sequence length, so that a key rotated at
#: position ``p`` and then by ``d`` is the key rotated at ``p + d`` (:meth:`DecoderAdapter.shift_keys`).
#: ``dynamic`` NTK scaling changes the frequencies with the length; ``yarn`` and ``longrope``
#: scale cos/sin by a factor, which one more rotation would apply twice.
SHIFTABLE_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3"})


def rope_type(config: Any) -> str:
    """The config's rotary type (``"default"`` when it names none)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def supports_key_shift(config: Any) -> bool:
    """True when a layer-loop family's cached keys can be moved to other positions exactly
    (:meth:`DecoderAdapter.shift_keys`): its rotary type is one of :data:`SHIFTABLE_ROPE_TYPES`."""
    return supports_layer_loop(config) and rope_type(config) in SHIFTABLE_ROPE_TYPES


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The Llama/Qwen2 rotary helper: ``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def supports_layer_loop(config: Any) -> bool:
    """True when :class:`DecoderAdapter` can run this config's family layer by layer.

    A static query on the config: nothing is built. Methods answer their own ``supports(config)``
    with it.
    """
    return getattr(config, "model_type", None) in LAYER_LOOP_FAMILIES and not getattr(
        config, "is_encoder_decoder", False
    )


def require_layer_loop(model: Any, method: str = "this method") -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` is a causal LM of a layer-loop family.

    Args:
        model: the model a method is about to run on.
        method: the method's name, used in the message.
    """
    check_causal_lm(model)
    if not supports_layer_loop(model.config):
        model_type = getattr(model.config, "model_type", "?")
        raise UnsupportedModelError(
            f"{method} supports the model families {sorted(LAYER_LOOP_FAMILIES)}, not {model_type!r}. "
            "Use method=None (full prefill) for this model."
        )


def is_causal_lm(model: Any) -> bool:
    """True when ``model`` is a decoder-only transformers model that can generate."""
    if not isinstance(model, PreTrainedModel):
        return False
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return False
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


def check_causal_lm(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` is a decoder-only causal LM."""
    if not is_causal_lm(model):
        name = type(model).__name__
        raise UnsupportedModelError(
            f"{name} is not a decoder-only causal language model; fastprefill needs a model loaded "
            "with AutoModelForCausalLM (encoder-decoder and encoder-only models have no prefill to speed up)."
        )


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's decoder layers in order (``model.model.layers``: every family transformers
    builds as ``XForCausalLM`` over ``XModel``), or ``[]`` when it keeps them elsewhere."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def swiglu_mlps(model: Any) -> list[torch.nn.Module]:
    """The decoder layers whose ``mlp`` is a SwiGLU, ``down_proj(silu(gate_proj(x)) * up_proj(x))``:
    every layer of a :data:`LAYER_LOOP_FAMILIES` model whose ``hidden_act`` is ``silu`` and whose
    MLP has those three projections (``[]`` otherwise)."""
    config = getattr(model, "config", None)
    if config is None or not supports_layer_loop(config) or getattr(config, "hidden_act", None) != "silu":
        return []
    return [layer for layer in decoder_layers(model)
            if all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))]


def fuse_mlps(model: Any) -> int:
    """Replace each SwiGLU MLP (:func:`swiglu_mlps`) whose three layers are packed by a
    :class:`~fastprefill.models.packed.PackedSwiGLU` over the same layers (the activation and
    the product inside oneDNN's matrix products). Returns how many were replaced."""
    count = 0
    for layer in swiglu_mlps(model):
        mlp = layer.mlp
        if not isinstance(mlp, PackedSwiGLU) and all(
                isinstance(m, PackedLinear) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            layer.mlp = PackedSwiGLU(mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
            count += 1
    return count


def compile_blocks(model: PreTrainedModel) -> int:
    """Compile the parts of every decoder layer that are not attention (its MLP, unless
    :func:`fuse_mlps` made it one fused call, and its two RMSNorms) and
    the final norm with ``torch.compile`` (inductor, dynamic sequence length).

    Inductor fuses what eager runs as separate element-wise passes over ``(T, D)`` and ``(T, I)``
    tensors (the norms' float32 statistics, SwiGLU's ``silu(gate) * up``); the matrix products
    stay oneDNN's. Each module's own ``compile()`` is used (nothing is patched), and both the
    model's forward and :class:`DecoderAdapter` call the same modules, so full prefill and every
    layer-loop method run the same compiled code. The graphs compile on the first call (one for
    prompts, one for single-token decode steps; every layer shares them) and inductor keeps them
    in its on-disk cache, so a later process reuses them.

    Returns:
        The number of modules compiled (0 for a family outside :data:`LAYER_LOOP_FAMILIES`).
    """
    if not supports_layer_loop(model.config):
        return 0
    inner = model.model
    modules: list[torch.nn.Module] = [inner.norm]
    for layer in inner.layers:
        fused = isinstance(layer.mlp, PackedSwiGLU)  # its element-wise work is inside oneDNN's products
        modules += [layer.input_layernorm, layer.post_attention_layernorm] + ([] if fused else [layer.mlp])
    for module in modules:
        module.compile(dynamic=True)
    return len(modules)


def blocks_compiled(model: Any) -> bool:
    """Whether :func:`compile_blocks` compiled this model's decoder blocks."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return bool(layers) and getattr(layers[0].input_layernorm, "_compiled_call_impl", None) is not None


class DecoderAdapter:
    """Runs a Llama-convention decoder one layer at a time with caller-chosen positions.

    Args:
        model: a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (``config.model_type`` in
            :data:`LAYER_LOOP_FAMILIES`).
        method: the method's name, used in the error message for unsupported families.

    Raises:
        UnsupportedModelError: for other families (Gemma3's sliding-window layers, for one).
    """

    def __init__(self, model: PreTrainedModel, method: str = "this method") -> None:
        require_layer_loop(model, method)
        self.model = model
        self.inner = model.model
        self.layers = self.inner.layers
        self.config = model.config
        self.shape = ModelShape.from_config(model.config)

    # --- properties --------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def device(self) -> torch.device:
        return self.inner.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.embed_tokens.weight.dtype

    # --- building blocks ---------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``(B, T)`` int64 -> ``(B, T, D)``."""
        return self.inner.embed_tokens(input_ids)

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary ``(cos, sin)`` for the given original positions ``(B, T)``; each ``(B, T, d)``."""
        return self.inner.rotary_emb(hidden, position_ids=positions)

    def layer(
        self,
        idx: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        scores: dict[int, torch.Tensor] | None = None,
        scorer: ScoreFn | None = None,
    ) -> torch.Tensor:
        """Run decoder layer ``idx`` on the rows ``hidden`` (``(B, T, D)``) at ``positions``.

        Args:
            cache: a :class:`~fastprefill.cache.LayerCache` (``update(k, v, layer_idx) -> (K, V)``),
                such as :class:`fastprefill.cache.PositionKVCache` or a transformers ``DynamicCache``.
                ``K, V`` are ``(B, H_kv, N, d)`` and include the rows just written.
            mask: boolean ``(B, 1, T, N)`` (True = attend) over the ``N`` keys the cache returns;
                ``None`` means plain causal attention, exact for ``T = 1`` or an empty cache (with
                ``T > 1`` rows over a cache that already holds rows SDPA's causal flag aligns the
                queries to the first keys: pass a mask then).
            rotary: precomputed :meth:`rotary` output for ``positions`` (shared across layers).
            scores: if given, receives ``scores[idx] = (B, N)``, one score per key from ``scorer``.
            scorer: what the scores are (a :data:`ScoreFn`; required with ``scores``).

        Returns:
            ``(B, T, D)`` hidden states after the layer (``(B, 1, D)`` for the model's last layer
            inside :func:`fastprefill.models.fused.last_row_only` over ``cache``). Must be called
            inside :meth:`attention_scope`.
        """
        if rotary is None:
            rotary = self.rotary(hidden, positions)
        if scores is not None and scorer is None:
            raise ValueError("DecoderAdapter.layer: scores need a scorer")
        extra = {SCORE_SINK_KWARG: scores, SCORER_KWARG: scorer} if scores is not None else {}
        return self.layers[idx](
            hidden,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            position_embeddings=rotary,
            **extra,
        )

    def shift_keys(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Move cached keys ``delta`` positions: ``(B, H_kv, N, d)`` keys rotated at positions
        ``p`` -> the same keys rotated at ``p + delta``.

        Rotary embedding is a rotation by ``position * inv_freq`` in each frequency pair, so
        rotating once more by ``delta * inv_freq`` (the model's own ``inv_freq``, without its
        cos/sin scaling factor, which the first rotation applied) gives the key at the new position.
        The angles, cos and sin are computed in float64 and the rotation in float32, rounded once
        to the keys' dtype. Exact only for :data:`SHIFTABLE_ROPE_TYPES` (check with
        :func:`supports_key_shift`).
        """
        if delta == 0:
            return keys
        inv_freq = self.inner.rotary_emb.inv_freq.to(device=keys.device, dtype=torch.float64)  # (d/2,)
        angles = torch.cat((inv_freq, inv_freq)) * float(delta)  # (d,)
        cos, sin = angles.cos().float(), angles.sin().float()
        k = keys.float()
        return (k * cos + rotate_half(k) * sin).to(keys.dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``(B, T, D)`` -> float32 logits ``(B, T, V)``."""
        return self.model.lm_head(self.inner.norm(hidden)).float()

    # --- a layer's attention input and K/V projections (KV Prediction) -----------------------
    def unit_rms(self, idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer ``idx``'s input RMSNorm *without* its gain: ``(B, T, D)`` -> ``(B, T, D)``.

        Computed as the llama / qwen2 ``RMSNorm`` computes it (float32 statistics, then back to
        the input dtype), so ``input_norm_gain(idx) * unit_rms(idx, h)`` is bit for bit the
        layer's own ``input_layernorm(h)``.
        """
        norm = self.layers[idx].input_layernorm
        x = hidden.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return x.to(hidden.dtype)

    def input_norm_gain(self, idx: int) -> torch.Tensor:
        """``(D,)``: the gain (weight) of layer ``idx``'s input RMSNorm (the model's own tensor)."""
        return self.layers[idx].input_layernorm.weight

    def attention_input(self, idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """What layer ``idx``'s q/k/v projections read: its input norm of ``hidden`` ``(B, T, D)``."""
        return self.layers[idx].input_layernorm(hidden)

    def kv_projections(self, idx: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
        """Layer ``idx``'s ``(k_proj, v_proj)``: ``nn.Linear(D, H_kv * d)`` each (bias on qwen2, none on llama)."""
        attn = self.layers[idx].self_attn
        return attn.k_proj, attn.v_proj

    def project_kv(self, idx: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``idx``'s own keys (before rotation) and values for the rows of ``hidden``.

        ``k_proj(input_layernorm(h))`` and ``v_proj(input_layernorm(h))`` as the attention
        computes them, reshaped to heads: ``(B, T, D)`` -> two ``(B, H_kv, T, d)``.
        """
        x = self.attention_input(idx, hidden)
        k_proj, v_proj = self.kv_projections(idx)
        return self.split_heads(k_proj(x)), self.split_heads(v_proj(x))

    def split_heads(self, merged: torch.Tensor) -> torch.Tensor:
        """``(B, T, H_kv * d)`` -> ``(B, H_kv, T, d)``."""
        b, t, _ = merged.shape
        return merged.view(b, t, self.shape.num_kv_heads, self.shape.head_dim).transpose(1, 2)

    def attention_scope(self) -> contextlib.AbstractContextManager[None]:
        """Select the fastprefill attention function on this model, restoring the old one after."""
        return fastprefill_attention(self.model)
