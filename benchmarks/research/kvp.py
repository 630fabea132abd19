"""KV Prediction on the dev split: the kvp-prefix depth sweep and the dev gate of a KV predictor.

- :func:`l_sweep`: for each ``l``, kvp-prefix beside full prefill on the same prompts: first-token
  agreement, median first-token KL(full || method) and the TTFT FLOPs fraction (the method's
  FLOPs estimate to the first token over full prefill's, maps included).
- :func:`dev_gate`: the check a KV predictor must pass before any full run: mean held-out V
  error and median first-token KL on dev prompts (through :func:`~.ablation.run_ablation`, the
  base reading the whole predicted cache) against fixed thresholds.

Dev prompts should leave out the calibration's own task prompts (:func:`exclude_calibration`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from fastprefill.bench.runner import first_token_kl
from fastprefill.methods.base import Method
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction import KVPrediction
from fastprefill.methods.kv_prediction.auxiliary.fit import kv_relative_errors
from fastprefill.methods.kv_prediction.prefix import KVPrefix
from reporting import error_summary
from research.ablation import run_ablation

__all__ = ["GATE_KL", "GATE_V_ERROR", "GateResult", "dev_gate", "exclude_calibration", "l_sweep"]

#: Dev gate thresholds: mean held-out relative V error, median first-token KL (nats).
GATE_V_ERROR = 0.5
GATE_KL = 1.0


def exclude_calibration(samples: Sequence[Any], meta: Mapping[str, Any]) -> list[Any]:
    """``samples`` without those whose id is among a checkpoint's calibration prompts (``task_ids``)."""
    used = set(meta.get("task_ids") or ())
    return [s for s in samples if s.id not in used]


@torch.inference_mode()
def l_sweep(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    layers: Sequence[int],
    progress: bool = True,
    extra: Sequence[tuple[int, Method]] = (),
) -> list[dict[str, Any]]:
    """kvp-prefix at each ``l`` of ``layers`` against full prefill on ``prompts``.

    Args:
        model: the base.
        prompts: ``(1, T)`` int64 ids.
        layers: the depths to try with zero-shot maps (``KVPrefix(layer=l)``).
        extra: further ``(l, method)`` rows after ``layers`` (calibrated maps beside the zero-shot
            ones at the same ``l``), against the same full-prefill references.

    Returns:
        One row per ``l`` of ``layers``, then one per ``extra``: ``layer``, ``method``, ``n``, ``first_token_agreement``,
        ``median_kl_nats``, ``mean_kl_nats``, ``ttft_flops_fraction`` (median over prompts),
        ``token_layer_fraction`` (mean).
    """
    refs = []
    for ids in tqdm(prompts, desc="full prefill", disable=not progress):
        out = FullPrefill().prefill(model, ids)
        refs.append((out.logits, out.stats.flops))
    rows = []
    for l, method in [*((l, KVPrefix(layer=l)) for l in layers), *extra]:
        agree, kl, flops, tl = [], [], [], []
        for ids, (ref, ref_flops) in tqdm(list(zip(prompts, refs)), desc=f"l={l}", disable=not progress):
            out = method.prefill(model, ids)
            agree.append(float(out.logits.argmax() == ref.argmax()))
            kl.append(first_token_kl(ref, out.logits))
            flops.append(out.stats.flops / ref_flops)
            tl.append(out.stats.fraction)
        rows.append({"layer": l, "method": method.describe(), "n": len(prompts),
                     "first_token_agreement": statistics.mean(agree), "median_kl_nats": statistics.median(kl),
                     "mean_kl_nats": statistics.mean(kl), "ttft_flops_fraction": statistics.median(flops),
                     "token_layer_fraction": statistics.mean(tl)})
    return rows


def lsweep_table(header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table of an :func:`l_sweep` result file (its ``header`` and ``rows``)."""
    lines = [f"# kvp-prefix l-sweep, {header['model']}, {header['task']} (dev), n={header['n']}", "",
             f"Command: `{header['command']}`", "",
             "| l | maps | first-token agreement | median KL (nats) | TTFT FLOPs fraction | token-layers |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['method']} | {100 * r['first_token_agreement']:.0f}% | {r['median_kl_nats']:.3f} | "
              f"{r['ttft_flops_fraction']:.3f} | {100 * r['token_layer_fraction']:.0f}% |" for r in rows]
    return "\n".join(lines) + "\n"


@dataclass
class GateResult:
    """The dev gate's verdict and the numbers behind it.

    Attributes:
        passed: both thresholds met.
        mean_v_error: mean over base layers of the held-out relative V error.
        median_kl_nats: median first-token KL(full prefill || predicted cache) on the dev prompts.
        first_token_agreement: share of dev prompts whose first token equals full prefill's.
        n_prompts: dev prompts used.
        thresholds: ``{"mean_v_error": ..., "median_kl_nats": ...}``.
        errors: the per-layer held-out errors (:func:`kv_relative_errors`) and their means.
    """

    passed: bool
    mean_v_error: float
    median_kl_nats: float
    first_token_agreement: float
    n_prompts: int
    thresholds: dict[str, float]
    errors: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: mean held-out V error {self.mean_v_error:.3f} (<= {self.thresholds['mean_v_error']}), "
                f"median first-token KL {self.median_kl_nats:.3f} nats (<= {self.thresholds['median_kl_nats']}) "
                f"on {self.n_prompts} dev prompts; first-token agreement {100 * self.first_token_agreement:.0f}%")


def dev_gate(
    base: PreTrainedModel,
    method: KVPrediction,
    prompts: Sequence[torch.Tensor],
    heldout: Sequence[torch.Tensor],
    v_error_max: float = GATE_V_ERROR,
    kl_max: float = GATE_KL,
    progress: bool = True,
) -> GateResult:
    """Gate a KV predictor on dev data before any full run.

    Args:
        base: the base model.
        method: the :class:`KVPrediction` (any source: aux KV or aux hidden states).
        prompts: dev prompts ``(1, T)`` (16 in the issue's protocol).
        heldout: held-out text ``(1, N)`` for the per-layer V error.
        v_error_max, kl_max: the thresholds.

    Returns:
        A :class:`GateResult` (pass/fail with the numbers).
    """
    aux = method.bind(base)
    predictor = method.predictor
    errors = kv_relative_errors(base, aux, predictor, heldout)
    rows = run_ablation(base, lambda ids: predictor(predictor.features(aux, ids)[0], dtype=base.dtype), prompts,
                        {"predicted K and V": lambda p, t: p}, progress=progress)
    row = rows[0]
    mean_v = statistics.mean(errors["v"])
    return GateResult(
        passed=mean_v <= v_error_max and row["median_kl_nats"] <= kl_max,
        mean_v_error=mean_v, median_kl_nats=row["median_kl_nats"],
        first_token_agreement=row["first_token_agreement"], n_prompts=len(prompts),
        thresholds={"mean_v_error": v_error_max, "median_kl_nats": kl_max},
        errors={**errors, **error_summary(errors)},
    )
