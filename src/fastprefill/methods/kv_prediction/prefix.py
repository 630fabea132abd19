"""kvp-prefix: KV Prediction that keeps the base's first ``l`` layers exact (SwiftKV-style,
arXiv 2410.03960).

Prefill of a ``T``-token prompt on an ``L``-layer base (everything inside TTFT):

1. the base runs its layers ``0..l-1`` exactly on all ``T`` prompt tokens (its own decoder
   layers, plain causal attention); ``h_l`` ``(1, T, D)`` is the output of layer ``l - 1`` (the
   embeddings for ``l = 0``);
2. for every later layer ``j >= l`` the keys (before rotation) and values of prompt tokens
   ``0..T-2`` are predicted from ``h_l`` by a per-layer linear map (:class:`PrefixPredictor`)::

       x = unit_rms(h_l)                       (1, T-1, D)    layer j's input RMSNorm, no gain
       K_j = W^K_j (g_j * x) + b^K_j           (1, T-1, H_kv*d) -> (1, H_kv, T-1, d)   (same for V)

   and the keys are rotated with the base's rotary at their original positions;
3. the last prompt token runs through layers ``l..L-1`` attending to those predicted keys and
   values (and to its own, computed), which gives the first-token logits. Decoding then goes on
   plainly from that cache, exactly as after :class:`~fastprefill.methods.full.FullPrefill`.
   With ``tail = W > 1`` (beyond SwiftKV, which runs only the last token) the last ``W`` prompt
   tokens run through layers ``l..L-1`` exactly instead (causal among themselves, attending to
   the predicted rows ``0..T-W-1``), so their later-layer KV is exact: in a chat prompt that is
   the question and the template tail. Only ``T - W`` rows are predicted.

**Maps.** Zero-shot (``kvp-prefix:layer=L``, no file): ``g_j`` = layer ``j``'s input-norm gain,
``W_j, b_j`` = its own ``k_proj`` / ``v_proj``, i.e. ``k_proj_j(norm_j(h_l))``: layer ``j``'s
projections applied to the wrong layer's hidden state (exact for ``j = l``). Calibrated
(:func:`calibrate_prefix`, ``kvp-prefix:predictor=DIR``): a least-squares correction ``Δ_j``
of the zero-shot map on the unit-RMS input ``[x 1]`` against the base's true pre-rotation
``K_j`` / ``V_j`` (ridge towards the zero-shot map), fitted on :mod:`.corpus` text.

**Checkpoint** (:mod:`.checkpoint`, ``variant = "prefix"`` in ``config.json``): ``l``, the
base's shape, weight and tokenizer fingerprints, and per later layer the correction in
**float16**: ``k.<j>.delta`` ``(D + 1, H_kv*d)`` (full rank), or, when the full-rank file
would exceed ``max_mb``, ``k.<j>.a`` ``(D + 1, r)`` and ``k.<j>.b`` ``(r, H_kv*d)`` (reduced-rank
regression: the best rank-``r`` correction under the calibration data's Gram matrix). The
zero-shot part comes from the base's own weights at load time, so the file holds corrections
only. Calibration is resumable: the Gram statistics are saved every ``checkpoint_every``
sequences (``calib-stats.pt``) and each layer's fit as soon as it is solved.

**Cost** (:class:`~fastprefill.methods.base.ComputeStats`): ``l`` full layers over ``T``
tokens, the maps over ``T - W`` tokens for ``L - l`` layers (``2 (D+1) H_kv d`` multiply-adds
per token, layer and K/V), ``L - l`` layers for the ``W`` tail tokens over their keys, one
LM-head row.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError, check_fields
from fastprefill.methods.base import ComputeStats, Method, PrefillOutput, prefix_length
from fastprefill.methods.kv_prediction.aux import tokenizer_fingerprint, weights_fingerprint
from fastprefill.methods.kv_prediction.checkpoint import (
    CheckpointError,
    atomic_torch_save,
    read_checkpoint,
    write_checkpoint,
)
from fastprefill.methods.kv_prediction.corpus import calibration_corpus
from fastprefill.models.adapters import DecoderAdapter, causal_mask, require_layer_loop
from fastprefill.models.kv import rotate_keys
from fastprefill.models.shape import ModelShape, causal_pairs

__all__ = [
    "VARIANT",
    "KVPrefix",
    "LayerMap",
    "PrefixCalibration",
    "PrefixPredictor",
    "calibrate_prefix",
    "check_layer",
    "exact_hidden",
    "predicted_tail",
    "prefix_errors",
]

#: ``config.json["variant"]`` of a kvp-prefix checkpoint.
VARIANT = "prefix"
#: File (in the checkpoint directory) holding the calibration's running Gram statistics.
STATS_FILE = "calib-stats.pt"

KV = tuple[torch.Tensor, torch.Tensor]


def check_layer(layer: Any, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers]``, else :class:`ConfigError` naming the range."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= num_layers:
        raise ConfigError(
            f"kvp-prefix layer must be an int in [0, {num_layers}] for this {num_layers}-layer model "
            f"(the number of layers run exactly), got {layer!r}"
        )
    return layer


@dataclass
class LayerMap:
    """Layer ``j``'s K and V maps on the unit-RMS input ``x`` ``(B, N, D)``: ``W (g * x) + b``.

    Attributes:
        gain: ``(D,)`` or ``None`` (no gain).
        k_weight, v_weight: ``(H_kv*d, D)``.
        k_bias, v_bias: ``(H_kv*d,)`` or ``None``.
    """

    gain: torch.Tensor | None
    k_weight: torch.Tensor
    k_bias: torch.Tensor | None
    v_weight: torch.Tensor
    v_bias: torch.Tensor | None

    def apply(self, x: torch.Tensor) -> KV:
        """``(B, N, D)`` -> merged ``(K, V)``, each ``(B, N, H_kv*d)``."""
        if self.gain is not None:
            x = self.gain * x
        return (torch.nn.functional.linear(x, self.k_weight, self.k_bias),
                torch.nn.functional.linear(x, self.v_weight, self.v_bias))

    def augmented(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The maps as float64 ``(D + 1, H_kv*d)`` matrices on ``[x 1]`` (gain folded in), K then V."""
        out = []
        for weight, bias in ((self.k_weight, self.k_bias), (self.v_weight, self.v_bias)):
            w = weight.detach().to("cpu", torch.float64)
            if self.gain is not None:
                w = w * self.gain.detach().to("cpu", torch.float64)[None, :]
            b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.detach().to("cpu", torch.float64)
            out.append(torch.cat([w.T, b[None]], dim=0))
        return out[0], out[1]


class PrefixPredictor:
    """The maps of every layer ``j`` in ``l..L-1`` (see the module docstring).

    Args:
        shape: the base's shape.
        layer: ``l``, the number of layers run exactly.
        maps: ``{j: LayerMap}`` for ``j = l..L-1``.
        kind: ``"zero-shot"``, ``"least-squares"`` or ``"distilled"`` (for :meth:`describe`).
        rank: the correction's rank (``None``: full rank or none).
    """

    def __init__(self, shape: ModelShape, layer: int, maps: dict[int, LayerMap], kind: str,
                 rank: int | None = None) -> None:
        self.shape = shape
        self.layer = check_layer(layer, shape.num_layers)
        if sorted(maps) != list(range(layer, shape.num_layers)):
            raise ConfigError(f"kvp-prefix maps must cover layers {layer}..{shape.num_layers - 1}, got {sorted(maps)}")
        self.maps = maps
        self.kind = kind
        self.rank = rank

    @classmethod
    def zero_shot(cls, model: PreTrainedModel, layer: int) -> PrefixPredictor:
        """Layer ``j``'s own input-norm gain and k/v projections (the model's tensors, not copies)."""
        ad = DecoderAdapter(model, "kvp-prefix")
        check_layer(layer, ad.num_layers)
        maps = {}
        for j in range(layer, ad.num_layers):
            k_proj, v_proj = ad.kv_projections(j)
            maps[j] = LayerMap(ad.input_norm_gain(j), k_proj.weight, k_proj.bias, v_proj.weight, v_proj.bias)
        return cls(ad.shape, layer, maps, "zero-shot")

    @classmethod
    def corrected(cls, model: PreTrainedModel, layer: int, deltas: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  rank: int | None, kind: str = "least-squares") -> PrefixPredictor:
        """Zero-shot maps plus float64 ``(D + 1, H_kv*d)`` corrections ``{j: (Δ_K, Δ_V)}`` on ``[x 1]``
        (``kind``: how they were fitted, ``"least-squares"`` or ``"distilled"``)."""
        zero = cls.zero_shot(model, layer)
        dtype, device = model.dtype, next(model.parameters()).device
        maps = {}
        for j, zmap in zero.maps.items():
            mats = [base + delta for base, delta in zip(zmap.augmented(), deltas[j])]  # (D+1, out)
            (kw, kb), (vw, vb) = ((m[:-1].T.contiguous(), m[-1].contiguous()) for m in mats)
            maps[j] = LayerMap(None, *(t.to(device, dtype) for t in (kw, kb, vw, vb)))
        return cls(zero.shape, layer, maps, kind, rank)

    def predict(self, ad: DecoderAdapter, hidden: torch.Tensor) -> dict[int, KV]:
        """Pre-rotation ``{j: (K_j, V_j)}``, each ``(B, H_kv, N, d)``, from ``h_l`` ``(B, N, D)``."""
        out = {}
        for j, lmap in self.maps.items():
            k, v = lmap.apply(ad.unit_rms(j, hidden))
            out[j] = (ad.split_heads(k), ad.split_heads(v))
        return out

    def flops(self, n_tokens: int) -> float:
        """FLOPs of the maps for ``n_tokens`` rows at every predicted layer (K and V, bias included)."""
        d_kv = self.shape.num_kv_heads * self.shape.head_dim
        return 2.0 * 2 * len(self.maps) * n_tokens * (self.shape.hidden_size + 1) * d_kv

    def describe(self) -> str:
        if self.kind == "zero-shot":
            return "zero-shot"
        return self.kind + (f", rank {self.rank}" if self.rank else "")


# ----------------------------------------------------------------------------------- the method
@dataclass
class KVPrefix(Method):
    """kvp-prefix: the base's first ``layer`` layers exact, later layers' prompt KV predicted.

    Args:
        layer: ``l`` in ``[0, L]``; with no ``predictor`` the zero-shot maps are used.
            ``l = L`` is full prefill (nothing is predicted).
        predictor: a checkpoint directory written by :func:`calibrate_prefix` (its ``l`` is
            used; a ``layer`` given too must equal it).
        tail: ``W >= 1``, the last prompt tokens that run through every layer exactly (``1`` is
            SwiftKV's rule: only the last token). The maps do not depend on it.

    Spec: ``kvp-prefix:layer=8`` (zero-shot), ``kvp-prefix:predictor=DIR`` or
    ``kvp-prefix:predictor=DIR,tail=64``.

    Raises:
        ConfigError: neither given, a bad ``layer``, a checkpoint that is missing, corrupted
            (sha256), of another kind or unfinished; at the first prefill, a model of another
            shape or other weights than the checkpoint's, or ``layer`` beyond its depth.
    """

    name: ClassVar[str] = "kvp-prefix"
    layer_loop: ClassVar[bool] = True
    takes_prefix: ClassVar[bool] = True

    layer: int | None = None
    predictor: str | None = None
    tail: int = 1
    _config: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _state: dict[str, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _given: PrefixPredictor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.layer is None and self.predictor is None:
            raise ConfigError(
                "kvp-prefix needs layer=L (zero-shot maps: the base runs its first L layers exactly) or "
                "predictor=DIR (a checkpoint from `fastprefill train-kvp --variant prefix --model NAME --layer L "
                "--out DIR`); for example --method kvp-prefix:layer=8"
            )
        if self.layer is not None and (isinstance(self.layer, bool) or not isinstance(self.layer, int)
                                       or self.layer < 0):
            raise ConfigError(f"KVPrefix.layer must be an int >= 0 (layers run exactly), got {self.layer!r}")
        if isinstance(self.tail, bool) or not isinstance(self.tail, int) or self.tail < 1:
            raise ConfigError(f"KVPrefix.tail must be an int >= 1 (prompt tokens run through every layer; 1 = "
                              f"only the last, as in SwiftKV), got {self.tail!r}")
        if self.predictor is not None:
            config, state, _ = read_checkpoint(self.predictor)
            if config.get("variant") != VARIANT:
                raise CheckpointError(
                    f"{self.predictor} is not a kvp-prefix checkpoint (it is a KV Prediction aux-model predictor: "
                    "use --method kvp:predictor=DIR for it)"
                )
            if not config.get("complete"):
                raise CheckpointError(
                    f"the kvp-prefix calibration in {self.predictor} is unfinished "
                    f"({len(config.get('layers_done', []))} layers fitted); resume it with "
                    "`fastprefill train-kvp --variant prefix ... --resume`"
                )
            if self.layer is not None and self.layer != config["layer"]:
                raise ConfigError(
                    f"layer={self.layer} but the checkpoint {self.predictor} was calibrated for layer={config['layer']}"
                )
            self.layer = int(config["layer"])
            self._config, self._state = config, state
        self._bound: tuple[weakref.ref, PrefixPredictor] | None = None

    @classmethod
    def from_predictor(cls, predictor: PrefixPredictor) -> KVPrefix:
        """A method around maps already built (tests, sweeps): bound to nothing until first used."""
        method = cls(layer=predictor.layer)
        method._given = predictor
        return method

    def bind(self, model: PreTrainedModel) -> PrefixPredictor:
        """Check ``model`` and build the maps for it (remembered per model; call before timing)."""
        if self._bound is not None and self._bound[0]() is model:
            return self._bound[1]
        require_layer_loop(model, "kvp-prefix")
        shape = ModelShape.from_config(model.config)
        check_layer(self.layer, shape.num_layers)
        given = self._given
        if given is not None:
            if given.shape != shape:
                raise ConfigError(f"these kvp-prefix maps were built for a model of shape {given.shape}, not {shape}")
            pred = given
        elif self._config is None:
            pred = PrefixPredictor.zero_shot(model, self.layer)
        else:
            pred = self._from_checkpoint(model, shape)
        self._bound = (weakref.ref(model), pred)
        return pred

    def _from_checkpoint(self, model: PreTrainedModel, shape: ModelShape) -> PrefixPredictor:
        config, state = self._config, self._state
        base = config.get("base", {})
        want = ModelShape.from_json(base["shape"])
        if want != shape:
            raise ConfigError(
                f"the kvp-prefix predictor {self.predictor} is for {base.get('name') or 'another model'!r} "
                f"of shape {want}, not this model of shape {shape}"
            )
        if base.get("fingerprint") and weights_fingerprint(model) != base["fingerprint"]:
            raise ConfigError(
                f"the kvp-prefix predictor {self.predictor} was calibrated for {base.get('name') or '?'!r}, "
                "whose weights differ from this model's (weights fingerprint mismatch)"
            )
        try:
            deltas = {j: tuple(_delta(state, w, j) for w in ("k", "v"))
                      for j in range(self.layer, shape.num_layers)}
        except KeyError as exc:
            raise CheckpointError(f"corrupted kvp-prefix checkpoint {self.predictor}: missing tensor {exc}") from None
        maps = config.get("maps", {})
        return PrefixPredictor.corrected(model, self.layer, deltas, maps.get("rank"),
                                         kind="distilled" if config.get("distillation") else "least-squares")

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        """Layers ``0..l-1`` exact on the prompt, later layers' K/V predicted except the last ``tail``
        tokens', which run through every layer.

        Args:
            input_ids: ``(1, T)``.
            prefix: exact K/V of positions ``0..P-1`` at every layer (a prefix cache's): context
                for the rest, which alone is computed and predicted.
        """
        pred = self.bind(model)
        ad = DecoderAdapter(model, "kvp-prefix")
        shape, l = ad.shape, pred.layer
        L, n = shape.num_layers, int(input_ids.shape[1])
        q = prefix_length(prefix)
        positions = torch.arange(q, n, device=input_ids.device)[None]  # (1, M) the rows computed
        cache = prefix if prefix is not None else DynamicCache(config=model.config)
        # over a prefix the rows are not the first keys: SDPA's causal flag would misalign them
        mask = causal_mask(positions[0], torch.arange(n, device=input_ids.device)) if q and n - q > 1 else None
        with torch.no_grad(), ad.attention_scope():
            hidden = ad.embed(input_ids[:, q:])  # (1, M, D)
            cos, sin = ad.rotary(hidden, positions)  # (1, M, d) each
            for i in range(l):  # exact on every computed prompt token
                hidden = ad.layer(i, hidden, positions, cache, mask=mask, rotary=(cos, sin))
            p = max(n - q - self.tail, 0) if l < L else 0  # predicted rows
            tail = predicted_tail(ad, lambda h: pred.predict(ad, h), hidden, positions, (cos, sin), cache, l, p,
                                  context=q)
            logits = ad.head(tail[:, -1:])[0, -1]  # (V,)
        m = n - q
        w = m - p
        map_flops = pred.flops(p)
        exact_flops = l * shape.layer_flops(m, m * q + causal_pairs(m))
        tail_flops = (L - l) * shape.layer_flops(w, w * (q + p) + causal_pairs(w))
        stats = ComputeStats(
            token_layers=l * m + (L - l) * w,
            total_token_layers=n * L,
            flops=exact_flops + map_flops + tail_flops + shape.head_flops(1),
            extra={"exact_layers": l, "predicted_layers": (L - l) if p else 0,
                   "map_flops": map_flops, "exact_flops": exact_flops, "tail_flops": tail_flops},
        )
        return PrefillOutput(logits=logits, cache=cache, stats=stats, next_position=n, exact_tokens=n if not p else q)

    def describe(self) -> str:
        maps = Path(self.predictor).name if self.predictor else "zero-shot"
        return f"kvp-prefix(l={self.layer}, {maps}{'' if self.tail == 1 else f', tail={self.tail}'})"


def predicted_tail(
    ad: DecoderAdapter,
    predict: Callable[[torch.Tensor], dict[int, KV]],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    cache: Any,
    layer: int,
    predicted: int,
    context: int = 0,
) -> torch.Tensor:
    """Steps 2-3 of kvp-prefix: the first ``predicted`` rows' K/V at every layer ``j >= layer``
    come from ``predict``, the other rows run through layers ``layer..L-1`` over them.

    Args:
        predict: ``h_l`` rows ``(1, p, D)`` -> pre-rotation ``{j: (K_j, V_j)}``, each
            ``(1, H_kv, p, d)`` (:meth:`PrefixPredictor.predict`'s contract).
        hidden: ``h_l`` ``(1, T, D)``, the input of layer ``layer``.
        positions: ``(1, T)``; rotary: their ``(cos, sin)``, each ``(1, T, d)``.
        cache: a ``DynamicCache`` (holding layers ``< layer``, or nothing; and, at every layer,
            the ``context`` positions before ``positions``); receives the rows.
        layer: ``l``; predicted: ``p`` in ``[0, T)``.
        context: ``P``, positions ``0..P-1`` already in ``cache`` at every layer (a cached
            prefix); ``positions`` then start at ``P``.

    Returns:
        ``(1, T - p, D)``: the exact rows' output of the last layer (before the final norm).
    """
    cos, sin = rotary
    p = predicted
    if p:
        for j, (k, v) in predict(hidden[:, :p]).items():  # (1, H_kv, p, d)
            cache.update(rotate_keys(k, cos[:, :p], sin[:, :p]), v, j)
    tail, tail_pos, tail_rot = hidden[:, p:], positions[:, p:], (cos[:, p:], sin[:, p:])  # (1, W, D)
    # A block of W > 1 rows over predicted rows needs an explicit mask: SDPA's own causal flag
    # aligns a short query block to the first keys, not the last.
    keys = torch.cat([torch.arange(context, device=positions.device), positions[0]])  # (P + T,)
    mask = causal_mask(tail_pos[0], keys) if (p or context) and tail.shape[1] > 1 else None  # (1, 1, W, P + T)
    for j in range(layer, ad.num_layers):  # the tail through every later layer (causal, over the predicted rows)
        tail = ad.layer(j, tail, tail_pos, cache, mask=mask, rotary=tail_rot)
    return tail


def _delta(state: dict[str, torch.Tensor], which: str, j: int) -> torch.Tensor:
    """Layer ``j``'s stored correction as float64 ``(D + 1, H_kv*d)`` (full or ``a @ b``)."""
    key = f"{which}.{j}"
    if f"{key}.delta" in state:
        return state[f"{key}.delta"].to(torch.float64)
    return state[f"{key}.a"].to(torch.float64) @ state[f"{key}.b"].to(torch.float64)


# ----------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class PrefixCalibration:
    """Settings of :func:`calibrate_prefix` (validated; recorded in the checkpoint).

    Attributes:
        layer: ``l``, the layers run exactly.
        lsq_tokens: calibration tokens.
        seq_len: tokens per calibration sequence.
        ridge: ρ: the correction is penalised by ``ρ · mean(diag G)`` (towards the zero-shot map).
        rank: the correction's rank; ``None``: full rank if the file fits ``max_mb``, else the
            largest multiple of 8 that fits.
        max_mb: upper bound on the weights file (float16 corrections).
        task_share: share of dev-split task prompts in the calibration text (:mod:`.corpus`).
        checkpoint_every: sequences between saves of the running statistics.
        heldout_seqs: held-out sequences (another seed) for the per-layer error report.
        seed: text selection and order.
    """

    layer: int
    lsq_tokens: int = 32_768
    seq_len: int = 512
    ridge: float = 1e-3
    rank: int | None = None
    max_mb: float = 20.0
    task_share: float = 0.25
    checkpoint_every: int = 8
    heldout_seqs: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("layer", isinstance(self.layer, int) and not isinstance(self.layer, bool) and self.layer >= 0, ">= 0"),
            ("seq_len", self.seq_len >= 2, ">= 2"),
            ("lsq_tokens", self.lsq_tokens >= self.seq_len, f">= seq_len ({self.seq_len})"),
            ("ridge", self.ridge >= 0, ">= 0"),
            ("rank", self.rank is None or self.rank >= 1, "None or >= 1"),
            ("max_mb", self.max_mb > 0, "> 0"),
            ("task_share", 0.0 <= self.task_share <= 1.0, "in [0, 1]"),
            ("checkpoint_every", self.checkpoint_every >= 1, ">= 1"),
            ("heldout_seqs", self.heldout_seqs >= 0, ">= 0"),
        ]
        check_fields(self, checks)


def choose_rank(shape: ModelShape, layer: int, rank: int | None, max_mb: float) -> int | None:
    """The correction's rank: ``None`` (full) if that fits ``max_mb`` in float16, else the
    largest multiple of 8 that fits (an explicit ``rank`` must fit too).

    Raises:
        ConfigError: nothing fits.
    """
    d_in, d_out, maps = shape.hidden_size + 1, shape.num_kv_heads * shape.head_dim, 2 * (shape.num_layers - layer)
    budget = max_mb * 1e6 / 2  # float16 values
    if rank is not None:
        if rank >= min(d_in, d_out):
            rank = None
        elif maps * (d_in + d_out) * rank > budget:
            raise ConfigError(f"rank {rank} needs {maps * (d_in + d_out) * rank * 2 / 1e6:.1f} MB > max_mb={max_mb}")
        else:
            return rank
    if maps * d_in * d_out <= budget:
        return None
    fit = int(budget // (maps * (d_in + d_out))) // 8 * 8
    if fit < 8:
        raise ConfigError(f"no correction of rank >= 8 fits max_mb={max_mb} for layer={layer}; raise max_mb or layer")
    return fit


def exact_hidden(ad: DecoderAdapter, ids: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The base's exact hidden states ``(1, N, D)`` for ``ids`` ``(1, N)``: for each ``i`` in
    ``layers`` the input of layer ``i`` (``i = L``: the last layer's output, before the final norm)."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    cache = DynamicCache(config=ad.config)
    hidden = ad.embed(ids)
    rot = ad.rotary(hidden, positions)
    want, out = set(layers), {}
    last = max(want, default=-1)
    with ad.attention_scope():
        for i in range(ad.num_layers):
            if i in want:
                out[i] = hidden
            if i >= last:
                break
            hidden = ad.layer(i, hidden, positions, cache, rotary=rot)
        else:
            if ad.num_layers in want:
                out[ad.num_layers] = hidden
    return out


def _layer_inputs(ad: DecoderAdapter, ids: torch.Tensor, layer: int) -> list[torch.Tensor]:
    """The inputs ``(1, N, D)`` of layers ``layer..L-1`` for ``ids`` ``(1, N)`` (exact forward)."""
    states = exact_hidden(ad, ids, range(layer, ad.num_layers))
    return [states[i] for i in range(layer, ad.num_layers)]


def _merged(kv: torch.Tensor) -> torch.Tensor:
    """``(1, H, N, d)`` -> float64 ``(N, H*d)``."""
    return kv[0].transpose(0, 1).reshape(kv.shape[2], -1).to("cpu", torch.float64)


def _augment(x: torch.Tensor) -> torch.Tensor:
    """``(1, N, D)`` -> float64 ``(N, D + 1)`` with a ones column."""
    x = x[0].to("cpu", torch.float64)
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)


@torch.no_grad()
def prefix_errors(model: PreTrainedModel, predictor: PrefixPredictor,
                  sequences: Sequence[torch.Tensor]) -> dict[str, list[float]]:
    """Per predicted layer ``j = l..L-1``: relative error ``||K̂ - K||_F / ||K||_F`` and centred
    ``R² = 1 - SSE / Σ||K - mean K||²`` (means over tokens per feature, pooled over sequences),
    for K (pre-rotation) and V.

    Returns:
        ``{"layers": [j...], "k": [...], "v": [...], "r2_k": [...], "r2_v": [...]}``.
    """
    ad = DecoderAdapter(model, "kvp-prefix")
    layers = list(predictor.maps)
    acc = {w: {j: [0.0, 0.0, 0.0, 0, None] for j in layers} for w in ("k", "v")}  # sse, ss, -, n, sum
    for ids in sequences:
        inputs = _layer_inputs(ad, ids.to(ad.device), predictor.layer)
        pred = predictor.predict(ad, inputs[0])
        for offset, j in enumerate(layers):
            true = ad.project_kv(j, inputs[offset])
            for w, t, p in (("k", true[0], pred[j][0]), ("v", true[1], pred[j][1])):
                y, yh = _merged(t), _merged(p)
                a = acc[w][j]
                a[0] += float((yh - y).pow(2).sum())
                a[1] += float(y.pow(2).sum())
                a[3] += y.shape[0]
                a[4] = y.sum(0) if a[4] is None else a[4] + y.sum(0)
    out: dict[str, list[float]] = {"layers": layers}
    for w in ("k", "v"):
        rel, r2 = [], []
        for j in layers:
            sse, ss, _, n, total = acc[w][j]
            centred = ss - float((total**2).sum()) / max(n, 1) if total is not None else 0.0
            rel.append(math.sqrt(sse / max(ss, 1e-30)))
            r2.append(1.0 - sse / max(centred, 1e-30))
        out[w], out[f"r2_{w}"] = rel, r2
    return out


def _solve(gram: torch.Tensor, cross: torch.Tensor, zero: torch.Tensor, ridge: float,
           rank: int | None) -> tuple[torch.Tensor, ...]:
    """The ridge least-squares correction of ``zero`` ``(D+1, out)``: ``Δ = (G + ρ s I)^{-1} (C - G Z)``
    (bias row not penalised), truncated to ``rank`` by reduced-rank regression. Returns ``(Δ,)``
    or ``(A, B)`` with ``Δ = A B``."""
    g = gram.clone()
    scale = g.diagonal()[:-1].mean().clamp_min(1e-12)
    g.diagonal()[:-1] += ridge * scale
    delta = torch.linalg.solve(g, cross - gram @ zero)  # (D+1, out)
    if rank is None:
        return (delta,)
    m = delta.T @ gram @ delta  # (out, out): the fitted correction's energy on the data
    _, vecs = torch.linalg.eigh((m + m.T) / 2)
    top = vecs[:, -rank:]  # (out, r)
    return delta @ top, top.T.contiguous()


def calibrate_prefix(
    model: PreTrainedModel,
    out_dir: str | os.PathLike[str],
    config: PrefixCalibration,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    model_name: str | None = None,
    corpus: Sequence[torch.Tensor] | None = None,
    heldout: Sequence[torch.Tensor] | None = None,
    resume: bool = False,
    progress: bool = True,
) -> KVPrefix:
    """Fit the kvp-prefix maps of ``model`` at ``config.layer`` by least squares; write ``out_dir``.

    Args:
        model: the base (llama / qwen2).
        out_dir: the checkpoint directory.
        config: :class:`PrefixCalibration`.
        tokenizer: needed unless ``corpus`` and ``heldout`` are given (and fingerprinted).
        model_name: the zoo name recorded in the checkpoint.
        corpus: calibration sequences ``(1, N)``; default :func:`~.corpus.calibration_corpus`.
        heldout: held-out sequences for the error report; default other-seed calibration text.
        resume: continue the calibration in ``out_dir`` (statistics and finished layers kept).
        progress: tqdm bars.

    Returns:
        The calibrated :class:`KVPrefix` (loaded back from ``out_dir``).

    Raises:
        ConfigError: a bad layer, ``resume`` without a checkpoint or for another model / layer, a
            directory that already holds a checkpoint without ``resume``, layers whose input
            norms have different epsilons.
    """
    out = Path(out_dir)
    ad = DecoderAdapter(model, "kvp-prefix")
    shape, l = ad.shape, check_layer(config.layer, ad.num_layers)
    if len({float(ad.layers[j].input_layernorm.variance_epsilon) for j in range(ad.num_layers)}) != 1:
        raise ConfigError("kvp-prefix calibration needs one RMSNorm epsilon in every layer")
    rank = choose_rank(shape, l, config.rank, config.max_mb)
    zero = PrefixPredictor.zero_shot(model, l)
    meta: dict[str, Any] = {
        "variant": VARIANT, "layer": l,
        "base": {"name": model_name, "shape": shape.to_json(), "fingerprint": weights_fingerprint(model),
                 "tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None},
        "maps": {"storage": "float16 corrections of the zero-shot map" + (f", rank {rank}" if rank else ", full rank"),
                 "rank": rank, "dtype": "float16"},
        "calibration": vars(config).copy(),
        "complete": False, "layers_done": [],
    }
    stats: dict[str, Any] = {"sequences_done": 0, "rows": 0, "gram": None, "cross": {}, "seconds": 0.0}
    tensors: dict[str, torch.Tensor] = {}
    if resume:
        old, tensors, _ = read_checkpoint(out)
        if old.get("variant") != VARIANT or old["base"].get("fingerprint") != meta["base"]["fingerprint"] \
                or old.get("layer") != l:
            raise CheckpointError(f"cannot resume {out}: it was calibrated for another model or layer")
        meta.update({k: old[k] for k in ("layers_done", "calibration_tokens", "task_ids") if k in old})
        if (out / STATS_FILE).is_file():
            stats = torch.load(out / STATS_FILE, weights_only=False)
    elif (out / "config.json").exists():
        raise CheckpointError(f"{out} already holds a checkpoint; pass resume=True (--resume) or another directory")
    if corpus is None:
        if tokenizer is None:
            raise ConfigError("calibrate_prefix needs a tokenizer or a corpus")
        built = calibration_corpus(tokenizer, config.lsq_tokens, config.seq_len, seed=config.seed,
                                   task_share=config.task_share)
        corpus = built.sequences
        meta["task_ids"], meta["calibration_tokens"] = built.task_ids, built.tokens
    start = time.perf_counter() - float(stats["seconds"])
    layers = list(range(l, shape.num_layers))

    def save(step: int) -> None:
        meta["wall_seconds"] = time.perf_counter() - start
        write_checkpoint(out, tensors, meta, step=step, dtype=None)

    with torch.no_grad():
        todo = corpus[int(stats["sequences_done"]):] if len(meta["layers_done"]) < len(layers) else []
        bar = tqdm(total=len(corpus), initial=int(stats["sequences_done"]), desc=f"kvp-prefix l={l}: statistics",
                   disable=not progress or not todo)
        for ids in todo:
            inputs = _layer_inputs(ad, ids.to(ad.device), l)
            if not inputs:
                break
            x = _augment(ad.unit_rms(l, inputs[0]))  # (N, D+1)
            stats["gram"] = x.T @ x if stats["gram"] is None else stats["gram"] + x.T @ x
            for offset, j in enumerate(layers):
                k, v = ad.project_kv(j, inputs[offset])
                ck, cv = x.T @ _merged(k), x.T @ _merged(v)
                old = stats["cross"].get(j)
                stats["cross"][j] = (ck, cv) if old is None else (old[0] + ck, old[1] + cv)
            stats["sequences_done"] += 1
            stats["rows"] += int(ids.shape[1])
            bar.update(1)
            if stats["sequences_done"] % config.checkpoint_every == 0 and stats["sequences_done"] < len(corpus):
                stats["seconds"] = time.perf_counter() - start
                atomic_torch_save(out / STATS_FILE, stats)
                save(step=0)
        bar.close()
        if todo:
            stats["seconds"] = time.perf_counter() - start
            atomic_torch_save(out / STATS_FILE, stats)
        meta["rows"] = stats["rows"]
        for j in tqdm([j for j in layers if j not in meta["layers_done"]], desc=f"kvp-prefix l={l}: least squares",
                      disable=not progress):
            if stats["gram"] is None:
                raise ConfigError("kvp-prefix calibration got no data")
            for w, zmat, cross in zip(("k", "v"), zero.maps[j].augmented(), stats["cross"][j]):
                parts = _solve(stats["gram"], cross, zmat, config.ridge, rank)
                names = ("delta",) if len(parts) == 1 else ("a", "b")
                for name, part in zip(names, parts):
                    tensors[f"{w}.{j}.{name}"] = part.to(torch.float16)
            meta["layers_done"] = sorted([*meta["layers_done"], j])
            save(step=len(meta["layers_done"]))
        meta["complete"] = True
        if heldout is None and tokenizer is not None and config.heldout_seqs:
            heldout = calibration_corpus(tokenizer, config.seq_len * config.heldout_seqs, config.seq_len,
                                         seed=config.seed + 12345, task_share=0.0).sequences
        if heldout and layers:
            fitted = _build_from(model, l, tensors, rank)
            meta["heldout_errors"] = {"zero-shot": prefix_errors(model, zero, heldout),
                                      "least-squares": prefix_errors(model, fitted, heldout),
                                      "sequences": len(heldout)}
        save(step=len(layers) + 1)
    (out / STATS_FILE).unlink(missing_ok=True)
    return KVPrefix(predictor=str(out))


def _build_from(model: PreTrainedModel, layer: int, tensors: dict[str, torch.Tensor],
                rank: int | None) -> PrefixPredictor:
    """The calibrated :class:`PrefixPredictor` from in-memory checkpoint tensors."""
    shape = ModelShape.from_config(model.config)
    deltas = {j: (_delta(tensors, "k", j), _delta(tensors, "v", j)) for j in range(layer, shape.num_layers)}
    return PrefixPredictor.corrected(model, layer, deltas, rank)


def checkpoint_bytes(path: str | os.PathLike[str]) -> int:
    """Size of a checkpoint's weights file in bytes."""
    config, _, _ = read_checkpoint(path)
    return (Path(path) / config["weights"]).stat().st_size
