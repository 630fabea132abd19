"""HumanEval (Chen et al., 2021), pass@1 through :func:`~fastprefill.data.sandbox.run_python`.

``humaneval``
    The HumanEval prompts as an instruction to complete the function (natural length, not
    sized), in a chat template when the tokenizer has one. The model's fenced code block is
    executed with the tests only through :mod:`fastprefill.data.sandbox`.
``humaneval-completion``
    The original HumanEval protocol: the raw problem prompt, no chat template; the model
    continues the function body, cut at the first line that starts a new top-level statement
    (``def``, ``class``, ``if``, ``print``, ``#``, a code fence). Outputs are shorter than
    ``humaneval``'s (no restated signature and docstring), so cheaper to decode.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from fastprefill.data import sources
from fastprefill.data.sandbox import run_python
from fastprefill.data.tasks.base import RecordTask, Sample
from fastprefill.data.tasks.sizing import Encoder, Overhead

__all__ = [
    "COMPLETION_STOPS",
    "HumanEvalCompletionTask",
    "HumanEvalTask",
    "cut_completion",
    "extract_code",
    "humaneval_program",
]

_HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, including its "
    "signature and any imports it needs, in a single ```python code block.\n\n```python\n{prompt}\n```"
)
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def _defines(code: str, entry_point: str) -> bool:
    """Whether ``code`` has a ``def entry_point(`` line."""
    return re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def extract_code(output: str, entry_point: str | None = None) -> str:
    """The code in a model's answer: the first fenced block that defines ``entry_point`` (else
    the first fenced block; an unclosed final block counts), or the raw output if there is none.
    A trailing ``if __name__ == "__main__":`` section is dropped."""
    blocks = _CODE_BLOCK.findall(output)
    code = output
    if blocks:
        code = blocks[0]
        if entry_point is not None:
            defining = [b for b in blocks if _defines(b, entry_point)]
            code = defining[0] if defining else code
    main = re.search(r"^if\s+__name__\s*==", code, re.MULTILINE)
    return code[: main.start()] if main else code


def humaneval_program(problem_prompt: str, code: str, test: str, entry_point: str) -> str:
    """The program that checks a completion: the problem prompt (imports, helpers, signature),
    then the completion (a whole function that redefines the stub, or the body that continues
    it), then the problem's tests and ``check(entry_point)``."""
    if _defines(code, entry_point):
        solution = problem_prompt.rstrip() + "\n\n\n" + code
    else:
        solution = problem_prompt + code
    return f"{solution.rstrip()}\n\n\n{test.strip()}\n\n\ncheck({entry_point})\n"


@dataclass(frozen=True)
class HumanEvalTask(RecordTask):
    """HumanEval completion, executed in :func:`~fastprefill.data.sandbox.run_python`."""

    name: ClassVar[str] = "humaneval"
    default_max_new_tokens: ClassVar[int] = 512
    sized: ClassVar[bool] = False
    timeout: float = 10.0
    memory_mb: int = 1024

    def _records(self) -> Sequence[sources.HumanEvalProblem]:
        return sources.humaneval()

    def _keys(self, record: sources.HumanEvalProblem) -> tuple[str, str]:
        return record.task_id, record.task_id

    def _encode(self, encoder: Encoder, problem: sources.HumanEvalProblem) -> tuple[str, list[int]]:
        """The prompt text and ids for ``problem``."""
        return encoder.encode(_HUMANEVAL_TEMPLATE.format(prompt=problem.prompt.rstrip()))

    def _code(self, sample: Sample, output_text: str) -> str:
        """The code of an output that is run after the problem prompt."""
        return extract_code(output_text, sample.meta["entry_point"])

    def _sample(
        self,
        encoder: Encoder,
        overhead: Overhead,
        problem: sources.HumanEvalProblem,
        length: int | None,
        seed: int,
    ) -> Sample:
        prompt, ids = self._encode(encoder, problem)
        return Sample(
            task=self.name,
            id=problem.task_id,
            prompt=prompt,
            input_ids=ids,
            answers=(problem.canonical_solution,),
            meta={"code_prompt": problem.prompt, "test": problem.test, "entry_point": problem.entry_point},
        )

    def score(self, sample: Sample, output_text: str) -> dict[str, float]:
        program = humaneval_program(
            sample.meta["code_prompt"], self._code(sample, output_text), sample.meta["test"],
            sample.meta["entry_point"],
        )
        result = run_python(program, timeout=self.timeout, memory_mb=self.memory_mb)
        passed = float(result.passed)
        return {"score": passed, "passed": passed, "timeout": float(result.status == "timeout")}

    def stop(self, sample: Sample) -> Callable[[str], bool]:
        """True once the output holds a closed code block that defines the entry point.

        :func:`extract_code` scores the first such block, so later text (the explanation
        instruction-tuned models add after the code) cannot change the score."""
        entry_point = sample.meta["entry_point"]

        def closed_definition(text: str) -> bool:
            return any(m.group(0).endswith("```") and _defines(m.group(1), entry_point)
                       for m in _CODE_BLOCK.finditer(text))

        return closed_definition


#: Where a raw HumanEval continuation ends: a line that starts a new top-level statement.
COMPLETION_STOPS: tuple[str, ...] = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\n```", "\nassert ")


def cut_completion(text: str) -> str | None:
    """``text`` up to the first :data:`COMPLETION_STOPS` sequence, or ``None`` if there is none."""
    cuts = [i for i in (text.find(stop) for stop in COMPLETION_STOPS) if i >= 0]
    return text[: min(cuts)] if cuts else None


@dataclass(frozen=True)
class HumanEvalCompletionTask(HumanEvalTask):
    """HumanEval as code completion: raw prompt in, function body out (see the module doc)."""

    name: ClassVar[str] = "humaneval-completion"
    default_max_new_tokens: ClassVar[int] = 384

    def _encode(self, encoder: Encoder, problem: sources.HumanEvalProblem) -> tuple[str, list[int]]:
        return problem.prompt, list(encoder.tokenizer(problem.prompt, add_special_tokens=False)["input_ids"])

    def _code(self, sample: Sample, output_text: str) -> str:
        body = cut_completion(output_text)
        return output_text if body is None else body

    def stop(self, sample: Sample) -> Callable[[str], bool]:
        """True once the continuation holds a stop sequence: what follows is never scored."""
        return lambda text: cut_completion(text) is not None
