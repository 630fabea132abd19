"""``fastprefill serve`` under torchrun: one OpenAI-compatible server over ranks on one or several machines.

Run the same command on every machine (``R`` its node rank, ``HOST`` node 0's address)::

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST --master-port 29500 \\
        -m fastprefill.cli serve --model NAME --method runahead:procs=2 --host 0.0.0.0 --port 8000

Every rank first checks the server's settings (:func:`check_specs`: every spec builds, each
multi-rank one asks for as many ranks as torchrun started), loads the model (on the CPU, in the dtype asked for) and
checks every method against it, then joins the process group and compares the weights' and
tokenizer's fingerprints with every other rank's; a rank that refuses, refuses on every rank
alike before anything runs (exit status 2, the message printed once per machine).

Roles are those of the rank pool (:mod:`fastprefill.distributed.pool`): rank 0 serves HTTP
(:func:`fastprefill.serve.create_app` over a :class:`~fastprefill.serve.ranks.ServedPool` whose
links are torchrun's ranks, :mod:`fastprefill.distributed.torchrun_links`), takes part in every
prefill as the chain's first rank (a thread of its process) and runs the single-process methods
itself; the last rank ends each prefill holding the whole K/V, decodes there and sends each
token to rank 0 as it comes. The other ranks ignore SIGINT and SIGTERM: they leave when rank 0
stops them (after its drain) or when their connection to it closes.

A lost rank ends the job: rank 0 answers the running and waiting requests, and any that arrive
during the shutdown, with a 503 naming the rank, drains (``--drain-timeout``), stops the other
ranks and exits with status 1, so torchrun reports the failure (or, with ``--max-restarts``,
starts the server again).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from fastprefill.distributed.rank import check_ranks
from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.host import set_threads
from fastprefill.methods.base import Method
from fastprefill.runtime import init_group, use_loopback
from fastprefill.serve.backends import rank_methods
from fastprefill.serve.config import ServeConfig, serving_method

__all__ = ["WATCH_PERIOD_S", "check_specs", "serve", "under_torchrun"]

#: Seconds between two checks of idle ranks on rank 0 (a rank lost between requests ends the server this soon).
WATCH_PERIOD_S = 1.0


def under_torchrun() -> bool:
    """Whether this process is a torchrun rank (``RANK`` and ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_specs(config: ServeConfig, world: int) -> dict[str, Method]:
    """Every method of ``config`` (``--method`` and ``--allow-method``), built, for a server over
    ``world`` torchrun ranks: at least one runs over the ranks, and each of those has ``procs``
    equal to ``world``.

    Raises:
        ConfigError: a spec that does not build, or does not fit ``world`` ranks.
    """
    if world < 2:
        raise ConfigError("torchrun started 1 rank; a server over torchrun ranks needs at least 2 (to serve on one "
                          "process, run `fastprefill serve` without torchrun)")
    methods = {spec: serving_method(spec) for spec in (config.method, *config.allow_methods)}
    multi = list(rank_methods(methods).values())
    if not multi:
        raise ConfigError(f"under torchrun the server runs a multi-rank method over its {world} ranks: give --method "
                          f"(or --allow-method) runahead:procs={world} or tsp:procs={world}")
    for method in multi:
        check_ranks(method, world, f"torchrun started {world} ranks (nnodes x nproc-per-node), and every rank joins "
                                   "each prefill: procs must equal the number of ranks")
    return methods


def _same_model(model: Any, tokenizer: Any, name: str) -> None:
    """Every rank's weights and tokenizer are rank 0's (a collective: every rank calls it).

    Raises:
        ConfigError: on every rank alike, naming the ranks that differ.
    """
    import torch.distributed as dist

    from fastprefill.models.fingerprint import tokenizer_fingerprint, weights_fingerprint

    mine = (weights_fingerprint(model), tokenizer_fingerprint(tokenizer))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    other = [r for r, fp in enumerate(everyone) if fp != everyone[0]]
    if other:
        raise ConfigError(f"ranks {other} loaded other weights or another tokenizer for {name!r} than rank 0; every "
                          "machine needs the same model files")


#: How long a rank that has no message to print waits before it exits with a refusal.
_QUIET_EXIT_DELAY_S = 5.0


def _exit(code: int) -> None:
    """End this process now: a thread may still wait in a collective with a lost rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(config: ServeConfig, *, host: str, port: int, threads: int, log_level: str = "info",
          control_port: int = 0, device: str = "cpu", dtype: str = "auto") -> int:
    """Run this torchrun rank of the server (see the module docstring); rank 0 serves on
    ``host:port``. Returns 0 after a clean stop; a rank lost ends the process with status 1.

    Args:
        threads: torch threads of this rank (rank 0's single-process methods included).
        control_port: the port rank 0 listens on for the other ranks (0: a free one).
        device: must be ``"cpu"`` (the ranks' gloo chain), refused otherwise.
        dtype: what every rank loads the model in (see :func:`fastprefill.host.resolve_dtype`).

    Raises:
        FastprefillError: a setting or the model refused, on every rank alike (on all but each
            machine's first local rank the error is not raised: they return 2 without a message, a few
            seconds later, so that torchrun stops them after the first rank's message is out).
    """
    import torch.distributed as dist

    from fastprefill.distributed.torchrun_links import local_ranks, on_one_machine
    from fastprefill.host import keep_freed_memory
    from fastprefill.models import load

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if device != "cpu":
            raise ConfigError("under torchrun the server's ranks run on the CPU (gloo): drop --device")
        methods = check_specs(config, world)
        set_threads(threads, interop=1)
        keep_freed_memory()
        model, tokenizer = load(config.model_name, dtype=dtype, processes=local_ranks())
        for method in methods.values():
            method.check_model(model)
        timeout = max(m.timeout_s for m in rank_methods(methods).values())
        if on_one_machine():
            use_loopback()
        init_group(timeout_s=timeout)
        _same_model(model, tokenizer, config.model_name)
    except FastprefillError:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            raise  # the one message of this machine
        # torchrun stops every rank as soon as one exits: leave after the machine's first rank,
        # so that it is never stopped before its message is out
        time.sleep(_QUIET_EXIT_DELAY_S)
        return 2
    if rank != 0:
        return _serve_other(model, tokenizer, rank, world, timeout)
    try:
        code = _serve_first(config, model, tokenizer, world, timeout, host, port, log_level, control_port)
    except Exception as exc:  # noqa: BLE001 - say why, then end every thread of this process
        print(f"error: {exc}" if isinstance(exc, FastprefillError) else f"error: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        _exit(1)
    if code:
        _exit(code)
    dist.destroy_process_group()
    return 0


def _serve_other(model: Any, tokenizer: Any, rank: int, world: int, timeout: float) -> int:
    import torch.distributed as dist

    from fastprefill.distributed.torchrun_links import join_driver, serve_driver

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 drains first, then stops this rank
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = serve_driver(join_driver(rank, timeout_s=timeout), model, tokenizer, rank, world)
    if code:
        _exit(code)
    dist.destroy_process_group()
    return 0


def _serve_first(config: ServeConfig, model: Any, tokenizer: Any, world: int, timeout: float, host: str, port: int,
                 log_level: str, control_port: int) -> int:
    import copy

    from fastprefill.distributed.torchrun_links import driver_links
    from fastprefill.serve.app import create_app
    from fastprefill.serve.ranks import ServedPool
    from fastprefill.serve.runner import run

    links = driver_links(model, copy.deepcopy(tokenizer), world, port=control_port, timeout_s=timeout)
    pool = ServedPool(config.model_name, world, links=links, timeout_s=timeout, start_timeout_s=timeout, fatal=True)
    try:
        app = create_app(model, tokenizer, config, pool)
        app.state.server.warm_up()
        pool.watch(WATCH_PERIOD_S)
        hosts = sorted({link.host for link in links})
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: listening on {host}: the server has no authentication", file=sys.stderr)
        print(f"serving {config.model_name} ({app.state.server.health()['method']}) at http://{host}:{port}/v1 over "
              f"{world} torchrun ranks on {', '.join(hosts)}", file=sys.stderr, flush=True)
        run(app, host, port, log_level=log_level, until=pool.failed)
    finally:
        pool.close()
    if pool.failure is not None:
        print(f"error: the server's ranks failed ({pool.failure}); exiting", file=sys.stderr)
        return 1
    return 0
