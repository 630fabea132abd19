"""``fastprefill tune`` on the real SmolLM2-135M: reading a prompts file with its tokenizer, and
an end-to-end tune whose profile ``auto`` serves."""

from __future__ import annotations

import pytest

from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.auto import Target, TuneProfile
from fastprefill.methods.registry import make_method
from fastprefill.models.fingerprint import tokenizer_fingerprint, weights_fingerprint
from fastprefill.tune import load_prompts


def test_prompts_file_errors(tmp_path, smollm2):
    _, tok = smollm2
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "Hello there"}\n"plain string"\n\n'
                    '{"id": "c", "messages": [{"role": "user", "content": "Hi"}]}\n')
    prompts = load_prompts(good, tok)
    assert [p.id for p in prompts] == ["1", "2", "c"] and all(p.bucket == "512" for p in prompts)
    cases = {'{"prompt": "ok"}\nnot json\n': r":2: not valid JSON",
             '{"prompt": "   "}\n': r":1: the prompt is empty",
             '{"messages": []}\n': r":1: the messages are empty",
             '{"text": "x"}\n': r":1: give \{.prompt",
             "\n": "holds no prompts",
             '{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n': "unique"}
    for text, match in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_prompts(bad, tok)



@pytest.mark.integration
def test_tune_end_to_end_on_smollm2(tmp_path, smollm2_auto):
    """The CLI on a handful of packaged prompts: a profile for this model in the default dtype, a
    plot, and auto serving it."""
    from fastprefill.cli import main

    model, tok = smollm2_auto
    out = tmp_path / "profile.json"
    code = main(["tune", "--model", "smollm2-135m", "--task", "multidoc-qa", "--lengths", "512", "--n", "12",
                 "--target", "first-token=0.5", "--only", "--methods", "lazyllm:preset=keep-all",
                 "lazyllm:preset=cut30k20+snap", "--min-speedup", "0.5", "--threads", "2", "--out", str(out)])
    assert code == 0
    profile = TuneProfile.load(out)
    assert profile.fingerprint == weights_fingerprint(model)
    assert profile.tokenizer_fingerprint == tokenizer_fingerprint(tok)
    assert profile.dtype == str(model.dtype).removeprefix("torch.")
    short = profile.bucket(512)
    assert short.method in ("full", "lazyllm:preset=keep-all", "lazyllm:preset=cut30k20+snap")
    assert short.n_choose + short.n_report == 12
    assert out.with_suffix(".png").stat().st_size > 0 and out.with_suffix(".jsonl").exists()
    res = generate(model, tok, "Say hi.", make_method(f"auto:profile={out}"), max_new_tokens=2, chat=True)
    assert res.timing.method  # ran through the profile's choice
    # another target over the same records: nothing runs again
    records = out.with_suffix(".jsonl").read_text().splitlines()
    other = tmp_path / "other.json"
    code = main(["tune", "--model", "smollm2-135m", "--task", "multidoc-qa", "--lengths", "512", "--n", "12",
                 "--target", "first-token=0.3", "--only", "--methods", "lazyllm:preset=keep-all",
                 "lazyllm:preset=cut30k20+snap", "--min-speedup", "0.5", "--threads", "2", "--out", str(other),
                 "--records", str(out.with_suffix(".jsonl")), "--resume"])
    assert code == 0 and TuneProfile.load(other).target == Target("first-token", 0.3)
    assert out.with_suffix(".jsonl").read_text().splitlines() == records
    assert main(["tune", "--model", "smollm2-135m", "--task", "multidoc-qa", "--split", "dev",
                 "--report-split", "dev"]) == 2


def test_an_interrupted_tune_says_how_to_continue(tmp_path, smollm2, monkeypatch, capsys):
    import fastprefill.tune
    from fastprefill.cli import main

    out = tmp_path / "profile.json"

    def interrupted(*args, records_path, **kwargs):
        records_path.write_text('{"header": {}}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(fastprefill.tune, "tune", interrupted)
    code = main(["tune", "--model", "smollm2-135m", "--task", "multidoc-qa", "--lengths", "512", "--n", "2",
                 "--only", "--methods", "lazyllm:preset=gentle", "--threads", "1", "--out", str(out)])
    err = " ".join(capsys.readouterr().err.split())  # rich may wrap the message
    assert code == 130 and "interrupted" in err
    assert f"the runs so far are in {out.with_suffix('.jsonl')}" in err
    assert "with --resume continues" in err
