"""``--method auto`` in the server, through the real ``openai`` client: the profile picks the
method per prompt length, the usage block names the choice, the answers equal the engine's, and
``/metrics`` counts the choices."""

from __future__ import annotations

import pytest

from fastprefill.engine import generate
from fastprefill.methods.auto import ProfileBucket, Target, TuneProfile
from fastprefill.methods.registry import make_method
from fastprefill.models.fingerprint import tokenizer_fingerprint, weights_fingerprint
from fastprefill.serve import ServeConfig, background, create_app
from tests.integration.serving import MODEL, metric_value, openai_client

pytestmark = pytest.mark.integration

LONG = " ".join(f"Item {i} costs {i + 3} coins." for i in range(30)) + " Which item costs 10 coins?"


def test_auto_picks_per_prompt_length_names_the_choice_and_counts_it(smollm2, tmp_path):
    model, tok = smollm2
    profile = TuneProfile(model=MODEL, fingerprint=weights_fingerprint(model),
                          tokenizer_fingerprint=tokenizer_fingerprint(tok), target=Target("first-token", 0.7),
                          buckets=(ProfileBucket("short", 32, "lazyllm:preset=keep-all"),
                                   ProfileBucket("long", None, "full")))
    path = profile.save(tmp_path / "profile.json")
    with background(create_app(model, tok, ServeConfig(MODEL, method=f"auto:profile={path}",
                                                       prefix_cache_mb=0))) as url:
        client = openai_client(url)
        short = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4)
        long = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
        # the choice as responses name it: LazyLLM with its revival policy (the profile's spec: the default, all)
        lazy = "lazyllm[keep-all revival=all]"
        choices = {c: metric_value(url, "fastprefill_auto_choices_total", choice=c) for c in (lazy, "full")}
    assert choices == {lazy: 1, "full": 1}
    assert short.usage.model_extra["fastprefill"]["method"] == lazy
    assert long.usage.model_extra["fastprefill"]["method"] == "full"
    for res, prompt, spec in ((short, "The sky is", "lazyllm:preset=keep-all"), (long, LONG, "full")):
        assert res.choices[0].text == generate(model, tok, prompt, make_method(spec), 4).text


def test_serve_takes_a_profile_or_a_method_not_both(capsys):
    from fastprefill.cli import main

    assert main(["serve", "--profile", "p.json", "--method", "lazyllm"]) == 2
    assert "not both" in capsys.readouterr().err
