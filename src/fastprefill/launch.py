"""Start the ranks of a multi-process prefill (KV-Runahead, TSP) and run the engine on them.

Two ways to run:

(a) **One machine** — :class:`RankPool` spawns ``procs`` worker processes (``spawn`` start
    method), joins them in a gloo process group on a free 127.0.0.1 port, fixes each rank's
    torch thread count and optionally pins rank ``r`` to one CPU core (``os.sched_setaffinity``).
    Every worker loads the model *once*; the pool then stays alive and the driver sends it
    prompts. That keeps model loading out of TTFT, and TTFT is measured **on the driver** from
    dispatching the prompt through receiving the first token id from the last rank (pipes,
    tokenisation, every rank's work and all communication included). :func:`generate_distributed`
    is the one-shot wrapper for the CLI (``fastprefill generate --method runahead --procs 2``).

(b) **torchrun** — ``torchrun --nnodes N --nproc-per-node P -m fastprefill.launch --model M
    --prompt "..."`` reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, uses NCCL
    when CUDA is available (one GPU per local rank) and gloo otherwise, and runs the same roles.

Roles (see :mod:`fastprefill.methods.runahead.method`): the last rank runs
:func:`fastprefill.engine.stream` (prefill, first token, decode); ranks ``0..P-2`` call the
method's ``contribute`` for the same prompt.

Faults: every communication wait is bounded by the method's ``timeout_s``; the driver watches
every worker's process sentinel, and the first worker that dies or reports an error makes it
kill all workers and raise :class:`RankPoolError` (a failed process group is not reused). The
workers are daemonic children and also exit when the driver's pid goes away: no orphans.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Self

import torch

from fastprefill.errors import ConfigError, FastprefillError, PromptError
from fastprefill.methods.base import Method, PrefillOutput

__all__ = ["PoolResult", "RankPool", "RankPoolError", "free_port", "generate_distributed", "load_model", "main"]

#: Worker exit code used by the fault-injection hook.
FAULT_EXIT_CODE = 17


class RankPoolError(FastprefillError, RuntimeError):
    """A worker died, hung or failed; the pool has been shut down."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (loopback only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_model(spec: str, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in float32, eval mode.

    ``spec`` is a zoo name or a model folder (:func:`fastprefill.models.zoo.load`), or
    ``"random:llama"`` / ``"random:qwen2"``: a seeded 4-layer random model (vocab 128, GQA 4/2
    heads, hidden 64) with no tokenizer, for smoke tests; it is bit-identical in every process.
    """
    if spec.startswith("random:"):
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

        family = spec.split(":", 1)[1]
        classes = {"llama": LlamaConfig, "qwen2": Qwen2Config}
        if family not in classes:
            raise ConfigError(f"model {spec!r}: random models are {sorted('random:' + k for k in classes)}")
        config = classes[family](
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model.to(device).eval(), None
    from fastprefill.models import zoo

    return zoo.load(spec, device=device)


@dataclass
class PoolResult:
    """One generation on a pool.

    Attributes:
        text, token_ids: the greedy output.
        ttft_s: driver-measured seconds from dispatching the prompt to receiving the first token.
        timing: the last rank's engine :class:`~fastprefill.engine.Timing` as a dict (its own TTFT
            excludes dispatch).
        ranks: per-rank prefill counters (chunks, bytes sent/received, ...), index = rank.
        logits: ``(V,)`` float32 first-token logits from the last rank (sent after generation,
            outside the TTFT window).
    """

    text: str
    token_ids: list[int]
    ttft_s: float
    timing: dict[str, Any]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    logits: torch.Tensor | None = None


# --- worker side ---------------------------------------------------------------------------------
def _loopback_env() -> None:
    """Make gloo use the loopback interface (set in the worker process only, before init)."""
    names = {name for _, name in socket.if_nameindex()}
    if "lo" in names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _layer_hook(fault: tuple[int, int, str] | None) -> Any:
    if fault is None:
        return None
    f_rank, f_layer, kind = fault

    def hook(rank: int, layer: int) -> None:
        if rank == f_rank and layer == f_layer:
            if kind == "exit":
                os._exit(FAULT_EXIT_CODE)
            time.sleep(10_000)  # "hang"

    return hook


def _check_request(model: Any, tokenizer: Any, req: dict[str, Any], world: int) -> torch.Tensor:
    """Same checks on every rank before any communication, so all ranks refuse alike."""
    from fastprefill.engine import prepare_prompt

    method = req["method"]
    if not isinstance(method, Method):
        raise ConfigError(f"method must be a fastprefill Method, got {type(method).__name__}")
    procs = getattr(method, "procs", 1)
    if procs != world:
        raise ConfigError(f"{method.describe()} needs procs={procs} ranks, but this pool has {world}")
    return prepare_prompt(model, tokenizer, req["prompt"], method, max_new_tokens=req["max_new_tokens"],
                          chat=req["chat"])


class _Capture(Method):
    """Delegates to a method and keeps its first-token logits (for exactness checks); the
    engine sees the wrapped method's description and counters unchanged."""

    def __init__(self, method: Method) -> None:
        self.method = method
        self.logits: torch.Tensor | None = None

    def prefill(self, model: Any, input_ids: torch.Tensor) -> PrefillOutput:
        out = self.method.prefill(model, input_ids)
        self.logits = out.logits
        return out

    def decode(self, state: Any, token_id: int) -> torch.Tensor:
        return self.method.decode(state, token_id)

    def decode_stats(self, state: Any) -> dict[str, Any]:
        return self.method.decode_stats(state)

    def describe(self) -> str:
        return self.method.describe()


def _serve(model: Any, tokenizer: Any, rank: int, world: int, conn: Connection, req: dict[str, Any]) -> None:
    from fastprefill.engine import stream

    try:
        ids = _check_request(model, tokenizer, req, world)
    except (ConfigError, PromptError) as exc:
        conn.send(("invalid", f"{type(exc).__name__}: {exc}"))
        return
    method = req["method"]
    if rank == world - 1:
        events = []
        capture = _Capture(method)
        for ev in stream(model, tokenizer, ids, capture, req["max_new_tokens"], stop_at_eos=req["stop_at_eos"]):
            if ev.index == 0:
                conn.send(("first", ev.token_id))
            events.append(ev)
        timing = events[-1].timing
        ids_out = [e.token_id for e in events]
        text = tokenizer.decode(ids_out, skip_special_tokens=True) if tokenizer is not None else ""
        conn.send(("done", {"text": text, "token_ids": ids_out, "timing": timing.to_dict(), "stats": timing.extra,
                            "logits": capture.logits.cpu() if capture.logits is not None else None}))
    else:
        with torch.inference_mode():
            stats = method.contribute(model, ids, layer_hook=_layer_hook(req.get("fault")))
        conn.send(("done", {"stats": stats.extra}))


def _worker_main(
    rank: int, world: int, port: int, model_spec: str, threads: int, core: int | None,
    conn: Connection, parent_pid: int, timeout_s: float,
) -> None:
    """Entry point of one spawned rank (module-level so ``spawn`` can import it)."""
    import torch.distributed as dist

    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        _loopback_env()
        model, tokenizer = load_model(model_spec)
        if world > 1:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        conn.send(("ready", rank))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    os._exit(1)  # the driver is gone: do not linger
                continue
            kind, payload = conn.recv()
            if kind == "stop":
                break
            if kind == "tokenize":
                from fastprefill.engine import encode_prompt

                conn.send(("tokens", encode_prompt(tokenizer, payload["prompt"], chat=payload["chat"])[0].tolist()))
                continue
            _serve(model, tokenizer, rank, world, conn, payload)
        if world > 1:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - report any failure, then exit non-zero: the driver tears the pool down
        msg = f"rank {rank}: {type(exc).__name__}: {exc}"
        if not isinstance(exc, FastprefillError):
            msg += "\n" + traceback.format_exc(limit=3)
        try:
            conn.send(("error", msg))
        except OSError:
            pass
        os._exit(1)


# --- driver side ---------------------------------------------------------------------------------
class RankPool:
    """A persistent group of ranks on this machine, each holding the model (see module docstring).

    Args:
        model: zoo name, model folder, or ``"random:llama"`` / ``"random:qwen2"``.
        procs: number of ranks (>= 1).
        threads_per_rank: ``torch.set_num_threads`` in each rank.
        pin: pin rank ``r`` to the ``r``-th CPU of this process's affinity set (one core per rank).
        timeout_s: process-group timeout and the bound on each communication wait.
        start_timeout_s: bound on starting all workers (model loading included).
        start_method: ``"spawn"`` (default: a fresh interpreter per rank; scripts need the
            ``if __name__ == "__main__":`` guard) or ``"fork"`` (starts in well under a second
            because torch is already imported; used by the tests; only with
            ``threads_per_rank=1`` and before this process has initialised CUDA or a process
            group, as forked OpenMP/CUDA state is not safe to reuse).

    Use as a context manager; :meth:`close` stops the workers.
    """

    def __init__(
        self,
        model: str,
        procs: int,
        *,
        threads_per_rank: int = 1,
        pin: bool = False,
        timeout_s: float = 120.0,
        start_timeout_s: float = 900.0,
        start_method: str = "spawn",
    ) -> None:
        if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
            raise ConfigError(f"procs must be an integer >= 1, got {procs!r}")
        if not isinstance(threads_per_rank, int) or threads_per_rank < 1:
            raise ConfigError(f"threads_per_rank must be an integer >= 1, got {threads_per_rank!r}")
        cores = sorted(os.sched_getaffinity(0))
        if pin and procs > len(cores):
            raise ConfigError(f"pin=True needs one core per rank: {procs} ranks, {len(cores)} cores available")
        if start_method not in ("spawn", "fork"):
            raise ConfigError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
        if start_method == "fork" and threads_per_rank != 1:
            raise ConfigError("start_method='fork' needs threads_per_rank=1 (forked OpenMP pools are unsafe)")
        import torch.multiprocessing as mp

        self.model_spec, self.procs, self.timeout_s = model, procs, timeout_s
        ctx = mp.get_context(start_method)
        port = free_port()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(procs):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, procs, port, model, threads_per_rank, cores[rank] if pin else None, child,
                      os.getpid(), timeout_s),
                daemon=True, name=f"fastprefill-rank{rank}",
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._closed = False
        replies = self._collect({"ready"}, start_timeout_s, "starting")
        assert len(replies) == procs

    # --- plumbing -----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._closed = True

    def _fail(self, msg: str) -> None:
        self._kill_all()
        raise RankPoolError(msg)

    def _collect(
        self, kinds: set[str], timeout_s: float, what: str, first_cb: Any = None
    ) -> dict[int, tuple[str, Any]]:
        """One reply per rank (kinds in ``kinds`` or "invalid"); watch sentinels and the deadline."""
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        by_conn = {c: r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(replies) < self.procs:
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = sorted(set(range(self.procs)) - set(replies))
                self._fail(f"{what}: ranks {waiting} did not answer within {timeout_s:.0f} s; pool shut down")
            ready = wait(list(by_conn) + list(by_sentinel), timeout=min(left, 1.0))
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        kind, payload = obj.recv()
                    except (EOFError, OSError):
                        continue  # the sentinel reports the death
                    if kind == "first":
                        if first_cb is not None:
                            first_cb(payload)
                        continue
                    if kind == "error":
                        self._fail(f"{what} failed on {payload}; pool shut down")
                    replies[rank] = (kind, payload)
                elif obj in by_sentinel:
                    rank = by_sentinel[obj]
                    if rank in replies and what == "stopping":
                        continue
                    # give its error message (if any) a moment to arrive
                    conn = self._conns[rank]
                    if conn.poll(0.5):
                        try:
                            kind, payload = conn.recv()
                            if kind == "error":
                                self._fail(f"{what} failed on {payload}; pool shut down")
                        except (EOFError, OSError):
                            pass
                    self._procs[rank].join(timeout=1.0)
                    code = self._procs[rank].exitcode
                    self._fail(f"{what}: rank {rank} died (exit code {code}); pool shut down")
        return replies

    def _check_open(self) -> None:
        if self._closed:
            raise RankPoolError("this RankPool is closed (a worker failed or close() was called); start a new one")

    # --- public -------------------------------------------------------------------------------
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt`` from the last rank's tokenizer (the driver loads no model)."""
        self._check_open()
        self._conns[-1].send(("tokenize", {"prompt": prompt, "chat": chat}))
        if not self._conns[-1].poll(self.timeout_s):
            self._fail("tokenize: no answer")
        kind, payload = self._conns[-1].recv()
        if kind == "error":
            self._fail(str(payload))
        return list(payload)

    def generate(
        self,
        prompt: str | bytes | Sequence[int],
        method: Any = None,
        max_new_tokens: int = 64,
        *,
        chat: bool = False,
        stop_at_eos: bool = True,
        fault: tuple[int, int, str] | None = None,
    ) -> PoolResult:
        """Greedy generation with ``method`` on every rank.

        Args:
            prompt: text (bytes must be UTF-8) or token ids (the same on every rank).
            method: a Method whose ``procs`` equals the pool's (default: ``KVRunahead(procs)``,
                or full prefill on a one-rank pool).
            fault: test hook ``(rank, layer, "exit"|"hang")``: that helper rank exits (or hangs)
                after the given layer.

        Raises:
            ConfigError, PromptError: refused by every rank before any communication (the pool
                stays usable).
            RankPoolError: a worker failed, died or hung (the pool is shut down).
        """
        self._check_open()
        if method is None:
            from fastprefill.methods.full import FullPrefill
            from fastprefill.methods.runahead.method import KVRunahead

            method = KVRunahead(procs=self.procs) if self.procs > 1 else FullPrefill()
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        req = {"prompt": prompt if isinstance(prompt, (str, bytes)) else list(prompt), "method": method,
               "max_new_tokens": max_new_tokens, "chat": chat, "stop_at_eos": stop_at_eos, "fault": fault}
        first: list[float] = []
        t0 = time.perf_counter()
        for c in self._conns:
            c.send(("run", req))
        bound = 4 * float(getattr(method, "timeout_s", self.timeout_s)) + 60.0
        replies = self._collect({"done"}, bound, "generate",
                                first_cb=lambda _tok: first.append(time.perf_counter() - t0))
        invalid = [p for k, p in replies.values() if k == "invalid"]
        if invalid:
            msg = invalid[0]
            raise (PromptError if msg.startswith("PromptError") else ConfigError)(msg.split(": ", 1)[1])
        last = replies[self.procs - 1][1]
        return PoolResult(
            text=last["text"], token_ids=last["token_ids"], ttft_s=first[0], timing=last["timing"],
            ranks=[replies[r][1]["stats"] for r in range(self.procs)], logits=last["logits"],
        )

    def close(self) -> None:
        """Stop the workers (kills any that do not exit within 10 s)."""
        if self._closed:
            return
        for c in self._conns:
            try:
                c.send(("stop", None))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._kill_all()


def make_method(method: str, procs: int, partition: str = "even", timeout_s: float = 120.0) -> Any:
    """``"runahead"`` -> :class:`KVRunahead`, ``"tsp"`` -> :class:`SequenceParallel`,
    ``"full"`` -> full prefill (``procs`` must be 1)."""
    from fastprefill.methods.full import FullPrefill
    from fastprefill.methods.runahead.method import KVRunahead, SequenceParallel

    if method == "runahead":
        part: Any = partition
        if partition not in ("even", "searched"):
            try:
                part = tuple(int(x) for x in partition.split("/"))
            except ValueError:
                raise ConfigError(f"partition must be even, searched or chunk sizes like 5/3, got {partition!r}") from None
        return KVRunahead(procs=procs, partition=part, timeout_s=timeout_s)
    if method == "tsp":
        return SequenceParallel(procs=procs, timeout_s=timeout_s)
    if method == "full":
        if procs != 1:
            raise ConfigError("method 'full' runs on one process; use procs=1")
        return FullPrefill()
    raise ConfigError(f"method must be runahead, tsp or full, got {method!r}")


def generate_distributed(
    model: str,
    prompt: str | bytes | Sequence[int],
    procs: int = 2,
    *,
    method: str = "runahead",
    partition: str = "even",
    max_new_tokens: int = 64,
    chat: bool = False,
    stop_at_eos: bool = True,
    threads_per_rank: int = 1,
    pin: bool = False,
    timeout_s: float = 120.0,
) -> PoolResult:
    """One generation on a fresh local pool (the CLI's ``--procs``); the pool is closed after."""
    m = make_method(method, procs, partition, timeout_s)
    with RankPool(model, procs, threads_per_rank=threads_per_rank, pin=pin, timeout_s=timeout_s) as pool:
        return pool.generate(prompt, m, max_new_tokens, chat=chat, stop_at_eos=stop_at_eos)


# --- torchrun -----------------------------------------------------------------------------------
def _torchrun(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from fastprefill.engine import encode_prompt, generate

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        model, tok = load_model(args.model, device=device)
        m = make_method(args.method, world, args.partition, args.timeout)
        ids = encode_prompt(tok, args.prompt, chat=args.chat).to(device)
        if rank == world - 1:
            res = generate(model, tok, ids, m, args.max_new_tokens, stop_at_eos=True)
            print(res.text)
            print(f"[rank {rank}] ttft {res.timing.ttft_s * 1e3:.1f} ms, {res.timing.extra}", file=sys.stderr)
        else:
            with torch.inference_mode():
                m.contribute(model, ids)
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastprefill.launch``: under torchrun (``RANK`` set) run this rank; otherwise
    start a local pool of ``--procs`` ranks and print the answer."""
    p = argparse.ArgumentParser(prog="python -m fastprefill.launch", description=main.__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--method", default="runahead", choices=["runahead", "tsp", "full"])
    p.add_argument("--partition", default="even", help="even | searched | chunk sizes like 600/424")
    p.add_argument("--procs", type=int, default=2, help="ranks for a local pool (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--pin", action="store_true", help="pin each rank to one CPU core")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a silent rank is an error")
    p.add_argument("--cpu", action="store_true", help="under torchrun: use gloo on CPU even if CUDA exists")
    args = p.parse_args(argv)
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return _torchrun(args)
        res = generate_distributed(
            args.model, args.prompt, args.procs, method=args.method, partition=args.partition,
            max_new_tokens=args.max_new_tokens, chat=args.chat, threads_per_rank=args.threads, pin=args.pin,
            timeout_s=args.timeout,
        )
    except FastprefillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(res.text)
    print(f"ttft {res.ttft_s * 1e3:.1f} ms (driver, dispatch included)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
