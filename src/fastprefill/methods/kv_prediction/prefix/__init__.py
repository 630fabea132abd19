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

from fastprefill.methods.kv_prediction.prefix.calibrate import (
    PrefixCalibration,
    calibrate_prefix,
    checkpoint_bytes,
    exact_hidden,
    prefix_errors,
)
from fastprefill.methods.kv_prediction.prefix.method import KVPrefix, predicted_tail
from fastprefill.methods.kv_prediction.prefix.predictor import VARIANT, LayerMap, PrefixPredictor, check_layer

__all__ = [
    "VARIANT",
    "KVPrefix",
    "LayerMap",
    "PrefixCalibration",
    "PrefixPredictor",
    "calibrate_prefix",
    "check_layer",
    "checkpoint_bytes",
    "exact_hidden",
    "predicted_tail",
    "prefix_errors",
]
