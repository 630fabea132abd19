"""Pauses between decoder layers (:mod:`fastprefill.serve.pauses`): a request that arrives while
a long chunk runs gets its first token in a pause of that chunk, and every answer and the paused
chunk's logits are those of running each request alone (tiny random models, float32)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastprefill.engine import Generation, generate
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.layer_steps import ROUTED_ATTENTION
from fastprefill.models.adapters import decoder_layers
from fastprefill.models.attention import ATTENTION_NAME, set_attention_backend
from fastprefill.prefix_cache import PrefixCache
from fastprefill.sampling import SamplingParams
from fastprefill.serve.answers import Finished
from fastprefill.serve.backends import LocalBackend
from fastprefill.serve.executor import ModelExecutor
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.pauses import LayerPauses
from fastprefill.serve.policies import ShortFirstPolicy
from fastprefill.serve.scheduler import Scheduler
from fastprefill.serve.worker import Job

from .test_scheduler import MB, loop  # noqa: F401  (the event-loop fixture)


def _job(backend, ids, loop, metrics, max_tokens, arrived=0.0) -> Job:  # noqa: F811
    return Job(ids, FullPrefill(), backend, "full", "full", max_tokens, SamplingParams(ignore_eos=True), True, arrived, 1e12,
               metrics, loop.loop)


def _long_then_short(model, make_ids, loop, pause: bool, cache: PrefixCache | None,  # noqa: F811
                     second: int = 6, budget: int = 256):
    """A 200-token prompt (one chunk of 256) and a 6-token one submitted from the chunk's thread as
    its first layer starts; returns the order of first tokens, both jobs, the scheduler and the
    attention implementation the scheduler's thread saw at each layer it ran meanwhile."""
    metrics = ServeMetrics()
    backend = LocalBackend(model, None, cache)
    sched = Scheduler(ModelExecutor(model, None, 8), metrics, 8, ShortFirstPolicy(max_running=4, budget=budget, pause=pause))
    long_ids = make_ids(200, 5)
    long = _job(backend, long_ids, loop, metrics, 4)
    short = _job(backend, make_ids(second, 6), loop, metrics, 3, 1.0)
    firsts, seen, submitted = [], [], []
    emit = sched._emit
    sched._emit = lambda run, event: (firsts.append(run.job) if event.index == 0 else None, emit(run, event))

    def arrive(module, args):
        if threading.current_thread() is threading.main_thread():
            seen.append(model.config._attn_implementation)
        elif not submitted:
            submitted.append(True)
            sched.submit(short)

    hook = decoder_layers(model)[0].register_forward_pre_hook(arrive)
    try:
        sched.submit(long)
        if not pause:
            sched.run_once()  # the long one's prefill on this thread: nothing submits the short one
            sched.submit(short)
        while sched.running or sched.waiting:
            sched.run_once()
    finally:
        hook.remove()
        if sched.executor.pauses is not None:
            sched.executor.pauses.remove()
    return firsts, long, short, sched, seen


def _answers_equal_generate(model, loop, expected) -> None:  # noqa: F811
    """Each job's answer (``expected``: pairs of a job and its token count) equals generate's."""
    for job, n in expected:
        (finished,) = [e for e in loop.events(job) if isinstance(e, Finished)]
        assert finished.answers[0].token_ids == generate(model, None, job.input_ids, FullPrefill(), n,
                                                         stop_at_eos=False).token_ids


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
@pytest.mark.parametrize("cached", [False, True], ids=["cold", "over-a-cached-prefix"])
def test_a_request_arriving_mid_chunk_gets_its_first_token_in_a_pause(tiny_llama, make_ids, loop, cached,  # noqa: F811
                                                                      backend):
    """The short request's first token comes before the long chunk's; both answers equal
    generate's; over a cached prefix (fastprefill's attention on the chunk's thread) the
    interlude's layers still run with the model's own attention (with the SDPA backend, the
    model's own is transformers' ``sdpa``; with the kernel, the short prefill and its decode
    steps select fastprefill's function themselves; a batched decode step selects its routing
    function, which runs fastprefill's for each stream)."""
    cache = None
    if cached:
        cache = PrefixCache(64 * MB, block_tokens=8)
        generate(tiny_llama, None, make_ids(200, 5)[:, :120], FullPrefill(), 2, stop_at_eos=False, prefix_cache=cache)
    set_attention_backend(tiny_llama, backend)
    try:
        firsts, long, short, sched, seen = _long_then_short(tiny_llama, make_ids, loop, True, cache)
    finally:
        set_attention_backend(tiny_llama, "auto")
    assert firsts == [short, long]
    assert sched.executor.pauses is not None and sched.executor.pauses.pauses == 1
    counted = [s.value for f in sched.metrics.registry.collect() for s in f.samples
               if s.name == "fastprefill_prefill_pauses_total"]
    assert counted == [1.0]
    # the short prefill's layers, on the scheduler's thread
    own = set(seen) - {ROUTED_ATTENTION}
    assert seen and own == ({"sdpa"} if backend == "sdpa" else {"sdpa", ATTENTION_NAME} & own)
    _answers_equal_generate(tiny_llama, loop, ((long, 4), (short, 3)))
    assert long.outcome == short.outcome == "ok"


def test_without_pauses_the_request_waits_for_the_chunk(tiny_llama, make_ids, loop):  # noqa: F811
    firsts, long, short, sched, _ = _long_then_short(tiny_llama, make_ids, loop, False, None)
    assert sched.executor.pauses is None and firsts == [long, short]


def test_a_paused_prefill_gives_the_logits_it_gives_unpaused(tiny_qwen2, make_ids):
    """Pause at every layer and run another prompt's prefill in each pause: the paused
    prefill's first logits equal, bit for bit, those of the same prefill unpaused."""
    ids, other = make_ids(90, 7), make_ids(30, 8)
    alone = Generation(tiny_qwen2, None, ids, FullPrefill(), 1, stop_at_eos=False)
    alone.prefill()
    cv = threading.Condition()
    pauses = LayerPauses(tiny_qwen2, cv)
    paused = Generation(tiny_qwen2, None, ids, FullPrefill(), 1, stop_at_eos=False)
    between = []
    try:
        pauses.run(paused.prefill, lambda: True,
                   lambda: between.append(generate(tiny_qwen2, None, other, FullPrefill(), 2, stop_at_eos=False)))
    finally:
        pauses.remove()
    assert pauses.pauses == len(between) == tiny_qwen2.config.num_hidden_layers
    assert torch.equal(paused.first_logits, alone.first_logits)
    assert all(g.token_ids == between[0].token_ids for g in between)


def test_an_error_in_the_paused_call_reaches_the_caller(tiny_llama):
    pauses = LayerPauses(tiny_llama, threading.Condition())
    try:
        with pytest.raises(ValueError, match="bad unit"):
            pauses.run(lambda: (_ for _ in ()).throw(ValueError("bad unit")), lambda: False, lambda: None)
        assert pauses.run(lambda: 7, lambda: False, lambda: None) == 7  # the thread goes on
    finally:
        pauses.remove()
    assert not LayerPauses.available(torch.nn.Linear(2, 2))


def test_a_decoding_stream_gets_its_tokens_in_pauses_of_a_long_chunk(tiny_llama, make_ids, loop):  # noqa: F811
    """A stream past its first token and a 200-token prompt prefilled in one unit: with a decode
    step due at every layer, the stream's whole answer comes in the unit's pauses, before the long
    prompt's first token; both answers equal generate's."""
    metrics = ServeMetrics()
    backend = LocalBackend(tiny_llama, None, None)
    policy = ShortFirstPolicy(max_running=4, budget=256, decode_interval_s=1e-9)
    sched = Scheduler(ModelExecutor(tiny_llama, None, 8), metrics, 8, policy)
    stream, long = _job(backend, make_ids(6, 6), loop, metrics, 3), _job(backend, make_ids(200, 5), loop, metrics, 2)
    order = []
    emit = sched._emit
    sched._emit = lambda run, event: (order.append((run.job, event.index)), emit(run, event))
    try:
        sched.submit(stream)
        sched.run_once()  # its first token
        sched.submit(long)
        sched.run_once()  # the stream's second token, then the long prompt's unit, paused at every layer
        assert order == [(stream, 0), (stream, 1), (stream, 2), (long, 0)]
        assert sched.executor.pauses is not None and sched.executor.pauses.pauses == 1  # the third token ended the stream
        while sched.running:
            sched.run_once()
    finally:
        sched.executor.pauses.remove()
    _answers_equal_generate(tiny_llama, loop, ((stream, 3), (long, 2)))


def test_pause_points_leave_the_model_copyable_and_come_off_when_collected(tiny_llama):
    import copy
    import gc

    layer = decoder_layers(tiny_llama)[0]
    gc.collect()  # pause points of earlier tests' schedulers on this shared model come off first
    before = len(layer._forward_pre_hooks)
    pauses = LayerPauses(tiny_llama, threading.Condition())
    assert pauses.run(lambda: 3, lambda: False, lambda: None) == 3  # its thread started
    assert len(layer._forward_pre_hooks) == before + 1
    copy.deepcopy(tiny_llama)  # no lock in the hooks
    del pauses
    gc.collect()
    assert len(layer._forward_pre_hooks) == before


def test_a_long_request_arriving_mid_chunk_waits_for_the_chunk(tiny_llama, make_ids, loop):  # noqa: F811
    """A second prompt above INTERLUDE_TOKENS (here 600, with chunks of 8192) is admitted in the
    pause but prefilled after the running chunk, not inside the interlude."""
    firsts, long, second, sched, _ = _long_then_short(tiny_llama, make_ids, loop, True, None, second=600, budget=8192)
    assert firsts == [long, second]
    assert sched.executor.pauses is not None and sched.executor.pauses.pauses >= 1


def test_an_interlude_never_decodes_the_request_whose_unit_it_paused(tiny_llama, make_ids, loop):  # noqa: F811
    """A prefill that scores its prompt (``prompt_logprobs``: a forward after the prompt's last
    token, so the run is prefilled before its unit returns), with a decode step due at every
    layer: its tokens still come in order, the first carrying the prompt's scores."""
    metrics = ServeMetrics()
    backend = LocalBackend(tiny_llama, None, None)
    sched = Scheduler(ModelExecutor(tiny_llama, None, 8), metrics, 8, ShortFirstPolicy(max_running=4, budget=256, decode_interval_s=1e-9))
    ids = make_ids(40, 3)
    job = Job(ids, FullPrefill(), backend, "full", "full", 3, SamplingParams(ignore_eos=True, prompt_logprobs=1), True, 0.0,
              1e12, metrics, loop.loop)
    indices = []
    emit = sched._emit
    sched._emit = lambda run, event: (indices.append((event.index, event.prompt_logprobs is not None)), emit(run, event))

    def slow_scoring(module, args):  # the scoring forward outlasts the scheduler's poll, so a pause comes
        if threading.current_thread().name == "fastprefill-prefill" and sched.running[0].work.prefilled:
            time.sleep(0.2)

    hook = decoder_layers(tiny_llama)[0].register_forward_pre_hook(slow_scoring)
    try:
        sched.submit(job)
        while sched.running or sched.waiting:
            sched.run_once()
    finally:
        hook.remove()
        sched.executor.pauses.remove()
    assert indices == [(0, True), (1, False), (2, False)]
    (finished,) = [e for e in loop.events(job) if isinstance(e, Finished)]
    assert finished.answers[0].token_ids == generate(tiny_llama, None, ids, FullPrefill(), 3, stop_at_eos=False).token_ids
