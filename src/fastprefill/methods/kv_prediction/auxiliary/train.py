"""Training KV predictors: a closed-form least-squares fit, then a short gradient phase.

The paper (arXiv 2410.08391, Sec. 3.3) trains the predictor (and the aux model) end to end with

    loss = CE(base next-token predictions when attending to the *predicted* KV)
           + λ · Σ_l ( L1(K̂_l, K_l) + L1(V̂_l, V_l) )          [+ aux CE if the aux is trained]

for ~140B tokens. Two CPU cores allow far less, so (as METHODS.md suggests):

1. **Least squares** (:func:`~.fit.fit_least_squares`): each map's L2-optimal weights in
   closed form, from Gram matrices accumulated over the corpus (see :mod:`.fit`).
2. **Gradient refinement** (:func:`train_kvp` ``steps``): Adam on the maps (and the aux model if
   ``train_aux``), base frozen. Each step takes one training sequence of ``seq_len`` tokens; the
   aux model reads it, the maps predict the base KV at every layer, and the base runs the whole
   sequence with every layer attending to the *predicted* KV instead of its own
   (:func:`base_logits_on_kv`: each layer's cache hands back the predicted keys and values,
   causal by position), as the paper's reference code trains it. CE is on every next-token
   prediction; L1 is on the predicted KV against the true base KV (mean over elements, summed
   over layers). *Choice*: λ = 0.1 by default, so that the L1 sum over ~24-28 layers (the first
   row of a checkpoint's ``loss.json`` gives it at the start of the gradient phase) weighs about as
   much as the CE; the loss curve (``loss.png``) shows both terms.

**Data** (:func:`~fastprefill.methods.kv_prediction.corpus.training_corpus`), disjoint from every
reported evaluation: dev-split task prompts in the tasks' chat template (``task_share``, at least
a quarter of the tokens by default), Wikipedia paragraphs outside the ``test`` split and
standard-library Python code (see :mod:`.corpus`).

**Checkpoints**: every ``checkpoint_every`` steps and at the end, atomically
(:mod:`.checkpoint`); ``resume=True`` continues from the last one (the least-squares phase is
skipped if it finished). ``loss.png`` / ``loss.json`` hold the loss curve.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.cache import ReplayCache
from fastprefill.errors import ConfigError, check_fields
from fastprefill.methods.kv_prediction.auxiliary.fit import fit_least_squares, kv_relative_errors
from fastprefill.methods.kv_prediction.auxiliary.method import KVPrediction
from fastprefill.methods.kv_prediction.auxiliary.models import (
    AuxSpec,
    check_tokenizers,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from fastprefill.methods.kv_prediction.auxiliary.predictor import SOURCES, KVPredictor
from fastprefill.methods.kv_prediction.checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    read_checkpoint,
    write_checkpoint,
)
from fastprefill.methods.kv_prediction.corpus import calibration_corpus, training_corpus
from fastprefill.models.adapters import DecoderAdapter
from fastprefill.models.kv import prefix_kv, rotate_keys
from fastprefill.models.shape import ModelShape

__all__ = ["TrainConfig", "base_logits_on_kv", "train_kvp"]


# ----------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainConfig:
    """Settings of :func:`train_kvp` (validated; all recorded in the checkpoint).

    Attributes:
        lsq_tokens: tokens for the least-squares fit (>= seq_len).
        steps: gradient steps after it (0 = least squares only).
        seq_len: tokens per training sequence (least squares and gradient steps).
        lr: Adam learning rate.
        l1_weight: λ.
        ridge: least-squares ridge ρ (relative).
        checkpoint_every: gradient steps between checkpoints.
        train_aux: also train the aux model (adds its own CE); default: maps only.
        task_share: share of dev-split task prompts in the training text (:mod:`.corpus`).
        source: what the maps read from the aux (:data:`~.predictor.SOURCES`): its KV (the
            paper's), its normalised attention input, or two aux layers' inputs.
        heldout_seqs: held-out sequences (other seed, no task prompts) on which the per-layer
            errors are measured after least squares and again after the gradient phase.
        seed: data order.
    """

    lsq_tokens: int = 100_000
    steps: int = 200
    seq_len: int = 512
    lr: float = 1e-4
    l1_weight: float = 0.1
    ridge: float = 1e-4
    checkpoint_every: int = 25
    train_aux: bool = False
    task_share: float = 0.25
    source: str = "kv"
    heldout_seqs: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("seq_len", self.seq_len >= 4, ">= 4"),
            ("lsq_tokens", self.lsq_tokens >= self.seq_len, f">= seq_len ({self.seq_len})"),
            ("steps", self.steps >= 0, ">= 0"),
            ("lr", self.lr > 0, "> 0"),
            ("l1_weight", self.l1_weight >= 0, ">= 0"),
            ("ridge", self.ridge >= 0, ">= 0"),
            ("checkpoint_every", self.checkpoint_every >= 1, ">= 1"),
            ("task_share", 0.0 <= self.task_share <= 1.0, "in [0, 1]"),
            ("source", self.source in SOURCES, f"one of {SOURCES}"),
            ("heldout_seqs", self.heldout_seqs >= 0, ">= 0"),
        ]
        check_fields(self, checks)


def _plot_loss(out_dir: Path, history: list[dict[str, float]]) -> None:
    """Write ``loss.json`` and ``loss.png`` (matplotlib, Agg) atomically."""
    atomic_write_bytes(out_dir / "loss.json", json.dumps(history).encode())
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [h["step"] for h in history]
    for key in ("loss", "ce", "l1"):
        ax.plot(steps, [h[key] for h in history], label=key)
    ax.set_xlabel("gradient step")
    ax.set_ylabel("loss")
    ax.set_title("KV predictor training")
    ax.legend()
    fig.tight_layout()
    tmp = out_dir / ".loss.png.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_dir / "loss.png")


def base_logits_on_kv(
    base: PreTrainedModel, input_ids: torch.Tensor, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The base model's logits over ``input_ids`` ``(1, T)`` when every layer attends to ``kv``
    (one pre-rotation ``(K, V)`` ``(1, H_kv, T, d)`` per layer) instead of its own KV.

    Queries come from the base's own hidden states; position ``t`` attends to positions ``<= t``
    of ``kv`` (causal). With the base's true KV this equals the base's own forward (tested).
    Differentiable in ``kv``. Returns ``(1, T, V)`` float32 logits.
    """
    ad = DecoderAdapter(base, method="KV Prediction training")
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    hidden = ad.embed(input_ids)
    cos, sin = ad.rotary(hidden, positions)
    cache = ReplayCache([(rotate_keys(k, cos, sin), v) for k, v in kv])
    with ad.attention_scope():
        for idx in range(ad.num_layers):
            hidden = ad.layer(idx, hidden, positions, cache, mask=None, rotary=(cos, sin))
    return ad.head(hidden)


def _step_loss(
    base: PreTrainedModel, aux: PreTrainedModel, predictor: KVPredictor, ids: torch.Tensor, cfg: TrainConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """One sequence's loss: base CE with every layer on the predicted KV + λ·L1 (+ aux CE)."""
    with torch.no_grad():
        true_kv, _ = prefix_kv(base, ids)
    with torch.set_grad_enabled(cfg.train_aux):
        features, aux_logits = predictor.features(aux, ids, with_logits=cfg.train_aux)
    pred = predictor(features, dtype=base.dtype)
    logits = base_logits_on_kv(base, ids, pred)[0, :-1]
    ce = F.cross_entropy(logits, ids[0, 1:])
    l1 = sum(F.l1_loss(pk.float(), tk.float()) + F.l1_loss(pv.float(), tv.float())
             for (pk, pv), (tk, tv) in zip(pred, true_kv))
    loss = ce + cfg.l1_weight * l1
    parts = {"ce": float(ce.detach()), "l1": float(l1.detach())}
    if cfg.train_aux:
        aux_ce = F.cross_entropy(aux_logits[0, :-1], ids[0, 1:])
        loss = loss + aux_ce
        parts["aux_ce"] = float(aux_ce.detach())
    parts["loss"] = float(loss.detach())
    return loss, parts


def train_kvp(
    base: PreTrainedModel,
    aux: PreTrainedModel | AuxSpec,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: PreTrainedTokenizerBase,
    aux_tokenizer: PreTrainedTokenizerBase | None = None,
    base_name: str | None = None,
    aux_name: str | None = None,
    layer_map: Sequence[int] | None = None,
    config: TrainConfig | None = None,
    corpus: Sequence[torch.Tensor] | None = None,
    heldout: Sequence[torch.Tensor] | None = None,
    resume: bool = False,
    progress: bool = True,
) -> KVPrediction:
    """Train a KV predictor for ``base`` from ``aux`` and write checkpoints to ``out_dir``.

    Args:
        base: the base model (frozen; its ``requires_grad`` flags are restored afterwards).
        aux: the aux model (KVP-C), or :meth:`AuxSpec.layer_drop` (KVP-LP, built from ``base``).
        out_dir: checkpoint directory (see :mod:`.checkpoint`); ``loss.png`` goes there too.
        tokenizer: the base tokenizer (used for the corpus; fingerprinted in the checkpoint).
        aux_tokenizer: the aux model's tokenizer (KVP-C): must equal the base's.
        base_name, aux_name: zoo names recorded in the checkpoint (``aux_name`` lets
            :meth:`KVPrediction.load` load the aux model by itself).
        layer_map: ``a(l)``; default proportional.
        config: :class:`TrainConfig`.
        corpus: training sequences ``(1, N)``; default :func:`training_corpus`.
        heldout: sequences for the per-layer error report (relative error and centred R²,
            :func:`~.fit.kv_relative_errors`) after least squares (``heldout_errors.least_squares`` in
            ``config.json``) and after the gradient phase (``heldout_errors.after_gradient``);
            default ``heldout_seqs`` sequences of other-seed text.
        resume: continue from the checkpoint in ``out_dir`` (must exist).
        progress: tqdm bars.

    Returns:
        The trained :class:`KVPrediction` (also saved in ``out_dir``).

    Raises:
        TokenizerMismatchError: ``aux_tokenizer`` differs from ``tokenizer``.
        CheckpointError: ``resume`` without a checkpoint, or one made for other models.
    """
    cfg = config or TrainConfig()
    out = Path(out_dir)
    spec, aux_model = (aux, aux.build(base)) if isinstance(aux, AuxSpec) else (AuxSpec.model(aux_name), aux)
    if cfg.train_aux and spec.kind == "layer_drop":
        raise ConfigError("TrainConfig.train_aux must be False for a layer-drop aux: its layers are the base's own")
    if aux_tokenizer is not None:
        check_tokenizers(tokenizer, aux_tokenizer)
    predictor = KVPredictor(ModelShape.from_config(aux_model.config), ModelShape.from_config(base.config), layer_map,
                            source=cfg.source).to(base.device)
    run = _Training(base, aux_model, predictor, cfg, out)
    run.record_models(spec, tokenizer, base_name, aux_name)
    if resume:
        run.resume()
    elif (out / "config.json").exists():
        raise CheckpointError(f"{out} already holds a checkpoint; pass resume=True or another directory")
    flags = {id(p): p.requires_grad for m in (base, aux_model) for p in m.parameters()}
    run.start = time.perf_counter() - float(run.state["seconds"])
    try:
        base.requires_grad_(False)
        aux_model.requires_grad_(cfg.train_aux)
        corpus = run.data(tokenizer, corpus, heldout)
        if run.state["phase"] == "start":
            run.least_squares(corpus, progress)
        run.gradient(corpus, progress)
    finally:
        for m in (base, aux_model):
            for p in m.parameters():
                p.requires_grad_(flags.get(id(p), p.requires_grad))
    predictor.eval().requires_grad_(False)
    if cfg.train_aux:
        aux_model.save_pretrained(out / "aux-trained")  # load it and pass aux=... to KVPrediction.load
    return KVPrediction.load(out, aux=aux_model if spec.kind == "model" else None)


class _Training:
    """One :func:`train_kvp` run: the predictor, the checkpoint's metadata and the training state
    (phase, step, loss history, seconds, and the optimiser's state on resume)."""

    def __init__(self, base: PreTrainedModel, aux: PreTrainedModel, predictor: KVPredictor, cfg: TrainConfig,
                 out: Path) -> None:
        self.base, self.aux, self.predictor, self.cfg, self.out = base, aux, predictor, cfg, out
        self.meta: dict[str, Any] = {}
        self.state: dict[str, Any] = {"phase": "start", "step": 0, "history": [], "seconds": 0.0}
        self.optim_state: dict[str, Any] | None = None
        self.heldout: Sequence[torch.Tensor] = []
        self.start = time.perf_counter()

    def record_models(self, spec: AuxSpec, tokenizer: PreTrainedTokenizerBase, base_name: str | None,
                      aux_name: str | None) -> None:
        """The checkpoint's record of the models (names, shapes, fingerprints), the layer map and the settings."""
        predictor, cfg = self.predictor, self.cfg
        self.meta.update({
            "base": {"name": base_name, "shape": predictor.base_shape.to_json(),
                     "fingerprint": weights_fingerprint(self.base), "tokenizer": tokenizer_fingerprint(tokenizer)},
            "aux": {"spec": spec.to_json(), "name": aux_name or spec.name, "shape": predictor.aux_shape.to_json(),
                    "fingerprint": weights_fingerprint(self.aux) if spec.kind == "model" else None},
            "layer_map": list(predictor.layer_map), "source": cfg.source, "heldout_errors": {},
            "l1_weight": cfg.l1_weight, "train_config": vars(cfg).copy(),
        })

    def resume(self) -> None:
        """Continue from the checkpoint in ``out``.

        Raises:
            CheckpointError: no checkpoint there, or one made for other models.
        """
        ckpt, weights, train_state = read_checkpoint(self.out, with_train_state=True)
        if ckpt["base"].get("fingerprint") != self.meta["base"]["fingerprint"] \
                or ckpt["aux"].get("shape") != self.meta["aux"]["shape"]:
            raise CheckpointError(f"cannot resume {self.out}: it was trained for other base / aux models")
        self.predictor.load_state_dict(weights)
        self.meta["heldout_errors"] = ckpt.get("heldout_errors", {})
        if train_state:
            self.state = {k: train_state[k] for k in ("phase", "step", "history", "seconds")}
            self.optim_state = train_state.get("optimizer")

    def data(self, tokenizer: PreTrainedTokenizerBase, corpus: Sequence[torch.Tensor] | None,
             heldout: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """The training sequences on the base's device (default: calibration text, recorded in the
        metadata); the held-out ones (default: other-seed text) are kept for :meth:`report`."""
        cfg = self.cfg
        if corpus is None:
            built = calibration_corpus(tokenizer, cfg.lsq_tokens, cfg.seq_len, seed=cfg.seed, task_share=cfg.task_share)
            corpus = built.sequences
            self.meta["task_ids"], self.meta["calibration_tokens"] = built.task_ids, built.tokens
        if heldout is None:
            heldout = training_corpus(tokenizer, cfg.seq_len * cfg.heldout_seqs, cfg.seq_len, seed=cfg.seed + 12345,
                                      task_share=0.0) if cfg.heldout_seqs else []
        self.heldout = heldout
        return [ids.to(self.base.device) for ids in corpus]

    def report(self, phase: str) -> None:
        """The per-layer errors on the held-out sequences, under ``heldout_errors[phase]``."""
        if self.heldout:
            self.meta["heldout_errors"][phase] = kv_relative_errors(self.base, self.aux, self.predictor, self.heldout)

    def save(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Write a checkpoint (with the training state to resume from) and the loss curve."""
        state = self.state
        state["seconds"] = time.perf_counter() - self.start
        if self.cfg.train_aux:  # the aux weights change: record what they are now
            self.meta["aux"]["fingerprint"] = weights_fingerprint(self.aux)
        train_state = {**state, "optimizer": optimizer.state_dict() if optimizer else None}
        write_checkpoint(self.out, self.predictor.state_dict(), {**self.meta, "wall_seconds": state["seconds"]},
                         step=int(state["step"]), train_state=train_state)
        _plot_loss(self.out, state["history"])

    def least_squares(self, corpus: Sequence[torch.Tensor], progress: bool) -> None:
        """Fit the maps in closed form on the first ``lsq_tokens`` of ``corpus``; save."""
        lsq_seqs = corpus[: max(1, math.ceil(self.cfg.lsq_tokens / self.cfg.seq_len))]

        def pairs() -> Iterator[tuple[Any, Any]]:
            for ids in tqdm(lsq_seqs, desc="least squares (sequences)", disable=not progress):
                with torch.no_grad():
                    yield self.predictor.features(self.aux, ids)[0], prefix_kv(self.base, ids)[0]

        rows = fit_least_squares(self.predictor, pairs(), ridge=self.cfg.ridge)
        self.report("least_squares")
        self.state["phase"] = "gradient"
        self.state["lsq_rows"] = rows
        self.meta["lsq_rows"] = rows
        self.save(None)

    def gradient(self, corpus: Sequence[torch.Tensor], progress: bool) -> None:
        """Adam steps up to ``steps`` (one sequence each, in a seeded order), saved every
        ``checkpoint_every``; then the held-out errors after the gradient phase."""
        cfg, state = self.cfg, self.state
        params = list(self.predictor.parameters()) + (list(self.aux.parameters()) if cfg.train_aux else [])
        optimizer = torch.optim.Adam(params, lr=cfg.lr)
        if self.optim_state:
            optimizer.load_state_dict(self.optim_state)
        order = list(range(len(corpus)))
        random.Random(cfg.seed + 1).shuffle(order)
        bar = tqdm(total=cfg.steps, initial=int(state["step"]), desc="gradient steps", disable=not progress)
        while state["step"] < cfg.steps:
            ids = corpus[order[int(state["step"]) % len(order)]]
            loss, parts = _step_loss(self.base, self.aux, self.predictor, ids, cfg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            state["step"] += 1
            state["history"].append({"step": state["step"], **parts})
            bar.update(1)
            bar.set_postfix(ce=f"{parts['ce']:.3f}", l1=f"{parts['l1']:.3f}")
            if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.steps:
                self.save(optimizer)
        bar.close()
        if cfg.steps == 0:
            self.save(None)
        elif "after_gradient" not in self.meta["heldout_errors"]:
            self.report("after_gradient")
            self.save(optimizer)
