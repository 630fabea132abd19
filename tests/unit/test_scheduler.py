"""The server's scheduler without HTTP, on the tiny random models in float32: chunked prefill
and batched decode against whole-prompt generation (:func:`fastprefill.engine.generate`), the
short-first policy with aging and counted chunks, on the server's executor (the scheduler's
decisions without a model, the queue's bound and its shutdown: ``test_scheduler_policy.py``)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from fastprefill.batch import DecodeBatch
from fastprefill.engine import Generation, generate
from fastprefill.methods.baselines import RandomDrop
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.prefix_cache import PrefixCache
from fastprefill.sampling import SamplingParams
from fastprefill.serve.answers import Finished, Token
from fastprefill.serve.backends import LocalBackend
from fastprefill.serve.config import ServeConfig
from fastprefill.serve.executor import ModelExecutor
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.policies import FifoPolicy, ShortFirstPolicy, make_policy
from fastprefill.serve.scheduler import Scheduler
from fastprefill.serve.worker import Failed, Job, timeout_error

MB = 1 << 20


def _tokens(gen: Generation, chunk: int | None) -> tuple[list[int], int]:
    """Run ``gen`` to its end with prefill units of ``chunk``; its tokens and the units run."""
    tokens = [e.token_id for e in gen.run(chunk)]
    assert gen.out is not None
    return tokens, gen.out.stats.extra.get("prefill_chunks", 1)


@pytest.mark.parametrize("chunk", [1, 7, 16, 23])
def test_chunked_prefill_gives_the_unchunked_tokens_and_counts_its_chunks(tiny_model, make_ids, chunk):
    ids = make_ids(61, 3)
    want = generate(tiny_model, None, ids, FullPrefill(), 8, stop_at_eos=False)
    gen = Generation(tiny_model, None, ids, FullPrefill(), 8, stop_at_eos=False)
    tokens, units = _tokens(gen, chunk)
    assert tokens == want.token_ids
    assert units == math.ceil(61 / chunk)
    assert gen.out is not None and gen.out.stats.token_layers == want.timing.stats.token_layers
    torch.testing.assert_close(gen.first_logits, want.first_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [5, 12, 40])
def test_chunked_prefill_over_a_prefix_cache_hit_is_exact(tiny_model, make_ids, chunk):
    """A 40-token prefix is cached (blocks of 8); a 75-token prompt sharing 37 tokens hits 32
    (chunk boundaries then fall mid-block) and prefills the other 43 in chunks."""
    first = make_ids(40, 1)
    second = torch.cat([first[:, :37], make_ids(38, 2)], dim=1)
    want = generate(tiny_model, None, second, FullPrefill(), 6, stop_at_eos=False)
    cache = PrefixCache(64 * MB, block_tokens=8)
    generate(tiny_model, None, first, FullPrefill(), 2, stop_at_eos=False, prefix_cache=cache)
    gen = Generation(tiny_model, None, second, FullPrefill(), 6, stop_at_eos=False, prefix_cache=cache)
    assert gen.lookup() == 75 - 32
    tokens, units = _tokens(gen, chunk)
    assert tokens == want.token_ids and units == math.ceil(43 / chunk)
    assert gen.out is not None and gen.out.stats.token_layers == 43 * tiny_model.config.num_hidden_layers


def test_a_method_that_is_not_exact_runs_its_prefill_whole(tiny_llama, make_ids):
    method = LazyLLM()
    gen = Generation(tiny_llama, None, make_ids(50, 4), method, 4, stop_at_eos=False)
    assert not gen.chunked
    assert gen.prefill(8) == 50 and gen.prefilled


def test_batched_decode_gives_each_stream_its_own_tokens(tiny_model, make_ids):
    """Four prompts of different lengths and budgets decode in one batch; streams leave as they
    finish (the batch is restacked) and the tokens equal each one's generation alone."""
    prompts = [(make_ids(n, 10 + n), budget) for n, budget in ((5, 9), (33, 4), (17, 12), (48, 6))]
    want = [generate(tiny_model, None, ids, FullPrefill(), budget, stop_at_eos=False).token_ids
            for ids, budget in prompts]
    batch = DecodeBatch(tiny_model, max_batch=8)
    gens = [Generation(tiny_model, None, ids, FullPrefill(), budget, stop_at_eos=False) for ids, budget in prompts]
    got: list[list[int]] = []
    for gen in gens:
        gen.prefill(None)
        got.append([e.token_id for e in gen.first_events()])
    sizes = []
    while live := [g for g in gens if not g.finished]:
        events = batch.step(live)
        sizes.append(len(batch.members))
        for gen, stepped in zip(live, events, strict=True):
            got[gens.index(gen)] += [e.token_id for e in stepped]
    assert got == want
    assert sizes[:3] == [4, 4, 3]  # the 33-token prompt's 4 tokens are done after 3 steps: it leaves
    assert batch.members == []  # the last stream decodes alone; every row was written back


def test_a_stream_joining_a_running_batch_keeps_every_answer(tiny_llama, make_ids):
    a = Generation(tiny_llama, None, make_ids(20, 1), FullPrefill(), 10, stop_at_eos=False)
    b = Generation(tiny_llama, None, make_ids(9, 2), FullPrefill(), 10, stop_at_eos=False)
    c = Generation(tiny_llama, None, make_ids(31, 3), FullPrefill(), 5, stop_at_eos=False)
    batch = DecodeBatch(tiny_llama)
    for g in (a, b):
        g.prefill(None)
        g.first_events()
    for _ in range(3):
        batch.step([a, b])
    c.prefill(None)
    c.first_events()
    while live := [g for g in (a, b, c) if not g.finished]:
        batch.step(live)
    for gen, (n, seed, budget) in zip((a, b, c), ((20, 1, 10), (9, 2, 10), (31, 3, 5)), strict=True):
        assert gen.generated == generate(tiny_llama, None, make_ids(n, seed), FullPrefill(), budget,
                                         stop_at_eos=False).token_ids


# --------------------------------------------------------------------------- the policy and the queue
class _Loop:
    """An event loop the jobs post to, and the events each job got."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def events(self, job: Job) -> list:
        self.loop.run_until_complete(asyncio.sleep(0))
        out = []
        while not job.events.empty():
            out.append(job.events.get_nowait())
        return out


@pytest.fixture
def loop():
    holder = _Loop()
    yield holder
    holder.loop.close()


def _job(backend, ids, loop, metrics, max_tokens=4, arrived=0.0) -> Job:
    """A streamed full-prefill job generating exactly ``max_tokens`` tokens (``ignore_eos``)."""
    return Job(ids, FullPrefill(), backend, "full", "full", max_tokens, SamplingParams(ignore_eos=True), True, arrived, 1e12,
               metrics, loop.loop)


def test_a_short_request_finishes_before_the_next_chunk_of_a_long_prefill(tiny_llama, make_ids, loop):
    """A 200-token prompt in chunks of 32 and a 6-token one that arrives once the long one has
    run one chunk: the short one gets its first token at the next iteration and its whole answer
    long before the long one's first token; both answers equal generate's."""
    metrics = ServeMetrics()
    backend = LocalBackend(tiny_llama, None, None)
    sched = Scheduler(ModelExecutor(tiny_llama, None, 8), metrics, 8, ShortFirstPolicy(max_running=4, budget=32))
    long_ids, short_ids = make_ids(200, 5), make_ids(6, 6)
    long, short = _job(backend, long_ids, loop, metrics, 3), _job(backend, short_ids, loop, metrics, 3, 1.0)
    sched.submit(long)
    sched.run_once()
    sched.submit(short)
    order = []
    for _ in range(20):
        sched.run_once()
        for name, job in (("long", long), ("short", short)):
            order += [(name, type(e).__name__) for e in loop.events(job)]
        if not sched.running:
            break
    assert order.index(("short", "Finished")) < order.index(("long", "Token"))
    finished = {name: e for name, e in order if e == "Finished"}
    assert set(finished) == {"long", "short"}
    chunks = {s.labels["method"]: s.value for f in metrics.registry.collect() for s in f.samples
              if s.name == "fastprefill_prefill_chunks_total"}
    # the long prompt: 32 tokens, then 26 beside the short one's 6, then chunks of 32; the short one: 1
    assert chunks["full"] == 1 + 1 + math.ceil((200 - 32 - 26) / 32) + 1


def test_answers_of_the_scheduler_equal_generate(tiny_llama, make_ids, loop):
    metrics = ServeMetrics()
    backend = LocalBackend(tiny_llama, None, None)
    sched = Scheduler(ModelExecutor(tiny_llama, None, 8), metrics, 8, ShortFirstPolicy(max_running=3, budget=24))
    prompts = [make_ids(n, n) for n in (70, 5, 41, 12)]
    jobs = [_job(backend, ids, loop, metrics, 7, float(i)) for i, ids in enumerate(prompts)]
    for job in jobs:
        sched.submit(job)
    while sched.running or sched.waiting:
        sched.run_once()
    for job, ids in zip(jobs, prompts, strict=True):
        events = loop.events(job)
        assert job.outcome == "ok" and isinstance(events[-1], Finished)
        assert sum(isinstance(e, Token) for e in events) >= 1
        assert events[-1].answers[0].token_ids == generate(tiny_llama, None, ids, FullPrefill(), 7, stop_at_eos=False).token_ids


def test_answers_with_decode_steps_riding_in_prefill_chunks_equal_generate(tiny_llama, make_ids, loop):
    """``mixed_chunk``: streams decode inside the chunks of the prompts that arrive after them
    (one forward for both, counted in /metrics); every answer equals generate's."""
    metrics = ServeMetrics()
    backend = LocalBackend(tiny_llama, None, None)
    sched = Scheduler(ModelExecutor(tiny_llama, None, 8), metrics, 8,
                      ShortFirstPolicy(max_running=4, budget=64, mixed_chunk=16))
    prompts = [make_ids(n, n) for n in (9, 70, 12, 90)]
    jobs = [_job(backend, ids, loop, metrics, 9, float(i)) for i, ids in enumerate(prompts)]
    for i, job in enumerate(jobs):
        sched.submit(job)
        sched.run_once()  # each later prompt arrives while the earlier ones decode
        if i == 0:
            sched.run_once()
    while sched.running or sched.waiting:
        sched.run_once()
    for job, ids in zip(jobs, prompts, strict=True):
        events = loop.events(job)
        assert job.outcome == "ok" and isinstance(events[-1], Finished)
        assert events[-1].answers[0].token_ids == generate(tiny_llama, None, ids, FullPrefill(), 9, stop_at_eos=False).token_ids
    mixed = [s.value for f in metrics.registry.collect() for s in f.samples if s.name == "fastprefill_mixed_steps_total"]
    assert mixed and mixed[0] >= 5


@pytest.mark.parametrize(("budget", "arrive"), [(32, "together"), (8192, "together"), (32, "mid-prefill")])
def test_requests_over_one_new_document_compute_it_once(tiny_llama, make_ids, loop, budget, arrive):
    """Four questions over one new 200-token document, submitted together (or three of them once the
    first has run a chunk), the prefix cache on: the document is prefilled once (the first request's
    whole prompt, then each other only its rest past the document's whole blocks, which it waited
    for: in chunks of 32 the others would be aged past the first after 4 iterations and compute the
    rest of the document beside it), /metrics' shared tokens count those, and every answer equals
    generate's without a cache."""
    metrics = ServeMetrics()
    cache = PrefixCache(64 * MB, block_tokens=16)
    backend = LocalBackend(tiny_llama, None, cache)
    sched = Scheduler(ModelExecutor(tiny_llama, None, 8), metrics, 8, ShortFirstPolicy(max_running=4, budget=budget))
    doc = make_ids(200, 40)
    prompts = [torch.cat([doc, make_ids(5 + i, 41 + i)], dim=1) for i in range(4)]
    jobs = [_job(backend, ids, loop, metrics, 5, float(i)) for i, ids in enumerate(prompts)]
    sched.submit(jobs[0])
    if arrive == "mid-prefill":
        sched.run_once()
        assert not sched.running[0].work.prefilled
    for job in jobs[1:]:
        sched.submit(job)
    while sched.running or sched.waiting:
        sched.run_once()
    finished = [loop.events(job)[-1] for job in jobs]
    timings = [f.timing for f in finished]
    reused = 200 // 16 * 16  # the document's whole blocks
    assert [t.cached_tokens for t in timings] == [0, reused, reused, reused]
    early = 32 if arrive == "mid-prefill" else 0  # the first chunk's blocks, stored before the others came
    assert [t.shared_tokens for t in timings] == [0, *3 * [reused - early]]
    prefilled = sum(t.prompt_tokens - t.cached_tokens for t in timings)
    assert prefilled == sum(p.shape[1] for p in prompts) - 3 * reused  # the document once, plus the questions
    samples = {s.name: s.value for f in metrics.registry.collect() for s in f.samples if s.labels.get("method") == "full"}
    assert samples["fastprefill_prompt_tokens_shared_total"] == 3 * (reused - early)
    assert samples["fastprefill_prompt_tokens_computed_total"] == prefilled
    for done, ids in zip(finished, prompts, strict=True):
        want = generate(tiny_llama, None, ids, FullPrefill(), 5, stop_at_eos=False).token_ids
        assert done.answers[0].token_ids == want


def test_a_request_waits_only_for_blocks_it_lacks_from_a_running_exact_prefill(tiny_llama, make_ids):
    """What a request would wait for: the whole blocks a running full prefill shares with its prompt
    past its own hit; nothing from a prefill of another prompt, one already done, one that is not
    exact (LazyLLM stores no pruned K/V), or when it takes no cached prefix."""
    cache = PrefixCache(64 * MB, block_tokens=16)
    backend = LocalBackend(tiny_llama, None, cache)
    doc = make_ids(70, 50)

    def gen(ids, method=None):
        return Generation(tiny_llama, None, ids, method or FullPrefill(), 3, prefix_cache=cache)

    waiting = gen(torch.cat([doc, make_ids(9, 51)], dim=1))
    waiting.lookup()
    running = gen(torch.cat([doc, make_ids(30, 52)], dim=1))
    assert backend.waits_for(waiting, running) == 64
    assert backend.waits_for(waiting, gen(doc[:, :40])) == 32  # a shorter prompt: its whole blocks
    assert backend.waits_for(waiting, gen(make_ids(90, 53))) == 0
    assert backend.waits_for(waiting, gen(torch.cat([doc, make_ids(3, 54)], dim=1), LazyLLM(preset="default"))) == 0
    no_prefix = gen(torch.cat([doc, make_ids(9, 51)], dim=1), RandomDrop(keep=0.5))
    assert not no_prefix.uses_cache and backend.waits_for(no_prefix, running) == 0
    running.prefill(None)
    assert backend.waits_for(waiting, running) == 0  # done: its blocks are in the cache (looked up again)
    running.publish()
    assert waiting.lookup() == 79 - 64 and waiting.shared_tokens == 64
    held = waiting._cache
    generate(tiny_llama, None, make_ids(40, 55), max_new_tokens=1, prefix_cache=cache)  # other blocks stored
    lookups = cache.stats.lookups
    assert waiting.lookup() == 79 - 64 and cache.stats.lookups == lookups + 1  # looked up again: nothing longer
    assert waiting._cache is held and waiting.shared_tokens == 64
    hit = cache.lookup(tiny_llama, waiting.input_ids, longer_than=64)
    assert hit.tokens == 64 and hit.cache is None  # no K/V assembled for a hit the caller holds


def test_short_first_orders_by_remaining_tokens_and_ages_the_passed_over():
    class W:
        def __init__(self, remaining):
            self.remaining = remaining

    class J:
        def __init__(self, arrived):
            self.arrived = arrived

    from fastprefill.serve.policies import Running

    runs = [Running(J(0.0), W(4000), None), Running(J(1.0), W(30), None), Running(J(2.0), W(30), None)]
    policy = ShortFirstPolicy(max_skips=2)
    assert policy.order(runs) == [runs[1], runs[2], runs[0]]
    runs[0].skips = 2
    assert policy.order(runs) == [runs[0], runs[1], runs[2]]
    assert FifoPolicy().order(runs[::-1]) == runs[::-1]
    assert make_policy(ServeConfig("m", scheduler="fifo")) == FifoPolicy()
    assert make_policy(ServeConfig("m", prefill_chunk=64, max_running=3)) == ShortFirstPolicy(3, 64)


def test_a_cancelled_request_is_dropped_at_the_next_chunk(tiny_llama, make_ids, loop):
    metrics = ServeMetrics()
    backend = LocalBackend(tiny_llama, None, None)
    sched = Scheduler(ModelExecutor(tiny_llama, None, 8), metrics, 8, ShortFirstPolicy(max_running=4, budget=16))
    job = _job(backend, make_ids(100, 1), loop, metrics)
    sched.submit(job)
    sched.run_once()
    assert sched.running and not sched.running[0].work.prefilled
    job.cancel()
    sched.run_once()
    assert not sched.running and job.outcome == "cancelled"


def test_serve_config_refuses_bad_scheduler_settings():
    from fastprefill.errors import ConfigError

    for bad in ({"scheduler": "lifo"}, {"scheduler": ["fifo"]}, {"prefill_chunk": 8}, {"prefill_chunk": 64.0},
                {"max_running": 0}, {"mixed_chunk": 8}, {"mixed_chunk": -1}, {"mixed_chunk": 16.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            ServeConfig("m", **bad)


# --------------------------------------------------------------------------- the request's side of a job
def _waiting_job(loop, deadline: float) -> Job:
    return Job(torch.zeros(1, 3, dtype=torch.long), FullPrefill(), None, "full", "full", 4, SamplingParams(), True, 0.0,
               deadline, ServeMetrics(), loop.loop)


def test_a_job_past_its_deadline_that_the_scheduler_timed_out_returns_the_schedulers_error(loop):
    """The scheduler settles a late job first and posts its 504: the request side, past the
    deadline too, gets that event (it used to wait for it with no time to wait, forever)."""
    job = _waiting_job(loop, time.monotonic() - 1.0)
    job.fail(timeout_error(2.0))
    event = loop.loop.run_until_complete(asyncio.wait_for(job.next_event(), timeout=5.0))
    assert isinstance(event, Failed) and event.error.status == 504
    assert job.outcome == "timeout"


def test_a_job_times_out_at_its_deadline_on_the_request_side(loop):
    job = _waiting_job(loop, time.monotonic() + 0.2)
    sent = time.monotonic()
    event = loop.loop.run_until_complete(job.next_event(poll_s=0.05))
    assert isinstance(event, Failed) and event.error.status == 504
    assert time.monotonic() - sent >= 0.2 - 1e-3 and job.cancelled and job.outcome == "timeout"


def test_a_job_returns_its_events_in_order_and_none_once_the_client_is_gone(loop):
    job = _waiting_job(loop, time.monotonic() + 60)
    job.post(Failed(timeout_error(1.0)))
    assert isinstance(loop.loop.run_until_complete(job.next_event()), Failed)

    async def gone() -> bool:
        return True

    assert loop.loop.run_until_complete(job.next_event(gone, poll_s=0.01)) is None
    assert job.cancelled and job.outcome == "cancelled"
