"""Model-family adapters: the only module that knows a decoder family's internals.

The methods (LazyLLM, KV-Runahead, KV Prediction) run the model layer by layer with their own
positions, masks and caches. They do that through :class:`DecoderAdapter`, which calls the
model's *own* decoder layers (``model.model.layers[i]``), its own rotary embedding and its own
final norm and head. Nothing is monkey-patched: the only extension point used is transformers'
``AttentionInterface``, where a named attention function (``"fastprefill_sdpa"``) is registered
once, lazily, and selected on a model only inside :meth:`DecoderAdapter.attention_scope`, which
restores the previous choice in ``finally``.

Tensor shapes used throughout (batch ``B`` is always 1 in fastprefill's engine):

- hidden states ``(B, T, D)``; positions ``(B, T)`` int64 (original prompt positions)
- keys / values ``(B, H_kv, N, d)``; queries ``(B, H_q, T, d)``
- boolean attention masks ``(B, 1, T, N)``, ``True`` where a query may attend a key

Supported families for the layer-loop methods: ``llama`` (SmolLM2) and ``qwen2``
(Qwen2.5-Coder). Others (for example Gemma3 with its sliding-window layers) are refused with
:class:`~fastprefill.errors.UnsupportedModelError`; plain full prefill works on any causal LM.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fastprefill.errors import UnsupportedModelError

#: Families whose decoder layers have the Llama calling convention
#: ``layer(hidden, attention_mask, position_ids, past_key_values, position_embeddings)``.
LAYER_LOOP_FAMILIES: frozenset[str] = frozenset({"llama", "qwen2"})

ATTENTION_NAME = "fastprefill_sdpa"
#: Keyword argument, passed through the decoder layer to the attention function, that receives
#: the last query's attention probabilities: a dict ``{layer_idx: (B, N) float32}``.
SCORE_SINK_KWARG = "fastprefill_scores"


def _fastprefill_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA attention that can also report the last query's attention row.

    The fused kernel computes the output. When the caller passes ``fastprefill_scores=dict`` the
    last query row of the attention probabilities is computed beside it: one row, not the full
    matrix. It is averaged over *all query heads* (GQA groups included) and stored as
    ``sink[layer_idx] = probs`` with shape ``(B, N)`` over the ``N`` keys of this layer.

    Args:
        query: ``(B, H_q, T, d)`` rotated queries.
        key, value: ``(B, H_kv, N, d)`` keys and values after the cache update.
        attention_mask: ``None`` (plain causal) or a boolean ``(B, 1, T, N)`` mask.
    """
    sink = kwargs.pop(SCORE_SINK_KWARG, None)
    if dropout == 0.0 and "position_bias" not in kwargs and _packable_single_query(query, key, attention_mask):
        out = _single_query_masked_sdpa(query, key, value, attention_mask, scaling)
    else:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sink is not None:
        sink[module.layer_idx] = last_query_attention(query, key, attention_mask, scaling)
    return out, None


def _packable_single_query(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """One query row, grouped-query heads and a boolean mask shared by all heads."""
    return (
        attention_mask is not None and attention_mask.dtype == torch.bool and query.shape[2] == 1
        and query.shape[1] != key.shape[1] and attention_mask.shape[1] == 1
    )


def _single_query_masked_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Masked attention of a single query under GQA without copying K and V per query head.

    transformers repeats K and V to every query head (``repeat_kv``) whenever a mask is given on
    CPU, a copy of the layer's whole cache at every LazyLLM decode step. With one query row the ``G``
    query heads of a KV group can instead be laid out as ``G`` query rows of that group, which all
    share the same ``(B, 1, 1, N)`` mask (the trick transformers uses for the unmasked case).

    Args:
        query: ``(B, H_q, 1, d)``; key, value: ``(B, H_kv, N, d)``; attention_mask: bool ``(B, 1, 1, N)``.

    Returns:
        ``(B, 1, H_q, d)``, the layout transformers' attention functions return.
    """
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    packed = query.reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, G, d): head h = g_kv * G + j
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )  # (B, H_kv, G, d_v)
    return out.reshape(b, h_q, 1, -1).transpose(1, 2).contiguous()


def last_query_attention(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """Attention probabilities of the last query over all keys, averaged over every query head.

    Args:
        query: ``(B, H_q, T, d)``; only ``query[:, :, -1]`` is used.
        key: ``(B, H_kv, N, d)`` with ``H_q % H_kv == 0`` (grouped-query attention).
        attention_mask: ``None`` (the last query sees every key) or boolean ``(B, 1, T, N)``.
        scaling: the softmax scale (``d ** -0.5`` when ``None``).

    Returns:
        ``(B, N)`` float32 probabilities, each row summing to 1.
    """
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    scale = scaling if scaling is not None else d**-0.5
    q_last = query[:, :, -1, :].reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, G, d)
    logits = torch.einsum("bhgd,bhnd->bhgn", q_last.float(), key.float()) * scale  # (B, H_kv, G, N)
    if attention_mask is not None:
        allowed = attention_mask[:, :, -1, :].unsqueeze(2)  # (B, 1, 1, N)
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.mean(dim=(1, 2))  # (B, N)


_registered = False


def _ensure_registered() -> None:
    """Register the attention function once, on first use (never at import time)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, _fastprefill_sdpa)
        _registered = True


@dataclass(frozen=True)
class ModelShape:
    """The dimensions a cost model or a KV map needs.

    Attributes:
        num_layers: decoder layers ``L``.
        hidden_size: ``D``.
        num_heads: query heads ``H_q``.
        num_kv_heads: key/value heads ``H_kv``.
        head_dim: ``d``.
        intermediate_size: MLP width.
        vocab_size: ``V``.
        max_positions: the context length the model was trained for.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
            vocab_size=cfg.vocab_size,
            max_positions=getattr(cfg, "max_position_embeddings", 1 << 30),
        )

    def linear_flops_per_token(self) -> float:
        """Multiply-add FLOPs (2 per MAC) of one token through one layer's linear maps.

        q/k/v/o projections plus a gated MLP (gate, up, down).
        """
        d_q = self.num_heads * self.head_dim
        d_kv = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (d_q + 2 * d_kv) + d_q * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return 2.0 * (attn + mlp)

    def attention_flops(self, n_queries: int, n_key_pairs: int) -> float:
        """FLOPs of QK^T and AV for ``n_key_pairs`` (query, key) dot products in one layer."""
        del n_queries
        return 4.0 * self.num_heads * self.head_dim * n_key_pairs

    def head_flops(self, n_tokens: int = 1) -> float:
        """FLOPs of the LM head for ``n_tokens`` rows."""
        return 2.0 * self.hidden_size * self.vocab_size * n_tokens

    def causal_prefill_flops(self, n_tokens: int) -> float:
        """Estimated FLOPs of a full causal prefill of ``n_tokens`` plus one LM-head row."""
        pairs = n_tokens * (n_tokens + 1) // 2
        per_layer = self.linear_flops_per_token() * n_tokens + self.attention_flops(n_tokens, pairs)
        return self.num_layers * per_layer + self.head_flops(1)


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
        check_causal_lm(model)
        model_type = getattr(model.config, "model_type", "?")
        if model_type not in LAYER_LOOP_FAMILIES:
            raise UnsupportedModelError(
                f"{method} supports the model families {sorted(LAYER_LOOP_FAMILIES)}, not {model_type!r}. "
                "Use method=None (full prefill) for this model."
            )
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
    ) -> torch.Tensor:
        """Run decoder layer ``idx`` on the rows ``hidden`` (``(B, T, D)``) at ``positions``.

        Args:
            cache: an object with ``update(k, v, layer_idx) -> (K, V)``, such as
                :class:`fastprefill.cache.PositionKVCache` or a transformers ``DynamicCache``.
                ``K, V`` are ``(B, H_kv, N, d)`` and include the rows just written.
            mask: boolean ``(B, 1, T, N)`` (True = attend) over the ``N`` keys the cache returns;
                ``None`` means plain causal attention with queries aligned to the last ``T`` keys.
            rotary: precomputed :meth:`rotary` output for ``positions`` (shared across layers).
            scores: if given, receives ``scores[idx] = (B, N)`` last-query attention probabilities.

        Returns:
            ``(B, T, D)`` hidden states after the layer. Must be called inside
            :meth:`attention_scope`.
        """
        if rotary is None:
            rotary = self.rotary(hidden, positions)
        extra = {SCORE_SINK_KWARG: scores} if scores is not None else {}
        return self.layers[idx](
            hidden,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            position_embeddings=rotary,
            **extra,
        )

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``(B, T, D)`` -> float32 logits ``(B, T, V)``."""
        return self.model.lm_head(self.inner.norm(hidden)).float()

    @contextlib.contextmanager
    def attention_scope(self) -> Iterator[None]:
        """Select the fastprefill attention function on this model, restoring the old one after."""
        _ensure_registered()
        configs = {id(m.config): m.config for m in self.model.modules() if hasattr(m, "config")}
        previous = {key: cfg._attn_implementation for key, cfg in configs.items()}
        try:
            for cfg in configs.values():
                cfg._attn_implementation = ATTENTION_NAME
            yield
        finally:
            for key, cfg in configs.items():
                cfg._attn_implementation = previous[key]


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Boolean causal mask by *original* positions.

    Args:
        query_positions: ``(T,)`` int64 positions of the query rows.
        key_positions: ``(N,)`` int64 positions of the keys.

    Returns:
        ``(1, 1, T, N)`` bool, True where ``key_position <= query_position``.
    """
    return (key_positions[None, :] <= query_positions[:, None])[None, None]


# =============================================================================================
# KV Prediction helpers: pre-rotation keys, filling a cache, dropping layers.
# (Model-family knowledge for fastprefill.methods.kv_prediction; llama / qwen2 convention.)
# =============================================================================================


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The Llama/Qwen2 rotary helper: ``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings to pre-rotation keys, as the llama/qwen2 attention does.

    Args:
        keys: ``(B, H_kv, N, d)`` keys before rotation.
        cos, sin: ``(B, N, d)`` from :meth:`DecoderAdapter.rotary` at the keys' positions.

    Returns:
        ``(B, H_kv, N, d)`` rotated keys, equal to what the model stores in its cache.
    """
    cos, sin = cos.unsqueeze(1).to(keys.dtype), sin.unsqueeze(1).to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin


def unrotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo :func:`rotate_keys`: rotation by ``-position`` (RoPE is orthogonal, so this is exact
    up to float rounding). Shapes as in :func:`rotate_keys`."""
    cos, sin = cos.unsqueeze(1).to(keys.dtype), sin.unsqueeze(1).to(keys.dtype)
    return keys * cos - rotate_half(keys) * sin


def prefix_kv(
    model: PreTrainedModel, input_ids: torch.Tensor, with_logits: bool = False
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Run the model's own forward over ``input_ids`` and return every layer's *pre-rotation* KV.

    The model runs its fused forward with a transformers ``DynamicCache``; the cached (rotated)
    keys are then un-rotated at positions ``0..N-1`` with :func:`unrotate_keys`. Gradients flow
    when called outside ``no_grad`` (used when the aux model is trained).

    Args:
        model: a llama / qwen2 causal LM.
        input_ids: ``(1, N)`` int64, ``N >= 1``.
        with_logits: also return the ``(1, N, V)`` float32 logits (else only the final hidden
            states are computed, no LM head).

    Returns:
        ``([(K_l, V_l) for each layer], logits or None)`` with ``K_l, V_l`` ``(1, H_kv, N, d)``.
    """
    DecoderAdapter(model, method="KV Prediction")
    cache = DynamicCache(config=model.config)
    out = model.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    cos, sin = model.model.rotary_emb(out.last_hidden_state, position_ids=positions)
    kv = [(unrotate_keys(layer.keys, cos, sin), layer.values) for layer in cache.layers]
    logits = model.lm_head(out.last_hidden_state).float() if with_logits else None
    return kv, logits


def cache_from_kv(
    model: PreTrainedModel, kv: list[tuple[torch.Tensor, torch.Tensor]], pre_rotation: bool = True
) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` holding the given per-layer KV at positions ``0..N-1``.

    Args:
        kv: one ``(K, V)`` per decoder layer, each ``(1, H_kv, N, d)`` in the model's dtype.
        pre_rotation: the keys are before rotation; they are rotated with the model's own rotary
            embedding at positions ``0..N-1`` (as the model would have cached them).
    """
    shape = ModelShape.from_config(model.config)
    if len(kv) != shape.num_layers:
        raise ValueError(f"cache_from_kv: {len(kv)} layers of KV for a {shape.num_layers}-layer model")
    cache = DynamicCache(config=model.config)
    n = kv[0][0].shape[-2]
    if pre_rotation:
        positions = torch.arange(n, device=kv[0][0].device)[None]
        cos, sin = model.model.rotary_emb(kv[0][1], position_ids=positions)
    for idx, (k, v) in enumerate(kv):
        cache.update(rotate_keys(k, cos, sin) if pre_rotation else k, v, idx)
    return cache


def _shallow_module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing every parameter/buffer/child with ``module``.

    Its registries (children, parameters, buffers, hooks) are fresh dicts, so replacing a child
    of the copy never touches the original.
    """
    clone = copy.copy(module)
    for key, value in list(vars(module).items()):
        if isinstance(value, dict):
            clone.__dict__[key] = type(value)(value)
    return clone


def drop_layers(model: PreTrainedModel, keep: Sequence[int]) -> PreTrainedModel:
    """The model with only the decoder layers ``keep``, sharing the original weight tensors.

    Used by KVP-LP (an aux model made of the base's own layers). Nothing is copied: embeddings,
    layers, norm and head are the same tensors; only module *objects* are new, so the original
    model is untouched. The copy gets its own config (``num_hidden_layers = len(keep)``,
    ``layer_types`` subset) and the kept attention modules are renumbered ``layer_idx = 0..``
    so they index a cache of ``len(keep)`` layers.

    Args:
        model: a llama / qwen2 causal LM.
        keep: strictly increasing layer indices in ``[0, num_layers)``, at least one.

    Raises:
        UnsupportedModelError: for other families.
        ValueError: for a bad ``keep``.
    """
    DecoderAdapter(model, method="layer dropping")
    num = model.config.num_hidden_layers
    keep = [int(i) for i in keep]
    if not keep or any(b <= a for a, b in itertools.pairwise(keep)) or keep[0] < 0 or keep[-1] >= num:
        raise ValueError(f"keep must be strictly increasing layer indices in [0, {num}), got {keep}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [model.config.layer_types[i] for i in keep]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, len(keep))
    new = _shallow_module_copy(model)
    new.config = config
    inner = _shallow_module_copy(model.model)
    inner.config = config
    layers = []
    for new_idx, old_idx in enumerate(keep):
        layer = _shallow_module_copy(model.model.layers[old_idx])
        attn = _shallow_module_copy(layer.self_attn)
        attn.config = config
        attn.layer_idx = new_idx
        layer.self_attn = attn
        layers.append(layer)
    inner.layers = torch.nn.ModuleList(layers)
    new.model = inner
    return new
