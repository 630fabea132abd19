"""Pausable prefill: a unit of prefill that stops between two decoder layers while other
requests' short prefills run, then goes on where it stopped.

A request that arrives while a long prompt's chunk runs would otherwise wait for the whole
chunk (the last 512-token chunks of a 4k prompt take most of a second). :class:`LayerPauses`
runs the chunk on a thread of its own and gives the scheduler a pause point before every decoder
layer (a forward pre-hook on each of ``model.model.layers``, acting only on that thread): when
the scheduler asks, the chunk's thread stops at the next layer, the scheduler runs its
*interlude* (admit the new requests and prefill the short ones, each to its first token) on its
own thread, and the chunk resumes. One thread computes at a time, so the two never share the
cores; a wait is at most one layer of the chunk.

Exactness: the paused forward resumes with the same tensors, so its result is the one it gives
unpaused, bit for bit. The interlude's forwards run with the attention implementation the model
had when the server started (the chunk may have selected fastprefill's attention function for its
suffix: :func:`~fastprefill.models.attention.attention_as` restores the start-up choice for the
interlude and the chunk's after it), and each short prefill is the same computation as when it
runs alone. Both are asserted by the tests against whole-prompt generation.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from fastprefill.models.adapters import decoder_layers
from fastprefill.models.attention import attention_as, attention_choices

__all__ = ["LayerPauses"]


class LayerPauses:
    """Runs calls on a thread that the scheduler may pause between decoder layers.

    Args:
        model: the model whose decoder layers get the pause points.
        cv: the scheduler's condition (its lock guards the pause state; the scheduler notifies it
            when a request arrives, so a pause is asked for at once).
        poll_s: how often a running call asks ``wants_pause`` again unnotified (a pause that is
            due by the clock).

    Attributes:
        pauses: pauses so far (the chunk stopped at a layer for an interlude).
    """

    def __init__(self, model: PreTrainedModel, cv: threading.Condition, poll_s: float = 0.05) -> None:
        self.model = model
        self.poll_s = poll_s
        self.cv = cv
        self.pauses = 0
        self._startup = attention_choices(model)
        self._tasks: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._ident: int | None = None
        self._want = False  # the scheduler asks the running call to stop at its next layer
        self._paused = False
        self._resumed = 0  # resumes so far: a paused layer waits for the next one
        self._done = True
        self._result: Any = None
        self._error: BaseException | None = None
        ref = weakref.ref(self)

        def pause_point(module: Any, args: Any) -> None:
            # a closure over a weak reference, not a bound method: a copy of the model
            # (``copy.deepcopy``) copies no lock, and the model keeps nothing here alive
            pauses = ref()
            if pauses is not None:
                pauses._at_layer(module, args)

        hooks = [layer.register_forward_pre_hook(pause_point) for layer in decoder_layers(model)]
        # collected or removed: the hooks come off (the idle thread stays blocked: a thread that
        # has run torch work and ends while the interpreter exits can abort the process)
        self._release = weakref.finalize(self, _release, hooks)
        self._thread: threading.Thread | None = None

    @staticmethod
    def available(model: PreTrainedModel | None) -> bool:
        """Whether ``model`` has decoder layers to pause at."""
        return model is not None and bool(decoder_layers(model))

    def remove(self) -> None:
        """Take the pause points off the model's layers (also done when this object is
        garbage-collected)."""
        self._release()

    def run(self, call: Callable[[], Any], wants_pause: Callable[[], bool], interlude: Callable[[], None]) -> Any:
        """``call()`` on the pausable thread; whenever ``wants_pause()`` (asked under :attr:`cv`,
        again each time it is notified) says so, stop it at its next layer, run ``interlude()``
        on this thread, and resume it. Returns what ``call`` returns, or raises what it raised."""
        self._start(call)
        while True:
            with self.cv:
                while not (self._done or self._paused or (not self._want and wants_pause())):
                    self.cv.wait(self.poll_s)
                if self._done:
                    self._want = False
                    break
                if not self._paused:
                    self._want = True  # stop at the next layer (or finish first)
                    continue
            try:
                with attention_as(self.model, self._startup):
                    interlude()
            finally:
                with self.cv:
                    self._want = self._paused = False
                    self._resumed += 1
                    self.cv.notify_all()
        error, result = self._error, self._result
        self._error = self._result = None
        if error is not None:
            raise error
        return result

    # --- the pausable thread ------------------------------------------------------------------
    def _start(self, call: Callable[[], Any]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._tasks),
                                            name="fastprefill-prefill", daemon=True)
            self._thread.start()
        with self.cv:
            self._done, self._want, self._paused = False, False, False
        self._tasks.put(call)

    def _run_task(self, call: Callable[[], Any]) -> None:
        """Run ``call`` on the pausable thread and hand its outcome to :meth:`run`."""
        self._ident = threading.get_ident()
        result, error = None, None
        try:
            result = call()
        except BaseException as exc:  # noqa: BLE001  (handed to the scheduler's thread, which raises it)
            error = exc
        with self.cv:
            self._result, self._error, self._done = result, error, True
            self.cv.notify_all()

    def _at_layer(self, module: Any, args: Any) -> None:
        """The pause point before a decoder layer (a forward pre-hook; only on the pausable thread)."""
        if not self._want or threading.get_ident() != self._ident:
            return
        with self.cv:
            if not self._want:
                return
            self._paused = True
            self.pauses += 1
            self.cv.notify_all()
            resumed = self._resumed
            while self._resumed == resumed:  # not ``while self._want``: the next pause may be asked already
                self.cv.wait()


def _serve(ref: weakref.ref[LayerPauses], tasks: queue.SimpleQueue[Callable[[], Any]]) -> None:
    """The pausable thread: runs each task of ``tasks``. Holds its object only while a task runs,
    so it does not keep it alive; once the object is collected no task comes, and the thread stays
    blocked (a daemon)."""
    while True:
        call = tasks.get()
        pauses = ref()
        if pauses is None:
            return
        pauses._run_task(call)
        del pauses


def _release(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()
