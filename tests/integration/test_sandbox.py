"""The sandbox that runs generated code: outcomes, time and memory limits, no network, no processes."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastprefill.data import sandbox
from fastprefill.data.sandbox import run_python


@pytest.fixture
def server() -> Iterator[socket.socket]:
    """A listening TCP socket on 127.0.0.1 (connections queue in the backlog without accept)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield listener
    finally:
        listener.close()


def _connection_pending(listener: socket.socket, wait: float = 0.3) -> bool:
    readable, _, _ = select.select([listener], [], [], wait)
    return bool(readable)


def _client(port: int) -> str:
    return (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'leak')\n"
        "print('CONNECTED')\n"
    )


@pytest.fixture
def hook_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run without the network namespace, so the audit hook alone must hold."""
    monkeypatch.setattr(sandbox, "_network_isolation_prefix", lambda: ())


def test_passing_program_reports_stdout() -> None:
    result = run_python("print(sum(range(10)))")
    assert result.passed and result.status == "passed" and result.returncode == 0
    assert result.stdout.strip() == "45"


def test_failing_assertion() -> None:
    result = run_python("def f():\n    return 1\nassert f() == 2, 'wrong'\n")
    assert not result.passed and result.status == "failed" and result.returncode == 1
    assert "AssertionError: wrong" in result.stderr


def test_syntax_error_fails() -> None:
    result = run_python("def f(:\n")
    assert result.status == "failed" and "SyntaxError" in result.stderr


def test_infinite_loop_is_killed_in_time() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", timeout=1.0)
    elapsed = time.monotonic() - start
    assert result.status == "timeout" and not result.passed
    assert 0.9 <= elapsed < 1.0 + 2.0


def test_sleeping_program_hits_the_wall_clock_limit() -> None:
    # Sleeping uses no CPU: only the wall-clock timeout can stop it.
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(60)\n", timeout=1.0)
    assert result.status == "timeout"
    assert time.monotonic() - start < 3.0


def test_memory_limit() -> None:
    result = run_python("x = bytearray(512 * 1024 * 1024)\nprint('allocated')\n", memory_mb=128)
    assert result.status == "failed" and "MemoryError" in result.stderr
    assert "allocated" not in result.stdout


def test_the_client_connects_outside_the_sandbox(server: socket.socket) -> None:
    """Control for the network tests: the same client does connect when not sandboxed."""
    port = server.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-c", _client(port)], check=True, capture_output=True, text=True, timeout=30
    )
    assert "CONNECTED" in proc.stdout
    assert _connection_pending(server)


@pytest.mark.parametrize("layers", ["all", "audit-hook-only"])
def test_network_is_blocked(server: socket.socket, layers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if layers == "audit-hook-only":
        monkeypatch.setattr(sandbox, "_network_isolation_prefix", lambda: ())
    port = server.getsockname()[1]
    result = run_python(_client(port), timeout=5)
    assert result.status == "failed"
    assert "CONNECTED" not in result.stdout
    assert not _connection_pending(server)


def test_network_namespace_alone_blocks_loopback(
    server: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not sandbox._network_isolation_prefix():  # sandboxed programs get their own (empty) network namespace
        pytest.skip("unshare --net does not work here; the audit hook is the only network layer")
    monkeypatch.setattr(sandbox, "_BOOTSTRAP", sandbox._BOOTSTRAP.replace("    _install_guard(root)\n", ""))
    port = server.getsockname()[1]
    result = run_python(_client(port), timeout=5)
    assert result.status == "failed" and "PermissionError" not in result.stderr  # the hook was really off
    assert not _connection_pending(server)


def test_swallowed_network_errors_still_block(server: socket.socket, hook_only: None) -> None:
    code = "try:\n" + "".join(f"    {line}\n" for line in _client(server.getsockname()[1]).splitlines())
    code += "except Exception as exc:\n    print('BLOCKED', type(exc).__name__)\n"
    result = run_python(code, timeout=5)
    assert result.passed and "BLOCKED PermissionError" in result.stdout
    assert "blocked socket" in result.stderr
    assert not _connection_pending(server)


@pytest.mark.parametrize(
    "spawn",
    [
        "import subprocess\nsubprocess.run(['touch', {marker!r}])",
        "import os\nos.system('touch ' + {marker!r})",
        "import os\nos.execv('/usr/bin/touch', ['touch', {marker!r}])",
        "import os\nif os.fork() == 0:\n    open({marker!r}, 'w').close()\n    os._exit(0)",
        "import os\nos.posix_spawn('/usr/bin/touch', ['touch', {marker!r}], {{}})",
        "import ctypes\nctypes.CDLL(None).system(b'touch ' + {marker!r}.encode())",
    ],
    ids=["subprocess", "os.system", "os.execv", "os.fork", "os.posix_spawn", "ctypes"],
)
def test_processes_cannot_be_spawned(spawn: str, tmp_path: Path, hook_only: None) -> None:
    marker = str(tmp_path / "spawned")
    result = run_python(spawn.format(marker=marker), timeout=5)
    assert result.status == "failed" and "PermissionError" in result.stderr
    time.sleep(0.2)
    assert not os.path.exists(marker)


def test_writes_only_inside_its_own_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    inside = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n")
    assert inside.passed and inside.stdout.strip() == "ok"
    result = run_python(f"open({str(outside)!r}, 'w').write('x')\n")
    assert result.status == "failed" and not outside.exists()
    target = tmp_path / "keep.txt"
    target.write_text("keep")
    result = run_python(f"import os\nos.remove({str(target)!r})\n")
    assert result.status == "failed" and target.read_text() == "keep"


def test_fresh_directory_and_minimal_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPREFILL_TEST_SECRET", "do-not-leak")
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.environ))\n"
    first, second = run_python(code), run_python(code)
    cwd = first.stdout.splitlines()[0]
    assert cwd != second.stdout.splitlines()[0]
    assert cwd != os.getcwd() and not os.path.exists(cwd)  # removed afterwards
    assert "FASTPREFILL_TEST_SECRET" not in first.stdout


def test_limits_cannot_be_raised(hook_only: None) -> None:
    result = run_python("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))\n")
    assert result.status == "failed" and "resource.setrlimit" in result.stderr


@pytest.mark.parametrize(("kwargs", "field"), [({"timeout": 0}, "timeout"), ({"memory_mb": 8}, "memory_mb")])
def test_bad_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        run_python("pass", **kwargs)
