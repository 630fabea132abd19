"""Benchmark tasks built from packaged public data, sized in tokens of the target tokenizer.

Five tasks (see :data:`TASKS`), one module per family:

* ``multidoc-qa``, ``singledoc-qa`` (:mod:`.qa`): HotpotQA / SQuAD v2 questions whose gold
  paragraphs sit among distractors; token F1 and exact match.
* ``needle`` (:mod:`.needle`): passkey retrieval at a given depth of essay text.
* ``humaneval``, ``humaneval-completion`` (:mod:`.humaneval`): HumanEval, executed in the
  sandbox; pass@1. Natural length, not sized.

The contract (:class:`Task`, :class:`Sample`) and the dev/test splits live in :mod:`.base`, the
token-budget fitting shared by the sized tasks in :mod:`.sizing`, the registry in :mod:`.registry`.

Every prompt but ``humaneval-completion``'s is the user turn of the tokenizer's chat template
when it has one (``apply_chat_template(..., add_generation_prompt=True)``), else the raw text.
``Sample.input_ids`` are ``tokenizer(prompt, add_special_tokens=False)`` for templated prompts
(the template already holds BOS and the like, and this equals
``apply_chat_template(..., tokenize=True)``) and ``tokenizer(prompt)`` otherwise.

**Determinism.** Samples depend only on (task, tokenizer, length, split, seed) and are stable in
``n``: ``build(n=5)[:3] == build(n=3)``. (Where in the tolerance window a prompt ends may depend
on the samples built before it in the same call, whose sizes tune the first guess.)
"""

from __future__ import annotations

from fastprefill.data.tasks.base import DEV_FRACTION, SPLITS, Sample, Split, Task, split_of
from fastprefill.data.tasks.humaneval import (
    COMPLETION_STOPS,
    HumanEvalCompletionTask,
    HumanEvalTask,
    cut_completion,
    extract_code,
    humaneval_program,
)
from fastprefill.data.tasks.needle import NeedleTask
from fastprefill.data.tasks.qa import MultiDocQATask, SingleDocQATask
from fastprefill.data.tasks.registry import TASKS, build_samples, get_task

__all__ = [
    "COMPLETION_STOPS",
    "DEV_FRACTION",
    "SPLITS",
    "TASKS",
    "HumanEvalCompletionTask",
    "HumanEvalTask",
    "MultiDocQATask",
    "NeedleTask",
    "Sample",
    "SingleDocQATask",
    "Split",
    "Task",
    "build_samples",
    "cut_completion",
    "extract_code",
    "get_task",
    "humaneval_program",
    "split_of",
]
