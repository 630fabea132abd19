"""The model side of the scheduler: what runs the units of work it decides on.

The scheduler (:mod:`fastprefill.serve.scheduler`) only decides: which requests are admitted,
which prefill runs next and how many tokens it may take, when a chunk pauses and when a decode
step is due. :class:`ModelExecutor` (the :class:`~fastprefill.serve.worker.Executor` contract;
vLLM's executor and model runner are the model) does what touches the model or the tokenizer:

- **begin**: a job's :class:`~fastprefill.serve.worker.Work` from its backend
  (:mod:`fastprefill.serve.backends`), and the :class:`~fastprefill.serve.answers.Collector` that
  gathers its answers and decodes their text when it ends;
- **decode**: one step for every stream the scheduler hands it, the local generations in one
  :class:`~fastprefill.batch.DecodeBatch`, each multi-rank request's next token apart, timed on
  the engine's clock;
- **prefill**: one unit of a request's prefill, on the pausable thread of
  :class:`~fastprefill.serve.pauses.LayerPauses` when the scheduler allows a pause and the unit is
  a local chunked prefill;
- **mixed**: one chunk of a local chunked prefill with the local streams' decode step riding in
  its layer calls (:meth:`~fastprefill.batch.DecodeBatch.mixed`), where the model runs a layer
  loop (:meth:`ModelExecutor.mixes`);
- **error**: what a failed unit answers (a request's fault: 400; a rank pool down: 503; anything
  else: 500).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.batch import DecodeBatch
from fastprefill.distributed.pool import RankPoolError
from fastprefill.engine import Generation, StreamEvent, TimingWindow
from fastprefill.errors import FastprefillError
from fastprefill.serve.answers import Collector
from fastprefill.serve.pauses import LayerPauses
from fastprefill.serve.protocol import APIError
from fastprefill.serve.worker import Decoded, Job, Pause, Stepped, Work, internal_error, ranks_down

__all__ = ["ModelExecutor"]

log = logging.getLogger(__name__)


class ModelExecutor:
    """Runs the scheduler's units on the server's model (see the module docstring).

    Args:
        model: the server's model (decode batches and pauses run on it).
        tokenizer: decodes each answer's whole text.
        max_batch: streams in one decode step at most (the scheduler's ``max_running``).

    Attributes:
        pauses: the pause points on the model's decoder layers, once :meth:`enable_pauses` has
            put them there (``None`` until then, or where the model has no decoder layers).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, max_batch: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch = DecodeBatch(model, max_batch)
        self.pauses: LayerPauses | None = None

    def enable_pauses(self, cv: threading.Condition) -> bool:
        """Put pause points on the model's decoder layers, under the scheduler's condition ``cv``;
        whether the model has layers to pause at."""
        if self.pauses is None and LayerPauses.available(self.model):
            self.pauses = LayerPauses(self.model, cv)
        return self.pauses is not None

    def release(self) -> None:
        """Take the pause points off the model (the scheduler's thread has ended)."""
        if self.pauses is not None:
            self.pauses.remove()

    def begin(self, job: Job) -> tuple[Work, Collector]:
        """The job's work on its backend, and the collector of its answers."""
        return job.backend.begin(job), Collector(job.sampling, self.tokenizer)

    def prefill(self, work: Work, budget: int | None, pause: Pause | None) -> int:
        """One unit of ``work``'s prefill (at most ``budget`` tokens when chunked); pausable between
        layers for ``pause.interlude`` when ``pause`` is given and the unit is a local chunked
        prefill. Returns the tokens it ran."""
        pauses = self.pauses
        if pause is None or pauses is None or not work.chunked or not isinstance(work, Generation):
            return work.prefill(budget)
        return pauses.run(lambda: work.prefill(budget), pause.wants, pause.interlude)

    def decode(self, works: Sequence[Work]) -> Decoded:
        """One decode step for every answer of ``works``: the local generations in one batch (a
        failure fails all of them), each multi-rank request's next token alone."""
        local = [w for w in works if isinstance(w, Generation)]
        steps: list[Stepped] = []
        with TimingWindow(self.model.device) as window:
            if local:
                steps.append(_stepped(local, lambda: self.batch.step(local)))
            for work in works:
                if not isinstance(work, Generation):
                    steps.append(_stepped([work], lambda w=work: [w.step()]))
        return Decoded(steps, window.seconds)

    def mixes(self, work: Work, works: Sequence[Work]) -> bool:
        """Whether ``work``'s next unit of prefill can carry ``works``' decode step: a chunked
        generation on this model, a model of a layer-loop family, and only local generations decoding."""
        return (self.batch.adapter is not None and isinstance(work, Generation) and work.chunked
                and work.model is self.model and all(isinstance(w, Generation) for w in works))

    def mixed(self, work: Work, budget: int, works: Sequence[Work]) -> tuple[int, Decoded]:
        """One unit of ``work``'s prefill (at most ``budget`` tokens) and one decode step of every
        answer of ``works`` in the same layer calls; never paused (the unit is short)."""
        assert isinstance(work, Generation) and all(isinstance(w, Generation) for w in works), "check mixes() first"
        gens = list(works)
        with TimingWindow(self.model.device) as window:
            ran, events = self.batch.mixed(gens, work, budget)  # type: ignore[arg-type]
        return ran, Decoded([Stepped(gens, events)], window.seconds)

    @staticmethod
    def error(exc: Exception, fatal: bool) -> APIError:
        """The answer to a unit that raised ``exc`` (``fatal``: a rank pool whose failure ends the
        server); an unexpected exception is logged with its traceback."""
        if isinstance(exc, RankPoolError):
            log.error("rank pool: %s", exc)
            return ranks_down(str(exc), fatal=fatal)
        if isinstance(exc, FastprefillError):
            return APIError(400, str(exc))
        log.error("generation failed", exc_info=exc)
        return internal_error(exc)


def _stepped(works: list[Work], call: Callable[[], list[list[StreamEvent]]]) -> Stepped:
    """``works``' events from ``call()``, or the exception it raised."""
    try:
        return Stepped(works, call())
    except Exception as exc:  # noqa: BLE001  (handed to the scheduler, which fails these works' requests)
        return Stepped(works, None, exc)
