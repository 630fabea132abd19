"""What runs a prepared request: the server's own model, or its rank pool (local ranks or
torchrun's), behind one interface chosen when the server starts.

:class:`Backends` is built once with the server (vLLM's ``Executor.get_class`` is the model):
it holds a :class:`LocalBackend` over the server's model and prefix cache and, when the server
has a rank pool, a :class:`RankBackend` over it (:class:`~fastprefill.serve.ranks.ServedPool`,
whose links are local processes or torchrun's ranks: the pool hides which).
:meth:`Backends.for_method` is the one place that asks whether a method runs over several
ranks (:func:`~fastprefill.methods.base.runs_on_ranks`, the test ``fastprefill generate`` uses
too); a request's :class:`~fastprefill.serve.worker.Job` carries its backend from then on.

A backend turns a job into a unit of :class:`Work` for the scheduler: a local
:class:`~fastprefill.engine.Generation` (chunked prefill for an exact method, then decode steps
the scheduler may batch), or a :class:`RankGeneration` (the whole prefill on the ranks as one
unit, up to the first token, then one token per step as the last rank sends them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.batch import DecodeBatch
from fastprefill.engine import Generation, StreamEvent, generate
from fastprefill.methods.base import Method, runs_on_ranks
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache
from fastprefill.serve.protocol import APIError
from fastprefill.serve.ranks import ServedPool
from fastprefill.serve.worker import Job, ranks_down

__all__ = ["Backend", "Backends", "LocalBackend", "RankBackend", "RankGeneration", "Work"]


class Work(Protocol):
    """One running request as the scheduler drives it (:class:`~fastprefill.engine.Generation`
    is the reference implementation)."""

    n_prompt: int
    finished: bool

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill (after :meth:`lookup`)."""
        ...

    @property
    def chunked(self) -> bool:
        """Whether :meth:`prefill` may run part of the prompt."""
        ...

    @property
    def prefilled(self) -> bool:
        """Whether the first token is known."""
        ...

    def lookup(self) -> int:
        """Find what is already computed (the prefix cache); returns :attr:`remaining`."""
        ...

    def prefill(self, budget: int | None = None) -> int:
        """One unit of prefill (at most ``budget`` tokens when :attr:`chunked`); the tokens run."""
        ...

    def first_events(self) -> list[StreamEvent]:
        """The first tokens' events (one per answer it holds), once :attr:`prefilled`."""
        ...

    def step(self) -> list[StreamEvent]:
        """One decode step: the next tokens' events (the generation's last carries the timing)."""
        ...

    def publish(self) -> None:
        """Once its first tokens are out: make what its prefill computed visible to other
        requests (the prefix cache's blocks)."""
        ...

    def close(self) -> None:
        """Stop early and free what the work holds (its K/V, the ranks)."""
        ...


class Backend(Protocol):
    """What a job runs on (see the module docstring)."""

    #: at most one of its works may run at a time (a rank pool runs one request at a time)
    exclusive: bool
    #: a failure of it ends the server (torchrun's ranks)
    fatal: bool

    def check(self) -> None:
        """Raise :class:`~fastprefill.serve.protocol.APIError` if it cannot take a request now."""
        ...

    def unavailable(self) -> str | None:
        """Why it cannot take a request now (``None``: it can); never waits."""
        ...

    def begin(self, job: Job) -> Work:
        """The job's work."""
        ...

    def waits_for(self, work: Work, other: Work) -> int:
        """Prompt tokens of ``work`` that ``other`` (running) will store and ``work`` lacks: worth
        waiting for rather than computing twice (0: none)."""
        ...

    def warm_up(self, method: Method, vocab_size: int) -> None:
        """One short generation with ``method`` (first calls are slow)."""
        ...


def _warm_ids(vocab_size: int) -> list[int]:
    return [(1000 + i) % vocab_size for i in range(64)]


class LocalBackend:
    """The server's own model (and its prefix cache, when it has one)."""

    exclusive = False
    fatal = False

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 prefix_cache: PrefixCache | None) -> None:
        self.model, self.tokenizer, self.prefix_cache = model, tokenizer, prefix_cache

    def check(self) -> None:
        """Always ready."""

    def unavailable(self) -> None:
        return None

    def begin(self, job: Job) -> Generation:
        """A :class:`~fastprefill.engine.Generation` of the job (it stores into the prefix cache
        only once it is complete)."""
        return Generation(self.model, self.tokenizer, job.input_ids, job.method, job.max_tokens,
                          prefix_cache=self.prefix_cache, sampling=job.sampling)

    def waits_for(self, work: Work, other: Work) -> int:
        """The whole blocks of ``work``'s prompt past what it found in the prefix cache that
        ``other``, an exact prefill still running over the same cache, shares with it and will
        store (each chunk's as it ends, the last once its first token is out); 0 when ``work``
        takes no cached prefix or ``other`` stores nothing it lacks."""
        cache = self.prefix_cache
        if (cache is None or not isinstance(work, Generation) or not isinstance(other, Generation) or not work.uses_cache
                or other.prefix_cache is not cache or other.prefilled or not other.method.chunked_prefill):
            return 0
        n = min(work.n_prompt - 1, other.n_prompt)  # a hit leaves at least the last prompt token to run
        differ = (work.input_ids[0, :n] != other.input_ids[0, :n]).nonzero()
        common = int(differ[0, 0]) if len(differ) else n
        return max(0, common // cache.block_tokens * cache.block_tokens - work.cached_tokens)

    def warm_up(self, method: Method, vocab_size: int) -> None:
        generate(self.model, self.tokenizer, _warm_ids(vocab_size), method, max_new_tokens=2)

    def warm_up_batch(self, vocab_size: int) -> None:
        """Two streams of different lengths decoded in one batch for a few steps (the first
        batched forwards are slow where the model's blocks are compiled: a new batch size)."""
        ids = torch.tensor([_warm_ids(vocab_size)])
        gens = [Generation(self.model, self.tokenizer, ids[:, :n], FullPrefill(), 4, stop_at_eos=False)
                for n in (64, 40)]
        for gen in gens:
            gen.prefill(None)
            gen.first_events()
        batch = DecodeBatch(self.model)
        while live := [g for g in gens if not g.finished]:
            batch.step(live)


class RankGeneration:
    """A multi-rank request on the pool: the prefill through the first token is one unit of
    work (it cannot be split: every rank joins it); then each :meth:`step` takes the next token
    the last rank sent (it decodes on its own meanwhile)."""

    chunked = False

    def __init__(self, events: Iterator[StreamEvent], n_prompt: int, note: str | None) -> None:
        self._events = events
        self.n_prompt = n_prompt
        self.note = note
        self.finished = False
        self._first: StreamEvent | None = None

    @property
    def remaining(self) -> int:
        return 0 if self._first is not None else self.n_prompt

    @property
    def prefilled(self) -> bool:
        return self._first is not None

    def lookup(self) -> int:
        return self.remaining

    def prefill(self, budget: int | None = None) -> int:
        self._first = self._take()
        return self.n_prompt

    def first_events(self) -> list[StreamEvent]:
        assert self._first is not None
        return [self._first]

    def step(self) -> list[StreamEvent]:
        return [self._take()]

    def publish(self) -> None:
        """Nothing: the ranks keep no prefix cache."""

    def _take(self) -> StreamEvent:
        event = next(self._events)
        if event.timing is not None:
            self.finished = True
            if self.note is not None:  # the ranks ran the whole prompt, with no cache
                event.timing.prefix_cache = self.note
        return event

    def close(self) -> None:
        """Cancel on the ranks (the last rank stops at its next token; the pool stays warm)."""
        self._events.close()  # type: ignore[attr-defined]


class RankBackend:
    """The server's rank pool: one multi-rank request at a time."""

    exclusive = True

    def __init__(self, pool: ServedPool, prefix_cache: bool) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache

    @property
    def fatal(self) -> bool:
        return self.pool.fatal

    def check(self) -> None:
        """Raises the 503 of a pool that has failed or lost a rank (multi-rank requests are
        refused from then on)."""
        if (reason := self.unavailable()) is not None:
            raise ranks_down(reason, fatal=self.pool.fatal)

    def unavailable(self) -> str | None:
        """The pool's failure, or a rank gone since its last request (:meth:`ServedPool.lost`)."""
        return self.pool.lost()

    def waits_for(self, work: Work, other: Work) -> int:
        """0: the ranks keep no prefix cache."""
        return 0

    def begin(self, job: Job) -> RankGeneration:
        assert runs_on_ranks(job.method)
        events = self.pool.stream(job.input_ids, job.method, job.max_tokens, sampling=job.sampling)
        note = f"not used: {job.method.name} takes no cached prefix" if self.prefix_cache else None
        return RankGeneration(events, int(job.input_ids.shape[1]), note)

    def warm_up(self, method: Method, vocab_size: int) -> None:
        assert runs_on_ranks(method)
        self.pool.warm_up(method, vocab_size)


class Backends:
    """The server's backends, chosen once at start (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prefix_cache: PrefixCache | None,
                 ranks: ServedPool | None) -> None:
        self.local = LocalBackend(model, tokenizer, prefix_cache)
        self.ranks = None if ranks is None else RankBackend(ranks, prefix_cache is not None)

    def for_method(self, method: Method) -> Backend:
        """The backend that runs ``method`` (the one place that asks whether it is multi-rank).

        Raises:
            APIError: 503 when its rank pool has failed; 400 for a multi-rank method on a server
                without a pool (the method table refuses those first).
        """
        if not runs_on_ranks(method):
            return self.local
        if self.ranks is None:
            raise APIError(400, f"{method.name} runs over several processes; this server has no rank pool",
                           param="fastprefill.method")
        self.ranks.check()
        return self.ranks

    def unavailable(self, method: Method) -> str | None:
        """Why ``method`` cannot run now (``None``: it can), without raising or waiting (``/health``)."""
        if not runs_on_ranks(method):
            return self.local.unavailable()
        if self.ranks is None:
            return "it runs over several processes and this server has no rank pool"
        return self.ranks.unavailable()

    def warm_up(self, methods: list[Method], vocab_size: int, batched: bool = False) -> None:
        """One short generation per method, on its backend (and, when ``batched``, a short
        batched decode on the server's model)."""
        for method in methods:
            self.for_method(method).warm_up(method, vocab_size)
        if batched:
            self.local.warm_up_batch(vocab_size)

