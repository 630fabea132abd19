"""``fastprefill serve``: an OpenAI-compatible HTTP server over one model (per-request method);
under torchrun, one server over the torchrun ranks (rank 0 serves HTTP, every rank joins each prefill)."""

from __future__ import annotations

import argparse
from typing import Any

from fastprefill.cli.common import _load, _positive, _threads, console, err_console, model_args
from fastprefill.errors import FastprefillError


def cmd_serve(args: argparse.Namespace) -> int:
    from fastprefill.host import set_threads
    from fastprefill.serve import ServeConfig, create_app, run, start_ranks
    from fastprefill.serve.backends import rank_methods
    from fastprefill.serve.config import serving_method
    from fastprefill.serve.torchrun import serve as serve_torchrun
    from fastprefill.serve.torchrun import under_torchrun

    if args.profile is not None:
        if args.method != "full":
            raise FastprefillError("give --profile FILE (which serves auto:profile=FILE) or --method SPEC, not both")
        args.method = f"auto:profile={args.profile}"
    config = ServeConfig(model_name=args.model, method=args.method, allow_methods=tuple(args.allow_method),
                         queue_size=args.queue, timeout_s=args.timeout, max_tokens=args.max_tokens,
                         max_body_mb=args.max_body_mb, drain_timeout_s=args.drain_timeout,
                         prefix_cache_mb=args.prefix_cache_mb, prefix_cache_dir=args.prefix_cache_dir,
                         scheduler=args.scheduler, prefill_chunk=args.prefill_chunk, max_running=args.max_running,
                         prefill_pauses=args.prefill_pauses, decode_interval_s=args.decode_interval,
                         mixed_chunk=args.mixed_chunk)
    if args.mlock and under_torchrun():
        raise FastprefillError("--mlock locks the weights of a server that loads its model itself; under torchrun "
                               "each rank loads its own: drop --mlock there")
    if under_torchrun():  # every process is a rank; rank 0 serves HTTP (docs/serving.md)
        return serve_torchrun(config, host=args.host, port=args.port, threads=args.threads_per_rank,
                              log_level=args.log_level, control_port=args.control_port, device=args.device,
                              dtype=args.dtype)
    set_threads(args.threads)
    on_ranks = rank_methods({s: serving_method(s) for s in (args.method, *args.allow_method)})
    if args.device != "cpu" and on_ranks:
        raise FastprefillError("multi-rank methods serve on CPU ranks (gloo): drop --device, or run the server "
                               "under torchrun")
    model, tok = _load(args.model, args.device, args.dtype, args.compile, args.row_floor,
                       processes=1 + max((m.ranks for m in on_ranks.values()), default=0))
    locked = _lock_weights(model) if args.mlock else None
    with console.status("starting the ranks ..."):
        ranks = start_ranks(config, args.model, dtype=args.dtype, threads_per_rank=args.threads_per_rank)
    app = create_app(model, tok, config, ranks)
    with console.status("warming up ..."):
        app.state.server.warm_up()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(f"[yellow]warning:[/yellow] listening on {args.host}: the server has no authentication")
    err_console.print(f"serving {args.model} ({app.state.server.health()['method']}) at http://{args.host}:{args.port}/v1"
                      f"; {args.scheduler} scheduler, queue {args.queue}, timeout {args.timeout:g} s, bodies up to {args.max_body_mb:g} MiB, "
                      f"drain {args.drain_timeout:g} s on SIGTERM, {args.threads} threads, prefix cache "
                      f"{f'{args.prefix_cache_mb:g} MiB' if args.prefix_cache_mb else 'off'}"
                      f"{f', {ranks.procs} ranks (pids {ranks.pids})' if ranks else ''}"
                      f"{f', {locked.bytes / 2**30:.2f} GiB of weights locked in memory' if locked else ''}",
                      highlight=False)
    run(app, args.host, args.port, log_level=args.log_level)
    return 0


def _lock_weights(model: Any) -> Any:
    """The model's weights (parameters and buffers) locked in memory (``--mlock``)."""
    from fastprefill.host import lock_in_memory

    with console.status("locking the weights in memory ..."):
        return lock_in_memory([*model.parameters(), *model.buffers()])


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over one model")
    p.add_argument("--method", default="full", help="default method spec (a request may name another in its "
                   "'fastprefill' field: full, lazyllm, static, random); runahead:procs=N starts N ranks")
    p.add_argument("--allow-method", action="append", default=[], metavar="SPEC",
                   help="another spec requests may name, built at start (e.g. kvp:predictor=DIR; repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (no authentication: keep it local)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--queue", type=_positive, default=16,
                   help="requests that may wait to be admitted (beyond --max-running); more get 429")
    p.add_argument("--scheduler", choices=["interleaved", "fifo"], default="interleaved",
                   help="interleaved: requests run side by side (chunked prefill, short work first, batched "
                        "decode); fifo: one request at a time, start to end (docs/serving.md)")
    p.add_argument("--prefill-chunk", type=_positive, default=8192, metavar="TOKENS",
                   help="interleaved: the largest unit of prefill; a longer prompt (full prefill) is prefilled in "
                        "chunks of this size (set it by measurement: docs/serving.md)")
    p.add_argument("--no-prefill-pauses", dest="prefill_pauses", action="store_false",
                   help="interleaved: never pause a chunk between layers for a new short request (docs/serving.md)")
    p.add_argument("--decode-interval", type=float, default=2.0, metavar="S", help="interleaved: a chunk also "
                   "pauses for the running streams' next tokens S seconds after their last (docs/serving.md)")
    p.add_argument("--mixed-chunk", type=int, default=0, metavar="TOKENS",
                   help="interleaved: while streams decode, prefill in chunks of at most TOKENS (>= 16), each "
                        "carrying the streams' next token in the same forward (mixed batches); 0: off (docs/serving.md)")
    p.add_argument("--max-running", type=_positive, default=8, metavar="N",
                   help="interleaved: requests run at once (the largest decode batch)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request, queue wait included")
    p.add_argument("--max-tokens", type=_positive, default=256, help="tokens when a request gives no max_tokens")
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body in MiB; a larger one is refused with 413 before it is read")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: refuse new requests (503), answer waiting ones 503, let the running "
                        "generation go on for up to S seconds (then end it with an error), and exit; a second "
                        "signal exits at once")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="serve --method auto:profile=FILE by default: a `fastprefill tune` profile picks the "
                        "method per prompt length")
    p.add_argument("--prefix-cache-mb", type=float, default=1024.0, metavar="MB",
                   help="bound of the exact prefix cache shared by all requests (a prompt whose start was "
                        "computed before prefills only the rest); 0 turns it off")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="load the prefix cache from DIR at start (a corrupt or mismatched file is refused and "
                        "ignored) and save it there at shutdown")
    p.add_argument("--threads-per-rank", type=_threads, default=1,
                   help="torch threads in each rank of a multi-rank --method / --allow-method (runahead:procs=N); "
                        "under torchrun, of every process (rank 0's single-process methods included)")
    p.add_argument("--control-port", type=int, default=0, metavar="PORT",
                   help="under torchrun: the port rank 0 listens on for the other ranks' control connections "
                        "(default: a free one)")
    p.add_argument("--mlock", action="store_true",
                   help="lock the model's weights in memory, so another process's demand on this host cannot make "
                        "the kernel drop them (a float32 model's weights are pages of the mapped checkpoint) and "
                        "slow decode steps and hits; that memory is then no longer the host's to reclaim. Needs "
                        "ulimit -l at least the weights' size (or CAP_IPC_LOCK)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    model_args(p)
    p.set_defaults(func=cmd_serve)
