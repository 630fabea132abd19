"""KL distillation of kvp-prefix maps (SwiftKV's second step, arXiv 2410.03960, applied to the
maps only): start from a least-squares checkpoint (:func:`~.calibrate.calibrate_prefix`) and refine
its corrections so that the base, reading the predicted KV, gives the same next-token
distributions as its own full prefill.

**Objective.** For a prompt cut at ``t`` tokens (its end, or a random earlier point) the base's
exact states are computed once, before training, without gradients: ``h_l`` ``(1, T, D)`` (the
input of layer ``l``) and the last layer's output ``h_L`` ``(1, T, D)``. A training step runs
kvp-prefix exactly as :meth:`~.method.KVPrefix.prefill` does with ``tail = W``: the maps predict
K/V of rows ``0..t-W-1`` at every layer ``j >= l`` from ``h_l``, and the last ``W`` rows run
through layers ``l..L-1`` over them. The loss is the mean over those ``W`` rows of
``KL(softmax(head(h_L)) || softmax(head(tail)))``; only the corrections get gradients (the base
is frozen, its own zero-shot part of the map too). At the prompt's end the last row is the first
answer token's distribution, which is what the tasks score.

**Parameters.** The checkpoint's own layout: per later layer ``j`` and for K and V either the
rank-``r`` factors ``a`` ``(D + 1, r)``, ``b`` ``(r, H_kv*d)`` or the full ``delta``
``(D + 1, H_kv*d)``; trained in float32, stored in float16 as before, so
:class:`~.method.KVPrefix` loads the result unchanged.

**Selection.** Every ``eval_every`` steps the mean tail KL on held-out prompts (cut at their end)
is measured; the checkpoint keeps the best maps (step 0 is the least-squares maps, so the result
is never worse than them on that measure). Resumable: optimiser state and the RNG position are
saved with each evaluation.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from fastprefill.errors import ConfigError, check_fields
from fastprefill.methods.kv_prediction.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from fastprefill.methods.kv_prediction.prefix.calibrate import exact_hidden
from fastprefill.methods.kv_prediction.prefix.distill_prompts import (
    DEFAULT_HELDOUT,
    DEFAULT_TRAIN,
    DISTILL_SEED,
    distillation_prompts,
)
from fastprefill.methods.kv_prediction.prefix.method import KVPrefix, predicted_tail
from fastprefill.methods.kv_prediction.prefix.predictor import VARIANT, PrefixPredictor
from fastprefill.models.adapters import DecoderAdapter

__all__ = [
    "PrefixDistillation",
    "PrefixTargets",
    "distill_on_dev",
    "distill_prefix",
    "prefix_targets",
    "read_distill_source",
    "tail_kl",
]

@dataclass(frozen=True)
class PrefixDistillation:
    """Settings of :func:`distill_prefix` (validated; recorded in the checkpoint).

    Attributes:
        steps: optimiser steps.
        batch: prompts per step (gradients averaged).
        lr: Adam learning rate on the corrections.
        tail: ``W``, rows run exactly during training (as ``KVPrefix(tail=W)`` at inference).
        end_share: share of training cuts at the prompt's end (the rest uniform in
            ``[tail + min_prefix, T]``).
        min_prefix: fewest predicted rows in a random cut.
        eval_every: steps between held-out evaluations (and saves).
        grad_clip: global gradient-norm clip (``0``: none).
        seed: cut and prompt order.
    """

    steps: int = 200
    batch: int = 2
    lr: float = 3e-5
    tail: int = 32
    end_share: float = 0.5
    min_prefix: int = 64
    eval_every: int = 25
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("steps", self.steps >= 1, ">= 1"),
            ("batch", self.batch >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"),
            ("tail", self.tail >= 1, ">= 1"),
            ("end_share", 0.0 <= self.end_share <= 1.0, "in [0, 1]"),
            ("min_prefix", self.min_prefix >= 1, ">= 1"),
            ("eval_every", self.eval_every >= 1, ">= 1"),
            ("grad_clip", self.grad_clip >= 0, ">= 0"),
        ]
        check_fields(self, checks)


@dataclass
class PrefixTargets:
    """One prompt's exact states (float32, on the model's device).

    Attributes:
        h_l: ``(1, T, D)``, the input of layer ``l``.
        h_final: ``(1, T, D)``, the last layer's output (before the final norm).
    """

    h_l: torch.Tensor
    h_final: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.h_l.shape[1])


@torch.no_grad()
def prefix_targets(model: PreTrainedModel, layer: int, prompts: Sequence[torch.Tensor],
                   progress: bool = True, desc: str = "exact states") -> list[PrefixTargets]:
    """The base's exact ``h_l`` and ``h_L`` for each prompt ``(1, T)`` (one full forward each)."""
    ad = DecoderAdapter(model, "kvp-prefix distillation")
    out = []
    for ids in tqdm(prompts, desc=desc, disable=not progress):
        states = exact_hidden(ad, ids.to(ad.device), [layer, ad.num_layers])
        out.append(PrefixTargets(states[layer].float(), states[ad.num_layers].float()))
    return out


class _Maps(torch.nn.Module):
    """Trainable corrections on top of the frozen zero-shot maps (layout of the checkpoint)."""

    def __init__(self, model: PreTrainedModel, layer: int, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        zero = PrefixPredictor.zero_shot(model, layer)
        self.layer = layer
        self.layers = list(zero.maps)
        device = next(model.parameters()).device
        self.zero: dict[str, torch.Tensor] = {}
        self.parts = torch.nn.ParameterDict()
        for j, zmap in zero.maps.items():
            for w, zmat in zip(("k", "v"), zmap.augmented()):
                self.zero[f"{w}.{j}"] = zmat.to(device, torch.float32)
                names = ("delta",) if f"{w}.{j}.delta" in state else ("a", "b")
                for name in names:
                    key = f"{w}.{j}.{name}"
                    if key not in state:
                        raise CheckpointError(f"kvp-prefix checkpoint lacks tensor {key!r}")
                    self.parts[key.replace(".", "_")] = torch.nn.Parameter(state[key].to(device, torch.float32))

    def predict(self, ad: DecoderAdapter, hidden: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Pre-rotation ``{j: (K_j, V_j)}``, each ``(1, H_kv, N, d)`` in the model's dtype, from
        ``h_l`` ``(1, N, D)`` (:meth:`PrefixPredictor.predict`'s contract, differentiable)."""
        x = ad.unit_rms(self.layer, hidden).float()
        x1 = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)  # (1, N, D+1)
        out = {}
        for j in self.layers:
            kv = []
            for w in ("k", "v"):
                y = x1 @ self.zero[f"{w}.{j}"]
                if f"{w}_{j}_delta" in self.parts:
                    y = y + x1 @ self.parts[f"{w}_{j}_delta"]
                else:
                    y = y + (x1 @ self.parts[f"{w}_{j}_a"]) @ self.parts[f"{w}_{j}_b"]
                kv.append(ad.split_heads(y.to(ad.dtype)))
            out[j] = (kv[0], kv[1])
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """The corrections under their checkpoint names (float16, CPU)."""
        return {key.replace("_", "."): p.detach().to("cpu", torch.float16) for key, p in self.parts.items()}


def _tail_logprobs(ad: DecoderAdapter, maps: _Maps, target: PrefixTargets, cut: int, tail: int) -> torch.Tensor:
    """kvp-prefix on the first ``cut`` rows with ``tail`` exact rows: log-probs ``(W, V)`` of the tail."""
    h = target.h_l[:, :cut].to(ad.dtype)  # (1, t, D)
    positions = torch.arange(cut, device=h.device)[None]
    rows = predicted_tail(ad, lambda x: maps.predict(ad, x), h, positions, ad.rotary(h, positions),
                          DynamicCache(config=ad.config), maps.layer, cut - tail)
    return torch.log_softmax(ad.head(rows)[0], dim=-1)


def _kl_rows(ad: DecoderAdapter, maps: _Maps, target: PrefixTargets, cut: int,
             tail: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tail row: KL(full prefill || kvp-prefix) ``(W,)``, and both log-probs ``(W, V)``."""
    with torch.no_grad():
        ref = torch.log_softmax(ad.head(target.h_final[:, cut - tail:cut].to(ad.dtype))[0], dim=-1)
    got = _tail_logprobs(ad, maps, target, cut, tail)
    return (ref.exp() * (ref - got)).sum(-1), ref, got


def tail_kl(ad: DecoderAdapter, maps: _Maps, target: PrefixTargets, cut: int, tail: int) -> torch.Tensor:
    """Mean over the ``tail`` rows ending at ``cut`` of KL(full prefill || kvp-prefix), in nats (scalar)."""
    return _kl_rows(ad, maps, target, cut, tail)[0].mean()


def _evaluate(ad: DecoderAdapter, maps: _Maps, targets: Sequence[PrefixTargets], tail: int) -> dict[str, float]:
    """Held-out prompts cut at their end: mean tail KL, mean last-row KL, last-row agreement."""
    tail_kls, last_kls, agree = [], [], []
    with torch.no_grad(), ad.attention_scope():
        for t in targets:
            kl, ref, got = _kl_rows(ad, maps, t, t.length, tail)
            tail_kls.append(float(kl.mean()))
            last_kls.append(float(kl[-1]))
            agree.append(float(ref[-1].argmax() == got[-1].argmax()))
    n = max(len(targets), 1)
    return {"tail_kl": sum(tail_kls) / n, "first_token_kl": sum(last_kls) / n, "first_token_agreement": sum(agree) / n}


def distill_prefix(
    model: PreTrainedModel,
    predictor: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: PrefixDistillation,
    train: Sequence[PrefixTargets],
    heldout: Sequence[PrefixTargets],
    *,
    task_ids: Sequence[str] = (),
    resume: bool = False,
    progress: bool = True,
) -> KVPrefix:
    """Refine a least-squares kvp-prefix checkpoint by KL distillation; write ``out_dir``.

    Args:
        model: the base the checkpoint was calibrated for (frozen here).
        predictor: the least-squares checkpoint directory (:func:`~.calibrate.calibrate_prefix`).
        out_dir: the new checkpoint directory (another directory than ``predictor``).
        config: :class:`PrefixDistillation`.
        train: :func:`prefix_targets` of the training prompts (each longer than ``tail``).
        heldout: :func:`prefix_targets` of held-out prompts (the selection measure).
        task_ids: dev sample ids of the train and held-out prompts, added to the checkpoint's
            ``task_ids`` so dev evaluations leave them out.
        resume: continue an interrupted run in ``out_dir``.
        progress: a tqdm bar.

    Returns:
        :class:`~.method.KVPrefix` loaded from ``out_dir`` (the best maps on ``heldout``).

    Raises:
        ConfigError: ``out_dir`` equal to ``predictor``, no training prompts, a prompt not longer
            than ``tail``, an existing checkpoint in ``out_dir`` without ``resume``.
        CheckpointError: ``predictor`` is not a finished kvp-prefix checkpoint or is for another
            model; ``resume`` of a run with other settings.
    """
    src, out = Path(predictor), Path(out_dir)
    if src.resolve() == out.resolve():
        raise ConfigError("distill_prefix writes a new checkpoint: out_dir must differ from the predictor directory")
    if not train:
        raise ConfigError("distill_prefix needs at least one training prompt")
    short = [t.length for t in (*train, *heldout) if t.length <= config.tail]
    if short:
        raise ConfigError(f"every distillation prompt must be longer than tail={config.tail} tokens; got {short[:4]}")
    KVPrefix(predictor=str(src)).bind(model)  # shape and weights checks
    base_meta, state, _ = read_checkpoint(src)
    if base_meta.get("distillation"):
        raise ConfigError(f"{src} is already distilled; distill its least-squares checkpoint instead")
    ad = DecoderAdapter(model, "kvp-prefix distillation")
    if int(base_meta["layer"]) >= ad.num_layers:
        raise ConfigError(f"{src} runs every layer exactly (l = {base_meta['layer']}): there are no maps to distill")
    run = _Distillation(ad, _Maps(model, int(base_meta["layer"]), state), config, src, out, base_meta, task_ids,
                        len(train), heldout)
    if resume:
        run.resume()
    elif (out / "config.json").exists():
        raise ConfigError(f"{out} already holds a checkpoint; pass resume=True (--resume) or another directory")
    run.start = time.perf_counter() - float(run.record["seconds"])
    if not run.record["curve"]:
        run.evaluate(0)
        run.save()
    frozen = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in frozen:
            p.requires_grad_(False)
        run.train(train, progress)
    finally:
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    return KVPrefix(predictor=str(out))


class _Distillation:
    """One :func:`distill_prefix` run: the maps and their optimiser, the checkpoint's metadata, the
    run's record (settings, held-out curve, best step) and the best maps so far."""

    def __init__(self, ad: DecoderAdapter, maps: _Maps, config: PrefixDistillation, src: Path, out: Path,
                 base_meta: dict[str, Any], task_ids: Sequence[str], train_prompts: int,
                 heldout: Sequence[PrefixTargets]) -> None:
        self.ad, self.maps, self.config, self.out, self.heldout = ad, maps, config, out, heldout
        self.base_meta = base_meta
        self.opt = torch.optim.Adam(maps.parameters(), lr=config.lr)
        self.meta: dict[str, Any] = {k: v for k, v in base_meta.items()
                                     if k not in ("format", "version", "step", "weights", "weights_sha256", "train_state")}
        self.meta["maps"] = {**base_meta.get("maps", {}), "fit": "least squares, then KL distillation"}
        self.meta["task_ids"] = sorted({*base_meta.get("task_ids", []), *task_ids})
        self.record: dict[str, Any] = {"settings": vars(config).copy(), "from": str(src), "train_prompts": train_prompts,
                                       "heldout_prompts": len(heldout), "curve": [], "best_step": 0, "step": 0,
                                       "seconds": 0.0}
        self.rng = random.Random(config.seed)
        self.best_state = maps.state()
        self.start = time.perf_counter()

    def resume(self) -> None:
        """Continue the run in ``out``: its record, best maps, current maps, optimiser and RNG.

        Raises:
            CheckpointError: no distillation run with these settings there.
        """
        old, old_state, train_state = read_checkpoint(self.out, with_train_state=True)
        if old.get("variant") != VARIANT or (old.get("distillation") or {}).get("settings") != self.record["settings"] \
                or train_state is None:
            raise CheckpointError(f"cannot resume {self.out}: no distillation run with these settings there")
        self.record = old["distillation"]
        self.best_state = old_state
        with torch.no_grad():
            for key, p in self.maps.parts.items():
                p.copy_(train_state["current"][key])
        self.opt.load_state_dict(train_state["optimizer"])
        self.rng.setstate(train_state["rng"])

    def save(self) -> None:
        """Write the best maps with the run's state (current maps, optimiser, RNG) to resume from."""
        self.record["seconds"] = time.perf_counter() - self.start
        self.meta["distillation"] = self.record
        self.meta["wall_seconds"] = float(self.base_meta.get("wall_seconds", 0.0)) + self.record["seconds"]
        train_state = {"current": {k: p.detach().cpu().clone() for k, p in self.maps.parts.items()},
                       "optimizer": self.opt.state_dict(), "rng": self.rng.getstate()}
        write_checkpoint(self.out, self.best_state, self.meta, step=int(self.record["step"]), train_state=train_state,
                         dtype=None)

    def evaluate(self, step: int) -> None:
        """Measure the held-out prompts; keep the maps if they are the best so far."""
        score = {"step": step, **_evaluate(self.ad, self.maps, self.heldout, self.config.tail), "train_loss": None}
        self.record["curve"].append(score)
        best = min(self.record["curve"], key=lambda r: r["tail_kl"])
        if best is score:
            self.record["best_step"] = step
            self.best_state = self.maps.state()

    def train(self, train: Sequence[PrefixTargets], progress: bool) -> None:
        """Optimiser steps up to ``config.steps``, evaluated and saved every ``eval_every``."""
        config, record = self.config, self.record
        bar = tqdm(total=config.steps, initial=int(record["step"]), desc="kvp-prefix distillation",
                   disable=not progress)
        losses: list[float] = []
        try:
            with self.ad.attention_scope():
                while record["step"] < config.steps:
                    losses += self._step(train)
                    record["step"] += 1
                    bar.update(1)
                    bar.set_postfix(loss=f"{sum(losses[-8:]) / len(losses[-8:]):.3f}")
                    if record["step"] % config.eval_every == 0 or record["step"] == config.steps:
                        self.evaluate(int(record["step"]))
                        record["curve"][-1]["train_loss"] = sum(losses) / len(losses) if losses else math.nan
                        losses = []
                        self.save()
        finally:
            bar.close()

    def _step(self, train: Sequence[PrefixTargets]) -> list[float]:
        """One optimiser step over ``batch`` random cuts of training prompts; their losses."""
        config, rng = self.config, self.rng
        self.opt.zero_grad(set_to_none=True)
        losses = []
        for _ in range(config.batch):
            target = train[rng.randrange(len(train))]
            lo = min(config.tail + config.min_prefix, target.length)
            cut = target.length if rng.random() < config.end_share else rng.randint(lo, target.length)
            loss = tail_kl(self.ad, self.maps, target, cut, config.tail) / config.batch
            loss.backward()
            losses.append(float(loss.detach()) * config.batch)
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.maps.parameters(), config.grad_clip)
        self.opt.step()
        return losses


def read_distill_source(predictor: str | os.PathLike[str], layer: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint to distill (its ``layer``, ``task_ids``), read before any
    model is loaded.

    Raises:
        ConfigError: no readable checkpoint config there, or ``layer`` given and not its ``l``.
    """
    try:
        config = json.loads(Path(predictor, "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{predictor}: no readable kvp-prefix checkpoint to distill ({exc})") from None
    if layer is not None and layer != config.get("layer"):
        raise ConfigError(f"--layer {layer} but {predictor} is calibrated at l={config.get('layer')}")
    return config


def distill_on_dev(
    model: PreTrainedModel,
    tokenizer: Any,
    predictor: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: PrefixDistillation,
    *,
    train: Sequence[str] = DEFAULT_TRAIN,
    heldout: Sequence[str] = DEFAULT_HELDOUT,
    length: int = 1024,
    keep_out_n: int = 16,
    seed: int = DISTILL_SEED,
    resume: bool = False,
    progress: bool = True,
) -> tuple[KVPrefix, dict[str, Any]]:
    """:func:`distillation_prompts`, their :func:`prefix_targets`, then :func:`distill_prefix`.

    Args: as :func:`distillation_prompts` (``train``, ``heldout``, ``length``, ``keep_out_n``,
    ``seed``; the checkpoint's own ``task_ids`` are excluded) and :func:`distill_prefix`.

    Returns:
        The distilled :class:`~.method.KVPrefix` and ``{"train_prompts": {"specs", "n", "tokens"},
        "heldout_prompts": {"specs", "n"}, "exact_states_seconds"}``.
    """
    source = read_distill_source(predictor)
    prompts = distillation_prompts(tokenizer, train, heldout, length, exclude=source.get("task_ids", []),
                                   keep_out_n=keep_out_n, seed=seed)
    layer = int(source["layer"])
    t0 = time.perf_counter()
    train_t = prefix_targets(model, layer, prompts.train, progress=progress, desc="exact states (train)")
    heldout_t = prefix_targets(model, layer, prompts.heldout, progress=progress, desc="exact states (held-out)")
    seconds = time.perf_counter() - t0
    method = distill_prefix(model, predictor, out_dir, config, train_t, heldout_t, task_ids=prompts.ids,
                            resume=resume, progress=progress)
    info = {"train_prompts": {"specs": list(train), "n": len(train_t), "tokens": sum(t.length for t in train_t)},
            "heldout_prompts": {"specs": list(heldout), "n": len(heldout_t)}, "exact_states_seconds": seconds}
    return method, info
