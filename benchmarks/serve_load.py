"""Load on ``fastprefill serve``: TTFT p50/p95 and throughput at 1, 2 and 4 concurrent clients,
and the server's own overhead against the engine called in-process.

For each model the script starts ``fastprefill serve`` as a subprocess on 127.0.0.1 (a free
port; loopback only) and loads the same model in this process. For each prompt length it builds
``--requests`` multidoc-qa prompts of that many tokens (``fastprefill.data.tasks``, test split)
and, for each method (sent per request in the ``fastprefill`` body field):

- **overhead** (concurrency 1): prompt by prompt, the engine in this process
  (:func:`fastprefill.engine.generate`, its TTFT, on one worker thread like the server's) and
  the same prompt through the server, one after the other (the server never works while this
  process does), which first alternating by prompt, so drift hits both alike.
  ``overhead = median(server TTFT) / median(in-process TTFT)``, with the median of per-prompt
  ratios beside it (goal <= 1.05). ``transport`` = the median of client TTFT / the server's
  engine TTFT per request: what HTTP, the queue and the stream add, measured in one process.
- **load** (each ``--concurrency`` above 1): that many client threads send the prompts as fast
  as answers come back; wall time from the first request to the last answer.

Server TTFT is the client's clock: from sending the streamed request (``/v1/completions``, the
prompt's text) to the first token's chunk, so HTTP, JSON, tokenization, the queue hand-off and
the stream are all inside; the server's own engine TTFT and queue wait (its usage block) are
recorded beside. Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``), so
throughput compares like with like. One warm-up request per method and client kind is
discarded. Both processes use ``--threads`` torch threads and load the model in ``--dtype``
(default ``auto``: :func:`fastprefill.host.resolve_dtype`).

Measured run (the lead schedules it; on a quiet machine)::

    python benchmarks/serve_load.py --models smollm2-135m qwen2.5-coder-0.5b --lengths 1024 2048 \\
        --methods full lazyllm:preset=default --concurrency 1 2 4 --requests 4 --max-tokens 16 --threads 2

Smoke run (a minute)::

    python benchmarks/serve_load.py --models smollm2-135m --lengths 512 --requests 2 --max-tokens 4 \\
        --concurrency 1 2 --out /tmp/serve_load
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openai

from fastprefill.bench.records import environment, result_name
from fastprefill.data.tasks import Sample, get_task
from fastprefill.engine import generate
from fastprefill.errors import FastprefillError
from fastprefill.host import DTYPES, keep_freed_memory, resolve_dtype, set_threads
from fastprefill.models import load as load_model
from fastprefill.runtime import free_port
from fastprefill.serve.config import serving_method
from reporting import write_json, write_rows

GOAL = 1.05


@dataclass
class LoadRecord:
    """One request (``kind``: ``inproc`` = the engine in this process, ``server`` = over HTTP)."""

    model: str
    length: int
    method: str
    kind: str
    concurrency: int
    sample_id: str
    prompt_tokens: int
    ttft_s: float
    total_s: float
    completion_tokens: int
    server_ttft_s: float | None = None
    server_queue_wait_s: float | None = None
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class ServerProcess:
    """``fastprefill serve`` in a subprocess on a free loopback port.

    By default without a prefix cache (the load cells send the same prompts again, and every
    prefill must be computed) and with a request timeout of an hour. ``log``: a file that takes
    the server's stderr (else a pipe, read only if the server fails to start: a long run that
    logs must give a file, or a full pipe stops the server). ``dtype``: the server's ``--dtype``."""

    def __init__(self, model: str, threads: int, queue: int, max_tokens: int, extra: Sequence[str] = (), *,
                 timeout_s: float = 3600, prefix_cache_mb: float = 0, log: Path | None = None,
                 dtype: str = "auto") -> None:
        self.port = free_port()
        self.model = model
        self.log = log
        self.cmd = [sys.executable, "-m", "fastprefill.cli", "serve", "--model", model, "--port", str(self.port),
                    "--threads", str(threads), "--dtype", dtype, "--queue", str(queue),
                    "--timeout", f"{timeout_s:g}", "--max-tokens", str(max_tokens), "--log-level", "warning",
                    "--prefix-cache-mb", f"{prefix_cache_mb:g}", *extra]
        if log is None:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        else:
            with log.open("wb") as err:  # the child holds its own copy of the descriptor
                self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=err)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stderr_tail(self, chars: int = 2000) -> str:
        """The end of what the server wrote to stderr (once it has exited, when it goes to a pipe)."""
        if self.log is not None:
            return self.log.read_text(errors="replace")[-chars:]
        return self.proc.stderr.read().decode(errors="replace")[-chars:]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=3600)

    def wait_ready(self, timeout: float = 900.0) -> None:
        client, deadline = self.client(), time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.stderr_tail()}")
            try:
                client.models.list()
                return
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start in time") from None
                time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _server_request(client: openai.OpenAI, model: str, prompt: str | list[int], spec: str,
                    max_tokens: int) -> dict[str, Any]:
    """One streamed completion; the client's TTFT (to the first token's chunk) and the usage block."""
    t0 = time.perf_counter()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"fastprefill": {"method": spec, "ignore_eos": True}})
    ttft, parts, usage = None, [], None
    for chunk in stream:
        if chunk.choices:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].text)
        elif chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    assert ttft is not None and usage is not None, "the stream ended without a token or usage"
    fp = usage.fastprefill
    return {"ttft_s": ttft, "total_s": total, "completion_tokens": usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens, "server_ttft_s": fp["ttft_s"],
            "server_queue_wait_s": fp["queue_wait_s"], "text": "".join(parts), "method": fp["method"]}


def ask_chat(client: openai.OpenAI, model: str, content: str, max_tokens: int, ignore_eos: bool = False,
             on_first: Callable[[float], None] | None = None) -> dict[str, Any]:
    """One streamed chat completion (one user message): the client's TTFT (sending it to the first
    content chunk), total, text, the longest gap between two chunks and the usage block's counts
    (``cached_tokens``; the server's ``ttft_s``, ``queue_wait_s`` and ``prefix_cache``).
    ``on_first`` is called with :func:`time.perf_counter` at the first content chunk, while the
    answer still streams."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                                            extra_body={"fastprefill": {"ignore_eos": ignore_eos}})
    ttft, parts, usage, arrivals = None, [], None, []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            arrivals.append(time.perf_counter())
            if ttft is None:
                ttft = arrivals[0] - t0
                if on_first is not None:
                    on_first(arrivals[0])
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert ttft is not None and usage is not None, "the stream ended without a token or usage"
    fp = usage.model_extra["fastprefill"]
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "completion_tokens": usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "server_ttft_s": fp["ttft_s"], "queue_wait_s": fp["queue_wait_s"], "text": "".join(parts),
            "max_gap_s": max((b - a for a, b in itertools.pairwise(arrivals)), default=None),
            "prefix_cache": fp.get("prefix_cache")}


def serve_header(args: argparse.Namespace, bench: str, **extra: Any) -> dict[str, Any]:
    """The header of a serving benchmark's record: the machine and the dtype ``--dtype`` resolves
    to, ``bench``, the model, every argument but the output's (``--out``, ``--name``), the
    server's extra flags (``--server-arg``) and ``--dtype`` as given, then ``extra``."""
    return {**environment(args.threads, resolve_dtype(args.dtype)), "bench": bench, "model": args.model,
            **{k: v for k, v in vars(args).items() if k not in ("model", "out", "name", "dtype", "server_arg")},
            "server_args": args.server_arg, "dtype_arg": args.dtype, **extra}


def save_serve_record(args: argparse.Namespace, header: dict[str, Any], rows: Sequence[dict[str, Any]],
                      text: str) -> Path:
    """Write ``<stem>.jsonl`` (``header``, then ``rows``) and ``<stem>.md`` (``text``) in ``--out``,
    the stem ``--name`` or ``<bench>_<model>`` (``-`` in the bench's name as ``_``; a new name if
    taken); print ``text``. Returns the ``.md``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_name(out, f"{header['bench'].replace('-', '_')}_{args.model}", name=args.name)
    write_rows(out / f"{stem}.jsonl", header, rows)
    (out / f"{stem}.md").write_text(text)
    print(text)
    return out / f"{stem}.md"


def _wire_prompt(tok: Any, sample: Sample) -> str | list[int]:
    """The sample's text when the server's tokenization of it gives the sample's ids, else the ids."""
    return sample.prompt if tok(sample.prompt)["input_ids"] == list(sample.input_ids) else list(sample.input_ids)


#: The in-process side of a cell: ``(input_ids, method, max_tokens) -> result`` with ``.text``,
#: ``.token_ids`` and ``.timing`` (``prompt_tokens``, ``ttft_s``, ``total_s``), as ``generate`` gives.
InProcess = Callable[[Any, Any, int], Any]


def run_model(name: str, args: argparse.Namespace, server_args: Sequence[str] = (),
              inproc: InProcess | None = None) -> list[LoadRecord]:
    """Every cell of ``args.methods`` on model ``name``: ``fastprefill serve`` started with
    ``server_args`` against ``inproc`` (default: :func:`generate` on one worker thread)."""
    model, tok = load_model(name, dtype=args.dtype)
    server = ServerProcess(name, args.threads, queue=max(args.concurrency) * 2, max_tokens=args.max_tokens,
                           extra=server_args, dtype=args.dtype)
    records: list[LoadRecord] = []
    # The in-process engine runs with the server's thread structure (model loaded on the main
    # thread, generation on one worker thread), so the two sides differ only by the server.
    engine = ThreadPoolExecutor(1, thread_name_prefix="inproc-engine", initializer=set_threads,
                                initargs=(args.threads,))
    if inproc is None:
        def inproc(ids: Any, method: Any, max_tokens: int) -> Any:
            return engine.submit(generate, model, tok, ids, method, max_tokens, stop_at_eos=False).result()
    try:
        server.wait_ready()
        client = server.client()
        for length in args.lengths:
            samples = get_task("multidoc-qa").build(tok, length, args.requests, split="test", seed=args.seed)
            wire = [_wire_prompt(tok, s) for s in samples]
            for spec in args.methods:
                method = serving_method(spec)  # what the server runs for spec (LazyLLM: revival=none)
                label = method.describe()
                # warm-up, discarded: one in-process, one over HTTP
                inproc(samples[0].input_ids, method, args.max_tokens)
                _server_request(client, name, wire[0], spec, args.max_tokens)
                for i, (s, w) in enumerate(zip(samples, wire, strict=True)):  # overhead: one at a time
                    pair: list[LoadRecord] = []
                    for kind in ("inproc", "server") if i % 2 == 0 else ("server", "inproc"):  # alternating
                        if kind == "inproc":
                            res = inproc(s.input_ids, method, args.max_tokens)
                            t = res.timing
                            pair.append(LoadRecord(name, length, label, "inproc", 1, s.id, t.prompt_tokens, t.ttft_s,
                                                   t.total_s, len(res.token_ids), text=res.text))
                            continue
                        r = _server_request(client, name, w, spec, args.max_tokens)
                        if r["prompt_tokens"] != len(s.input_ids):
                            raise RuntimeError(f"the server saw {r['prompt_tokens']} prompt tokens, not "
                                               f"{len(s.input_ids)}")
                        pair.append(_server_record(name, length, label, 1, s, r))
                    records.extend(pair)
                for conc in (c for c in args.concurrency if c > 1):
                    records.extend(_load(server, name, length, label, spec, conc, samples, wire, args.max_tokens))
                print(f"{name} {length} {label}: done", file=sys.stderr, flush=True)
    finally:
        server.close()
        engine.shutdown()
    return records


def _server_record(name: str, length: int, label: str, conc: int, s: Sample, r: dict[str, Any],
                   extra: dict[str, Any] | None = None) -> LoadRecord:
    return LoadRecord(name, length, label, "server", conc, s.id, r["prompt_tokens"], r["ttft_s"], r["total_s"],
                      r["completion_tokens"], r["server_ttft_s"], r["server_queue_wait_s"], r["text"],
                      extra or {})


def _load(server: ServerProcess, name: str, length: int, label: str, spec: str, conc: int,
          samples: list[Sample], wire: list[str | list[int]], max_tokens: int) -> list[LoadRecord]:
    """``conc`` client threads draining the prompts; each record holds the cell's wall time."""
    todo = list(range(len(samples)))
    lock = threading.Lock()
    results: list[tuple[int, dict[str, Any]]] = []
    errors: list[Exception] = []

    def client_loop() -> None:
        client = server.client()
        while True:
            with lock:
                if not todo or errors:
                    return
                i = todo.pop(0)
            try:
                r = _server_request(client, name, wire[i], spec, max_tokens)
            except Exception as exc:  # noqa: BLE001 - any failure is re-raised after the join
                errors.append(exc)
                return
            with lock:
                results.append((i, r))

    threads = [threading.Thread(target=client_loop) for _ in range(conc)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return [_server_record(name, length, label, conc, samples[i], r, {"wall_s": wall}) for i, r in results]


# --- report ------------------------------------------------------------------------------------
def summarize(records: list[LoadRecord]) -> list[dict[str, Any]]:
    """One row per (model, length, method, concurrency) of server runs, with the overhead at 1."""
    rows = []
    keys = sorted({(r.model, r.length, r.method, r.concurrency) for r in records if r.kind == "server"})
    for model, length, method, conc in keys:
        cell = [r for r in records if (r.model, r.length, r.method, r.concurrency, r.kind)
                == (model, length, method, conc, "server")]
        ttft = np.array([r.ttft_s for r in cell])
        wall = cell[0].extra.get("wall_s") or sum(r.total_s for r in cell)
        row = {
            "model": model, "length": length, "method": method, "concurrency": conc, "n": len(cell),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p95_s": float(np.percentile(ttft, 95)),
            "server_engine_ttft_p50_s": float(np.median([r.server_ttft_s for r in cell])),
            "queue_wait_p50_s": float(np.median([r.server_queue_wait_s for r in cell])),
            "requests_per_s": len(cell) / wall, "tokens_per_s": sum(r.completion_tokens for r in cell) / wall,
        }
        if conc == 1:
            inproc = {r.sample_id: r for r in records if (r.model, r.length, r.method, r.kind)
                      == (model, length, method, "inproc")}
            base = float(np.median([r.ttft_s for r in inproc.values()]))
            row["inproc_ttft_p50_s"] = base
            row["overhead"] = row["ttft_p50_s"] / base
            row["overhead_paired_median"] = statistics.median(r.ttft_s / inproc[r.sample_id].ttft_s for r in cell)
            row["transport_overhead"] = statistics.median(r.ttft_s / r.server_ttft_s for r in cell)
            row["same_text"] = all(r.text == inproc[r.sample_id].text for r in cell)
        rows.append(row)
    return rows


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        f"# fastprefill serve under load ({header['started']})", "",
        f"`{header['command']}`", "",
        (f"{header['cpu']}, {header['threads']} torch threads in the server and in-process; torch "
        f"{header['torch']}, transformers {header['transformers']}, commit {header['git_commit']}. "
        f"{header['requests']} multidoc-qa prompts per cell, {header['max_tokens']} generated tokens each "
        "(ignore_eos). TTFT is the client's clock (request sent -> first token's chunk, over loopback HTTP); "
        "engine TTFT is what the server's engine measured; throughput = answers / wall time of the cell "
         "(at 1 client: / the summed request times). "
        f"Overhead = server TTFT p50 / in-process engine TTFT p50 at concurrency 1 (goal <= {GOAL}); "
        "transport = median of client TTFT / the server's engine TTFT (the same requests)."), "",
        ("| model | prompt | method | clients | n | TTFT p50 (s) | TTFT p95 (s) | engine TTFT p50 (s) | "
        "queue wait p50 (s) | req/s | tokens/s | in-process TTFT p50 (s) | overhead (paired) | transport | "
         "same answers |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        over = (f"{r['overhead']:.3f} ({r['overhead_paired_median']:.3f})"
                f"{'' if r['overhead'] <= GOAL else ' ✗'}") if "overhead" in r else ""
        lines.append(
            f"| {r['model']} | {r['length']} | {r['method']} | {r['concurrency']} | {r['n']} | "
            f"{r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | {r['server_engine_ttft_p50_s']:.3f} | "
            f"{r['queue_wait_p50_s']:.3f} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{_num(r.get('inproc_ttft_p50_s'))} | {over} | {_num(r.get('transport_overhead'))} | "
            f"{r.get('same_text', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024])
    p.add_argument("--methods", nargs="+", default=["full", "lazyllm:preset=default"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--requests", type=int, default=8, help="prompts per cell (each sent once per concurrency)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="the model's dtype in the server and in-process (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file stem (default serve_load_<models>)")
    args = p.parse_args(argv)
    if 1 not in args.concurrency:
        p.error("--concurrency must include 1 (the overhead is measured there)")
    if args.requests < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        p.error("--requests, --max-tokens and --concurrency must be >= 1")
    keep_freed_memory()
    set_threads(args.threads)
    header = {**environment(args.threads, resolve_dtype(args.dtype)), "models": args.models, "lengths": args.lengths,
              "methods": args.methods, "concurrency": args.concurrency, "requests": args.requests,
              "max_tokens": args.max_tokens, "task": "multidoc-qa", "split": "test", "seed": args.seed,
              "goal_overhead": GOAL}
    try:
        records = [r for name in args.models for r in run_model(name, args)]
    except FastprefillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    stem = result_name(out, "serve_load_" + "_".join(args.models), name=args.name)
    write_rows(out / f"{stem}.jsonl", header, [dataclasses.asdict(r) for r in records])
    rows = summarize(records)
    write_json(out / f"{stem}.summary.json", rows)
    (out / f"{stem}.md").write_text(markdown(rows, header))
    print(markdown(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
