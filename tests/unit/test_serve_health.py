"""``/health``'s rules without a server: each served method's state, and the server's status
from them (503 when the default method cannot run, ``degraded`` when only an allowed one cannot).

The server itself (a killed rank of a real pool seen by ``/health`` within a second) is tested
in ``tests/integration/test_serve_runahead.py``."""

from __future__ import annotations

import pytest

from fastprefill.methods.base import Method
from fastprefill.serve.backends import Backends
from fastprefill.serve.health import MethodState, http_status, method_states, server_status
from fastprefill.serve.method_table import MethodTable

RANK_DOWN = "rank 1 (pid 4242) has gone"


def _states(default_ready: bool, allowed_ready: tuple[bool, ...]) -> list[MethodState]:
    return [MethodState("full", "full", True, None if default_ready else "down"),
            *(MethodState(f"m{i}", f"m{i}", False, None if ok else f"m{i} down") for i, ok in enumerate(allowed_ready))]


@pytest.mark.parametrize(("default_ready", "allowed_ready", "draining", "want", "code"), [
    (True, (), False, "ok", 200),
    (True, (True, True), False, "ok", 200),
    (True, (True, False), False, "degraded", 200),
    (True, (False, False), False, "degraded", 200),
    (False, (), False, "unavailable", 503),
    (False, (True,), False, "unavailable", 503),
    (False, (False,), False, "unavailable", 503),
    (True, (), True, "draining", 503),
    (False, (True,), True, "draining", 503),
])
def test_the_status_follows_the_default_method_first(default_ready, allowed_ready, draining, want, code):
    """Every combination of the default's state, the allowed methods' and a drain gives one status;
    the reason names the method that cannot run and why, and is None only when all is well."""
    status = server_status(_states(default_ready, allowed_ready), draining=draining)
    assert status.status == want and status.http_status == code == http_status(want)
    assert (status.reason is None) == (want == "ok")
    if want == "unavailable":
        assert "'full'" in status.reason and "down" in status.reason
    if want == "degraded":
        first = allowed_ready.index(False)
        assert f"'m{first}' cannot run: m{first} down" in status.reason and "'full' answers" in status.reason
        assert ("1 more" in status.reason) == (allowed_ready.count(False) == 2)
    if want == "draining" and not default_ready:
        assert "down" in status.reason


def test_bad_states_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="exactly one default"):
        server_status([MethodState("a", "a", False)])
    with pytest.raises(ValueError, match="exactly one default"):
        server_status([MethodState("a", "a", True), MethodState("b", "b", True)])
    with pytest.raises(ValueError, match="each spec once"):
        server_status([MethodState("a", "a", True), MethodState("a", "a", False)])
    with pytest.raises(ValueError, match="spec"):
        MethodState("", "a", True)
    with pytest.raises(ValueError, match="reason"):
        MethodState("a", "a", True, "")
    with pytest.raises(ValueError, match="status"):
        http_status("fine")  # type: ignore[arg-type]


def test_a_method_state_body_says_ok_or_unavailable_with_the_reason():
    assert MethodState("full", "full", True).body() == {"method": "full", "default": True, "state": "ok",
                                                        "reason": None}
    assert MethodState("x", "x", False, "gone").body()["state"] == "unavailable"


class _Backends(Backends):
    """Backends with a pool of two ranks that has lost one: multi-rank methods cannot run, the others can."""

    def __init__(self) -> None:  # no model, no pool: only the questions the table and /health ask
        pass

    @property
    def pool_ranks(self) -> int:
        return 2

    def check(self, method: Method, spec: str) -> None:
        pass

    def unavailable(self, method: Method) -> str | None:
        return RANK_DOWN if self.on_ranks(method) else None


@pytest.mark.parametrize(("default", "allowed", "want"), [
    ("runahead:procs=2", ("full",), "unavailable"),
    ("full", ("runahead:procs=2",), "degraded"),
    ("full", ("static:keep=0.5",), "ok"),
])
def test_each_started_method_gets_its_backends_state(tiny_llama, default, allowed, want):
    """The table's methods (default first) each take the state their backend reports: a dead rank
    makes a multi-rank default ``unavailable`` (503) and a multi-rank allowed method ``degraded``."""
    backends = _Backends()
    table = MethodTable(tiny_llama, default, allowed, backends)
    states = method_states(table, backends)
    assert [s.spec for s in states] == [default, *allowed] and [s.default for s in states] == [True, False]
    for s in states:
        assert s.reason == (RANK_DOWN if s.spec.startswith("runahead") else None)
    status = server_status(states)
    assert status.status == want
    if want != "ok":
        assert RANK_DOWN in status.reason
