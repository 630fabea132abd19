"""Cache ablation: which part of a predicted KV cache breaks the base model's first token.

The base reads its own (true) prompt KV with one part replaced by the prediction (K or V, all
but the first positions, the lower or upper half of the layers), runs the last prompt token,
and its first-token distribution is compared with its own full prefill's: agreement of the
argmax and KL(full || variant).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from fastprefill.bench.runner import first_token_kl
from fastprefill.models.kv import cache_from_kv, prefix_kv

__all__ = ["KVList", "ablation_table", "ablation_variants", "run_ablation"]

#: Per-layer ``(K, V)``, each ``(1, H_kv, N, d)``, keys before rotation.
KVList = list[tuple[torch.Tensor, torch.Tensor]]
#: A variant builds the cache to read from ``(predicted, true)``.
Variant = Callable[[KVList, KVList], KVList]


def ablation_variants(sink: int) -> dict[str, Variant]:
    """Caches to test, each built from the predicted and the true per-layer ``(K, V)`` lists:
    the true KV with one part replaced by the prediction (``sink``: leading positions kept
    true in the "first positions exact" variant)."""

    def first_exact(p: KVList, t: KVList) -> KVList:
        return [(torch.cat([tk[:, :, :sink], pk[:, :, sink:]], 2), torch.cat([tv[:, :, :sink], pv[:, :, sink:]], 2))
                for (pk, pv), (tk, tv) in zip(p, t)]

    def layers(lo: float, hi: float) -> Variant:
        def pick(p: KVList, t: KVList) -> KVList:
            n = len(t)
            return [p[l] if int(lo * n) <= l < int(hi * n) else t[l] for l in range(n)]
        return pick

    return {
        "true KV (sanity)": lambda p, t: t,
        "predicted K and V": lambda p, t: p,
        "predicted V only": lambda p, t: [(tk, pv) for (_, pv), (tk, _) in zip(p, t)],
        "predicted K only": lambda p, t: [(pk, tv) for (pk, _), (_, tv) in zip(p, t)],
        f"predicted, first {sink} positions exact": first_exact,
        "predicted in the lower half of layers only": layers(0.0, 0.5),
        "predicted in the upper half of layers only": layers(0.5, 1.0),
    }


@torch.no_grad()
def run_ablation(
    base: PreTrainedModel,
    predict: Callable[[torch.Tensor], KVList],
    prompts: Sequence[torch.Tensor],
    variants: Mapping[str, Variant],
    progress: bool = True,
) -> list[dict[str, Any]]:
    """First-token agreement and KL of ``base`` reading each variant's cache.

    Args:
        base: the model whose cache is predicted.
        predict: ``(1, T - 1)`` prompt ids (all but the last) -> the predicted :data:`KVList`.
        prompts: ``(1, T)`` int64 ids.
        variants: name -> cache builder (:func:`ablation_variants`).

    Returns:
        One row per variant: ``variant``, ``first_token_agreement``, ``median_kl_nats``,
        ``mean_kl_nats`` (KL(full prefill || variant)).
    """
    agree: dict[str, list[float]] = {v: [] for v in variants}
    kl: dict[str, list[float]] = {v: [] for v in variants}
    for ids in tqdm(prompts, desc="ablate", disable=not progress):
        ref = base(input_ids=ids, logits_to_keep=1).logits[0, -1]  # (V,)
        true, _ = prefix_kv(base, ids[:, :-1])
        pred = predict(ids[:, :-1])
        for name, build in variants.items():
            cache = cache_from_kv(base, build(pred, true))
            logits = base(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            agree[name].append(float(logits.argmax() == ref.argmax()))
            kl[name].append(first_token_kl(ref, logits))
    return [{"variant": v, "first_token_agreement": statistics.mean(agree[v]),
             "median_kl_nats": statistics.median(kl[v]), "mean_kl_nats": statistics.mean(kl[v])} for v in variants]


def ablation_table(header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], title: str) -> str:
    """The ablation's markdown (``# <title>, <task> (<split>), n=<n>``, the command, the table)."""
    lines = [f"# {title}, {header['task']} ({header['split']}), n={header['n']}", "",
             f"Command: `{header['command']}`", "",
             ("The base reads its own (true) KV for the prompt with one part replaced by the prediction, then runs "
              "the last prompt token. Reference: the base's full prefill."), "",
             "| cache the base reads | first-token agreement | median KL (nats) | mean KL (nats) |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {100 * r['first_token_agreement']:.0f}% | {r['median_kl_nats']:.3f} | "
              f"{r['mean_kl_nats']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"
