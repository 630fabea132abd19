"""What ``GET /health`` says: whether each method the server was started with can run now, and
the server's status from them.

The rules (:func:`server_status`), those a load balancer needs:

- ``draining`` (503): the server is shutting down;
- ``unavailable`` (503): the default method (``--method``) cannot run, e.g. a rank of its pool
  has died: most requests would fail, so traffic should go elsewhere;
- ``degraded`` (200): the default method runs, but a method allowed with ``--allow-method``
  cannot; requests that name it get a 503, every other request is answered;
- ``ok`` (200): every method can run.

``reason`` says why (the first method that cannot run and what stops it); ``methods`` gives each
method's state. This module holds only the rules; the server asks its backends what stops each
method (:meth:`~fastprefill.serve.backends.Backends.unavailable`), on the event loop, without
waiting on the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from fastprefill.serve.backends import Backends
    from fastprefill.serve.method_table import MethodTable
    from fastprefill.serve.ranks import ServedPool

__all__ = ["MethodState", "ServerStatus", "http_status", "method_states", "ranks_health", "server_status"]

Status = Literal["ok", "degraded", "unavailable", "draining"]


@dataclass(frozen=True)
class MethodState:
    """One served method's state.

    Attributes:
        spec: the spec it was started with (``--method`` or ``--allow-method``).
        name: how responses name it (:meth:`~fastprefill.methods.base.Method.served_name`).
        default: it is the server's default method.
        reason: why it cannot run now (``None``: it can).
    """

    spec: str
    name: str
    default: bool
    reason: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"spec: a non-empty method spec, not {self.spec!r}")
        if self.reason is not None and (not isinstance(self.reason, str) or not self.reason):
            raise ValueError(f"reason: None or a non-empty message, not {self.reason!r}")

    @property
    def ready(self) -> bool:
        return self.reason is None

    def body(self) -> dict[str, Any]:
        """The entry of ``/health``'s ``methods``."""
        return {"method": self.name, "default": self.default, "state": "ok" if self.ready else "unavailable",
                "reason": self.reason}


def http_status(status: Status) -> int:
    """The HTTP status ``/health`` answers a ``status`` with: 503 when the server should get no
    traffic (``unavailable``, ``draining``), else 200.

    Raises:
        ValueError: an unknown status.
    """
    if status not in ("ok", "degraded", "unavailable", "draining"):
        raise ValueError(f"status: one of ok, degraded, unavailable, draining, not {status!r}")
    return 503 if status in ("unavailable", "draining") else 200


@dataclass(frozen=True)
class ServerStatus:
    """The server's status (see the module docstring) and why it is not ``ok``."""

    status: Status
    reason: str | None

    @property
    def http_status(self) -> int:
        return http_status(self.status)


def server_status(states: Sequence[MethodState], draining: bool = False) -> ServerStatus:
    """The server's status from its methods' states (see the module docstring).

    Raises:
        ValueError: ``states`` without exactly one default method, or a spec named twice.
    """
    defaults = [s for s in states if s.default]
    if len(defaults) != 1:
        raise ValueError(f"states: exactly one default method, not {len(defaults)}")
    specs = [s.spec for s in states]
    if len(set(specs)) != len(specs):
        raise ValueError(f"states: each spec once, not {specs}")
    default = defaults[0]
    if draining:
        why = "" if default.ready else f" (the default method {default.spec!r} cannot run: {default.reason})"
        return ServerStatus("draining", f"the server is shutting down{why}")
    if not default.ready:
        return ServerStatus("unavailable", f"the default method {default.spec!r} cannot run: {default.reason}")
    down = [s for s in states if not s.ready]
    if down:
        first = down[0]
        more = f" (and {len(down) - 1} more allowed method(s))" if len(down) > 1 else ""
        return ServerStatus("degraded", f"the allowed method {first.spec!r} cannot run: {first.reason}{more}; "
                                        f"the default method {default.spec!r} answers")
    return ServerStatus("ok", None)


def method_states(table: MethodTable, backends: Backends) -> list[MethodState]:
    """Each method the server was started with (the default first) and whether its backend can
    run it now (:meth:`~fastprefill.serve.backends.Backends.unavailable`)."""
    return [MethodState(spec, method.served_name(), spec == table.default, backends.unavailable(method))
            for spec, (_, method) in table.built.items()]


def ranks_health(ranks: ServedPool) -> dict[str, Any]:
    """``/health``'s ``ranks``: their count and pids, ``up`` (none lost, the pool open) and the failure."""
    lost = ranks.lost()
    return {"procs": ranks.procs, "pids": ranks.pids, "up": lost is None, "failure": ranks.failure or lost}
