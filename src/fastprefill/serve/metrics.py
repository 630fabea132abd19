"""The server's Prometheus metrics, in a registry of their own (one per app, so several servers
can live in one process).

Every series is labelled by ``method``: the registry name of the request's method (``full``,
``static``, ...; LazyLLM's with its revival policy, ``lazyllm[revival=none]``, since that sets
its decode cost; ``invalid`` when the request named none that exists or was refused before its
method was known), a bounded set whatever the requests send. The full setting
(``lazyllm[four-stage revival=none]``) is in each response's usage block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

if TYPE_CHECKING:
    from fastprefill.engine import Timing

__all__ = ["ServeMetrics"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BATCH = (1, 2, 3, 4, 6, 8, 12, 16, 32)
_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class ServeMetrics:
    """TTFT, decode time, queue wait, prompt sizes, token-layers, prefix-cache hits, request
    outcomes, and the scheduler's prefill chunks, decode batch sizes and decode step times."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["method"]
        self.ttft = Histogram("fastprefill_ttft_seconds", "prefill through the first token (engine clock)",
                              m, buckets=_SECONDS, registry=r)
        self.decode = Histogram("fastprefill_decode_seconds_per_token", "mean decode seconds per token of a request",
                                m, buckets=_SECONDS, registry=r)
        self.queue_wait = Histogram("fastprefill_queue_wait_seconds", "seconds from arrival to the start of generation "
                                    "(the scheduler admitting the request)", m, buckets=_SECONDS, registry=r)
        self.prefill_chunks = Counter("fastprefill_prefill_chunks", "units of prefill run (a chunk of a chunked "
                                      "prefill, or a whole prompt)", m, registry=r)
        self.prefill_pauses = Counter("fastprefill_prefill_pauses", "pauses of a chunk of prefill between two "
                                      "layers (interludes: requests that had just arrived, or a decode step due)", registry=r)
        self.mixed_steps = Counter("fastprefill_mixed_steps", "decode steps whose rows rode in a chunk of prefill "
                                   "(one forward for both: --mixed-chunk)", registry=r)
        self.decode_batch = Histogram("fastprefill_decode_batch_size", "streams decoded by one scheduler step",
                                      buckets=_BATCH, registry=r)
        self.decode_step = Histogram("fastprefill_decode_step_seconds", "seconds of one scheduler decode step (every "
                                     "running stream's next token)", buckets=_SECONDS, registry=r)
        self.prompt_tokens = Histogram("fastprefill_prompt_tokens", "prompt length in tokens",
                                       m, buckets=_TOKENS, registry=r)
        self.token_layers = Counter("fastprefill_prompt_token_layers_computed",
                                    "prompt (token, layer) pairs the prefills computed", m, registry=r)
        self.token_layers_full = Counter("fastprefill_prompt_token_layers",
                                         "prompt tokens x layers of the same prefills (what full prefill computes)",
                                         m, registry=r)
        self.cached_prompt_tokens = Counter("fastprefill_prompt_tokens_cached",
                                            "prompt tokens served from the prefix cache (not prefilled)",
                                            m, registry=r)
        self.shared_prompt_tokens = Counter("fastprefill_prompt_tokens_shared",
                                            "of the cached prompt tokens, those a request running beside it "
                                            "computed after it arrived (it waited for them)", m, registry=r)
        self.computed_prompt_tokens = Counter("fastprefill_prompt_tokens_computed",
                                              "prompt tokens prefilled (not found in the prefix cache)", m, registry=r)
        self.prefix_cache_bytes = Gauge("fastprefill_prefix_cache_bytes", "bytes of K/V the prefix cache holds",
                                        registry=r)
        self.prefix_cache_blocks = Gauge("fastprefill_prefix_cache_blocks", "blocks the prefix cache holds",
                                         registry=r)
        self.auto_choices = Counter("fastprefill_auto_choices", "requests of --method auto by the method its "
                                    "profile chose for the prompt's length (its full setting)", ["choice"], registry=r)
        self.completion_tokens = Counter("fastprefill_completion_tokens",
                                         "tokens generated (stopped generations included)", m, registry=r)
        self.requests = Counter("fastprefill_requests", "requests by outcome: ok, bad_request, too_large, "
                                "queue_full, timeout, cancelled (client gone), shutting_down, error",
                                [*m, "outcome"], registry=r)
        self.waiting = Gauge("fastprefill_queue_waiting", "requests waiting for the scheduler to admit them",
                             registry=r)
        self.busy = Gauge("fastprefill_busy", "1 while the scheduler runs a request", registry=r)
        self.running = Gauge("fastprefill_running", "requests the scheduler has admitted (prefilling or decoding)",
                             registry=r)
        self.precision = Info("fastprefill_precision", "the served model's dtype and device, and the CPU's bfloat16 "
                              "matrix units (amx_bf16, avx512_bf16 or none) and vector ISA", registry=r)

    def set_precision(self, report: dict[str, object]) -> None:
        """Set the precision info (:func:`fastprefill.host.precision_report`'s fields, as strings)."""
        self.precision.info({key: str(value) for key, value in report.items() if value is not None})

    def watch(self, waiting: Callable[[], float], running: Callable[[], float]) -> None:
        """Read the queue's gauges from the scheduler at scrape time."""
        self.waiting.set_function(waiting)
        self.running.set_function(running)
        self.busy.set_function(lambda: float(running() > 0))

    def watch_prefix_cache(self, nbytes: Callable[[], float], blocks: Callable[[], float]) -> None:
        """Read the prefix cache's size at scrape time."""
        self.prefix_cache_bytes.set_function(nbytes)
        self.prefix_cache_blocks.set_function(blocks)

    def finished(self, label: str, timing: Timing, completion_tokens: int) -> None:
        """Count a request that finished under ``label`` (its method's label), with its timing."""
        self.completion_tokens.labels(label).inc(completion_tokens)
        self.ttft.labels(label).observe(timing.ttft_s)
        if timing.decode_s_per_token is not None:
            self.decode.labels(label).observe(timing.decode_s_per_token)
        self.prompt_tokens.labels(label).observe(timing.prompt_tokens)
        self.token_layers.labels(label).inc(timing.stats.token_layers)
        self.token_layers_full.labels(label).inc(timing.stats.total_token_layers)
        if label == "auto":  # the profile's choice for this prompt's length
            self.auto_choices.labels(timing.method).inc()
        self.cached_prompt_tokens.labels(label).inc(timing.cached_tokens)
        self.shared_prompt_tokens.labels(label).inc(timing.shared_tokens)
        self.computed_prompt_tokens.labels(label).inc(timing.prompt_tokens - timing.cached_tokens)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
