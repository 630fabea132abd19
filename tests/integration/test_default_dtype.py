"""The real model in the default dtype (``auto``: bfloat16 on a CPU with native bfloat16 units,
float32 elsewhere), as the command line and the server run it.

Exact methods split the same work differently (a prefix-cache hit prefills only the suffix;
KV-Runahead gives each rank a chunk), so in bfloat16 their sums round differently from full
prefill's: each must keep the first token and stay within a small first-token KL (a rounding
step of bfloat16 is ~1e-2 relative; float32 passes with far less). Layer-loop methods at keep-all
run the same operations on the same shapes, so they equal full prefill exactly in any dtype.
"""

from __future__ import annotations

import pytest
import torch

from fastprefill.bench.runner import first_token_kl
from fastprefill.distributed.pool import RankPool
from fastprefill.engine import generate
from fastprefill.methods.kv_prediction.prefix import KVPrefix
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.runahead import KVRunahead
from fastprefill.prefix_cache import PrefixCache
from fastprefill.serve import ServeConfig, background, create_app
from tests.integration.serving import MODEL, http_request, openai_client

pytestmark = pytest.mark.integration

#: first-token KL (nats) an exact method may reach through rounding alone, in any dtype
ROUNDING_KL = 0.02
DOC = ("The Rhine flows from the Swiss Alps through Germany and the Netherlands into the North Sea. "
       "Its length is about 1,230 kilometres, and it carries barges between Basel and Rotterdam. ") * 3


def _close(ref, got, what: str) -> None:
    assert int(ref.first_logits.argmax()) == int(got.first_logits.argmax()), what
    kl = first_token_kl(ref.first_logits, got.first_logits)
    assert kl <= ROUNDING_KL, f"{what}: first-token KL {kl:.4f}"


def test_prefix_cache_hits_keep_the_first_token(smollm2_auto):
    model, tok = smollm2_auto
    first = tok(DOC + "Question: which sea does the Rhine reach? Answer:", return_tensors="pt").input_ids
    n = int(first.shape[1])
    cache = PrefixCache(256 << 20, block_tokens=16)
    generate(model, tok, first, max_new_tokens=4, prefix_cache=cache)
    for name, ids in {"99%": torch.cat([first[:, :-1], tok(" Reply:", return_tensors="pt",
                                                           add_special_tokens=False).input_ids], dim=1),
                      "100%": first, "strict prefix": first[:, : n - 7]}.items():
        plain = generate(model, tok, ids, max_new_tokens=1)
        cached = generate(model, tok, ids, max_new_tokens=1, prefix_cache=cache)
        assert cached.timing.cached_tokens > 0 and cached.timing.dtype == plain.timing.dtype
        _close(plain, cached, name)


def test_layer_loop_methods_at_keep_all_equal_full_prefill_exactly(smollm2_auto):
    model, tok = smollm2_auto
    ids = tok(DOC + "Question: how long is the Rhine? Answer:", return_tensors="pt").input_ids
    full = generate(model, tok, ids, max_new_tokens=8, stop_at_eos=False)
    for method in (LazyLLM(preset="keep-all"), KVPrefix(layer=model.config.num_hidden_layers)):
        got = generate(model, tok, ids, method, max_new_tokens=8, stop_at_eos=False)
        assert torch.equal(got.first_logits, full.first_logits), method.describe()
        assert got.token_ids == full.token_ids, method.describe()


@pytest.mark.timeout(300)
def test_runahead_ranks_run_in_the_default_dtype(smollm2_auto):
    model, tok = smollm2_auto
    ids = tok("Question: Which planet is known as the red planet, and why?\nAnswer:")["input_ids"]
    full = generate(model, tok, ids, max_new_tokens=1)
    with RankPool("smollm2-135m", 2, timeout_s=120) as pool:  # dtype "auto", as the server's model
        res = pool.generate(ids, KVRunahead(procs=2), 1)
    assert res.timing["dtype"] == full.timing.dtype
    assert res.token_ids[0] == full.token_ids[0]
    kl = first_token_kl(full.first_logits, res.logits)
    assert kl <= ROUNDING_KL, f"first-token KL {kl:.4f}"


def test_the_server_reports_its_dtype_and_the_cpu(smollm2_auto):
    from fastprefill.host import cpu_info

    model, tok = smollm2_auto
    dtype = str(model.dtype).removeprefix("torch.")
    with background(create_app(model, tok, ServeConfig(MODEL, prefix_cache_mb=0))) as url:
        r = openai_client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=1)
        usage = r.usage.model_extra["fastprefill"]
        assert usage["dtype"] == dtype and usage["bf16_native"] == cpu_info().bf16_native
        _, health = http_request(url, "GET", "/health")
        assert health["dtype"] == dtype
        _, text = http_request(url, "GET", "/metrics")
        assert f'fastprefill_precision_info{{bf16_native="{cpu_info().bf16_native}",bf16_units="{cpu_info().bf16_units}"' \
            in text and f'dtype="{dtype}"' in text
