"""The scheduler as policy (:mod:`fastprefill.serve.scheduler`): its module imports nothing that
touches a model, and its decisions (admission, the prefill budget and its order, aging, waiting
for a running prefill's blocks, decode steps, pauses, cancellation, failures, the queue's bound
and shutdown) are driven here by a fake executor over fake works: no model is loaded.

The fake works count tokens and nothing else; what each test asserts is the sequence of units
the scheduler asked its executor for, against the one its module docstring describes."""

from __future__ import annotations

import ast
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastprefill.methods.full import FullPrefill
from fastprefill.sampling import SamplingParams
from fastprefill.serve import scheduler as scheduler_module
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.policies import FifoPolicy, ShortFirstPolicy
from fastprefill.serve.protocol import APIError
from fastprefill.serve.scheduler import Scheduler
from fastprefill.serve.worker import Decoded, Failed, Job, Pause, Stepped

#: What the scheduler module may import from fastprefill: the contracts it drives, its settings,
#: its metrics and the wire errors; everything else (the engine, the models, the methods, the
#: decode batch, the pauses, the backends, the answers' text) belongs to its executor.
ALLOWED = {"fastprefill.serve.config", "fastprefill.serve.metrics", "fastprefill.serve.policies", "fastprefill.serve.protocol",
           "fastprefill.serve.worker"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``TYPE_CHECKING`` blocks and functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            found.add(node.module)
    return found


def test_the_scheduler_module_imports_only_the_standard_library_and_its_contracts():
    imports = _imports(Path(scheduler_module.__file__))
    ours = {m for m in imports if m.split(".")[0] == "fastprefill"}
    others = {m for m in imports - ours if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"}}
    assert ours <= ALLOWED, f"the scheduler imports model-side modules: {sorted(ours - ALLOWED)}"
    assert not others, f"the scheduler imports third-party modules: {sorted(others)}"


def test_the_import_check_sees_what_it_must_refuse(tmp_path):
    """The check above reads imports inside functions and ``TYPE_CHECKING`` blocks too."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                      "def f():\n    from fastprefill.engine import Generation\n")
    assert {"torch", "fastprefill.engine"} <= _imports(source)


# --------------------------------------------------------------------------- fakes
@dataclass
class Event:
    """A stand-in for the engine's StreamEvent: the fields the scheduler reads."""

    index: int
    timing: object | None = None


def _timing(prompt: int, tokens: int) -> SimpleNamespace:
    stats = SimpleNamespace(token_layers=prompt, total_token_layers=prompt)
    return SimpleNamespace(ttft_s=0.1, decode_s_per_token=None, prompt_tokens=prompt, stats=stats, method="fake",
                           cached_tokens=0, shared_tokens=0, new_tokens=tokens)


class Work:
    """A request's work that counts prompt tokens and answer tokens."""

    def __init__(self, name: str, n_prompt: int, tokens: int, chunked: bool) -> None:
        self.name, self.n_prompt, self.tokens, self.chunked = name, n_prompt, tokens, chunked
        self.done = self.out = 0
        self.finished = self.closed = self.published = False

    @property
    def remaining(self) -> int:
        return self.n_prompt - self.done

    @property
    def prefilled(self) -> bool:
        return self.done >= self.n_prompt

    def lookup(self) -> int:
        return self.remaining

    def prefill(self, budget: int | None = None) -> int:
        ran = self.remaining if budget is None or not self.chunked else min(budget, self.remaining)
        self.done += ran
        return ran

    def _event(self) -> Event:
        self.out += 1
        self.finished = self.out == self.tokens
        return Event(self.out - 1, _timing(self.n_prompt, self.tokens) if self.finished else None)

    def first_events(self) -> list[Event]:
        return [self._event()]

    def step(self) -> list[Event]:
        return [self._event()]

    def publish(self) -> None:
        self.published = True

    def close(self) -> None:
        self.closed = True


class Backend:
    """Begins a :class:`Work` named by the job's label; ``waits`` gives ``waits_for``."""

    def __init__(self, exclusive: bool = False, chunked: bool = True, waits=lambda work, other: 0) -> None:
        self.exclusive, self.fatal, self.chunked, self.waits = exclusive, False, chunked, waits
        self.works: dict[str, Work] = {}

    def begin(self, job: Job) -> Work:
        work = Work(job.label, int(job.input_ids.shape[1]), job.max_tokens, self.chunked)
        self.works[job.label] = work
        return work

    def waits_for(self, work: Work, other: Work) -> int:
        return self.waits(work, other)


class Answers:
    def __init__(self) -> None:
        self.count = 0

    def add(self, event: Event) -> str:
        self.count += 1
        return f"token {event.index}"

    def finished(self, timing: object, queue_wait_s: float) -> str:
        return "finished"


class Executor:
    """Runs what the scheduler asks and records it: ``("prefill", name, budget, pausable)``,
    ``("decode", names)`` and ``("mixed", name, budget, names)``. ``fail``: names whose decode
    step (or mixed unit, by its prefill's name) raises; ``during``: called with the
    :class:`Pause` of a pausable unit before it runs (a pause at a layer); ``mix``: whether a
    chunked work's unit can carry a decode step."""

    def __init__(self, pauses: bool = True, mix: bool = True) -> None:
        self.calls: list[tuple] = []
        self.fail: set[str] = set()
        self.during = None
        self.pauses, self.released, self.mix = pauses, False, mix

    def enable_pauses(self, cv) -> bool:
        return self.pauses

    def release(self) -> None:
        self.released = True

    def begin(self, job: Job) -> tuple[Work, Answers]:
        return job.backend.begin(job), Answers()

    def prefill(self, work: Work, budget: int | None, pause: Pause | None) -> int:
        self.calls.append(("prefill", work.name, budget, pause is not None))
        if pause is not None and self.during is not None:
            during, self.during = self.during, None
            during(pause)
        return work.prefill(budget)

    def decode(self, works) -> Decoded:
        self.calls.append(("decode", [w.name for w in works]))
        steps = [Stepped([w], None, ValueError(f"{w.name} failed")) if w.name in self.fail else Stepped([w], [w.step()])
                 for w in works]
        return Decoded(steps, 0.01)

    def mixes(self, work: Work, works) -> bool:
        return self.mix and work.chunked

    def mixed(self, work: Work, budget: int, works) -> tuple[int, Decoded]:
        self.calls.append(("mixed", work.name, budget, [w.name for w in works]))
        if work.name in self.fail:
            raise ValueError(f"{work.name} failed")
        return work.prefill(budget), Decoded([Stepped(list(works), [w.step() for w in works])], 0.01)

    def error(self, exc: Exception, fatal: bool) -> APIError:
        return APIError(400, str(exc))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _events(loop, job: Job) -> list:
    loop.run_until_complete(asyncio.sleep(0))
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def _job(loop, backend, name: str, n_prompt: int, tokens: int = 2, arrived: float = 0.0, deadline: float = 1e12) -> Job:
    return Job(torch.zeros(1, n_prompt, dtype=torch.long), FullPrefill(), backend, name, name, tokens, SamplingParams(),
               True, arrived, deadline, ServeMetrics(), loop)


def _scheduler(executor: Executor, policy=None, capacity: int = 8) -> Scheduler:
    return Scheduler(executor, ServeMetrics(), capacity, policy or ShortFirstPolicy(max_running=4, budget=32))


def _drain(sched: Scheduler, limit: int = 50) -> None:
    for _ in range(limit):
        if not (sched.running or sched.waiting):
            return
        sched.run_once()
    raise AssertionError("the scheduler did not finish its requests")


def _prefills(executor: Executor) -> list[tuple]:
    return [c[1:3] for c in executor.calls if c[0] == "prefill"]


# --------------------------------------------------------------------------- decisions
def test_the_budget_goes_to_the_fewest_remaining_tokens_first(loop):
    """A long prompt in chunks of 32; a short one arriving after its first chunk takes its whole
    6 tokens first, and the long one the other 26 of that iteration's budget; then the short one
    decodes while the long one goes on in chunks."""
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor)
    long, short = _job(loop, backend, "long", 100), _job(loop, backend, "short", 6, arrived=1.0)
    sched.submit(long)
    sched.run_once()
    sched.submit(short)
    _drain(sched)
    assert _prefills(executor)[:4] == [("long", 32), ("short", 32), ("long", 26), ("long", 32)]
    assert ("decode", ["short"]) in executor.calls[:6]
    assert [type(e) for e in _events(loop, short)] == [str, str, str]  # two tokens, then its answers
    assert backend.works["long"].published and backend.works["short"].published
    assert executor.released is False  # only the thread releases the executor when it ends


def test_a_whole_prefill_starts_only_at_the_head_of_an_iteration(loop):
    """A method that cannot chunk is not squeezed into what is left of a budget: it waits for the
    next iteration and then runs whole, with the iteration's budget to itself."""
    executor, chunked, whole = Executor(), Backend(), Backend(chunked=False)
    sched = _scheduler(executor)
    sched.submit(_job(loop, chunked, "short", 8))
    sched.submit(_job(loop, whole, "whole", 50, arrived=1.0))
    sched.run_once()
    assert _prefills(executor) == [("short", 32)]
    sched.run_once()
    assert _prefills(executor)[1:] == [("whole", 32)] and whole.works["whole"].prefilled


def test_a_short_request_is_prefilled_before_the_streams_next_step_unless_one_is_due(loop):
    """A follow-up arriving while a stream decodes (its uncached rest under INTERLUDE_TOKENS):
    its prefill runs before the stream's next step, and the stream steps in the same iteration;
    with a decode step due (the decode interval past), the step goes first."""
    for interval, order in ((60.0, ["prefill", "decode"]), (1e-9, ["decode", "prefill"])):
        executor, backend = Executor(), Backend()
        sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=32, decode_interval_s=interval))
        sched.submit(_job(loop, backend, "stream", 8, tokens=5))
        sched.run_once()  # its prefill and first token
        sched.run_once()  # a decode step
        sched.submit(_job(loop, backend, "follow", 6, arrived=1.0))
        n = len(executor.calls)
        sched.run_once()
        assert [c[0] for c in executor.calls[n:]] == order, interval
        assert ("decode", ["stream"]) in executor.calls[n:] and backend.works["follow"].prefilled


def test_a_prefill_passed_over_max_skips_times_goes_first(loop):
    """Aging: with ``max_skips=2`` and a budget that only the first prefill in order gets, a long
    prompt passed over twice by shorter ones arriving each iteration goes first at the third."""
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor, ShortFirstPolicy(max_running=8, budget=16, max_skips=2))
    sched.submit(_job(loop, backend, "long", 200))
    for i in range(3):
        sched.submit(_job(loop, backend, f"q{i}", 16, tokens=1, arrived=1.0 + i))
        sched.run_once()
    assert [name for name, _ in _prefills(executor)] == ["q0", "q1", "long"]


def test_fifo_runs_one_request_whole_in_arrival_order(loop):
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor, FifoPolicy())
    jobs = [_job(loop, backend, name, n, arrived=float(i)) for i, (name, n) in enumerate((("a", 300), ("b", 5)))]
    for job in jobs:
        sched.submit(job)
    _drain(sched)
    assert executor.calls == [("prefill", "a", None, False), ("decode", ["a"]), ("prefill", "b", None, False),
                              ("decode", ["b"])]


def test_every_decoding_stream_is_stepped_in_one_executor_call(loop):
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=64))
    for i, n in enumerate((10, 20, 30)):
        sched.submit(_job(loop, backend, f"s{i}", n, tokens=3, arrived=float(i)))
    sched.run_once()  # all three prefilled within one budget
    sched.run_once()
    assert executor.calls[-1] == ("decode", ["s0", "s1", "s2"])


def test_a_failed_decode_group_fails_only_its_requests(loop):
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor)
    bad, good = _job(loop, backend, "bad", 5, tokens=4), _job(loop, backend, "good", 5, tokens=4, arrived=1.0)
    executor.fail.add("bad")
    for job in (bad, good):
        sched.submit(job)
    _drain(sched)
    (failed,) = [e for e in _events(loop, bad) if isinstance(e, Failed)]
    assert failed.error.status == 400 and failed.error.message == "bad failed" and bad.outcome == "bad_request"
    assert backend.works["bad"].closed and _events(loop, good)[-1] == "finished" and good.outcome == "ok"


def test_an_exclusive_backend_runs_one_request_while_others_pass_it(loop):
    """Two requests on a backend that runs one at a time (the rank pool) and one on another: the
    second waits in the queue until the first is done, without holding up the third."""
    executor, ranks, local = Executor(), Backend(exclusive=True, chunked=False), Backend()
    sched = _scheduler(executor)
    first, second = _job(loop, ranks, "r1", 10, tokens=3), _job(loop, ranks, "r2", 10, arrived=1.0)
    third = _job(loop, local, "l", 10, arrived=2.0)
    for job in (first, second, third):
        sched.submit(job)
    sched.run_once()
    assert [r.job for r in sched.running] == [first, third] and sched.waiting == 1
    _drain(sched)
    names = [name for name, _ in _prefills(executor)]
    assert names.index("r2") > names.index("r1") and all(j.outcome == "ok" for j in (first, second, third))
    assert len([c for c in executor.calls if c[0] == "decode" and "r1" in c[1]]) == 2  # r1's 3 tokens: 1 + 2 steps


def test_a_request_waits_for_the_blocks_a_running_prefill_will_store(loop):
    """While a started prefill will store blocks of its prompt, a new request is not prefilled
    (though it comes first in the policy's order); once that prefill is done, it runs."""
    executor = Executor()
    backend = Backend(waits=lambda work, other: 16 if work.name == "b" and other.name == "a" and not other.prefilled else 0)
    sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=16))
    sched.submit(_job(loop, backend, "a", 40))
    sched.run_once()
    sched.submit(_job(loop, backend, "b", 20, arrived=1.0))
    sched.run_once()
    assert _prefills(executor) == [("a", 16), ("a", 16)]  # b passed over: a will store its blocks
    sched.run_once()
    assert _prefills(executor)[2:] == [("a", 16), ("b", 8)]  # a ran its last 8: b runs in the 8 left


def test_a_pausable_unit_lets_the_interlude_prefill_a_short_request_whole(loop):
    """A chunk that pauses (the executor calls the scheduler's interlude at a layer): a request
    that arrived runs its whole prefill (budget None, not pausable) before the chunk ends; a long
    one is admitted but left for later."""
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=1024))
    short, long = _job(loop, backend, "short", 6, arrived=1.0), _job(loop, backend, "long2", 600, arrived=2.0)

    def arrive(pause: Pause) -> None:
        sched.submit(short)
        sched.submit(long)
        with sched._cv:
            assert pause.wants()  # a request came since the last interlude
        pause.interlude()

    executor.during = arrive
    sched.submit(_job(loop, backend, "chunk", 900))
    sched.run_once()
    assert executor.calls[:2] == [("prefill", "chunk", 1024, True), ("prefill", "short", None, False)]
    pauses = [s.value for f in sched.metrics.registry.collect() for s in f.samples
              if s.name == "fastprefill_prefill_pauses_total"]
    assert len(sched.running) == 3 and pauses == [1.0] and "long2" in backend.works
    assert [name for name, _ in _prefills(executor)] == ["chunk", "short"]  # long2: above INTERLUDE_TOKENS
    assert _events(loop, short)[0] == "token 0"  # its first token came inside the chunk's pause


def test_no_unit_is_pausable_when_the_executor_cannot_pause(loop):
    executor = Executor(pauses=False)
    sched = _scheduler(executor)
    sched.submit(_job(loop, Backend(), "a", 10))
    sched.run_once()
    assert not sched.pausing and executor.calls == [("prefill", "a", 32, False)]


def _mixing(loop, executor: Executor) -> tuple[Scheduler, Backend, list[Job]]:
    """A stream of 4 tokens prefilled, then a 100-token prompt arriving, under ``mixed_chunk=16``."""
    backend = Backend()
    sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=64, mixed_chunk=16))
    jobs = [_job(loop, backend, "stream", 8, tokens=4), _job(loop, backend, "long", 100, arrived=1.0)]
    sched.submit(jobs[0])
    sched.run_once()  # its prefill and first token
    sched.submit(jobs[1])
    return sched, backend, jobs


def test_with_mixed_chunks_the_streams_next_token_rides_in_a_chunk_of_the_prefill(loop):
    """While a stream decodes, the long prompt runs in chunks of ``mixed_chunk`` that carry the
    stream's next token (no decode step apart); once the stream is done, in chunks of the budget."""
    executor = Executor()
    sched, backend, jobs = _mixing(loop, executor)
    _drain(sched)
    assert all(job.outcome == "ok" for job in jobs)
    assert executor.calls[0] == ("prefill", "stream", 64, True)
    assert executor.calls[1:] == [("mixed", "long", 16, ["stream"])] * 3 + [("prefill", "long", 64, True)] + [
        ("decode", ["long"])]
    assert backend.works["long"].prefilled and backend.works["long"].published
    steps = [s.value for f in sched.metrics.registry.collect() for s in f.samples if s.name == "fastprefill_mixed_steps_total"]
    assert steps == [3.0]


def test_with_mixed_chunks_requests_arriving_together_are_prefilled_one_after_the_other(loop):
    """Three short requests at once: without mixing all three are prefilled in the first iteration
    and then decode in lockstep; with it the first is prefilled alone and each next one's chunks
    carry the tokens of those before."""
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=64, mixed_chunk=16))
    for i in range(3):
        sched.submit(_job(loop, backend, f"q{i}", 20, tokens=8, arrived=float(i)))
    _drain(sched)
    assert executor.calls[:4] == [("prefill", "q0", 64, True), ("mixed", "q1", 16, ["q0"]), ("mixed", "q1", 16, ["q0"]),
                                  ("mixed", "q2", 16, ["q0", "q1"])]
    executor = Executor()
    sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=64))
    for i in range(3):
        sched.submit(_job(loop, backend, f"r{i}", 20, tokens=8, arrived=float(i)))
    sched.run_once()
    assert [c[:2] for c in executor.calls] == [("prefill", "r0"), ("prefill", "r1"), ("prefill", "r2")]


def test_no_chunk_carries_a_step_where_the_executor_cannot_mix_or_the_policy_says_no(loop):
    """The executor cannot mix (a model without a layer loop): a decode step, then the budget's
    chunk, as without ``mixed_chunk``; and the default policy never asks."""
    executor = Executor(mix=False)
    sched, _, _ = _mixing(loop, executor)
    sched.run_once()
    assert executor.calls[1:] == [("decode", ["stream"]), ("prefill", "long", 64, True)]
    assert ShortFirstPolicy().mixed_chunk == 0


def test_a_failed_mixed_unit_fails_its_prefill_and_every_stream_riding_in_it(loop):
    executor = Executor()
    executor.fail.add("long")
    sched, backend, jobs = _mixing(loop, executor)
    _drain(sched)
    assert executor.calls[1:] == [("mixed", "long", 16, ["stream"])]
    assert [job.outcome for job in jobs] == ["bad_request", "bad_request"]
    assert backend.works["long"].closed and backend.works["stream"].closed


def test_cancelled_and_late_requests_are_dropped_between_units(loop):
    executor, backend = Executor(), Backend()
    sched = _scheduler(executor, ShortFirstPolicy(max_running=4, budget=16))
    cancelled, late = _job(loop, backend, "c", 100), _job(loop, backend, "late", 100, arrived=0.0, deadline=0.0)
    sched.submit(cancelled)
    sched.run_once()
    cancelled.cancel()
    sched.submit(late)  # past its deadline before it is admitted
    sched.run_once()
    assert not sched.running and backend.works["c"].closed and "late" not in backend.works
    assert cancelled.outcome == "cancelled" and late.outcome == "timeout"
    assert _prefills(executor) == [("c", 16)]


def test_a_closed_scheduler_fails_the_waiting_jobs_and_refuses_new_ones(loop):
    metrics = ServeMetrics()
    sched = Scheduler(Executor(), metrics, capacity=2, policy=FifoPolicy())  # never started: the jobs stay queued
    waiting = [_job(loop, Backend(), "full", 2) for _ in range(2)]
    for job in waiting:
        job.metrics = metrics
        sched.submit(job)
    with pytest.raises(APIError) as full:
        sched.submit(_job(loop, Backend(), "full", 2))
    assert full.value.status == 429 and "queue of 2 is full" in full.value.message
    sched.close(APIError(503, "the server is shutting down", kind="server_error"))
    for job in waiting:
        (event,) = _events(loop, job)
        assert isinstance(event, Failed) and event.error.status == 503 and job.cancelled
    for _ in range(2):  # every later submission, each with an error of its own
        with pytest.raises(APIError) as info:
            sched.submit(_job(loop, Backend(), "full", 2))
        assert info.value.status == 503 and info.value.message == "the server is shutting down"
    outcomes = {s.labels["outcome"]: s.value for f in metrics.registry.collect() for s in f.samples
                if s.name == "fastprefill_requests_total"}
    assert outcomes == {"shutting_down": 2.0}  # the refused submissions were never jobs
