"""What every ``fastprefill`` subcommand shares: the two consoles, argument types, model loading."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.console import Console

console = Console(stderr=False, soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def _threads(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("--threads must be >= 1")
    return n


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("must be an integer >= 1")
    return n


def model_args(p: argparse.ArgumentParser, default_model: bool = True, dtype: str = "auto",
               row_floor: bool = True) -> None:
    """The options of a subcommand that loads a model: ``--model`` (unless the subcommand names its
    own), ``--device``, ``--dtype``, ``--no-compile``, ``--row-floor`` (where ``row_floor``),
    ``--threads``."""
    from fastprefill.host import DTYPES

    if default_model:
        p.add_argument("--model", default="smollm2-135m", help="zoo name, HF model id or local dir")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=dtype, choices=list(DTYPES),
                   help="auto: bfloat16 where the CPU (AMX-BF16, AVX512-BF16) or GPU multiplies it natively, "
                        f"float32 elsewhere (default: {dtype})")
    p.add_argument("--no-compile", dest="compile", action="store_const", const=False, default=None,
                   help="run the model as transformers builds it (by default, on the CPU, each decoder layer's MLP "
                        "and norms are compiled with torch.compile, a few seconds more at the first run, and a "
                        "bfloat16 model's linear weights are prepacked for oneDNN: faster prefill and decode)")
    if row_floor:
        p.add_argument("--row-floor", default=None, type=_row_floor,
                       help="'auto': every matrix product whose few-row kernel rounds differently from a wider "
                            "one (a one-row decode step, a one-row prefix-cache suffix) is padded to the fewest rows "
                            "at which this CPU's kernels agree, so a request's tokens do not depend on its decode "
                            "batch or on the cache (the linear weights are then packed, float32 too; the floors "
                            "found are kept in row_floors.json in the cache folder, so only the first load on a "
                            "machine checks them); or a number of rows. Default: off")
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1, help="torch threads")


def _row_floor(value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError("--row-floor must be 'auto' or an integer >= 1")
    return int(value)


def _load(model: str, device: str, dtype: str, compile: bool | None = None, row_floor: int | str | None = None,
          processes: int = 1):
    """Load ``model`` in ``dtype`` (``"auto"``: see :func:`fastprefill.host.resolve_dtype`) for a
    command that runs it, its decoder blocks compiled and its linear weights packed unless
    ``compile=False`` (see :func:`fastprefill.models.load`, and its ``processes``: the server's
    rank pool holds the model too); with a ``row_floor`` (``--row-floor``)
    packed whatever the dtype, and the floor set (:func:`fastprefill.models.row_floor.set_row_floor`).
    The process keeps freed memory for reuse from here on (:func:`fastprefill.host.keep_freed_memory`)."""
    from fastprefill.host import keep_freed_memory
    from fastprefill.models import load
    from fastprefill.models.row_floor import set_row_floor

    keep_freed_memory()
    with console.status(f"loading {model} ..."):
        loaded = load(model, device=device, dtype=dtype, compile=compile, pack=True if row_floor is not None else compile,
                      processes=processes)
        if row_floor is not None:
            set_row_floor(loaded[0], row_floor)
        return loaded


def _print_json(data: Any) -> None:
    """One JSON document on stdout (plain print: no wrapping, no markup)."""
    print(json.dumps(data, ensure_ascii=False))


def sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling options of ``generate`` (see :class:`fastprefill.sampling.SamplingParams`;
    none given: greedy decoding)."""
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, help="seed of the sampling generator (same seed, same text)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable); cut from the answer")
    g.add_argument("--min-tokens", type=int, default=0, help="no end token or stop string before this many tokens")
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    g.add_argument("--logprobs", type=int, help="with --json: each token's log-probability and this many alternatives")


def sampling_params(args: argparse.Namespace) -> Any:
    """The :class:`~fastprefill.sampling.SamplingParams` of ``args`` (:func:`sampling_args`).

    Raises:
        ConfigError: a value out of range, naming the field.
    """
    from fastprefill.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, stop=tuple(args.stop), min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def _names(registry: Any) -> str:
    """The names of a registry, comma-separated, for a help text."""
    return ", ".join(registry)
