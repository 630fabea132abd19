"""kvp-prefix calibration: least-squares corrections of the zero-shot maps on calibration text,
resumable, and the held-out error report (see :mod:`fastprefill.methods.kv_prediction.prefix`)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError, check_fields, is_int
from fastprefill.methods.kv_prediction.auxiliary.models import tokenizer_fingerprint, weights_fingerprint
from fastprefill.methods.kv_prediction.checkpoint import (
    CheckpointError,
    atomic_torch_save,
    read_checkpoint,
    write_checkpoint,
)
from fastprefill.methods.kv_prediction.corpus import calibration_corpus
from fastprefill.methods.kv_prediction.prefix.method import KVPrefix
from fastprefill.methods.kv_prediction.prefix.predictor import (
    VARIANT,
    PrefixPredictor,
    check_layer,
    stored_delta,
)
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.shape import ModelShape

__all__ = ["STATS_FILE", "PrefixCalibration", "calibrate_prefix", "checkpoint_bytes", "choose_rank", "exact_hidden",
           "prefix_errors"]

#: File (in the checkpoint directory) holding the calibration's running Gram statistics.
STATS_FILE = "calib-stats.pt"


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
            ("layer", is_int(self.layer, 0), ">= 0"),
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
    l = check_layer(config.layer, ad.num_layers)
    if len({float(ad.layers[j].input_layernorm.variance_epsilon) for j in range(ad.num_layers)}) != 1:
        raise ConfigError("kvp-prefix calibration needs one RMSNorm epsilon in every layer")
    run = _Calibration(ad, out, config, l, choose_rank(ad.shape, l, config.rank, config.max_mb))
    run.meta["base"] = {"name": model_name, "shape": ad.shape.to_json(), "fingerprint": weights_fingerprint(model),
                        "tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None}
    if resume:
        run.resume()
    elif (out / "config.json").exists():
        raise CheckpointError(f"{out} already holds a checkpoint; pass resume=True (--resume) or another directory")
    if corpus is None:
        if tokenizer is None:
            raise ConfigError("calibrate_prefix needs a tokenizer or a corpus")
        built = calibration_corpus(tokenizer, config.lsq_tokens, config.seq_len, seed=config.seed,
                                   task_share=config.task_share)
        corpus = built.sequences
        run.meta["task_ids"], run.meta["calibration_tokens"] = built.task_ids, built.tokens
    zero = PrefixPredictor.zero_shot(model, l)
    run.start = time.perf_counter() - float(run.stats["seconds"])
    with torch.no_grad():
        run.accumulate(corpus, progress)
        run.fit(zero, progress)
        if heldout is None and tokenizer is not None and config.heldout_seqs:
            heldout = calibration_corpus(tokenizer, config.seq_len * config.heldout_seqs, config.seq_len,
                                         seed=config.seed + 12345, task_share=0.0).sequences
        if heldout and run.layers:
            fitted = _build_from(model, l, run.tensors, run.rank)
            run.meta["heldout_errors"] = {"zero-shot": prefix_errors(model, zero, heldout),
                                          "least-squares": prefix_errors(model, fitted, heldout),
                                          "sequences": len(heldout)}
        run.save(step=len(run.layers) + 1)
    (out / STATS_FILE).unlink(missing_ok=True)
    return KVPrefix(predictor=str(out))


class _Calibration:
    """One :func:`calibrate_prefix` run: the checkpoint's metadata and tensors, and the running
    Gram statistics (``gram`` ``(D+1, D+1)``, ``cross[j]`` ``(D+1, H_kv*d)`` for K and V)."""

    def __init__(self, ad: DecoderAdapter, out: Path, config: PrefixCalibration, layer: int, rank: int | None) -> None:
        self.ad, self.out, self.config, self.l, self.rank = ad, out, config, layer, rank
        self.layers = list(range(layer, ad.num_layers))
        self.meta: dict[str, Any] = {
            "variant": VARIANT, "layer": layer, "base": {},
            "maps": {"storage": "float16 corrections of the zero-shot map" + (f", rank {rank}" if rank else ", full rank"),
                     "rank": rank, "dtype": "float16"},
            "calibration": vars(config).copy(),
            "complete": False, "layers_done": [],
        }
        self.stats: dict[str, Any] = {"sequences_done": 0, "rows": 0, "gram": None, "cross": {}, "seconds": 0.0}
        self.tensors: dict[str, torch.Tensor] = {}
        self.start = time.perf_counter()

    def resume(self) -> None:
        """Continue the calibration in ``out``: its finished layers and saved statistics.

        Raises:
            CheckpointError: the checkpoint is for another model or layer.
        """
        old, self.tensors, _ = read_checkpoint(self.out)
        if old.get("variant") != VARIANT or old["base"].get("fingerprint") != self.meta["base"]["fingerprint"] \
                or old.get("layer") != self.l:
            raise CheckpointError(f"cannot resume {self.out}: it was calibrated for another model or layer")
        self.meta.update({k: old[k] for k in ("layers_done", "calibration_tokens", "task_ids") if k in old})
        if (self.out / STATS_FILE).is_file():
            self.stats = torch.load(self.out / STATS_FILE, weights_only=False)

    def save(self, step: int) -> None:
        self.meta["wall_seconds"] = time.perf_counter() - self.start
        write_checkpoint(self.out, self.tensors, self.meta, step=step, dtype=None)

    def _save_stats(self) -> None:
        self.stats["seconds"] = time.perf_counter() - self.start
        atomic_torch_save(self.out / STATS_FILE, self.stats)

    def accumulate(self, corpus: Sequence[torch.Tensor], progress: bool) -> None:
        """Add every sequence of ``corpus`` not yet counted to the Gram statistics (saved every
        ``checkpoint_every`` sequences)."""
        ad, l, stats = self.ad, self.l, self.stats
        todo = corpus[int(stats["sequences_done"]):] if len(self.meta["layers_done"]) < len(self.layers) else []
        bar = tqdm(total=len(corpus), initial=int(stats["sequences_done"]), desc=f"kvp-prefix l={l}: statistics",
                   disable=not progress or not todo)
        for ids in todo:
            inputs = _layer_inputs(ad, ids.to(ad.device), l)
            if not inputs:
                break
            x = _augment(ad.unit_rms(l, inputs[0]))  # (N, D+1)
            stats["gram"] = x.T @ x if stats["gram"] is None else stats["gram"] + x.T @ x
            for offset, j in enumerate(self.layers):
                k, v = ad.project_kv(j, inputs[offset])
                ck, cv = x.T @ _merged(k), x.T @ _merged(v)
                old = stats["cross"].get(j)
                stats["cross"][j] = (ck, cv) if old is None else (old[0] + ck, old[1] + cv)
            stats["sequences_done"] += 1
            stats["rows"] += int(ids.shape[1])
            bar.update(1)
            if stats["sequences_done"] % self.config.checkpoint_every == 0 and stats["sequences_done"] < len(corpus):
                self._save_stats()
                self.save(step=0)
        bar.close()
        if todo:
            self._save_stats()
        self.meta["rows"] = stats["rows"]

    def fit(self, zero: PrefixPredictor, progress: bool) -> None:
        """Solve the correction of every layer not yet done (saved after each); the run is then complete."""
        stats = self.stats
        for j in tqdm([j for j in self.layers if j not in self.meta["layers_done"]],
                      desc=f"kvp-prefix l={self.l}: least squares", disable=not progress):
            if stats["gram"] is None:
                raise ConfigError("kvp-prefix calibration got no data")
            for w, zmat, cross in zip(("k", "v"), zero.maps[j].augmented(), stats["cross"][j]):
                parts = _solve(stats["gram"], cross, zmat, self.config.ridge, self.rank)
                names = ("delta",) if len(parts) == 1 else ("a", "b")
                for name, part in zip(names, parts):
                    self.tensors[f"{w}.{j}.{name}"] = part.to(torch.float16)
            self.meta["layers_done"] = sorted([*self.meta["layers_done"], j])
            self.save(step=len(self.meta["layers_done"]))
        self.meta["complete"] = True


def _build_from(model: PreTrainedModel, layer: int, tensors: dict[str, torch.Tensor],
                rank: int | None) -> PrefixPredictor:
    """The calibrated :class:`PrefixPredictor` from in-memory checkpoint tensors."""
    shape = ModelShape.from_config(model.config)
    deltas = {j: (stored_delta(tensors, "k", j), stored_delta(tensors, "v", j)) for j in range(layer, shape.num_layers)}
    return PrefixPredictor.corrected(model, layer, deltas, rank)


def checkpoint_bytes(path: str | os.PathLike[str]) -> int:
    """Size of a checkpoint's weights file in bytes."""
    config, _, _ = read_checkpoint(path)
    return (Path(path) / config["weights"]).stat().st_size
