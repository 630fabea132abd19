"""Sampling on the real SmolLM2-135M (the session's ``smollm2``): greedy unchanged and seeded
sampling equal to transformers' ``generate``, the same seeded text after a prefix-cache hit,
log-probabilities equal to the log-softmax of a full forward's logits, stop strings that span
tokens, and a bad setting refused before any work."""

from __future__ import annotations

import pytest
import torch

from fastprefill.engine import generate, stream
from fastprefill.errors import ConfigError
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method
from fastprefill.prefix_cache import PrefixCache
from fastprefill.sampling import SamplingParams

PROMPT = "The three primary colours are"


def _hf_ids(tok, prompt: str) -> torch.Tensor:
    return tok(prompt, return_tensors="pt").input_ids


@pytest.mark.integration
def test_greedy_default_and_seeded_sampling_equal_transformers_generate(smollm2):
    model, tok = smollm2
    ids = _hf_ids(tok, PROMPT)
    n = ids.shape[1]
    greedy = generate(model, tok, PROMPT, FullPrefill(), 12, sampling=SamplingParams())
    assert greedy.token_ids == model.generate(ids, max_new_tokens=12, do_sample=False)[0, n:].tolist()
    kw = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
    params = SamplingParams(seed=7, **kw)
    sampled = generate(model, tok, PROMPT, FullPrefill(), 12, sampling=params)
    torch.manual_seed(7)
    hf = model.generate(ids, max_new_tokens=12, do_sample=True, **kw)[0, n:].tolist()
    assert sampled.token_ids == hf[: len(sampled.token_ids)]  # hf may pad after its end token
    assert generate(model, tok, PROMPT, FullPrefill(), 12, sampling=params).text == sampled.text


@pytest.mark.integration
def test_seeded_text_is_the_same_after_a_prefix_cache_hit(smollm2):
    model, tok = smollm2
    prompt = "Here is a short story about a lighthouse keeper and a storm. " * 4
    params = SamplingParams(temperature=1.0, seed=123, presence_penalty=0.5, frequency_penalty=0.3)
    cache = PrefixCache(64 << 20)
    first = generate(model, tok, prompt, FullPrefill(), 10, prefix_cache=cache, sampling=params)
    second = generate(model, tok, prompt, FullPrefill(), 10, prefix_cache=cache, sampling=params)
    assert first.timing.prefix_cache == "miss" and second.timing.prefix_cache == "hit"
    assert second.text == first.text and second.token_ids == first.token_ids


@pytest.mark.integration
def test_logprobs_equal_log_softmax_of_full_prefill_logits(smollm2):
    model, tok = smollm2
    params = SamplingParams(temperature=0.7, seed=2, repetition_penalty=1.3, logprobs=3, prompt_logprobs=2)
    res = generate(model, tok, PROMPT, FullPrefill(), 6, sampling=params, stop_at_eos=False)
    prompt = _hf_ids(tok, PROMPT)[0].tolist()
    full = torch.tensor([prompt + res.token_ids[:-1]])
    with torch.inference_mode():
        ref = torch.log_softmax(model(full).logits[0].float(), -1)  # (T + n - 1, V)
    got = res.answers[0].logprobs
    for k, entry in enumerate(got):
        row = ref[len(prompt) - 1 + k]
        assert entry.token_id == res.token_ids[k]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(row, 3).indices.tolist()
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    for k, entry in enumerate(res.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[k]
        assert entry.logprob == pytest.approx(float(ref[k - 1, prompt[k]]), abs=1e-4)


@pytest.mark.integration
def test_stop_string_spanning_tokens_ends_and_cuts_the_stream(smollm2):
    model, tok = smollm2
    free = generate(model, tok, "Count: one, two, three,", FullPrefill(), 16, stop_at_eos=False)
    pieces = [tok.decode([t]) for t in free.token_ids]
    # a stop string made of the end of one token's text and the start of the next's
    k = next(i for i in range(1, len(pieces)) if len(pieces[i - 1].strip()) >= 1 and len(pieces[i]) >= 2)
    stop = pieces[k - 1][-1] + pieces[k][:2]
    cut = free.text[: free.text.find(stop)]
    params = SamplingParams(stop=(stop,))
    events = list(stream(model, tok, "Count: one, two, three,", FullPrefill(), 16, stop_at_eos=False,
                         sampling=params))
    sent = ""
    for e in events:
        sent += e.text
        assert cut.startswith(sent)  # never a part of the stop string
    assert sent == cut and events[-1].finish_reason == "stop"
    res = generate(model, tok, "Count: one, two, three,", FullPrefill(), 16, stop_at_eos=False, sampling=params)
    assert res.text == cut and res.answers[0].finish_reason == "stop"


@pytest.mark.integration
def test_bad_sampling_settings_are_refused_before_any_work(smollm2):
    model, tok = smollm2
    with pytest.raises(ConfigError, match="logit_bias: token id 10000000"):
        next(stream(model, tok, PROMPT, sampling=SamplingParams(logit_bias={10**7: 1.0})))
    with pytest.raises(ConfigError, match="n=2"):
        generate(model, tok, "A long document about rivers. " * 60, make_method("lazyllm:preset=default,revival=all"),
                 3, sampling=SamplingParams(n=2))
