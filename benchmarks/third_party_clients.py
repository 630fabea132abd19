"""Clients the project did not write, against ``fastprefill serve``: lm-evaluation-harness
(``local-chat-completions`` on a generation task, ``local-completions`` on a log-likelihood
task) and LangChain's ``ChatOpenAI`` (a multi-turn conversation over the prefix cache).

The clients live in their own venv (``benchmarks/clients/requirements.txt``), never in the
library's dependencies::

    python -m venv .venv-clients
    .venv-clients/bin/pip install -r benchmarks/clients/requirements.txt

For each ``--methods`` spec the script starts ``fastprefill serve --method SPEC`` on a free
loopback port (lm-eval cannot send the ``fastprefill`` body field, so the method is the
server's) and runs, with the clients' venv:

- ``lm_eval --model local-chat-completions`` on ``fastprefill_squad_gen``: the packaged SQuAD v2
  dev questions (offline: written here as JSON lines, a task config beside them), greedy, the
  answer cut at the first newline, exact match;
- ``lm_eval --model local-completions`` on ``fastprefill_squad_ll``: the log-likelihood of the
  gold answer after the same prompt (``echo`` with ``logprobs``: the server scores the prompt's
  tokens), perplexity and whether the answer is the greedy continuation;
- ``benchmarks/clients/langchain_chat.py`` (``ChatOpenAI`` with its defaults).

Everything lands in ``--out``: the tasks, lm-eval's own output folders, the LangChain turns and
``third_party_clients.json`` with the scores by method. A smoke run (a few minutes)::

    python benchmarks/third_party_clients.py --model smollm2-135m --methods full lazyllm:preset=default \\
        --limit 8 --out /tmp/clients
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from fastprefill.data.sources import squad
from fastprefill.models import zoo
from serve_load import ServerProcess

HERE = Path(__file__).resolve().parent
CLIENTS = HERE / "clients"
VENV = HERE.parent / ".venv-clients"
PROMPT = "Context: {{context}}\\nQuestion: {{question}}\\nAnswer:"

GEN_TASK = """task: fastprefill_squad_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{prompt}"
doc_to_target: "{{{{answers[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""

LL_TASK = """task: fastprefill_squad_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{prompt}"
doc_to_target: " {{{{answers[0]}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
"""


def write_tasks(folder: Path, n: int) -> Path:
    """The first ``n`` packaged SQuAD questions as JSON lines and the two task configs; the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "squad.jsonl"
    with data.open("w") as f:
        for q in squad()[:n]:
            f.write(json.dumps({"context": q.context, "question": q.question, "answers": list(q.answers)}) + "\n")
    (folder / "fastprefill_squad_gen.yaml").write_text(GEN_TASK.format(data=data, prompt=PROMPT))
    (folder / "fastprefill_squad_ll.yaml").write_text(LL_TASK.format(data=data, prompt=PROMPT))
    return folder


def lm_eval(kind: str, task: str, server: ServerProcess, tasks: Path, out: Path, tokenizer: Path) -> dict[str, Any]:
    """One lm-eval run (``kind``: ``local-chat-completions`` or ``local-completions``); its
    results for ``task``."""
    route = "chat/completions" if kind == "local-chat-completions" else "completions"
    model_args = f"model={server.model},base_url={server.url}/{route},num_concurrent=1,max_retries=1"
    extra = ["--apply_chat_template"]
    if kind == "local-completions":
        model_args += f",tokenizer={tokenizer},tokenizer_backend=huggingface,tokenized_requests=True"
        extra = []
    subprocess.run([str(VENV / "bin" / "lm_eval"), "--model", kind, "--model_args", model_args, "--tasks", task,
                    "--include_path", str(tasks), "--output_path", str(out), *extra], check=True)
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text())["results"][task]


def run_method(spec: str, args: argparse.Namespace, tasks: Path, tokenizer: Path) -> dict[str, Any]:
    folder = args.out / spec.replace(":", "_").replace(",", "_").replace("=", "-")
    folder.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model, args.threads, queue=4, max_tokens=64, extra=["--method", spec],
                           prefix_cache_mb=256, log=folder / "server.log")
    try:
        server.wait_ready()
        gen = lm_eval("local-chat-completions", "fastprefill_squad_gen", server, tasks, folder / "gen", tokenizer)
        ll = lm_eval("local-completions", "fastprefill_squad_ll", server, tasks, folder / "ll", tokenizer)
        subprocess.run([str(VENV / "bin" / "python"), str(CLIENTS / "langchain_chat.py"), "--base-url", server.url,
                        "--model", args.model, "--out", str(folder / "langchain.json")], check=True)
    finally:
        server.close()
    turns = json.loads((folder / "langchain.json").read_text())["turns"]
    return {"method": spec, "squad_gen": gen, "squad_ll": ll,
            "langchain_cached_tokens": [(t["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                                        for t in turns]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", nargs="+", default=["full", "lazyllm:preset=default"])
    p.add_argument("--limit", type=int, default=50, help="SQuAD questions per task")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results" / "third_party_clients")
    args = p.parse_args(argv)
    if not (VENV / "bin" / "lm_eval").exists():
        raise SystemExit(f"no {VENV}/bin/lm_eval: install the clients first (see benchmarks/clients/requirements.txt)")
    tasks = write_tasks(args.out / "tasks", args.limit)
    tokenizer = zoo.prepare(args.model)
    rows = [run_method(spec, args, tasks, tokenizer) for spec in args.methods]
    (args.out / "third_party_clients.json").write_text(json.dumps({"model": args.model, "limit": args.limit,
                                                                  "rows": rows}, indent=2))
    for row in rows:
        print(row["method"], json.dumps(row["squad_gen"]), json.dumps(row["squad_ll"]), row["langchain_cached_tokens"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
