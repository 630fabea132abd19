"""fastprefill's attention function, registered with transformers' ``AttentionInterface``, and
masks by original position.

:func:`fastprefill_attention` selects the function (``"fastprefill_sdpa"``, registered once,
lazily, never at import) on a model for the duration of a block and restores the previous
choice in ``finally``; :meth:`~fastprefill.models.adapters.DecoderAdapter.attention_scope` and
full prefill over a cached prefix use it. Inside, the fused SDPA kernel computes the output:

- with a boolean mask shared by the heads of a grouped-query layer, without copying K and V per
  query head (:func:`_gqa_masked_sdpa`);
- for a prompt's suffix over a cached prefix (no mask, fewer queries than keys), causal by
  original position at the cost of a causal prefill (:func:`_suffix_causal_sdpa`);
- otherwise as transformers' own SDPA attention.

Where no mask is given (a whole causal prefill, a suffix over cached keys, a decode step) or a
boolean mask shared by the heads (LazyLLM's rows over a prefix or beside filled rows, a decode
step over a pruned cache, a padded batch), and the model's attention backend (:func:`set_attention_backend`, chosen once per model: ``"auto"``
by default) resolves to fastprefill's C++ kernel (:mod:`fastprefill.kernels`: grouped-query
heads stacked over each key block, oneDNN's micro-GEMMs, online softmax), the kernel computes
the output instead; where it cannot run (not built, a CPU without the instructions, another
device or dtype), SDPA does, and :func:`attention_backend` says why.

Beside it, a caller may ask for one score per key from the last query rows (:data:`ScoreFn`,
through the keyword arguments :data:`SCORE_SINK_KWARG` and :data:`SCORER_KWARG`).

Shapes: queries ``(B, H_q, T, d)``; keys / values ``(B, H_kv, N, d)``; boolean masks
``(B, 1, T, N)``, ``True`` where a query may attend a key.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fastprefill.errors import ConfigError
from fastprefill.kernels import attention_kernel, kernel_status

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_NAME",
    "MASK_MEMO_KWARG",
    "PACKED_GQA_MAX_QUERIES",
    "SCORER_KWARG",
    "SCORE_SINK_KWARG",
    "ScoreFn",
    "attention_as",
    "attention_backend",
    "attention_choices",
    "causal_mask",
    "fastprefill_attention",
    "set_attention_backend",
]

ATTENTION_NAME = "fastprefill_sdpa"
#: Masked grouped-query attention with at most this many query rows packs a KV group's query heads
#: into one head's rows (:func:`_gqa_masked_sdpa`); more rows use SDPA's ``enable_gqa`` on CPU.
PACKED_GQA_MAX_QUERIES = 32
#: Keyword argument, passed through the decoder layer to the attention function, that receives
#: the last query's scores: a dict ``{layer_idx: (B, N) float32}``.
SCORE_SINK_KWARG = "fastprefill_scores"
#: Keyword argument naming the :data:`ScoreFn` that fills the sink.
SCORER_KWARG = "fastprefill_scorer"
#: Keyword argument, passed through the model's forward, of a dict in which the layers of one
#: forward share the masks :func:`_suffix_causal_sdpa` builds (each built once, not once per layer).
MASK_MEMO_KWARG = "fastprefill_masks"

#: ``scorer(query, key, attention_mask, scaling) -> (B, N)``: one score per key, computed beside the
#: fused attention from the rotated queries ``(B, H_q, T, d)``, keys ``(B, H_kv, N, d)`` and the
#: boolean mask ``(B, 1, T, N)`` (or ``None``: causal). The scorers themselves (what a score is)
#: are policies: :mod:`fastprefill.methods.pruning.scorers`.
ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, float | None], torch.Tensor]

#: Where unmasked causal attention runs: ``"auto"`` (the C++ kernel where it runs, else SDPA),
#: ``"kernel"`` (required: :func:`set_attention_backend` refuses it where it cannot run), ``"sdpa"``.
ATTENTION_BACKENDS = ("auto", "kernel", "sdpa")
#: The config attribute that holds a model's choice (every config of the model carries it).
_BACKEND_ATTR = "fastprefill_attention_backend"


def attention_backend(model: torch.nn.Module) -> tuple[str, str]:
    """``(backend, why)``: what unmasked causal attention of ``model`` runs on, ``"kernel"`` or
    ``"sdpa"``, and, for SDPA, why not the kernel (``""`` when chosen as ``"sdpa"``)."""
    choice = getattr(getattr(model, "config", None), _BACKEND_ATTR, "auto")
    if choice == "sdpa":
        return "sdpa", ""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return "sdpa", "the kernel runs on the CPU only"
    status = kernel_status(param.dtype)
    return ("kernel", "") if status.available else ("sdpa", status.reason)


def set_attention_backend(model: torch.nn.Module, backend: str = "auto") -> str:
    """Choose, once for ``model``, where its unmasked causal attention runs (one of
    :data:`ATTENTION_BACKENDS`); returns what it resolves to (``"kernel"`` or ``"sdpa"``).

    Raises:
        ConfigError: an unknown ``backend``, or ``"kernel"`` where the kernel cannot run (the
            reason named).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention backend {backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    for cfg in _configs(model).values():
        setattr(cfg, _BACKEND_ATTR, backend)
    resolved, why = attention_backend(model)
    if backend == "kernel" and resolved != "kernel":
        for cfg in _configs(model).values():
            setattr(cfg, _BACKEND_ATTR, "auto")
        raise ConfigError(f"attention backend 'kernel' cannot run here: {why}; use 'auto' or 'sdpa'")
    return resolved


def _kernel_for(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The C++ kernel for this call, or ``None``: the module's model chose ``"sdpa"``, the kernel
    does not run on the query's device and dtype, or a gradient must flow through the call (the
    kernel has no backward; KV Prediction's training differentiates through attention)."""
    if query.device.type != "cpu" or getattr(getattr(module, "config", None), _BACKEND_ATTR, "auto") == "sdpa":
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    return attention_kernel(query.dtype)


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
    """SDPA attention that can also report the last query's scores over the keys.

    The fused kernel computes the output. When the caller passes ``fastprefill_scores=dict`` and
    ``fastprefill_scorer=fn`` (a :data:`ScoreFn`), ``fn`` computes one score per key beside it
    (from the last query rows, not the full matrix), stored as ``sink[layer_idx]`` with shape
    ``(B, N)`` over the ``N`` keys of this layer.

    Args:
        query: ``(B, H_q, T, d)`` rotated queries.
        key, value: ``(B, H_kv, N, d)`` keys and values after the cache update.
        attention_mask: ``None`` (plain causal) or a boolean ``(B, 1, T, N)`` mask.
    """
    sink = kwargs.pop(SCORE_SINK_KWARG, None)
    scorer: ScoreFn | None = kwargs.pop(SCORER_KWARG, None)
    memo: dict[tuple[int, int], torch.Tensor] | None = kwargs.pop(MASK_MEMO_KWARG, None)
    plain = dropout == 0.0 and "position_bias" not in kwargs and all(
        kwargs.get(name) is None for name in ("sliding_window", "softcap", "s_aux"))
    kernel = _kernel_for(module, query, key, value) if plain and _kernel_takes(query, key, attention_mask) else None
    if kernel is not None:  # a whole causal prefill, a suffix over cached keys, a decode step, or masked rows
        d = query.shape[-1]
        out = kernel(query, key, value, float(scaling) if scaling is not None else d ** -0.5,
                     mask=attention_mask)  # (B, T, H_q, d)
    elif dropout == 0.0 and "position_bias" not in kwargs and _gqa_with_shared_mask(query, key, attention_mask):
        out = _gqa_masked_sdpa(query, key, value, attention_mask, scaling)
    elif attention_mask is None and 1 < query.shape[2] < key.shape[2] and dropout == 0.0 and "position_bias" not in kwargs:
        out = _suffix_causal_sdpa(query, key, value, scaling, memo)
    else:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sink is not None:
        if scorer is None:
            raise ValueError(f"{SCORE_SINK_KWARG} needs a {SCORER_KWARG} (what a score is)")
        sink[module.layer_idx] = scorer(query, key, attention_mask, scaling)
    return out, None


def _kernel_takes(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether the C++ kernel computes this call: no mask and no more queries than keys (causal
    for the last ``T`` of ``N`` positions), or a boolean ``(B, 1, T, N)`` mask shared by the
    heads (``B`` and ``T`` may be 1, broadcast)."""
    if attention_mask is None:
        return query.shape[2] <= key.shape[2]
    m = attention_mask
    return (m.dtype == torch.bool and m.dim() == 4 and m.shape[1] == 1 and m.shape[0] in (1, query.shape[0])
            and m.shape[2] in (1, query.shape[2]) and m.shape[3] == key.shape[2])


def _gqa_with_shared_mask(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Grouped-query heads and a boolean ``(B, 1, T, N)`` mask shared by all heads."""
    return (
        attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1
        and query.shape[1] != key.shape[1]
    )


def _gqa_masked_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Masked attention under GQA without copying K and V per query head.

    transformers repeats K and V to every query head (``repeat_kv``) whenever a mask is given on
    CPU, a copy of the layer's whole cache at every masked call (LazyLLM's decode steps, with or
    without revived rows). Instead:

    - on CPU with more than :data:`PACKED_GQA_MAX_QUERIES` query rows, SDPA's ``enable_gqa``: the
      CPU kernel reads each query head's KV head in place and takes the mask as it is;
    - otherwise (a few query rows, such as a decode step or a short question over a cached
      document, or a device whose masked kernels need equal head counts) the ``G`` query heads of
      a KV group are laid out as ``G * T`` query rows of that group, with the ``(T, N)`` mask
      repeated ``G`` times (one row: the mask broadcasts as it is). Each KV head is then read
      once rather than once per query head, which is what a few rows over a long cache wait on.

    Args:
        query: ``(B, H_q, T, d)``; key, value: ``(B, H_kv, N, d)`` with ``H_q = G * H_kv``;
        attention_mask: bool ``(B, 1, T, N)``, True = attend (or the additive mask of the
            query's dtype that SDPA makes of one: 0 = attend, ``-inf`` = not).

    Returns:
        ``(B, T, H_q, d_v)``, the layout transformers' attention functions return.
    """
    t = query.shape[2]
    if t > PACKED_GQA_MAX_QUERIES and query.device.type == "cpu":
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )  # (B, H_q, T, d_v)
        return out.transpose(1, 2).contiguous()
    return _packed_gqa_sdpa(query, key, value, attention_mask, scaling)


def _suffix_causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
    memo: dict[tuple[int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``T`` of ``N`` positions: a prompt's suffix over a cached prefix.

    transformers builds no mask for an attention function it does not know, so a model's own
    forward over a cache of ``P = N - T`` exact tokens (a prefix-cache hit, or the next chunk of a
    chunked prefill) arrives here with ``attention_mask=None`` and ``T < N``: query row ``t`` may
    attend keys ``0 .. P + t``. A mask for that costs the fused CPU kernel the whole ``T x N``
    rectangle, nearly twice a causal prefill's attention when ``P`` is short (a chat template's
    system prompt), so such a hit would be slower than no hit. While ``2T > N`` the queries are
    instead padded at the front with ``P`` zero rows, attended with ``is_causal`` (``N^2 / 2``
    pairs, the kernel's skipped upper triangle) and the padding's rows dropped; the kept rows are
    the same computation. Past that, the lower-right mask is the cheaper one: given to the kernel
    as the additive mask it would convert a boolean one to, built once per forward in ``memo``
    (the layers' dict, :data:`MASK_MEMO_KWARG`; without one, once per call).

    Args:
        query: ``(B, H_q, T, d)``; key, value: ``(B, H_kv, N, d)``, ``H_q`` a multiple of ``H_kv``.
        memo: masks already built in this forward, by ``(T, N)``.

    Returns:
        ``(B, T, H_q, d_v)``, the layout transformers' attention functions return.
    """
    b, h_q, t, d = query.shape
    n = key.shape[2]
    p = n - t
    if 2 * t > n:
        padded = torch.cat([query.new_zeros(b, h_q, p, d), query], dim=2)  # (B, H_q, N, d)
        out = torch.nn.functional.scaled_dot_product_attention(
            padded, key, value, is_causal=True, scale=scaling, enable_gqa=h_q != key.shape[1]
        )[:, :, p:]  # (B, H_q, T, d_v)
        return out.transpose(1, 2).contiguous()
    mask = memo.get((t, n)) if memo is not None else None
    if mask is None or mask.dtype != query.dtype:
        positions = torch.arange(n, device=query.device)
        allowed = causal_mask(positions[p:], positions)  # (1, 1, T, N)
        mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, float("-inf"))
        if memo is not None:
            memo[(t, n)] = mask
    if h_q != key.shape[1]:
        return _gqa_masked_sdpa(query, key, value, mask, scaling)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def _packed_gqa_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """The packed layout of :func:`_gqa_masked_sdpa`: query head ``h = g_kv * G + j`` row ``t`` -> row ``j * T + t``.

    Shapes as in :func:`_gqa_masked_sdpa`.
    """
    b, h_q, t, d = query.shape
    h_kv = key.shape[1]
    g = h_q // h_kv
    packed = query.reshape(b, h_kv, g * t, d)  # (B, H_kv, G*T, d)
    mask = attention_mask
    if t > 1:
        mask = mask[:, :, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, -1)  # (B, 1, G*T, N)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scaling
    )  # (B, H_kv, G*T, d_v)
    return out.reshape(b, h_q, t, -1).transpose(1, 2).contiguous()


_registered = False


def _ensure_registered() -> None:
    """Register the attention function once, on first use (never at import time)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, _fastprefill_sdpa)
        _registered = True


#: Each model's configs (:func:`_configs`), found once: walking every module on each decode step
#: cost more than a step's norms.
_CONFIGS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, dict[int, Any]]] = weakref.WeakKeyDictionary()


def _configs(model: torch.nn.Module) -> dict[int, Any]:
    """Every config of ``model``'s modules, by its ``id``: found by walking the modules at the first
    call for a model, and again whenever ``model.config`` is another object than then."""
    known = _CONFIGS.get(model)
    if known is None or known[0] is not getattr(model, "config", None):
        known = (getattr(model, "config", None),
                 {id(m.config): m.config for m in model.modules() if hasattr(m, "config")})
        _CONFIGS[model] = known
    return known[1]


def attention_choices(model: torch.nn.Module) -> dict[int, str | None]:
    """The attention implementation each config of ``model`` names now, by the config's ``id``."""
    return {key: cfg._attn_implementation for key, cfg in _configs(model).items()}


@contextlib.contextmanager
def attention_as(model: torch.nn.Module, choices: dict[int, str | None] | str) -> Iterator[None]:
    """Set the attention implementation of every config of ``model`` (one name for all, or each
    config's own from :func:`attention_choices`) for the duration of a block, restoring the
    previous choice in ``finally``."""
    configs = _configs(model)
    previous = attention_choices(model)
    try:
        for key, cfg in configs.items():
            cfg._attn_implementation = choices if isinstance(choices, str) else choices.get(key, previous[key])
        yield
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = previous[key]


@contextlib.contextmanager
def fastprefill_attention(model: torch.nn.Module) -> Iterator[None]:
    """Select the fastprefill attention function on ``model``, restoring the old one after.

    Inside, the model's own forward over a cache of exact tokens (no mask given) runs its suffix
    with :func:`_suffix_causal_sdpa`; plain full prefill uses it for a cached prefix.
    """
    _ensure_registered()
    with attention_as(model, ATTENTION_NAME):
        yield


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Boolean causal mask by *original* positions.

    Args:
        query_positions: ``(T,)`` int64 positions of the query rows.
        key_positions: ``(N,)`` int64 positions of the keys.

    Returns:
        ``(1, 1, T, N)`` bool, True where ``key_position <= query_position``.
    """
    return (key_positions[None, :] <= query_positions[:, None])[None, None]
