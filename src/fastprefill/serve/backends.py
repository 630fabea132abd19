"""What runs a prepared request: the server's own model, or its rank pool (local ranks or
torchrun's), behind one interface chosen when the server starts.

:class:`Backends` is built once with the server (vLLM's ``Executor.get_class`` is the model):
it holds a :class:`LocalBackend` over the server's model and prefix cache and, when the server
has a rank pool, a :class:`RankBackend` over it (:class:`~fastprefill.serve.ranks.ServedPool`,
whose links are local processes or torchrun's ranks: the pool hides which). It is the one
place that asks whether a method runs over several ranks (the method says so,
:attr:`~fastprefill.methods.base.Method.on_ranks`): :meth:`Backends.on_ranks` for
``fastprefill generate``, torchrun's server and :func:`start_ranks`, :meth:`Backends.check` for
the methods a server starts with, :meth:`Backends.for_method` for each request, whose
:class:`~fastprefill.serve.worker.Job` carries its backend from then on.

A backend (the :class:`~fastprefill.serve.worker.Backend` contract) turns a job into a unit of
:class:`~fastprefill.serve.worker.Work` for the scheduler: a local
:class:`~fastprefill.engine.Generation` (chunked prefill for an exact method, then decode steps
the scheduler may batch), or a :class:`RankGeneration` (the whole prefill on the ranks as one
unit, up to the first token, then one token per step as the last rank sends them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.batch import DecodeBatch
from fastprefill.distributed.rank import check_ranks
from fastprefill.engine import Generation, StreamEvent, generate
from fastprefill.errors import ConfigError
from fastprefill.methods.base import DistributedMethod, Method
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache
from fastprefill.serve.config import ServeConfig, serving_method
from fastprefill.serve.protocol import APIError
from fastprefill.serve.ranks import ServedPool
from fastprefill.serve.worker import Backend, Job, Work, ranks_down

__all__ = ["Backends", "LocalBackend", "RankBackend", "RankGeneration", "rank_methods", "start_ranks"]


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
                          prefix_cache=self.prefix_cache, sampling=job.sampling, name=job.name)

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
        events = self.pool.stream(job.input_ids, job.method, job.max_tokens, sampling=job.sampling, name=job.name)
        note = f"not used: {job.method.name} takes no cached prefix" if self.prefix_cache else None
        return RankGeneration(events, int(job.input_ids.shape[1]), note)

    def warm_up(self, method: Method, vocab_size: int) -> None:
        self.pool.warm_up(method, vocab_size)


class Backends:
    """The server's backends, chosen once at start (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prefix_cache: PrefixCache | None,
                 ranks: ServedPool | None) -> None:
        self.local = LocalBackend(model, tokenizer, prefix_cache)
        self.ranks = None if ranks is None else RankBackend(ranks, prefix_cache is not None)

    @staticmethod
    def on_ranks(method: Method) -> bool:
        """Whether ``method`` runs on a rank pool rather than on the caller's own model (the method
        says so: :attr:`~fastprefill.methods.base.Method.on_ranks`); the question behind every
        choice of backend: this class's, ``fastprefill generate``'s and torchrun's server's."""
        return method.on_ranks

    @property
    def pool_ranks(self) -> int:
        """Ranks of the server's pool (1: it has none, so it runs no multi-rank method)."""
        return 1 if self.ranks is None else self.ranks.pool.procs

    def check(self, method: Method, spec: str) -> None:
        """Refuse, when the server starts, a ``method`` (built from ``spec``) that no backend of this
        server can run: a multi-rank one without a pool, or on another number of ranks.

        Raises:
            ConfigError: saying how to start a server that runs it.
        """
        if not self.on_ranks(method):
            return
        if self.ranks is None:
            raise ConfigError(
                f"{spec!r} runs over several ranks and this server has no rank pool: `fastprefill serve "
                f"--method {spec}` starts one (from Python: create_app(..., ranks=start_ranks(config, "
                "model_name))), or run it with `python -m fastprefill.launch` (or torchrun)")
        check_ranks(method, self.pool_ranks, f"the server's rank pool has {self.pool_ranks}")

    def for_method(self, method: Method) -> Backend:
        """The backend that runs ``method``, as resolved for the request's prompt.

        Raises:
            APIError: 503 when its rank pool has failed; 400 for a multi-rank method on a server
                without a pool (the method table refuses those first).
        """
        if not self.on_ranks(method):
            return self.local
        if self.ranks is None:
            raise APIError(400, f"{method.name} runs over several processes; this server has no rank pool",
                           param="fastprefill.method")
        self.ranks.check()
        return self.ranks

    def unavailable(self, method: Method) -> str | None:
        """Why ``method`` cannot run now (``None``: it can), without raising or waiting (``/health``)."""
        if not self.on_ranks(method):
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


def start_ranks(config: ServeConfig, model: str, **pool: Any) -> ServedPool | None:
    """The rank pool that ``config``'s methods need (``--method`` and ``--allow-method``), or
    ``None`` when all of them run in one process (:meth:`Backends.on_ranks`).

    Args:
        model: what each rank loads (:func:`fastprefill.models.load`: a zoo name, a folder, ...;
            on the CPU): the server's own model, in the dtype ``pool["dtype"]`` names.
        pool: more :class:`~fastprefill.distributed.pool.RankPool` arguments (``threads_per_rank``,
            ``pin``, ``start_method``).

    Raises:
        ConfigError: multi-rank methods asking for different numbers of ranks; see
            :class:`~fastprefill.distributed.pool.RankPool` for a rank that cannot start.
    """
    needs = rank_methods({spec: serving_method(spec) for spec in (config.method, *config.allow_methods)})
    if not needs:
        return None
    procs = {m.ranks for m in needs.values()}
    if len(procs) > 1:
        raise ConfigError(f"the multi-rank methods {sorted(needs)} ask for {sorted(procs)} ranks; the server keeps "
                          "one rank pool, so give them all the same procs")
    return ServedPool(model, procs.pop(), timeout_s=max(m.timeout_s for m in needs.values()), **pool)


def rank_methods(methods: Mapping[str, Method]) -> dict[str, DistributedMethod]:
    """Those of ``methods`` (by spec) that run on a rank pool (:meth:`Backends.on_ranks`)."""
    return {spec: cast(DistributedMethod, m) for spec, m in methods.items() if Backends.on_ranks(m)}
