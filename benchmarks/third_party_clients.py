"""Clients the project did not write, against ``fastprefill serve``: lm-evaluation-harness
(``local-chat-completions`` on a generation task, ``local-completions`` on a log-likelihood
task), guidellm (a TTFT/throughput sweep) and LangChain's ``ChatOpenAI`` (a multi-turn
conversation over the prefix cache); lm-eval's answers set beside the engine's in this process.

The clients live in their own venv (``benchmarks/clients/requirements.txt``), never in the
library's dependencies; ``--venv`` names it (default: the checkout's ``.venv-clients``)::

    python -m venv .venv-clients
    .venv-clients/bin/pip install -r benchmarks/clients/requirements.txt

Everything is offline: the clients run with ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1``,
their tokenizer is the zoo's prepared folder of ``--model``, and the data are the packaged SQuAD
v2 dev questions. Each client runs as its documentation says, from its command line (lm-eval,
guidellm) or its Python API with its defaults (LangChain); the method is the server's
``--method`` (no client can send the ``fastprefill`` body field).

The questions are the project's ``singledoc-qa`` test prompts (``fastprefill.data.tasks``) of
``--length`` tokens: an answerable SQuAD question after its paragraph among others, LongBench's
"only give me the answer" instruction. They are written as JSON lines beside two lm-eval task
configs (``--include_path``):

- ``fastprefill_squad_gen`` (``generate_until``): the prompt as the user message (the server
  applies the chat template), greedy, cut at the first newline, at most ``--max-tokens``; exact match
  against any gold answer (case and punctuation ignored, the answer stripped);
- ``fastprefill_squad_ll`` (``loglikelihood``): the log-likelihood of the first gold answer
  after the same prompt as raw text (``echo`` with ``logprobs``: the server scores the prompt's
  tokens); perplexity and ``acc`` (whether the answer is the greedy continuation).

For each ``--methods`` spec the script starts two servers, one after the other:

1. ``--prefix-cache-mb 0 --prefill-chunk`` >= the prompt: each prompt is computed whole and
   alone, as :func:`fastprefill.engine.generate` computes it. lm-eval runs both tasks here
   (``--log_samples``).
2. the server's defaults (interleaved scheduler, 512-token prefill chunks) with a 256 MiB prefix
   cache: LangChain's conversation (``benchmarks/clients/langchain_chat.py``; turn 2 on should
   report ``cached_tokens``), then guidellm: ``--guidellm-streams`` concurrent streams (one
   benchmark each, ``--guidellm-seconds`` long) of synthetic prompts of
   ``--guidellm-prompt-tokens`` tokens and ``--guidellm-output-tokens`` output tokens
   (``ignore_eos``), over ``/v1/chat/completions`` with streaming.

Then, with the servers closed, the model is loaded here (same ``--threads``, same ``--dtype``)
and lm-eval's own requests (from its sample logs) are run again in-process: each generation
prompt through :func:`~fastprefill.engine.generate` (the one user message with ``chat=True``,
the server's method for the spec, greedy, lm-eval's stop strings and token limit); each
log-likelihood pair, tokenized as lm-eval does, with full prefill (the server scores an echoed
prompt with full prefill whatever the method) two ways: one forward pass of the model over
context + continuation, and :func:`fastprefill.sampling.prompt_logprobs`, the server's own
scoring (256-token chunks over the K/V of the ones before, which in bfloat16 rounds differently
from one pass; ``--dtype float32`` for the two to agree closely). Per method ``third_party_clients.json``
holds lm-eval's scores beside the same scores of the in-process answers, how many answers are
identical, the largest |log-likelihood difference| each way, the project's own SQuAD F1 and
exact match of both sides' answers, guidellm's TTFT p50/p99 and output tokens/s per stream
count, and LangChain's cached tokens per turn (a LazyLLM server stores nothing in the prefix
cache, docs/prefix-cache.md, so its conversation never hits). The in-process side is
``client_inprocess.py``; every score of a row keeps the per-sample records it is made from
(``gen.inprocess.samples``, ``ll.inprocess.samples``), and ``python benchmarks/verify.py`` makes
them again from those and the clients' files in the method's folder (``client_scores.py``).

Smoke run (about 10 minutes on 2 quiet cores; on a machine busy with other work far longer,
and ``--threads 1`` suffers least there)::

    python benchmarks/third_party_clients.py --model smollm2-135m --methods full lazyllm:preset=default \\
        --limit 8 --guidellm-seconds 20 --guidellm-streams 1 2 --out /tmp/clients

Measured run (about 30 minutes on 2 quiet cores)::

    python benchmarks/third_party_clients.py --model qwen2.5-coder-0.5b --methods full lazyllm:preset=default \\
        --limit 50 --length 1024 --out benchmarks/results/third_party_clients
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client_inprocess import compare_ll, inprocess_gen, inprocess_ll, ll_pair, read_samples
from client_scores import GEN_METRIC, folder_of, guidellm_summary, langchain_summary, scores_equal
from fastprefill.data.tasks import build_samples
from fastprefill.models import zoo
from serve_load import ServerProcess

HERE = Path(__file__).resolve().parent
CLIENTS = HERE / "clients"
GEN, LL = "fastprefill_squad_gen", "fastprefill_squad_ll"
MARK = "\x00FASTPREFILL-USER\x00"

GEN_TASK = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: user
doc_to_target: answers
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
"""

LL_TASK = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: user
doc_to_target: answer
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


# --------------------------------------------------------------------------- the tasks


def user_turn(tokenizer: Any, prompt: str) -> str:
    """The user message inside ``prompt``, a sample rendered with ``tokenizer``'s chat template
    (the template's text around a marker message is cut off both ends)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=True,
                                             tokenize=False)
    head, _, tail = rendered.partition(MARK)
    if not (prompt.startswith(head) and prompt.endswith(tail)):
        raise SystemExit("the sample's prompt is not one user turn of the chat template")
    return prompt[len(head): len(prompt) - len(tail)]


def write_tasks(folder: Path, tokenizer: Any, length: int, n: int, max_tokens: int) -> list[dict[str, Any]]:
    """The first ``n`` ``singledoc-qa`` test samples of ``length`` tokens as JSON lines (the user
    message, the gold answers) and the two task configs in ``folder``; the rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in build_samples("singledoc-qa", tokenizer, length, n):
        user = user_turn(tokenizer, s.prompt)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                            tokenize=False)
        assert rendered == s.prompt, "the user message does not render back to the sample's prompt"
        rows.append({"id": s.id, "question": s.meta["question"], "user": user, "answers": list(s.answers),
                     "answer": s.answers[0], "prompt_tokens": len(s.input_ids)})
    data = folder / "squad.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (folder / f"{GEN}.yaml").write_text(GEN_TASK.format(task=GEN, data=data, max_tokens=max_tokens))
    (folder / f"{LL}.yaml").write_text(LL_TASK.format(task=LL, data=data))
    return rows


# --------------------------------------------------------------------------- the clients


def client_env() -> dict[str, str]:
    """The clients' environment: offline (nothing from the hub; the tokenizer is a local folder)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


STARTED = time.perf_counter()


def note(text: str) -> None:
    """Progress on stderr, with the minutes since the start."""
    print(f"[{(time.perf_counter() - STARTED) / 60:5.1f} min] {text}", file=sys.stderr, flush=True)


def run_logged(cmd: Sequence[str], log: Path) -> float:
    """Run a client, its output into ``log``; its wall time. A failure names the log's end."""
    note(f"{Path(cmd[0]).name} {cmd[1] if len(cmd) > 1 else ''} (output: {log})")
    t0 = time.perf_counter()
    with log.open("wb") as f:
        proc = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=client_env(), check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{Path(cmd[0]).name} failed ({proc.returncode}); the end of {log}:\n{tail}")
    return time.perf_counter() - t0


def context_length(server: ServerProcess) -> int:
    """The served model's context (``/v1/models``), for lm-eval's ``max_length``."""
    listed = server.client().models.list()
    return int(getattr(listed.data[0], "context_length", None) or 2048)


def lm_eval(kind: str, task: str, server: ServerProcess, tasks: Path, out: Path, tokenizer: Path,
            venv: Path) -> dict[str, Any]:
    """One lm-eval run (``kind``: ``local-chat-completions`` or ``local-completions``) with its
    samples logged; its results for ``task``, the wall time and the samples' file."""
    route = "chat/completions" if kind == "local-chat-completions" else "completions"
    model_args = f"model={server.model},base_url={server.url}/{route},num_concurrent=1,max_retries=1"
    extra = ["--apply_chat_template"]
    if kind == "local-completions":
        model_args += (f",tokenizer={tokenizer},tokenizer_backend=huggingface,tokenized_requests=True"
                       f",max_length={context_length(server)}")
        extra = []
    out.mkdir(parents=True, exist_ok=True)
    seconds = run_logged([str(venv / "bin" / "lm_eval"), "run", "--model", kind, "--model_args", model_args,
                          "--tasks", task, "--include_path", str(tasks), "--output_path", str(out), "--log_samples",
                          *extra], out / "lm_eval.log")
    results = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    samples = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    return {"results": json.loads(results.read_text())["results"][task], "seconds": seconds,
            "samples_file": str(samples)}


def guidellm(server: ServerProcess, tokenizer: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """guidellm's concurrent profile, one benchmark per stream count; its JSON report and the
    summary per stream count (TTFT p50/p99 of the successful requests, output tokens/s)."""
    report = out / "guidellm.json"
    streams = ",".join(str(s) for s in args.guidellm_streams)
    cmd = [str(args.venv / "bin" / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={server.url},model={server.model}",
           "--profile", f"kind=concurrent,streams={args.guidellm_streams[0]}",
           "--override", "profile.streams", streams,
           "--constraint", f"kind=max_duration,seconds={args.guidellm_seconds:g}",
           "--data", (f"kind=synthetic_text,prompt_tokens={args.guidellm_prompt_tokens}"
                      f",output_tokens={args.guidellm_output_tokens}"),
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    seconds = run_logged(cmd, out / "guidellm.log")
    return {"command": cmd, "seconds": seconds, "report": str(report),
            "rows": guidellm_summary(json.loads(report.read_text()))}


def langchain(server: ServerProcess, venv: Path, out: Path) -> dict[str, Any]:
    """LangChain's ``ChatOpenAI`` conversation; its turns' usage."""
    path = out / "langchain.json"
    cmd = [str(venv / "bin" / "python"), str(CLIENTS / "langchain_chat.py"), "--base-url", server.url,
           "--model", server.model, "--out", str(path)]
    seconds = run_logged(cmd, out / "langchain.log")
    return {"seconds": seconds, **langchain_summary(json.loads(path.read_text()))}


def run_clients(spec: str, args: argparse.Namespace, tasks: Path, tokenizer: Path) -> dict[str, Any]:
    """Every client against the servers of one method spec (see the module docstring)."""
    folder = folder_of(args.out, spec)
    folder.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"method": spec}
    whole = max(512, args.length + args.max_tokens)  # no prompt of the tasks is cut into chunks
    exact = ["--method", spec, "--prefill-chunk", str(whole)]
    if "lm-eval" in args.clients:
        server = ServerProcess(args.model, args.threads, queue=4, max_tokens=64, extra=exact, prefix_cache_mb=0,
                               log=folder / "server_exact.log", dtype=args.dtype)
        try:
            note(f"{spec}: server without prefix cache, whole prefill")
            server.wait_ready()
            row["server_exact"] = server.cmd[2:]
            row["gen"] = lm_eval("local-chat-completions", GEN, server, tasks, folder / "gen", tokenizer, args.venv)
            row["ll"] = lm_eval("local-completions", LL, server, tasks, folder / "ll", tokenizer, args.venv)
        finally:
            server.close()
    if {"langchain", "guidellm"} & set(args.clients):
        queue = max(4, 2 * max(args.guidellm_streams))
        server = ServerProcess(args.model, args.threads, queue=queue, max_tokens=64,
                               extra=["--method", spec], prefix_cache_mb=256, log=folder / "server_default.log",
                               dtype=args.dtype)
        try:
            note(f"{spec}: server with its defaults and a prefix cache")
            server.wait_ready()
            row["server_default"] = server.cmd[2:]
            if "langchain" in args.clients:
                row["langchain"] = langchain(server, args.venv, folder)
            if "guidellm" in args.clients:
                row["guidellm"] = guidellm(server, tokenizer, args, folder)
        finally:
            server.close()
    return row


# --------------------------------------------------------------------------- in this process


def inprocess(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The in-process side of every row that ran lm-eval (the servers are closed by now)."""
    from fastprefill import load_model
    from fastprefill.bench.records import environment
    from fastprefill.host import set_threads

    set_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    ll_samples = {r["method"]: read_samples(r["ll"]["samples_file"]) for r in rows if "ll" in r}
    pairs = sorted({ll_pair(s) for samples in ll_samples.values() for s in samples})
    note(f"in-process: {len(pairs)} log-likelihoods")
    ours = inprocess_ll(model, tok, pairs)
    for r in rows:
        if "gen" in r:
            note(f"in-process: lm-eval's generation prompts with {r['method']}")
            samples = read_samples(r["gen"]["samples_file"])
            gen = r["gen"]["inprocess"] = inprocess_gen(model, tok, r["method"], samples)
            lm_score = r["gen"]["results"].get(GEN_METRIC)
            assert lm_score is None or abs(lm_score - gen["exact_match_lm_eval"]) < 1e-9, \
                "lm-eval's aggregate is not the mean of its samples' scores"
            r["gen"]["scores_equal"] = scores_equal("gen", gen, r["gen"]["results"])
        if "ll" in r:
            ll = r["ll"]["inprocess"] = compare_ll(ll_samples[r["method"]], ours, r["ll"]["results"])
            r["ll"]["scores_equal"] = scores_equal("ll", ll, r["ll"]["results"])
    return environment(args.threads, model)


# --------------------------------------------------------------------------- main


def summary_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for r in doc["rows"]:
        lines.append(f"== {r['method']}")
        if "gen" in r:
            g = r["gen"].get("inprocess", {})
            lines.append(f"  lm-eval gen: exact match {r['gen']['results'].get(GEN_METRIC)}"
                         f"; in-process {g.get('exact_match_inprocess')};"
                         f" identical {g.get('identical')}/{g.get('n')}")
        if "ll" in r:
            ll = r["ll"].get("inprocess", {})
            lines.append(f"  lm-eval ll: perplexity {r['ll']['results'].get('perplexity,none')}"
                         f" acc {r['ll']['results'].get('acc,none')}; in-process, one pass: perplexity"
                         f" {ll.get('perplexity_inprocess')} acc {ll.get('acc_inprocess')}"
                         f" max |loglik diff| {ll.get('max_abs_loglik_diff')}; in-process, prompt_logprobs:"
                         f" perplexity {ll.get('perplexity_inprocess_chunked')}"
                         f" acc {ll.get('acc_inprocess_chunked')}"
                         f" max |loglik diff| {ll.get('max_abs_loglik_diff_chunked')}")
        if "langchain" in r:
            lines.append(f"  langchain cached tokens per turn {r['langchain']['cached_tokens']}"
                         f" of {r['langchain']['prompt_tokens']}")
        for g in r.get("guidellm", {}).get("rows", []):
            lines.append(f"  guidellm {g['strategy']}@{g['streams']}: TTFT p50 {g['ttft_p50_ms']:.0f} ms"
                         f" p99 {g['ttft_p99_ms']:.0f} ms, {g['output_tokens_per_s']:.1f} output tok/s,"
                         f" requests {g['requests']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="lm-eval, guidellm and LangChain against fastprefill serve; lm-eval's "
                                            "answers beside the engine's in this process")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", nargs="+", default=["full", "lazyllm:preset=default"])
    p.add_argument("--limit", type=int, default=50, help="SQuAD questions per lm-eval task")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens of the SQuAD questions (singledoc-qa)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens at most (generation task)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the servers' and this process's (auto: bfloat16 where the CPU multiplies it natively)")
    p.add_argument("--clients", nargs="+", choices=["lm-eval", "guidellm", "langchain"],
                   default=["lm-eval", "guidellm", "langchain"])
    p.add_argument("--guidellm-streams", nargs="+", type=int, default=[1, 2, 4],
                   help="concurrent streams, one guidellm benchmark each")
    p.add_argument("--guidellm-seconds", type=float, default=30, help="duration of each guidellm benchmark")
    p.add_argument("--guidellm-prompt-tokens", type=int, default=512)
    p.add_argument("--guidellm-output-tokens", type=int, default=64)
    p.add_argument("--venv", type=Path, default=HERE.parent / ".venv-clients", help="the clients' venv")
    p.add_argument("--out", type=Path, default=HERE / "results" / "third_party_clients")
    p.add_argument("--inprocess-only", action="store_true",
                   help="no servers, no clients: run the in-process side again over the lm-eval samples that "
                        "--out's third_party_clients.json names, and rewrite it (same --model, --threads, --dtype)")
    args = p.parse_args(argv)
    if args.inprocess_only:
        return rerun_inprocess(args)
    for tool in ("lm_eval", "guidellm", "python"):
        if not (args.venv / "bin" / tool).exists():
            raise SystemExit(f"no {args.venv}/bin/{tool}: install the clients"
                             " (benchmarks/clients/requirements.txt)")
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = zoo.prepare(args.model)
    tasks = args.out / "tasks"
    questions = write_tasks(tasks, AutoTokenizer.from_pretrained(tokenizer), args.length, args.limit,
                            args.max_tokens)
    rows = [run_clients(spec, args, tasks, tokenizer) for spec in args.methods]
    env = inprocess(rows, args) if any("gen" in r for r in rows) else served_environment(args)
    doc = {"model": args.model, "limit": args.limit, "length": args.length, "questions": len(questions),
           "clients": client_versions(args.venv), "environment": env,
           "seconds": time.perf_counter() - started, "rows": rows}
    (args.out / "third_party_clients.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    print("\n".join(summary_lines(doc)))
    return 0


def served_environment(args: argparse.Namespace) -> dict[str, Any]:
    """The environment record of a run without an in-process side (its servers' dtype and
    threads, the machine's bfloat16 capability, the command), as every timing carries."""
    from fastprefill.bench.records import environment
    from fastprefill.host import resolve_dtype

    return environment(args.threads, resolve_dtype(args.dtype))


def rerun_inprocess(args: argparse.Namespace) -> int:
    """The in-process side again, from the lm-eval samples a finished run logged: the clients'
    records are kept, the in-process ones replaced, and the rerun's command recorded."""
    path = args.out / "third_party_clients.json"
    if not path.exists():
        raise SystemExit(f"no {path}: run the clients first (without --inprocess-only)")
    doc = json.loads(path.read_text())
    if doc["model"] != args.model:
        raise SystemExit(f"{path} was run on {doc['model']}, not {args.model}: pass --model {doc['model']}")
    started = time.perf_counter()
    doc["environment"] = inprocess(doc["rows"], args)
    doc["inprocess_rerun"] = {"command": "python " + " ".join(sys.argv), "seconds": time.perf_counter() - started}
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    print("\n".join(summary_lines(doc)))
    return 0


def client_versions(venv: Path) -> dict[str, str]:
    """The versions of the clients as installed in ``venv``."""
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('lm_eval', 'guidellm', 'langchain-openai', 'langchain-core', 'openai', 'transformers')}))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
