"""KV Prediction training end to end: the real model's calibration text and dev prompts, the
``train-kvp --variant prefix`` command (calibration, then distillation), the distillation
prompts, and a training run killed mid-way in a child process that leaves a checkpoint which
verifies and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fastprefill.cli import main
from fastprefill.errors import ConfigError
from fastprefill.methods.kv_prediction import CheckpointError
from fastprefill.methods.kv_prediction.checkpoint import read_checkpoint
from fastprefill.methods.kv_prediction.corpus import calibration_corpus
from fastprefill.methods.kv_prediction.prefix import KVPrefix
from research.kvp import exclude_calibration
from tests import REPO
from tests.kvp_helpers import train_tiny

_KILLED_CHILD = """
from fastprefill.models.random import random_model
from tests.kvp_helpers import train_tiny
train_tiny(random_model("llama"), {out!r}, steps=10_000)
"""

def test_calibration_text_holds_a_quarter_of_dev_task_prompts(smollm2):
    from fastprefill.data.tasks import get_task

    _, tok = smollm2
    corpus = calibration_corpus(tok, 4096, 512, seed=0)
    assert corpus.task_share >= 0.25
    assert corpus.task_ids and all(isinstance(i, str) for i in corpus.task_ids)
    assert sum(int(s.shape[1]) for s in corpus.sequences) >= 4096
    text = tok.decode(torch.cat([s[0] for s in corpus.sequences]).tolist())
    assert "<|im_start|>user" in text  # the tasks' chat template
    dev = get_task("singledoc-qa").build(tok, 512, 8, split="dev", seed=1000)
    assert {s.id for s in dev} & set(corpus.task_ids)  # the dev prompts of the calibration seed
    assert exclude_calibration(dev, {"task_ids": corpus.task_ids}) == [s for s in dev if s.id not in corpus.task_ids]
    none = calibration_corpus(tok, 1024, 512, seed=0, task_share=0.0)
    assert none.task_share == 0.0 and not none.task_ids



def test_train_kvp_prefix_command(tmp_path, capsys, smollm2):
    out = tmp_path / "p28"
    args = ["train-kvp", "--variant", "prefix", "--model", "smollm2-135m", "--layer", "28", "--out", str(out),
            "--lsq-tokens", "1024", "--threads", "1"]
    assert main(args) == 0
    method = KVPrefix(predictor=str(out))
    assert method.layer == 28
    config = json.loads((out / "config.json").read_text())
    assert config["complete"] and config["calibration"]["task_share"] == 0.25 and config["task_ids"]
    assert main(["train-kvp", "--variant", "prefix", "--model", "smollm2-135m", "--out", str(tmp_path / "x")]) == 2
    assert "--layer" in capsys.readouterr().err
    # KL distillation of that checkpoint on (short) dev prompts
    dist = tmp_path / "d28"
    assert main(["train-kvp", "--variant", "prefix", "--model", "smollm2-135m", "--distill-from", str(out),
                 "--out", str(dist), "--steps", "2", "--tail", "8", "--train-prompts", "humaneval-completion:2",
                 "--heldout-prompts", "humaneval-completion:1", "--threads", "1"]) == 0
    distilled = json.loads((dist / "config.json").read_text())
    assert distilled["distillation"]["step"] == 2 and distilled["layer"] == 28
    assert len(distilled["task_ids"]) == len(config["task_ids"]) + 3
    assert KVPrefix(predictor=str(dist), tail=8).bind(smollm2[0]).describe() == "distilled"
    capsys.readouterr()
    assert main(["train-kvp", "--variant", "prefix", "--model", "smollm2-135m", "--distill-from",
                 str(tmp_path / "none"), "--out", str(tmp_path / "y")]) == 2
    assert "no readable kvp-prefix checkpoint" in capsys.readouterr().err
    assert main(["train-kvp", "--model", "smollm2-135m", "--distill-from", str(out), "--out", str(tmp_path / "z")]) == 2
    assert "--variant prefix" in capsys.readouterr().err


def test_distillation_prompts_keep_out_sweep_and_calibration_prompts(smollm2):
    from fastprefill.data.tasks import get_task
    from fastprefill.methods.kv_prediction.prefix.distill_prompts import distillation_prompts

    _, tok = smollm2
    sweep = {s.id for s in get_task("humaneval-completion").build(tok, None, 4, split="dev", seed=0)}
    calibration = ["HumanEval/0", "HumanEval/2"]
    got = distillation_prompts(tok, ["humaneval-completion:3"], ["humaneval-completion:2"], exclude=calibration,
                               keep_out_n=4)
    assert len(got.train) == 3 and len(got.heldout) == 2 and len(set(got.ids)) == 5
    assert not set(got.ids) & (sweep | set(calibration))
    for bad in ("humaneval-completion", "humaneval-completion:0", "nosuch:3"):
        with pytest.raises(ConfigError):
            distillation_prompts(tok, [bad], [])
    with pytest.raises(ConfigError, match="only"):
        distillation_prompts(tok, ["humaneval-completion:1000"], [])


def test_kill_mid_training_leaves_resumable_checkpoint(tiny_llama, tmp_path):
    """SIGKILL during training leaves a checkpoint that verifies and resumes."""
    out = tmp_path / "k"
    code = _KILLED_CHILD.format(out=str(out))
    # the child imports tests.kvp_helpers from the repository root
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 600  # a loaded machine can take minutes to reach step 4
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            try:
                if read_checkpoint(out)[0]["step"] >= 4:
                    break
            except CheckpointError:
                pass
    finally:
        proc.kill()  # no warning, no cleanup in the child
        _, err = proc.communicate()
    assert proc.returncode != 0, err.decode()[-2000:]
    config = read_checkpoint(out)[0]  # verifies the weights' sha256
    assert config["step"] >= 4, err.decode()[-2000:]
    train_tiny(tiny_llama, out, steps=config["step"] + 2, resume=True)
    assert read_checkpoint(out)[0]["step"] == config["step"] + 2
