"""One rank's side of a distributed generation (KV-Runahead, TSP), wherever the rank runs.

The same code serves the processes of a local :class:`~fastprefill.distributed.pool.RankPool`
and torchrun ranks (``python -m fastprefill.launch``, and ``fastprefill serve`` under torchrun):
the :class:`Request` every rank receives, its validation (:func:`check_request`, identical on
every rank and before any communication, so all ranks refuse alike), the rank's role
(:func:`run_rank`: the last rank runs a :class:`~fastprefill.engine.Generation` of the ids
:func:`check_request` made, or that a driver holding the model prepared, the others call the
method's :meth:`~fastprefill.methods.base.DistributedMethod.contribute`), and the loop that
answers a driver over a duplex connection (:func:`serve_rank`).

Protocol of :func:`serve_rank` (the driver sends, the rank answers; a ``multiprocessing``
connection: a pipe for a local worker, an authenticated socket for a torchrun rank):

- at start the rank sends ``("ready", rank)``;
- ``("run", Request)`` -> ``("first", token_id)`` (last rank, as soon as it has it), then
  ``("done", payload)``; or ``("invalid", (message, error))`` when validation refused the
  request. With ``Request.stream`` the last rank sends ``("token", (token_id, text, index,
  timing, choice, logprob, finish_reason, prompt_logprobs))`` (a
  :class:`~fastprefill.engine.StreamEvent`'s fields) for every token instead of ``"first"``
  (``timing`` on the last one only), and stops
  at the next token when ``("cancel", None)`` arrives (a stray one, after the run, is ignored);
- ``("stop", None)`` -> the loop returns.

Whoever runs the loop reports any failure as ``("error", (message, user error or None))`` and
ends the rank (:func:`send_error`).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, cast

import torch

from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.methods.base import DistributedMethod, LayerHook, Method

if TYPE_CHECKING:
    from fastprefill.sampling import SamplingParams

__all__ = [
    "FAULT_EXIT_CODE",
    "Request",
    "check_ranks",
    "check_request",
    "run_rank",
    "send_error",
    "serve_rank",
]

#: Worker exit code used by the fault-injection hook.
FAULT_EXIT_CODE = 17


@dataclass(frozen=True)
class Request:
    """One generation request, identical on every rank.

    Attributes:
        prompt: text (needs the model's tokenizer) or token ids; with ``prepared``, the ids a
            driver holding the model made (the server's request processor), which no rank
            validates again.
        method: the method every rank runs (with ``prepared``, as resolved for the prompt);
            it must need as many ranks as the group has (:func:`check_ranks`).
        max_new_tokens: tokens to generate, the first included.
        chat: wrap text in the chat template.
        stop_at_eos: stop at the model's end-of-sequence token.
        fault: test hook ``(rank, layer, "exit"|"hang")``: that helper rank exits (or hangs)
            after the given layer.
        stream: the last rank sends every token as it comes (see the module docstring).
        sampling: how tokens are picked, stop strings included (``None``: greedy, as
            :func:`fastprefill.engine.stream` says).
        prepared: ``prompt`` is validated ids and ``method`` resolved for them.
        name: how the last rank's :class:`~fastprefill.events.Timing` names the method
            (``None``: its ``describe()``).
    """

    prompt: str | bytes | list[int]
    method: Method
    max_new_tokens: int = 64
    chat: bool = False
    stop_at_eos: bool = True
    fault: tuple[int, int, str] | None = None
    stream: bool = False
    sampling: SamplingParams | None = None
    prepared: bool = False
    name: str | None = None


def check_ranks(method: Method, world: int, group: str) -> None:
    """Refuse ``method`` unless it runs on ``world`` ranks (:attr:`~fastprefill.methods.base.Method.ranks`);
    ``group`` says what has ``world`` ranks, for the message (``"this group has 2"``).

    Raises:
        ConfigError: ``method.ranks != world``.
    """
    if method.ranks != world:
        what = f"needs procs={method.ranks} ranks" if method.on_ranks else "runs on one process"
        raise ConfigError(f"{method.describe()} {what}, but {group}")


def check_request(model: Any, tokenizer: Any, request: Request, world: int) -> tuple[torch.Tensor, Method]:
    """Validate ``request`` for a group of ``world`` ranks: its ``(1, T)`` ids and the method
    resolved for them (:func:`fastprefill.prompt.prepare_generation`; a ``prepared`` request's
    own, checked only for the number of ranks).

    Every rank runs the same checks on the same input before any communication, so all ranks
    refuse alike.

    Raises:
        ConfigError: not a Method, or a method for another number of ranks; see also
            :func:`fastprefill.prompt.prepare_generation` (PromptError, UnsupportedModelError, ...).
    """
    from fastprefill.prompt import prepare_generation

    method = request.method
    if not isinstance(method, Method):
        raise ConfigError(f"method must be a fastprefill Method, got {type(method).__name__}")
    check_ranks(method, world, f"this group has {world}")
    if request.prepared:
        return torch.tensor([list(request.prompt)], dtype=torch.long, device=model.device), method
    return prepare_generation(model, tokenizer, request.prompt, method, request.max_new_tokens, chat=request.chat,
                              sampling=request.sampling)


def _layer_hook(fault: tuple[int, int, str] | None) -> LayerHook | None:
    if fault is None:
        return None
    f_rank, f_layer, kind = fault

    def hook(rank: int, layer: int) -> None:
        if rank == f_rank and layer == f_layer:
            if kind == "exit":
                os._exit(FAULT_EXIT_CODE)
            time.sleep(10_000)  # "hang"

    return hook


def run_rank(
    model: Any,
    tokenizer: Any,
    rank: int,
    world: int,
    request: Request,
    prepared: tuple[torch.Tensor, Method],
    on_first: Callable[[int], None] | None = None,
    on_token: Callable[[Any], bool] | None = None,
) -> dict[str, Any]:
    """This rank's part of a request, given what :func:`check_request` made of it (its ids and
    the method resolved for them).

    The last rank generates (a :class:`~fastprefill.engine.Generation` of those ids): the result
    has ``text``, ``token_ids``, ``timing`` (the engine's :class:`~fastprefill.engine.Timing` as a
    dict), ``stats`` (its prefill counters) and ``logits`` (``(V,)`` first-token logits on the
    CPU); ``on_first(token_id)`` is called as soon as the first token is known, ``on_token(event)``
    with every :class:`~fastprefill.engine.StreamEvent` (True: stop now; the result is then
    ``{"cancelled": True, "stats": {}}``). Other ranks contribute and return ``{"stats": counters}``.
    """
    from fastprefill.engine import Generation

    input_ids, method = prepared
    if rank == world - 1:
        events = []
        gen = Generation(model, tokenizer, input_ids, method, request.max_new_tokens, stop_at_eos=request.stop_at_eos,
                         sampling=request.sampling, name=request.name).run()
        with contextlib.closing(gen):
            for ev in gen:
                if ev.index == 0 and ev.choice == 0 and on_first is not None:
                    on_first(ev.token_id)
                events.append(ev)
                if on_token is not None and on_token(ev) and ev.timing is None:
                    return {"cancelled": True, "stats": {}}
        timing = events[-1].timing
        assert timing is not None
        first = [e for e in events if e.choice == 0]  # the first answer (of n)
        ids_out = [e.token_id for e in first]
        text = tokenizer.decode(ids_out, skip_special_tokens=True) if tokenizer is not None else ""
        if request.sampling is not None and request.sampling.stop:  # cut before the stop string, as streamed
            text = "".join(e.text for e in first)
        return {"text": text, "token_ids": ids_out, "timing": timing.to_dict(), "stats": timing.extra,
                "logits": None if request.stream else events[-1].first_logits}
    helper = cast(DistributedMethod, method)  # check_ranks: a group of several ranks runs only such methods
    with torch.inference_mode():
        stats = helper.contribute(model, input_ids, layer_hook=_layer_hook(request.fault))
    return {"stats": stats.extra}


def _send_user_error(conn: Connection, kind: str, exc: FastprefillError, message: str) -> None:
    try:
        conn.send((kind, (message, exc)))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: send the text only
        conn.send((kind, (message, None)))


def _token_sender(conn: Connection) -> Callable[[Any], bool]:
    """``on_token`` of a streamed request: send the event, then say whether a cancel has come."""

    def send(ev: Any) -> bool:
        conn.send(("token", (ev.token_id, ev.text, ev.index, ev.timing, ev.choice, ev.logprob, ev.finish_reason,
                             ev.prompt_logprobs)))
        cancelled = False
        while conn.poll(0):  # only a cancel is sent to a rank while it runs
            cancelled |= conn.recv()[0] == "cancel"
        return cancelled

    return send


def send_error(conn: Connection, rank: int, exc: BaseException) -> None:
    """Report the failure that ends this rank to the driver (best effort: it may be gone); call
    it in the ``except`` block that caught ``exc`` (the message keeps its traceback)."""
    msg = f"rank {rank}: {type(exc).__name__}: {exc}"
    if not isinstance(exc, FastprefillError):
        msg += "\n" + traceback.format_exc(limit=3)
    try:
        if isinstance(exc, FastprefillError):
            _send_user_error(conn, "error", exc, msg)
        else:
            conn.send(("error", (msg, None)))
    except OSError:
        pass


def serve_rank(
    conn: Connection, model: Any, tokenizer: Any, rank: int, world: int,
    driver_alive: Callable[[], bool] | None = None,
) -> bool:
    """Answer the driver on ``conn`` (the module docstring's protocol) until it says ``"stop"``.

    Args:
        rank, world: this rank and the number of ranks (its process group is already joined).
        driver_alive: checked every second while idle; False ends the loop (a local worker
            whose driver process has gone).

    Returns:
        True after ``"stop"``; False when the driver has gone (its end of ``conn`` closed, or
        ``driver_alive`` said so).

    Raises:
        Exception: whatever a request's run raised other than a refusal (the caller reports it
            with :func:`send_error` and ends the rank).
    """
    conn.send(("ready", rank))
    while True:
        try:
            if not conn.poll(1.0):
                if driver_alive is not None and not driver_alive():
                    return False
                continue
            kind, payload = conn.recv()
        except (EOFError, OSError):
            return False
        if kind == "stop":
            return True
        if kind == "cancel":  # for a run that had already ended
            continue
        try:
            prepared = check_request(model, tokenizer, payload, world)
        except FastprefillError as exc:
            _send_user_error(conn, "invalid", exc, f"rank {rank}: {type(exc).__name__}: {exc}")
            continue
        streams = payload.stream and rank == world - 1
        result = run_rank(model, tokenizer, rank, world, payload, prepared,
                          on_first=None if streams else lambda tok: conn.send(("first", tok)),
                          on_token=_token_sender(conn) if streams else None)
        conn.send(("done", result))
