"""The dev-split prompts kvp-prefix distillation (:mod:`.distill`) trains on and selects its maps
by, kept apart from the prompts dev sweeps and gates score and from the calibration's own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastprefill.errors import ConfigError

__all__ = ["DEFAULT_HELDOUT", "DEFAULT_TRAIN", "DISTILL_SEED", "DistillPrompts", "distillation_prompts"]

#: Default training prompts: ``TASK:N`` dev prompts per task.
DEFAULT_TRAIN: tuple[str, ...] = ("singledoc-qa:24", "multidoc-qa:4", "humaneval-completion:4")
#: Default held-out prompts (the selection measure).
DEFAULT_HELDOUT: tuple[str, ...] = ("singledoc-qa:8",)
#: Distillation prompts are built with this seed (train) and the next (held-out).
DISTILL_SEED = 2000


@dataclass
class DistillPrompts:
    """Dev prompts for :func:`~.distill.distill_prefix`.

    Attributes:
        train, heldout: ``(1, T)`` int64 ids each.
        ids: the dev sample ids of both (to keep them out of dev evaluations).
    """

    train: list[torch.Tensor]
    heldout: list[torch.Tensor]
    ids: list[str]


def distillation_prompts(
    tokenizer: Any,
    train: Sequence[str] = DEFAULT_TRAIN,
    heldout: Sequence[str] = DEFAULT_HELDOUT,
    length: int = 1024,
    exclude: Sequence[str] = (),
    keep_out_n: int = 16,
    seed: int = DISTILL_SEED,
) -> DistillPrompts:
    """Dev-split task prompts for distillation, in the tasks' own chat template.

    Args:
        tokenizer: the base's tokenizer.
        train, heldout: ``"TASK:N"`` specs (registry task names).
        length: prompt tokens for sized tasks.
        exclude: sample ids never to use (a calibration's ``task_ids``).
        keep_out_n: the first ``n`` seed-0 dev prompts of each task (those dev sweeps and gates
            score) are never used either.
        seed: task seed of the training prompts (``seed + 1``: held-out).

    Raises:
        ConfigError: a malformed spec, an unknown task, a split too small.
    """
    from fastprefill.data.tasks import get_task

    def parse(spec: str) -> tuple[Any, int]:
        name, sep, n = spec.partition(":")
        if not sep or not n.isdigit() or int(n) < 1:
            raise ConfigError(f"distillation prompts are given as TASK:N with N >= 1, got {spec!r}")
        return get_task(name), int(n)

    def size(task: Any) -> int | None:
        return length if task.sized else None

    parsed = {role: [parse(s) for s in specs] for role, specs in (("train", train), ("heldout", heldout))}
    used = set(exclude)
    for task in {t.name: t for t, _ in (*parsed["train"], *parsed["heldout"])}.values():
        used |= {s.id for s in task.build(tokenizer, size(task), min(keep_out_n, len(task.source_ids("dev"))),
                                          split="dev", seed=0)}
    out: dict[str, list[torch.Tensor]] = {"train": [], "heldout": []}
    ids: list[str] = []
    for role, role_seed in (("train", seed), ("heldout", seed + 1)):
        for task, n in parsed[role]:
            ask = min(n + len(used), len(task.source_ids("dev")))
            samples = [s for s in task.build(tokenizer, size(task), ask, split="dev", seed=role_seed)
                       if s.id not in used][:n]
            if len(samples) < n:
                raise ConfigError(f"{task.name}: only {len(samples)} unused dev prompts, asked for {n}")
            used |= {s.id for s in samples}
            ids += [s.id for s in samples]
            out[role] += [torch.as_tensor(s.input_ids, dtype=torch.long).reshape(1, -1) for s in samples]
    return DistillPrompts(out["train"], out["heldout"], ids)
