"""No host round-trip inside the layer loop of a prefill: full prefill (whole and over a cached
prefix), the pruning methods (LazyLLM at the paper's rule and at presets that pool and fill,
static pruning, GemFilter, random drop) and kvp-prefix run their decoder layers without reading a tensor's value back to the host, so
on an accelerator the layers are queued without a stall. The hook is device-agnostic
(:mod:`tests.sync_guard`), so the CPU suite keeps the CUDA path honest; a layer that does read
a value is caught (the control). Every clock read synchronises the device first
(:func:`fastprefill.host.device_clock`), and a generation's TTFT is a span of that clock."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from fastprefill.cache import fork_cache
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.pruning.state import ComputeCounter, DeferredAuxCache
from fastprefill.methods.registry import make_method
from tests.sync_guard import host_syncs_in_layers

PRUNING_SPECS = [
    "lazyllm",  # the library's default preset
    "lazyllm:preset=paper",  # the paper's rule: four cuts, the last query's attention
    "lazyllm:preset=cut30k20+snap",  # a window of queries, pooled scores, sinks, recent tokens
    "lazyllm:preset=late-half,fill=zero-shot,revival=none",
    "static:keep=0.5,select_layer=1",
    "gemfilter:keep=0.5",
    "random:keep=0.5",
    "kvp-prefix:layer=2,tail=4",  # zero-shot maps
]


def _syncs(model, run) -> list:
    """The round-trips of ``run()``'s layers, after one unwatched call (one-time lazy set-up on
    first use, such as an attention kernel's self-check, is no round-trip of every prefill)."""
    with torch.inference_mode():
        run()
        with host_syncs_in_layers(model) as log:
            run()
    return log.syncs


@pytest.mark.parametrize("spec", PRUNING_SPECS)
def test_a_pruned_prefill_reads_nothing_back_between_its_first_and_last_layer(tiny_model, make_ids, spec):
    method = make_method(spec)
    ids = make_ids(96, 3)
    assert _syncs(tiny_model, lambda: method.prefill(tiny_model, ids)) == []


def test_full_prefill_reads_nothing_back_whole_or_over_a_cached_prefix(tiny_model, make_ids):
    ids = make_ids(80, 4)
    assert _syncs(tiny_model, lambda: FullPrefill().prefill(tiny_model, ids)) == []
    with torch.inference_mode():
        prefix = FullPrefill().prefill(tiny_model, ids[:, :48]).cache
    assert isinstance(prefix, DynamicCache)
    # each call over its own copy: a prefill appends its K/V to the prefix's cache
    assert _syncs(tiny_model, lambda: FullPrefill().prefill(tiny_model, ids, fork_cache(prefix))) == []


def test_lazyllm_over_a_cached_prefix_reads_nothing_back(tiny_llama, make_ids):
    ids = make_ids(96, 5)
    with torch.inference_mode():
        prefix = FullPrefill().prefill(tiny_llama, ids[:, :32]).cache
    method = make_method("lazyllm:preset=paper")
    assert _syncs(tiny_llama, lambda: method.prefill(tiny_llama, ids, fork_cache(prefix))) == []


def test_a_layer_that_reads_a_value_is_caught_and_hooks_are_removed(tiny_llama, make_ids):
    """The control: a hook on a middle layer doing what a careless loop does."""
    layer = tiny_llama.model.layers[1]
    # hooks already there (transformers installs its output-capturing hooks on a shared model the
    # first time an earlier test asks for hidden states) must be all that is left afterwards
    before = (dict(layer._forward_hooks), dict(tiny_llama.model.layers[0]._forward_pre_hooks))
    reads = {"item": lambda t: t.sum().item(), "int": lambda t: int(t.argmax()),
             "tolist": lambda t: t[0, :2, 0].tolist(), "boolean index": lambda t: t[t > 0]}
    for name, read in reads.items():
        def hook(_module, _args, out, read=read) -> None:  # None: the layer's output stays
            read(out[0] if isinstance(out, tuple) else out)

        handle = layer.register_forward_hook(hook)
        try:
            syncs = _syncs(tiny_llama, lambda: FullPrefill().prefill(tiny_llama, make_ids(24, 1)))
        finally:
            handle.remove()
        assert len(syncs) >= 1, name
    assert (dict(layer._forward_hooks), dict(tiny_llama.model.layers[0]._forward_pre_hooks)) == before
    assert torch.Tensor.tolist.__qualname__ == "TensorBase.tolist"  # the patch is undone


def test_a_value_read_outside_the_layers_is_not_counted(tiny_llama, make_ids):
    ids = make_ids(24, 2)

    def run() -> None:
        out = FullPrefill().prefill(tiny_llama, ids)
        int(out.logits.argmax())  # the first token's pick, after the last layer

    assert _syncs(tiny_llama, run) == []


def test_the_pruning_results_are_those_of_the_host_reading_code(tiny_model, make_ids):
    """What the cut reads on the host (the protected count) equals the device's count, and the
    dropped rows wait in the Aux Cache as before: every pruned position once, at its layer."""
    method = make_method("lazyllm:preset=cut30k20+snap,revival=none")
    ids = make_ids(96, 6)
    with torch.inference_mode():
        run = method.run(tiny_model, ids)
    state = run.state
    opts = state.options
    for cut, kept in zip(state.selected, run.output.stats.extra["kept_per_stage"], strict=True):
        forced = opts.protected(cut, 96, decoding=False)
        forced[-1] = True
        assert int(forced.sum()) == opts.protected_count(0, 96) and kept == cut.numel()
    (layer, _), = state.schedule
    waiting = state.aux.positions(layer + 1)
    assert waiting == sorted(set(range(96)) - set(state.selected[0].tolist()))
    assert len(state.aux) == len(waiting)


@pytest.mark.parametrize(("start", "prompt_len", "sinks", "recent"), [
    (0, 96, 4, 16), (0, 10, 4, 16), (8, 96, 4, 16), (0, 96, 0, 0), (50, 96, 64, 40), (0, 1, 4, 16), (5, 5, 4, 1),
])
def test_the_protected_count_is_the_protected_masks_sum(start, prompt_len, sinks, recent):
    from fastprefill.methods.pruning.options import PruneOptions

    opts = PruneOptions(sinks=sinks, keep_recent=recent)
    positions = torch.arange(start, prompt_len)
    forced = opts.protected(positions, prompt_len, decoding=False)
    if positions.numel():
        forced[-1] = True
    assert opts.protected_count(start, prompt_len) == int(forced.sum())


def test_the_counter_and_aux_cache_answer_as_before_without_reading_on_write():
    counter = ComputeCounter(2, 4, torch.device("cpu"))
    counter.add(0, torch.tensor([0, 2]), bound=3)
    counter.add(1, torch.tensor([6]))  # grows (no bound: read)
    counter.add(1, torch.tensor([], dtype=torch.long))
    assert counter.length == 7 and counter.counts.tolist() == [[1, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1]]
    assert ComputeCounter(2, 4, torch.device("cpu")).counts.shape == (2, 0)

    aux = DeferredAuxCache()
    aux.put(3, torch.tensor([5, 1]), torch.arange(6.0).reshape(1, 2, 3))
    aux.put(3, torch.tensor([1]), torch.full((1, 1, 3), 9.0))  # a later put replaces position 1
    assert len(aux) == 2 and aux.positions(3) == [1, 5] and aux.positions(2) == []
    assert aux.take(3, torch.tensor([1, 5])).tolist() == [[[9.0, 9.0, 9.0], [0.0, 1.0, 2.0]]]
    assert len(aux) == 0
    with pytest.raises(KeyError):
        aux.take(3, torch.tensor([5]))


def test_the_clock_synchronises_before_every_read(monkeypatch):
    import torch

    from fastprefill import host
    from fastprefill.events import TimingWindow

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"sync {device}"))
    with TimingWindow("cuda:0") as window:
        calls.append("work")
    assert calls == ["sync cuda:0", "work", "sync cuda:0"] and window.seconds >= 0
    calls.clear()
    host.device_clock("cpu")
    assert calls == []  # nothing to wait for on the CPU


def test_a_generations_ttft_is_a_span_of_the_device_clock(monkeypatch, tiny_llama, make_ids):
    """The engine's TTFT (across the lookup and every unit of prefill) and its decode times are
    differences of :func:`~fastprefill.host.device_clock` reads: a fake clock that ticks once per
    read, each read after a synchronisation, gives whole ticks."""
    import itertools
    import types

    from fastprefill import host
    from fastprefill.engine import generate
    from fastprefill.prefix_cache import PrefixCache

    ticks = itertools.count()
    log: list[str] = []
    monkeypatch.setattr(host, "synchronize", lambda device: log.append("sync"))
    monkeypatch.setattr(host, "time", types.SimpleNamespace(perf_counter=lambda: (log.append("read"), next(ticks))[1]))
    result = generate(tiny_llama, None, make_ids(40, 1), max_new_tokens=3, stop_at_eos=False,
                      prefix_cache=PrefixCache(1 << 24))
    timing = result.timing
    assert log and all(a == "sync" for a, b in itertools.pairwise(log) if b == "read") and log[0] == "sync"
    assert timing.ttft_s >= 1 and timing.ttft_s == int(timing.ttft_s)
    assert timing.decode_s_per_token is not None and 2 * timing.decode_s_per_token == int(2 * timing.decode_s_per_token)


def test_a_decode_batch_step_reads_the_greedy_rows_tokens_at_once(tiny_llama, make_ids):
    """One step of a decode batch reads its greedy rows' tokens from the device in one
    transfer: the step's host reads do not grow with its rows (and the tokens are each stream's
    alone, as ``tests/unit/test_batch_sampling.py`` asserts for every sampling setting)."""
    from fastprefill.batch import DecodeBatch
    from fastprefill.engine import Generation, generate
    from tests.sync_guard import host_syncs

    def step_reads(rows: int) -> tuple[int, list[list[int]]]:
        gens = [Generation(tiny_llama, None, make_ids(9 + 7 * i, i), FullPrefill(), 6, stop_at_eos=False)
                for i in range(rows)]
        for gen in gens:
            gen.prefill(None)
            gen.first_events()
        batch = DecodeBatch(tiny_llama, max_batch=rows)
        batch.step(gens)  # the first step stacks the rows (a regroup)
        with host_syncs() as log:  # a middle step (the last one stores the answer's ids)
            batch.step(gens)
        while live := [g for g in gens if not g.finished]:
            batch.step(live)
        return len(log.syncs), [g.choices[0].ids for g in gens]

    (two, tokens2), (four, tokens4) = step_reads(2), step_reads(4)
    assert two == four <= 2  # the rows' tokens (and, over padded rows, transformers' own look at the mask)
    alone = [generate(tiny_llama, None, make_ids(9 + 7 * i, i), FullPrefill(), 6, stop_at_eos=False).token_ids
             for i in range(4)]
    assert tokens4 == alone and tokens2 == alone[:2]
