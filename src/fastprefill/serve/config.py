"""A server's settings (:class:`ServeConfig`) and its defaults for the methods it serves
(:func:`serving_method`, :data:`PER_REQUEST_METHODS`); the table of those methods is
:mod:`fastprefill.serve.method_table`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastprefill.errors import check_fields, is_int, is_number
from fastprefill.methods.base import Method
from fastprefill.methods.registry import make_method

__all__ = ["PER_REQUEST_METHODS", "SCHEDULERS", "SERVER_REVIVAL", "ServeConfig", "serving_method"]

#: Methods a request may build by name: their settings are plain values. The others (``kvp``
#: reads a checkpoint from the server's disk) serve only if named when the server starts.
PER_REQUEST_METHODS = frozenset({"full", "lazyllm", "random", "static", "gemfilter"})
#: The revival policy of the server's LazyLLM when a request's spec names none: ``none`` decodes
#: with the model's own forward over the kept cache, at full prefill's speed per token; the
#: paper's Aux-Cache revival (``all``) recomputes deferred tokens while decoding. A request may
#: still ask for ``lazyllm:...,revival=all``; the usage block's method names the policy.
SERVER_REVIVAL = "none"
#: The schedulers a server may run (:mod:`fastprefill.serve.scheduler`).
SCHEDULERS = frozenset({"interleaved", "fifo"})


@dataclass(frozen=True)
class ServeConfig:
    """Settings of one server.

    Attributes:
        model_name: the name requests give as ``model`` (and ``/v1/models`` lists).
        method: the default method spec (``"full"``, ``"lazyllm:preset=default"``, ...).
        allow_methods: more specs built at start that requests may name (e.g. ``kvp:predictor=DIR``).
        queue_size: requests that may wait while one generates (>= 1); more get 429.
        timeout_s: seconds a request may take from arrival, queue wait included (> 0).
        max_tokens: tokens to generate when a request gives no ``max_tokens`` (>= 1).
        max_body_mb: the largest request body in MiB (> 0); a larger one gets 413 before it is read.
        drain_timeout_s: on SIGTERM/SIGINT, seconds the running generation may go on (>= 0)
            before it is ended with an error (see the module docstring).
        prefix_cache_mb: the bound in MiB of the exact prefix cache all requests share (>= 0;
            0 turns it off): a prompt whose start an earlier request computed prefills only the
            rest (:class:`~fastprefill.prefix_cache.PrefixCache`).
        prefix_cache_dir: a folder where the prefix cache is loaded from at start (a corrupt or
            mismatched file is refused with a log message and ignored) and saved to at shutdown.
        scheduler: ``"interleaved"`` (requests run side by side: chunked prefill, short work
            first, batched decode; :mod:`fastprefill.serve.scheduler`) or ``"fifo"`` (one request
            at a time, start to end, in arrival order).
        prefill_chunk: the largest unit of prefill of the interleaved scheduler (>= 16): a longer
            prompt of an exact method is prefilled in chunks of this size. With pauses, short
            requests and decode steps run between two layers of a chunk, so it bounds memory and
            the chunking overhead rather than their wait.
        max_running: requests the interleaved scheduler runs at once (>= 1; the largest decode
            batch); more wait in the queue of ``queue_size``.
        prefill_pauses: the interleaved scheduler pauses a running chunk of prefill between two
            decoder layers to prefill a request that has just arrived, when that request's
            uncached prompt is short (:data:`~fastprefill.serve.scheduler.INTERLUDE_TOKENS`;
            :mod:`fastprefill.serve.pauses`).
        decode_interval_s: with pauses, the running streams' longest wait for their next token
            while a chunk runs (> 0): the chunk also pauses for a decode step that long after
            the last one.
        mixed_chunk: where > 0, the interleaved scheduler runs a prefill that has decoding streams
            beside it in chunks of at most this many tokens (>= 16), each chunk carrying the
            streams' next token in the same layer calls (mixed batches: one pass over the weights
            for both; :meth:`fastprefill.batch.DecodeBatch.mixed`); 0 (the default): prefill
            units and decode steps run apart.
    """

    model_name: str
    method: str = "full"
    allow_methods: tuple[str, ...] = field(default_factory=tuple)
    queue_size: int = 16
    timeout_s: float = 300.0
    max_tokens: int = 256
    max_body_mb: float = 8.0
    drain_timeout_s: float = 30.0
    prefix_cache_mb: float = 1024.0
    prefix_cache_dir: str | None = None
    scheduler: str = "interleaved"
    prefill_chunk: int = 8192
    max_running: int = 8
    prefill_pauses: bool = True
    decode_interval_s: float = 2.0
    mixed_chunk: int = 0

    def __post_init__(self) -> None:
        def count(v: object) -> bool:
            return is_int(v, 1)

        def seconds(v: object, low: float) -> bool:
            return is_number(v) and math.isfinite(v) and v >= low

        check_fields(self, (
            ("queue_size", count(self.queue_size), "an integer >= 1"),
            ("scheduler", isinstance(self.scheduler, str) and self.scheduler in SCHEDULERS, f"one of {sorted(SCHEDULERS)}"),
            ("prefill_chunk", is_int(self.prefill_chunk, 16), "an integer number of tokens >= 16"),
            ("max_running", count(self.max_running), "an integer >= 1"),
            ("prefill_pauses", isinstance(self.prefill_pauses, bool), "True or False"),
            ("decode_interval_s", seconds(self.decode_interval_s, 0) and self.decode_interval_s > 0,
             "a finite number of seconds > 0"),
            ("mixed_chunk", is_int(self.mixed_chunk, 0) and self.mixed_chunk not in range(1, 16),
             "0 (off) or an integer number of tokens >= 16"),
            ("max_tokens", count(self.max_tokens), "an integer >= 1"),
            ("timeout_s", seconds(self.timeout_s, 0) and self.timeout_s > 0, "a finite number of seconds > 0"),
            ("max_body_mb", seconds(self.max_body_mb, 0) and self.max_body_mb > 0, "a finite number > 0"),
            ("drain_timeout_s", seconds(self.drain_timeout_s, 0), "a finite number of seconds >= 0"),
            ("prefix_cache_mb", seconds(self.prefix_cache_mb, 0), "a finite number of MiB >= 0 (0: no cache)"),
            ("prefix_cache_dir", self.prefix_cache_dir is None or (isinstance(self.prefix_cache_dir, str)
                                                                   and bool(self.prefix_cache_dir.strip())),
             "a folder path, or None"),
        ))

    @property
    def max_body_bytes(self) -> int:
        """``max_body_mb`` in bytes."""
        return int(self.max_body_mb * 2**20)


def serving_method(spec: str) -> Method:
    """The method the server runs for ``spec``: :func:`make_method`'s, with
    :data:`SERVER_REVIVAL` as the ``revival`` of a LazyLLM whose spec names none.

    Raises:
        ConfigError: as :func:`make_method`.
    """
    return make_method(spec, {"revival": SERVER_REVIVAL})  # only lazyllm declares revival
