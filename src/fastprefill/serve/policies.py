"""The scheduler's policies (:mod:`fastprefill.serve.scheduler` runs them): how many requests run
at once, the prefill budget of an iteration and the order of the waiting prefills.

:class:`FifoPolicy` (``--scheduler fifo``) runs one request at a time, whole, in arrival order;
:class:`ShortFirstPolicy` (``--scheduler interleaved``, the default) orders prefills by the
prompt tokens they still need, fewest first, and ages them so a long prompt always advances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastprefill.serve.config import ServeConfig
from fastprefill.serve.worker import Answers, Job, Work

__all__ = ["FifoPolicy", "Running", "ShortFirstPolicy", "make_policy"]


@dataclass(eq=False)
class Running:
    """An admitted request: job, work, answers so far, prefills passed over in a row (``skips``)."""

    job: Job
    work: Work
    collected: Answers
    skips: int = 0
    started: float | None = None  # the first unit of work (the end of its queue wait)


@dataclass(frozen=True)
class FifoPolicy:
    """One request at a time, its whole prompt at once, in arrival order."""

    max_running: int = 1
    budget: int | None = None

    def order(self, prefilling: Sequence[Running]) -> list[Running]:
        """Arrival order."""
        return list(prefilling)


@dataclass(frozen=True)
class ShortFirstPolicy:
    """Fewest remaining prompt tokens first, with aging (see the module docstring).

    Attributes:
        max_running: requests admitted at once.
        budget: prompt tokens of prefill per iteration (``--prefill-chunk``).
        max_skips: iterations a prefill may be passed over in a row before it goes first.
        pause: pause a running chunk between two layers for a request that has just arrived,
            and for a decode step ``decode_interval_s`` after the last (``--prefill-pauses``,
            ``--decode-interval``; see the module docstring).
        mixed_chunk: tokens of a chunk that carries the decoding streams' next token (``--mixed-chunk``;
            0: none).
    """

    max_running: int = 8
    budget: int | None = 8192
    max_skips: int = 4
    pause: bool = True
    decode_interval_s: float = 2.0
    mixed_chunk: int = 0

    def order(self, prefilling: Sequence[Running]) -> list[Running]:
        """The aged prefills (oldest first), then the rest by remaining tokens (ties: arrival)."""
        aged = sorted((r for r in prefilling if r.skips >= self.max_skips), key=lambda r: r.job.arrived)
        rest = sorted((r for r in prefilling if r.skips < self.max_skips),
                      key=lambda r: (r.work.remaining, r.job.arrived))
        return aged + rest


def make_policy(config: ServeConfig) -> FifoPolicy | ShortFirstPolicy:
    """The policy ``config.scheduler`` names."""
    if config.scheduler == "fifo":
        return FifoPolicy()
    return ShortFirstPolicy(max_running=config.max_running, budget=config.prefill_chunk, pause=config.prefill_pauses,
                            decode_interval_s=config.decode_interval_s, mixed_chunk=config.mixed_chunk)
