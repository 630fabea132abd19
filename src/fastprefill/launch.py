"""``python -m fastprefill.launch``: run a distributed prefill (KV-Runahead, TSP) on one prompt.

Two ways to run, chosen by the environment:

(a) **Under torchrun** (``RANK`` and ``WORLD_SIZE`` set): this process is one rank. It joins the
    default process group (:func:`fastprefill.runtime.init_group`: NCCL when the
    device is CUDA, one GPU per local rank; gloo on CPU), loads the model
    (:func:`fastprefill.models.load`), validates the request like every other rank, waits at a
    barrier so all ranks start together, and runs its role (:func:`fastprefill.distributed.rank.run_rank`):
    the last rank prints the answer, the others contribute KV. One machine, two ranks::

        torchrun --standalone --nproc-per-node 2 -m fastprefill.launch \\
            --model smollm2-135m --method runahead:partition=searched --prompt "..."

    Several machines (run on every machine, ``R`` = 0, 1, ... its node rank; ``HOST:PORT`` a
    reachable address of node 0; every node needs the same model under the same name)::

        torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --rdzv-backend c10d \\
            --rdzv-endpoint HOST:PORT --rdzv-id fastprefill -m fastprefill.launch \\
            --model smollm2-135m --method runahead --prompt "..."

    The chain follows the global rank order, so neighbouring ranks should share a fast link.
    ``procs`` of the method is the world size. Gloo picks its network interface from the
    host name; set ``GLOO_SOCKET_IFNAME`` (or ``NCCL_SOCKET_IFNAME``) when that is the wrong
    one. When every rank is on this machine (``LOCAL_WORLD_SIZE == WORLD_SIZE``) gloo uses
    the loopback interface.

(b) **Otherwise**: a local :class:`~fastprefill.distributed.pool.RankPool` of ``--procs`` ranks
    on this machine (gloo over 127.0.0.1, CPU only), TTFT measured on the driver.

``--method`` may be repeated: the methods run in turn on the same ranks, the model loaded once.
Every method is built and checked against the number of ranks before any work starts, and
every request is validated before the first one runs, so a bad spec anywhere in the list is
refused before any answer is printed.
``--json`` prints one JSON object per method on stdout (under torchrun, from the last rank only):
``first_token_id``, ``token_ids``, ``text``, ``ttft_s`` (with ``ttft_clock``: ``"driver"``
for the local pool, dispatch included; ``"last rank"`` under torchrun, from the barrier),
``method``, ``procs``, ``prompt_tokens``. ``--save-logits PATH`` writes the list of ``(V,)``
float32 first-token logits, one per method, with ``torch.save`` (for exactness checks against
one process). Errors a user can fix exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.host import DTYPES, keep_freed_memory, set_threads
from fastprefill.runtime import init_group, use_loopback

if TYPE_CHECKING:
    from fastprefill.methods.base import Method

__all__ = ["main"]


def _device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine; use --device cpu")
    return torch.device(f"cuda:{local_rank}")


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if args.prompt_ids is None:
        return args.prompt
    try:
        return [int(x) for x in args.prompt_ids.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"--prompt-ids must be integers separated by spaces or commas, got {args.prompt_ids!r}") from None


class _Reporter:
    """Prints one result per method (text, or a JSON line) and collects the first-token logits."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.logits: list[torch.Tensor] = []

    def __call__(self, method: Method, procs: int, out: dict[str, Any], ttft_s: float, clock: str) -> None:
        timing = out["timing"]
        self.logits.append(out["logits"])
        if self.args.json:
            print(json.dumps({
                "model": self.args.model, "method": method.describe(), "procs": procs,
                "prompt_tokens": timing["prompt_tokens"], "first_token_id": out["token_ids"][0],
                "token_ids": out["token_ids"], "text": out["text"], "ttft_s": ttft_s, "ttft_clock": clock,
            }), flush=True)
            return
        print(out["text"], flush=True)
        print(f"{method.describe()}: ttft {ttft_s * 1e3:.1f} ms ({clock} clock), {timing['prompt_tokens']} prompt "
              "tokens", file=sys.stderr)

    def save(self) -> None:
        if self.args.save_logits:
            torch.save(self.logits, self.args.save_logits)


def _methods(args: argparse.Namespace, procs: int, group: str) -> list[Method]:
    """Every ``--method``, built and checked to run on ``procs`` ranks (``group`` names them)."""
    from fastprefill.distributed.rank import check_ranks
    from fastprefill.methods.registry import make_method

    methods = [make_method(spec, {"procs": procs, "timeout_s": args.timeout}) for spec in args.method or ["runahead"]]
    for method in methods:
        check_ranks(method, procs, group)
    return methods


def _torchrun(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from fastprefill.distributed.rank import Request, check_request, run_rank
    from fastprefill.distributed.torchrun_links import local_ranks, on_one_machine
    from fastprefill.models import load

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(args.device, local)
    methods = _methods(args, world, f"torchrun started {world} ranks")
    prompt = _prompt(args)
    set_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif on_one_machine():
        use_loopback()
    init_group(device=device, timeout_s=args.timeout)
    report = _Reporter(args)
    try:
        keep_freed_memory()
        model, tok = load(args.model, device=device, dtype=args.dtype, processes=local_ranks())
        requests = [Request(prompt, method, args.max_new_tokens, args.chat) for method in methods]
        checked = [check_request(model, tok, req, world) for req in requests]  # all, before any runs
        for method, req, prepared in zip(methods, requests, checked, strict=True):
            dist.barrier()  # every rank starts the request together
            out = run_rank(model, tok, rank, world, req, prepared)
            if rank == world - 1:
                report(method, world, out, out["timing"]["ttft_s"], "last rank")
        if rank == world - 1:
            report.save()
    finally:
        dist.destroy_process_group()
    return 0


def _local(args: argparse.Namespace) -> int:
    from fastprefill.distributed.pool import RankPool

    if args.device not in ("auto", "cpu"):
        raise ConfigError(f"--device {args.device}: the local pool runs on CPU (gloo); use torchrun for CUDA")
    methods = _methods(args, args.procs, f"--procs is {args.procs}")
    prompt = _prompt(args)
    report = _Reporter(args)
    with RankPool(args.model, args.procs, dtype=args.dtype, threads_per_rank=args.threads, pin=args.pin,
                  timeout_s=args.timeout) as pool:
        for method in methods:
            res = pool.generate(prompt, method, args.max_new_tokens, chat=args.chat)
            out = {"text": res.text, "token_ids": res.token_ids, "timing": res.timing, "logits": res.logits}
            report(method, args.procs, out, res.ttft_s, "driver")
    report.save()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Under torchrun (``RANK`` set) run this rank; otherwise start a local pool of ``--procs``
    ranks and print the answer (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m fastprefill.launch", description=main.__doc__)
    p.add_argument("--model", required=True, help="zoo name, model folder, HF id or random:llama")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, e.g. '1 2 3' (models without a tokenizer)")
    p.add_argument("--method", action="append",
                   help="method spec: runahead[:partition=even|searched|600/424] (default), tsp, full (one rank); "
                        "procs defaults to the world size. Repeat it to run several methods in turn on the same "
                        "ranks (the model loads once)")
    p.add_argument("--procs", type=int, default=2, help="ranks of a local pool (under torchrun: the world size)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--pin", action="store_true", help="local pool: pin each rank to one CPU core")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="under torchrun: auto = cuda:LOCAL_RANK (NCCL) when CUDA is available, else cpu (gloo)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="auto: bfloat16 where the CPU or GPU multiplies it natively, float32 elsewhere")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a silent rank is an error")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--save-logits", metavar="PATH",
                   help="torch.save the list of (V,) first-token logits (one per --method) to PATH")
    args = p.parse_args(argv)
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return _torchrun(args)
        return _local(args)
    except FastprefillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
