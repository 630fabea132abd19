"""The task registry: :data:`TASKS` by name, :func:`get_task`, :func:`build_samples`.

It sits above the task modules (they import :mod:`.base`, this imports them), so the contract in
:mod:`.base` never imports a concrete task.
"""

from __future__ import annotations

from typing import Any

from fastprefill.data.tasks.base import Sample, Split, Task
from fastprefill.data.tasks.humaneval import HumanEvalCompletionTask, HumanEvalTask
from fastprefill.data.tasks.needle import NeedleTask
from fastprefill.data.tasks.qa import MultiDocQATask, SingleDocQATask
from fastprefill.errors import ConfigError

__all__ = ["TASKS", "build_samples", "get_task"]

TASKS: dict[str, Task] = {
    task.name: task
    for task in (MultiDocQATask(), SingleDocQATask(), NeedleTask(), HumanEvalTask(), HumanEvalCompletionTask())
}


def get_task(name: str) -> Task:
    """The registered task called ``name``.

    Raises:
        ConfigError: no such task (the message lists the known ones).
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


def build_samples(
    task: str | Task,
    tokenizer: Any,
    length: int | None,
    n: int | None,
    split: Split = "test",
    seed: int = 0,
) -> list[Sample]:
    """``get_task(task).build(tokenizer, length, n, split, seed)`` (a :class:`Task` is used as is)."""
    resolved = get_task(task) if isinstance(task, str) else task
    return resolved.build(tokenizer, length, n, split=split, seed=seed)
