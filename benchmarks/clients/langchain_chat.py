"""LangChain's ``ChatOpenAI`` with its default settings against ``fastprefill serve``: a
multi-turn conversation whose every turn resends the history, so from the second turn on the
server's prefix cache serves the earlier turns.

Runs in the clients' venv (``.venv-clients``, see ``requirements.txt`` here), not the library's::

    .venv-clients/bin/python benchmarks/clients/langchain_chat.py --base-url http://127.0.0.1:8000/v1 \\
        --model smollm2-135m --out /tmp/langchain_chat.json

Writes one JSON object: the request fields ``ChatOpenAI`` sends with its defaults, and each
turn's question, answer, wall time and the usage the server reported (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``, and fastprefill's own block).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

QUESTIONS = [
    "Name three rivers in Europe.",
    "Which of them is the longest?",
    "Into which sea does it flow?",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the server's /v1 URL")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", type=Path, help="write the turns as JSON here")
    args = p.parse_args(argv)
    chat = ChatOpenAI(model=args.model, base_url=args.base_url, api_key="unused")  # otherwise its defaults
    history: list = [SystemMessage("You are a concise assistant.")]
    try:  # the fields a request carries, as a record (a private method, which other versions may lack)
        fields = sorted(chat._get_request_payload(history))
    except AttributeError:
        fields = None
    turns = []
    for question in QUESTIONS:
        history.append(HumanMessage(question))
        t0 = time.perf_counter()
        reply = chat.invoke(history)
        seconds = time.perf_counter() - t0
        history.append(reply)
        usage = reply.response_metadata.get("token_usage", {})
        turns.append({"question": question, "answer": reply.content, "seconds": seconds, "usage": usage})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        print(f"> {question}\n{reply.content}\n  [prompt {usage.get('prompt_tokens')} tokens, {cached} cached]")
    if args.out is not None:
        doc = {"model": args.model, "request_fields": fields, "turns": turns}
        args.out.write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
