"""Every method that must be exact in its lossless setting, through one parametrized test.

A table of methods (in the spirit of kvpress's ``default_presses``): each entry, configured to
keep everything, must give full prefill's first-token logits (max abs diff <= 1e-4; in bfloat16
that means the same computation, as one rounding step is ~1e-2) and transformers' own greedy
``generate`` tokens, on the tiny Llama and Qwen2 configs, in float32 and in bfloat16. A new method
is covered by adding a row. A second table feeds each registered method bad options through the
registry: each must be refused with a ConfigError naming the option.
"""

from __future__ import annotations

import pytest
import torch

from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.methods.baselines import GemFilter, RandomDrop, StaticPruning
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction.prefix import KVPrefix
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.registry import METHODS, make_method
from fastprefill.methods.research.blend import Blend
from fastprefill.methods.runahead import KVRunahead, SequenceParallel

#: layers of the selection pass a row pays on top of the full count (layers 0..s on the whole prompt)
SELECTION_LAYERS = {"static-keep-1": 2, "gemfilter-keep-1": 3, "gemfilter-keep-1-default-depth": 2}

LOSSLESS = {
    "full": FullPrefill(),
    "lazyllm-keep-all-preset": LazyLLM(preset="keep-all"),
    "lazyllm-keep-1.0-at-layers-1-2": LazyLLM(schedule=((1, 1.0), (2, 1.0))),
    "random-keep-1": RandomDrop(keep=1.0, seed=3),
    "static-keep-1": StaticPruning(keep=1.0, select_layer=1),
    "gemfilter-keep-1": GemFilter(keep=1.0, select_layer=2, kernel=7),
    "gemfilter-keep-1-default-depth": GemFilter(keep=1.0),
    "runahead-1-rank": KVRunahead(procs=1),
    "tsp-1-rank": SequenceParallel(procs=1),
    "kvp-prefix-every-layer-exact": KVPrefix(layer=4),  # the tiny configs have 4 layers
    "blend-without-passages": Blend(),  # no passage declared: the whole prompt is prefilled
}


@pytest.mark.parametrize("name", list(LOSSLESS))
def test_lossless_setting_equals_full_prefill_and_hf_generate(tiny_model_any_dtype, name, make_ids):
    tiny_model, method = tiny_model_any_dtype, LOSSLESS[name]
    ids = make_ids(41, 1)
    with torch.inference_mode():
        ref = FullPrefill().prefill(tiny_model, ids).logits
        out = method.prefill(tiny_model, ids)
    assert float((out.logits - ref).abs().max()) <= 1e-4
    assert method.own_decoder(tiny_model) == (out.decoder is not None)  # said before the prefill (n > 1 refused)
    hf = tiny_model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, 41:].tolist()
    res = generate(tiny_model, None, ids, method, max_new_tokens=10, stop_at_eos=False)
    assert res.token_ids == hf
    assert res.timing.stats.token_layers == 41 * (4 + SELECTION_LAYERS.get(name, 0))


def test_every_registered_method_has_a_row():
    """kvp needs a trained predictor (its lossless setting is the identity test of
    test_kv_prediction.py); auto needs a tuned profile and resolves to one of the others."""
    assert set(METHODS) - {"kvp", "auto"} <= {m.name for m in LOSSLESS.values()}


INVALID = [
    ("blend:budget=1.5", r"budget.*\[0, 1\]"),
    ("blend:policy=oracle", r"policy.*deviation"),
    ("blend:anchor=middle", r"anchor"),
    ("blend:chunks=0:5", r"no option"),
    ("lazyllm:schedule=1:1.5", r"schedule.*\(0, 1\]"),
    ("lazyllm:schedule=2:0.5+1:0.4", r"schedule.*strictly increasing"),
    ("lazyllm:preset=fastest", r"preset"),
    ("random:keep=0", r"keep.*\(0, 1\]"),
    ("random:keep=1.5", r"keep.*\(0, 1\]"),
    ("static:keep=0", r"keep.*\(0, 1\]"),
    ("static:select_layer=-1", r"select_layer.*>= 0"),
    ("gemfilter:keep=2", r"keep.*\(0, 1\]"),
    ("gemfilter:select_layer=-3", r"select_layer.*>= 0"),
    ("gemfilter:select_depth=1.0", r"select_depth.*\[0, 1\)"),
    ("gemfilter:select_layer=1,select_depth=0.5", r"select_layer or select_depth, not both"),
    ("gemfilter:kernel=4", r"kernel.*odd integer >= 1"),
    ("gemfilter:window=8", r"no option"),
    ("kvp-prefix:layer=-2", r"layer.*>= 0"),
    ("kvp-prefix:layer=two", r"layer.*not an integer"),
    ("kvp-prefix:keep=0.5", r"no option"),
]


@pytest.mark.parametrize(("spec", "match"), INVALID)
def test_bad_options_are_refused_naming_the_field(spec, match):
    with pytest.raises(ConfigError, match=match):
        make_method(spec)


def test_registered_specs_build_the_policies():
    gem = make_method("gemfilter:keep=0.2,select_depth=0.5,kernel=7")
    assert gem == GemFilter(keep=0.2, select_depth=0.5, kernel=7)
    assert make_method("gemfilter:select_layer=3").selection_layer(24) == 3
    assert make_method("static:keep=0.3,select_layer=2") == StaticPruning(keep=0.3, select_layer=2)


def test_defaults_fill_only_the_options_a_method_declares_and_the_spec_wins():
    """``make_method(spec, defaults)``: a default reaches a method's own field (``procs``) or a
    field of its flattened options (LazyLLM's ``revival``), never a method without it, and never
    over the spec's own value."""
    defaults = {"revival": "none", "procs": 3}
    assert str(make_method("lazyllm:preset=gentle", defaults).options.revival) == "none"
    assert str(make_method("lazyllm:preset=gentle,revival=all", defaults).options.revival) == "all"
    assert make_method("lazyllm:preset=gentle", defaults) == make_method("lazyllm:preset=gentle,revival=none")
    assert make_method("runahead", defaults).procs == 3 and make_method("runahead:procs=2", defaults).procs == 2
    assert make_method("gemfilter", defaults) == make_method("gemfilter")
