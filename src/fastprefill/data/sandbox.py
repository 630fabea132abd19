"""Run untrusted generated Python (HumanEval completions) in a locked-down child process.

Generated code is never executed in this process. :func:`run_python` writes the program into a
fresh temporary directory and runs it there with ``sys.executable -I -B`` under these layers:

1. **Resource limits** set in ``preexec_fn``: address space (``memory_mb``), CPU seconds,
   file size, open files, no core dumps; the child runs in its own session (process group).
2. **A wall-clock timeout**: on expiry the whole process group is killed with SIGKILL.
3. **An audit hook** (:func:`sys.addaudithook`), installed by a small bootstrap in the child
   before the untrusted code is compiled or run. It refuses every ``socket.*`` event (creating,
   connecting, binding, resolving), process creation (``subprocess.Popen``, ``os.system``,
   ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``, ``os.fork``, ``os.forkpty``), signalling
   other processes, raising resource limits, ``ctypes`` and ``_posixsubprocess`` (which could
   bypass the hook), and writing, deleting or renaming files outside the temporary directory.
   The bootstrap also sets ``RLIMIT_NPROC`` to 0 (effective for non-root users).
   This layer is always present.
4. **A network namespace** when ``unshare --net`` works here (as root; ``--map-root-user``
   otherwise): the child then has no network interface but a down loopback.

The environment is minimal (``PATH``, ``HOME``/``TMPDIR`` pointing at the temporary directory,
a UTF-8 locale); ``-I`` ignores ``PYTHON*`` variables and the user site directory. Output is
written to files in the temporary directory (bounded by ``RLIMIT_FSIZE``) and the first
:data:`MAX_OUTPUT_CHARS` characters of each are returned.

This is a defence-in-depth sandbox for benchmark code, not a security boundary against a
determined attacker with a CPython memory-corruption bug.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["MAX_OUTPUT_CHARS", "SandboxResult", "run_python"]

Status = Literal["passed", "failed", "timeout", "error"]

MAX_OUTPUT_CHARS = 65_536
_FILE_SIZE_LIMIT = 16 * 1024 * 1024
_OPEN_FILES_LIMIT = 64

# Runs in the child before the untrusted program. argv: bootstrap.py <sandbox dir> <program.py>.
_BOOTSTRAP = r"""
import os
import resource
import sys


def _install_guard(root):
    root = os.path.normpath(root)
    blocked_prefixes = ("socket.", "ctypes.")
    blocked = frozenset({
        "subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
        "os.forkpty", "os.startfile", "os.kill", "os.killpg", "signal.pthread_kill",
        "resource.setrlimit", "resource.prlimit", "pty.spawn", "os.symlink", "os.link",
        "sys.remote_exec",
    })
    blocked_modules = frozenset({
        "ctypes", "_ctypes", "_posixsubprocess", "_testcapi", "_testinternalcapi",
        "_xxsubinterpreters", "_interpreters",
    })
    path_events = frozenset({
        "os.remove", "os.rmdir", "os.rename", "os.truncate", "os.chmod", "os.chown",
        "os.mkdir", "os.utime", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
        "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree", "os.mkfifo",
        "os.mknod",
    })
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    deny_write = os.write
    path_types = (str, bytes, os.PathLike)

    def inside(path):
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            return False
        full = os.path.normpath(os.path.join(os.getcwd(), path))
        return full == root or full.startswith(root + os.sep)

    def deny(event):
        deny_write(2, ("fastprefill-sandbox: blocked " + event + "\n").encode())
        raise PermissionError("fastprefill sandbox: " + event + " is not allowed")

    def hook(event, args):
        if event in blocked or event.startswith(blocked_prefixes):
            deny(event)
        elif event == "import":
            if args and str(args[0]).partition(".")[0] in blocked_modules:
                deny("import " + str(args[0]))
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, int) or not isinstance(path, path_types):
                return
            writing = any(c in str(mode or "") for c in "wax+") or bool((flags or 0) & write_flags)
            if writing and not inside(path):
                deny("open for writing " + os.fsdecode(os.fspath(path)))
        elif event in path_events:
            for arg in args:
                if isinstance(arg, path_types) and not inside(arg):
                    deny(event + " " + os.fsdecode(os.fspath(arg)))

    sys.addaudithook(hook)


def _main():
    root, program = sys.argv[1], sys.argv[2]
    with open(program, encoding="utf-8") as handle:
        source = handle.read()
    for name in ("ctypes", "_ctypes", "_posixsubprocess"):
        sys.modules.pop(name, None)
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    except (ValueError, OSError):
        pass
    _install_guard(root)
    sys.argv = [program]
    code = compile(source, program, "exec")
    namespace = {"__name__": "__main__", "__file__": program, "__builtins__": __builtins__}
    exec(code, namespace)


_main()
"""


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one sandboxed program.

    ``status`` is ``"passed"`` (exit code 0), ``"failed"`` (non-zero exit: an exception, a failed
    assertion, a syntax error, a refused operation), ``"timeout"`` (wall-clock or CPU limit hit)
    or ``"error"`` (killed by another signal, e.g. a file-size limit, or the child could not
    start). ``returncode`` is negative for a signal and ``None`` if the child never started.
    """

    passed: bool
    status: Status
    stdout: str
    stderr: str
    returncode: int | None
    elapsed: float


@functools.cache
def _network_isolation_prefix() -> tuple[str, ...]:
    """The ``unshare`` prefix that gives the child an empty network namespace, or ``()``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    flags = ("--net",) if os.geteuid() == 0 else ("--net", "--map-root-user")
    prefix = (unshare, *flags, "--")
    try:
        probe = subprocess.run(
            [*prefix, sys.executable, "-I", "-c", "pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    return prefix if probe.returncode == 0 else ()


def _limit_child(memory_bytes: int, cpu_seconds: int) -> None:
    """``preexec_fn``: resource limits for the child, applied between fork and exec."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_OPEN_FILES_LIMIT, _OPEN_FILES_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _read_output(path: Path) -> str:
    with path.open("rb") as handle:
        data = handle.read(MAX_OUTPUT_CHARS * 4)
    return data.decode("utf-8", errors="replace")[:MAX_OUTPUT_CHARS]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status(returncode: int, timed_out: bool) -> Status:
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == 0:
        return "passed"
    return "failed" if returncode > 0 else "error"


def run_python(code: str, timeout: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
    """Run the Python program ``code`` in a sandboxed child process and report the outcome.

    Args:
        code: the complete program (it runs as ``__main__``).
        timeout: wall-clock seconds before the child's process group is killed (> 0). The CPU
            limit is ``ceil(timeout) + 1`` seconds.
        memory_mb: address-space limit of the child in MiB (>= 64).

    Returns:
        A :class:`SandboxResult`; ``passed`` is true exactly when the program exited with 0.
    """
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb must be at least 64, got {memory_mb!r}")
    prefix = _network_isolation_prefix()
    with tempfile.TemporaryDirectory(prefix="fastprefill-sandbox-") as tmp:
        root = Path(tmp).resolve()
        work = root / "work"
        work.mkdir()
        bootstrap = root / "bootstrap.py"
        bootstrap.write_text(_BOOTSTRAP, encoding="utf-8")
        program = work / "program.py"
        program.write_text(code, encoding="utf-8")
        stdout_path, stderr_path = root / "stdout.txt", root / "stderr.txt"
        env = {
            "PATH": os.defpath,
            "HOME": str(work),
            "TMPDIR": str(work),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }
        command = [*prefix, sys.executable, "-I", "-B", str(bootstrap), str(work), str(program)]
        limits = functools.partial(_limit_child, memory_mb * 1024 * 1024, math.ceil(timeout) + 1)
        start = time.monotonic()
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            try:
                proc = subprocess.Popen(
                    command,
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    # The limits must apply before exec; the hook only calls setrlimit.
                    preexec_fn=limits,  # noqa: PLW1509
                    close_fds=True,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                return SandboxResult(False, "error", "", f"could not start the sandbox: {exc}", None, 0.0)
            timed_out = False
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                returncode = proc.wait()
            finally:
                # Anything left in the group, whatever happened. While a process of the group
                # lives, Linux keeps its id from being reused, so this cannot hit a stranger.
                _kill_group(proc.pid)
            elapsed = time.monotonic() - start
        status = _status(returncode, timed_out)
        return SandboxResult(
            passed=status == "passed",
            status=status,
            stdout=_read_output(stdout_path),
            stderr=_read_output(stderr_path),
            returncode=returncode,
            elapsed=elapsed,
        )
