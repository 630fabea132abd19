"""Benchmark data: packaged public data sets, sized tasks, metrics and the code sandbox.

Importing this package reads no data: every data set is loaded on first use and cached.
"""

from fastprefill.data.metrics import exact_match, needle_score, normalize_answer, pass_at_1, qa_f1
from fastprefill.data.sandbox import SandboxResult, run_python
from fastprefill.data.tasks import (
    SPLITS,
    TASKS,
    HumanEvalTask,
    MultiDocQATask,
    NeedleTask,
    Sample,
    SingleDocQATask,
    Task,
    build_samples,
    get_task,
    split_of,
)

__all__ = [
    "SPLITS",
    "TASKS",
    "HumanEvalTask",
    "MultiDocQATask",
    "NeedleTask",
    "Sample",
    "SandboxResult",
    "SingleDocQATask",
    "Task",
    "build_samples",
    "exact_match",
    "get_task",
    "needle_score",
    "normalize_answer",
    "pass_at_1",
    "qa_f1",
    "run_python",
    "split_of",
]
